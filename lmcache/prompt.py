"""A request's tokens hashed once: :class:`Prompt` and the engine's :class:`PromptMemo`.

One request passes through an engine several times: the scheduler's lookup, the load's
retrieve and its release, a save's lookup, store and release, the KV-event bridge. Each
of those used to turn the tokens into chunk keys again. A :class:`Prompt` holds the
tokens (one int64 array), the :class:`~lmcache.keys.KeyExtra` and the chunk keys computed
so far (in the growing batches of :meth:`TokenProcessor.key_batches`, so a lookup that
misses early hashes only up to its miss); every :class:`~lmcache.CacheEngine` call takes
one in place of the tokens. Callers that receive the tokens again later (a vLLM worker
gets the token ids from the scheduler's metadata, not the object its lookup service
built) find the same prompt in the engine's :class:`PromptMemo`, keyed by the exact
token bytes (compared in full, never by a digest alone), so each key is hashed once per
request per process.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import xxhash

from .keys import Chunk, KeyExtra, TokenProcessor, as_token_array

#: prompts an engine remembers, and the tokens they may hold together (int64: 8 B each)
MEMO_PROMPTS = 64
MEMO_TOKENS = 1 << 18


class Prompt:
    """Tokens, their key extra and their chunk keys, computed as far as asked and kept.

    Thread-safe: the lookup service's thread and a worker's load may use one prompt at
    once. ``tokens`` is an int64 array (read-only and the prompt's own when remembered).
    """

    __slots__ = ("tokens", "extra", "prefix", "stop", "_cs", "_proc", "_keys", "_batches", "_lock")

    def __init__(self, processor: TokenProcessor, prefix: str, tokens: np.ndarray, extra: KeyExtra | None,
                 known: list[str] | None = None):
        """``known``: the keys of the first full chunks of ``tokens``, from a prompt these
        tokens extend (:meth:`PromptMemo.get`); the chain goes on from the last of them."""
        self.tokens = tokens
        self.extra = extra or None
        self.prefix = prefix
        self.stop = processor._stop(len(tokens))  # where the last chunk ends
        self._cs = processor.chunk_size
        self._proc = processor
        self._keys: list[str] = list(known or ())
        resume = (len(self._keys), self._keys[-1]) if self._keys else None
        self._batches: Iterator[list[str]] | None = processor.key_batches(tokens, prefix, extra=self.extra,
                                                                          resume=resume)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.tokens)

    def _more(self) -> bool:
        """Hash the next batch (the caller holds the lock); False when all are hashed."""
        if self._batches is None:
            return False
        got = next(self._batches, None)
        if got is None:
            self._batches = None
            return False
        self._keys += got
        return True

    def batches(self) -> Iterator[list[str]]:
        """The keys in consecutive batches, hashed as the caller iterates (what is hashed
        already comes in one batch)."""
        at = 0
        while True:
            with self._lock:
                if at >= len(self._keys):
                    self._more()
                got = self._keys[at:]
            if not got:
                return
            yield got
            at += len(got)

    @property
    def keys(self) -> list[str]:
        """Every chunk's key (hashing what is left)."""
        with self._lock:
            while self._more():
                pass
            return self._keys

    def keys_upto(self, num_tokens: int) -> list[str]:
        """The keys of the chunks that end at or before ``num_tokens`` (and the one that ends
        at ``stop`` when ``num_tokens`` reaches it): what a lookup of ``tokens[:num_tokens]``
        would have leased."""
        if num_tokens >= self.stop:
            return self.keys
        n = num_tokens // self._cs
        with self._lock:
            while len(self._keys) < n and self._more():
                pass
            return self._keys[:n]

    def head(self, num_tokens: int) -> Prompt | None:
        """The prompt of ``tokens[:num_tokens]`` with the keys it shares with this one, or
        ``None`` where its last chunk would be a partial one of its own (not a prefix of
        these keys: it is hashed when built). A lookup that hit ``num_tokens`` leaves this
        in the memo for the retrieve of exactly those tokens that follows."""
        if num_tokens >= len(self.tokens):
            return self
        if num_tokens % self._cs:
            return None
        keys = self.keys_upto(num_tokens)
        head = Prompt.__new__(Prompt)
        head.tokens, head.extra, head.prefix, head._cs = self.tokens[:num_tokens], self.extra, self.prefix, self._cs
        head._proc, head.stop, head._keys, head._batches = self._proc, num_tokens, list(keys), None
        head._lock = threading.Lock()
        return head

    def prefix_of(self, num_tokens: int) -> Prompt:
        """The prompt of ``tokens[:num_tokens]``: the full chunks' keys are this one's, a
        partial last chunk of its own is hashed when asked (no token is converted again)."""
        head = self.head(num_tokens)
        if head is not None:
            return head
        full = num_tokens // self._cs
        return Prompt(self._proc, self.prefix, self.tokens[:num_tokens], self.extra, self.keys_upto(full * self._cs)[:full])

    @property
    def chunks(self) -> list[Chunk]:
        """Every chunk, in order (see :meth:`TokenProcessor.chunks`)."""
        keys = self.keys
        cs, skip = self._cs, len(self.prefix)
        return [Chunk(s, min(s + cs, self.stop), k[skip:]) for s, k in zip(range(0, self.stop, cs), keys)]


def _probes(m: int) -> set[int]:
    """The positions of ``m`` shared tokens :meth:`PromptMemo.of_request` compares."""
    return {0, m - 1, *(m * k // 8 for k in range(1, 8))}


class PromptMemo:
    """The prompts an engine saw last, by exact content: at most :data:`MEMO_PROMPTS`
    prompts holding at most :data:`MEMO_TOKENS` tokens together, least recently used
    dropped first."""

    def __init__(self, processor: TokenProcessor, max_prompts: int = MEMO_PROMPTS, max_tokens: int = MEMO_TOKENS):
        self.processor = processor
        self.max_prompts = max_prompts
        self.max_tokens = max_tokens
        self._items: OrderedDict[tuple[str, bytes, int, bytes], Prompt] = OrderedDict()
        self._tokens = 0
        #: each request's prompt, the longest its calls gave (:meth:`of_request`), bounded as ``_items``
        self._requests: OrderedDict[tuple[str, str, bytes], Prompt] = OrderedDict()
        self._request_tokens = 0
        self._lock = threading.Lock()
        #: prompts built (their tokens hashed) and prompts found again
        self.built = self.found = 0

    def get(self, tokens: Any, prefix: str, extra: KeyExtra | None = None, request: str | None = None) -> Prompt:
        """The prompt of ``tokens`` (a list, array, tensor or a :class:`Prompt`) under
        ``prefix`` and ``extra``: the remembered one if its tokens are exactly these.
        ``request``: the tokens are (a prefix of, or an extension of) that request's, as
        the earlier calls naming it gave them (:meth:`of_request`)."""
        if isinstance(tokens, Prompt):
            if tokens.prefix == prefix and tokens.extra == (extra or tokens.extra):
                return tokens
            tokens, extra = tokens.tokens, extra or tokens.extra
        if request is not None:
            return self.of_request(request, tokens, prefix, extra)
        arr = as_token_array(tokens)
        if len(arr) > self.max_tokens:  # too long to keep: hashed for this call only
            return Prompt(self.processor, prefix, arr, extra)
        if type(tokens) not in (list, tuple):  # the caller's array or tensor: a kept prompt owns its tokens
            arr = arr.copy()
        arr.flags.writeable = False
        key = self._key(prefix, extra, arr)
        with self._lock:
            found = self._items.get(key)
            if found is not None and np.array_equal(found.tokens, arr):  # the digest's match checked in full
                self._items.move_to_end(key)
                self.found += 1
                return found
        prompt = Prompt(self.processor, prefix, arr, extra, self._known(prefix, extra, arr))
        with self._lock:
            found = self._items.get(key)
            if found is not None and np.array_equal(found.tokens, arr):  # another thread built it meanwhile
                return found
            self.built += 1
            self._keep(key, prompt)
        return prompt

    def of_request(self, request: str, tokens: Any, prefix: str, extra: KeyExtra | None = None) -> Prompt:
        """The prompt of ``tokens``, which the caller names as request ``request``'s: a
        request's tokens only grow (a vLLM request's prompt, a chunked prefill's saves of
        ``prompt[:n]``, a lookup that leaves the last token out), so ``tokens`` is taken
        as a prefix or an extension of the longest tokens an earlier call of the request
        gave, and no digest of the whole prompt is needed to find it: a prefix shares that
        prompt's keys and converts nothing; an extension converts only the tokens past it
        and hashes on from its last full chunk. Nine shared tokens are checked (the first,
        the last, seven between; a request id reused for other tokens starts over, as a
        new request). The engine's callers that know the request (the
        vLLM connector's lookup, loads, saves, KV events and PD sends) use this; the
        request is forgotten by :meth:`forget` or, as the memo's prompts are, least
        recently used first."""
        extra = extra or None
        key = (request, prefix, extra.to_bytes() if extra else b"")
        n = len(tokens)
        if not n:
            return Prompt(self.processor, prefix, self._own(tokens), extra)
        with self._lock:
            p = self._requests.get(key)
            if p is not None:
                self._requests.move_to_end(key)
        arr, known = None, None
        m = min(n, len(p.tokens)) if p is not None else 0
        if p is not None and m and all(int(tokens[i]) == int(p.tokens[i]) for i in _probes(m)):
            if n <= len(p.tokens):
                self.found += 1
                return p.prefix_of(n)
            arr = np.concatenate([p.tokens, as_token_array(tokens[len(p.tokens):])])
            full = len(p.tokens) // self.processor.chunk_size
            known = p.keys_upto(full * self.processor.chunk_size)[:full]
        if arr is None:
            arr = self._own(tokens)
        arr.flags.writeable = False
        if known is None:
            known = self._known(prefix, extra, arr)
        prompt = Prompt(self.processor, prefix, arr, extra, known)
        with self._lock:
            self.built += 1
            old = self._requests.pop(key, None)
            if old is not None:
                self._request_tokens -= len(old.tokens)
            self._requests[key] = prompt
            self._request_tokens += len(arr)
            while len(self._requests) > 1 and (len(self._requests) > self.max_prompts
                                               or self._request_tokens > self.max_tokens):
                _, old = self._requests.popitem(last=False)
                self._request_tokens -= len(old.tokens)
        return prompt

    @staticmethod
    def _own(tokens: Any) -> np.ndarray:
        """``tokens`` as an int64 array this memo owns (a caller's array or tensor is copied)."""
        arr = as_token_array(tokens)
        return arr if type(tokens) in (list, tuple) else arr.copy()

    def forget(self, request: str) -> None:
        """Drop request ``request``'s prompts (it finished)."""
        with self._lock:
            for key in [k for k in self._requests if k[0] == request]:
                self._request_tokens -= len(self._requests.pop(key).tokens)

    def put(self, prompt: Prompt) -> None:
        """Remember ``prompt`` (e.g. a :meth:`Prompt.head`), unless one of equal content is."""
        if len(prompt.tokens) > self.max_tokens or prompt.tokens.flags.writeable:
            return  # too long, or tokens it does not own (a head of a prompt that was not kept)
        key = self._key(prompt.prefix, prompt.extra, prompt.tokens)
        with self._lock:
            self._keep(key, prompt)

    def _known(self, prefix: str, extra: KeyExtra | None, arr: np.ndarray) -> list[str] | None:
        """The keys of the first full chunks of ``arr`` that a remembered prompt (same prefix
        and extra) shares with it, as many as the best one shares: a chunked prefill saves
        ``prompt[:n]`` for a growing ``n`` (each step's chunks then hash only what the step
        added), and a save of a prefix of a prompt looked up whole hashes only its partial
        last chunk. Keys are read under the prompt's own lock, hashed there if not yet."""
        cs = self.processor.chunk_size
        if len(arr) < cs:
            return None
        first = int(arr[0])
        with self._lock:
            items = list(self._items.values()) + list(self._requests.values())
        others = []
        for p in items:  # cheap checks first: the first token, and the last one both hold
            m = min(len(p.tokens), len(arr))
            if m >= cs and int(p.tokens[0]) == first and int(p.tokens[m - 1]) == int(arr[m - 1]) \
                    and p.prefix == prefix and p.extra == (extra or None):
                others.append((m // cs, p))
        for n, p in sorted(others, key=lambda x: -x[0]):
            if np.array_equal(p.tokens[: n * cs], arr[: n * cs]):  # full chunks: the same keys in both
                keys = p.keys_upto(n * cs)
                return list(keys[:n]) if len(keys) >= n else None
        return None

    @staticmethod
    def _key(prefix: str, extra: KeyExtra | None, arr: np.ndarray) -> tuple[str, bytes, int, bytes]:
        """The memo's key: a 128-bit digest of the tokens (no copy of them); a hit is then
        compared token by token."""
        return prefix, extra.to_bytes() if extra else b"", len(arr), xxhash.xxh3_128_digest(memoryview(arr).cast("B"))

    def _keep(self, key: tuple[str, bytes, int, bytes], prompt: Prompt) -> None:
        """Add (or replace) under the lock; the least recently used go beyond the bounds."""
        old = self._items.pop(key, None)
        if old is not None:
            self._tokens -= len(old.tokens)
        self._items[key] = prompt
        self._tokens += len(prompt.tokens)
        while len(self._items) > self.max_prompts or self._tokens > self.max_tokens:
            _, old = self._items.popitem(last=False)
            self._tokens -= len(old.tokens)

    def clear(self) -> None:
        """Forget every prompt (a benchmark that times hashing calls this between calls)."""
        with self._lock:
            self._items.clear()
            self._tokens = 0
            self._requests.clear()
            self._request_tokens = 0

    def __len__(self) -> int:
        return len(self._items)
