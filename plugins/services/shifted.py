"""Shifted reuse: KV of chunks computed at other positions, for prompts whose older part
was cut (the ``approximate_reuse`` service; docs/truncation.md).

A prefix cache keys each chunk by everything before it, so once a sliding window drops a
conversation's oldest tokens no chunk of the new prompt has a cached key, although almost
all of its tokens were computed before. This service indexes chunks by their own token
content too: a content hash of each full chunk stored (or read back), with the chunk's key
and the position it was computed at. A connector asks :meth:`ShiftedReuse.find` which runs
of a prompt's tokens, past its exact cached prefix, match such chunks at any offset, loads
them (:meth:`fetch`), re-rotates their keys by the position difference
(:func:`lmcache.kernels.rope.rerotate`) and recomputes what it chooses.

Why it cannot confuse contexts unless asked: the content index is consulted only by a
connector whose engine enables ``approximate_reuse``, never by ``lookup``/``retrieve``. KV
that was built on reused chunks is not exact, so it is never stored under the exact prefix
keys: :meth:`store_shifted` stores it under keys of their own (the exact key's hash hashed
again with a tag), which no exact lookup can produce, and indexes them by content only.

The index lives in this process (bounded by ``index_entries``, oldest first out); a
restarted engine starts with an empty one and fills it as it stores and reads chunks.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import xxhash

from lmcache.keys import as_token_array

if TYPE_CHECKING:
    from lmcache.config import Config
    from lmcache.keys import Chunk
    from lmcache.services import EngineView

log = logging.getLogger(__name__)
_CONTENT = b"lmcache-content\0"
#: a prompt's first chunks are also indexed by their first HEAD tokens (see ``cover``)
HEAD = 8
_HEADS_PER_KEY = 8
_SHIFTED = b"lmcache-shifted\0"


@dataclass(frozen=True)
class Match:
    """Prompt tokens ``[start, start + length)`` equal tokens ``[offset, offset + length)``
    of the chunk stored under ``key``, which were computed at ``old_start`` of an earlier
    prompt. ``offset`` is 0 and ``length`` the chunk size for a whole chunk; a tail of a
    chunk (the partial chunk after a cut) has ``offset > 0``."""

    start: int
    length: int
    key: str
    old_start: int
    offset: int = 0

    @property
    def delta(self) -> int:
        return self.start - self.old_start


@dataclass(frozen=True)
class _Entry:
    key: str
    start: int  # the position the chunk was computed at
    exact: bool  # computed on exact KV only
    prev: bytes | None  # content hash of the chunk before it in that prompt
    tokens: Any  # its tokens (int32 where they fit), to match a tail of it


def _compact(arr: Any) -> Any:
    return arr.astype("<i4") if arr.size and int(arr.max()) < 2**31 and int(arr.min()) >= -(2**31) else arr.copy()


def content_hash(tokens: Any) -> bytes:
    return xxhash.xxh3_128_digest(_CONTENT + as_token_array(tokens).tobytes())


def shifted_key(key: str) -> str:
    """The key KV built on reused chunks is stored under instead of ``key``: the same
    namespace, model and signature, a hash no token chain gives."""
    head, _, h = key.rpartition(":")
    return f"{head}:{xxhash.xxh3_128_hexdigest(_SHIFTED + h.encode())}"


class ShiftedReuse:
    """The content index of one engine and the loads and stores of shifted chunks."""

    @staticmethod
    def enabled(config: Config) -> bool:
        return config.approximate_reuse.enabled

    def __init__(self, engine: EngineView):
        self.engine = engine
        self.cfg = engine.config.approximate_reuse
        self.chunk_size = engine.config.chunk_size
        #: content hash -> the chunk's entry
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()
        #: hash of the first HEAD tokens -> exact first chunks (position 0) that start with them
        self._heads: OrderedDict[bytes, list[_Entry]] = OrderedDict()
        self._lock = threading.Lock()
        #: counters (``stats()["approximate_reuse"]``)
        self.matched_chunks = self.missing_chunks = self.stored_chunks = 0
        engine.add_store_observer(self._observe)

    # ------------------------------------------------------------ the index
    def _observe(self, tokens: Any, chunks: list[Chunk], keys: list[str]) -> None:
        """A store (or a retrieve) of ``chunks``: remember each full one by its content."""
        self._remember(as_token_array(tokens), chunks, keys, exact=True)

    def _remember(self, arr: Any, chunks: Sequence[Chunk], keys: Sequence[str], exact: bool) -> None:
        """Index each full chunk by its content; an exact chunk is never replaced by a
        shifted one of the same content (its KV is the better one)."""
        size = self.chunk_size
        full = [(c, k) for c, k in zip(chunks, keys) if c.num_tokens == size]
        own = {c.start: content_hash(arr[c.start : c.end]) for c, _ in full}

        def prev(start: int) -> bytes | None:  # the chunk before, hashed once if it is stored too
            if start < size:
                return None
            return own.get(start - size) or content_hash(arr[start - size : start])

        entries = [(own[c.start], _Entry(k, c.start, exact, prev(c.start), _compact(arr[c.start : c.end])))
                   for c, k in full]
        with self._lock:
            for h, e in entries:
                old = self._index.get(h)
                if old is None or exact or not old.exact:
                    self._index[h] = e
                self._index.move_to_end(h)
                if exact and e.start == 0:
                    hk = content_hash(e.tokens[:HEAD])
                    same = [x for x in self._heads.pop(hk, []) if x.key != e.key]
                    self._heads[hk] = [e, *same][:_HEADS_PER_KEY]
            while len(self._heads) > max(1, self.cfg.index_entries // 8):
                self._heads.popitem(last=False)
            while len(self._index) > self.cfg.index_entries:
                self._index.popitem(last=False)

    def find(self, tokens: Any, start: int, end: int) -> list[Match]:
        """Runs of ``tokens[start:end]`` that equal indexed chunks, left to right, not
        overlapping (each the first match at or after the end of the one before).

        Where unmatched tokens precede a match (the partial chunk after a cut), the chunk
        that came before the matched one where it was computed is looked up too: the
        longest tail of it that equals the tokens just before the match is a match of its
        own (``offset > 0``), since those tokens were computed right before the chunk."""
        arr = as_token_array(tokens)
        c = self.chunk_size
        out: list[Match] = []
        i = start
        with self._lock:
            index = self._index
            while i + c <= end:
                hit = index.get(content_hash(arr[i : i + c]))
                if hit is None:
                    i += 1
                    continue
                before = out[-1].start + out[-1].length if out else start
                tail = self._tail(arr, before, i, hit)
                if tail is not None:
                    out.append(tail)
                out.append(Match(i, c, hit.key, hit.start))
                i += c
        return out

    def _tail(self, arr: Any, lo: int, at: int, hit: _Entry) -> Match | None:
        """The longest tail of the chunk before ``hit`` (in the prompt it was computed in)
        that equals ``arr[lo:at]``'s end; ``None`` if there is none (lock held)."""
        prev = self._index.get(hit.prev) if at > lo and hit.prev is not None else None
        if prev is None:  # (any copy of the predecessor's tokens will do: its own position is used)
            return None
        c = self.chunk_size
        n = min(at - lo, c)
        same = arr[at - n : at] == prev.tokens[c - n :]
        g = n if same.all() else n - 1 - int(np.flatnonzero(~same)[-1])
        if g <= 0:
            return None
        return Match(at - g, g, prev.key, prev.start + c - g, offset=c - g)

    def cover(self, tokens: Any, start: int, end: int) -> list[Match]:
        """Matches that cover ``tokens[start:x)`` without a gap, for the largest such ``x``
        (up to ``end``): what an engine that loads only a prefix of a prompt can take
        (vLLM). From position 0 the run starts with the longest head of an exact first
        chunk that equals the prompt's start (the system prompt of an earlier, longer
        prompt): KV at the same positions of the same leading tokens, exact, since a token's
        KV depends only on the tokens up to it."""
        arr = as_token_array(tokens)
        out: list[Match] = []
        at = start
        if start == 0:
            head = self.head(arr, end)
            if head is not None:
                out.append(head)
                at = head.length
        for m in self.find(arr, start, end):
            if m.start + m.length <= at:
                continue
            if m.start > at:
                break
            if m.start < at:  # overlaps the head: take the rest
                d = at - m.start
                m = Match(at, m.length - d, m.key, m.old_start + d, m.offset + d)
            out.append(m)
            at = m.start + m.length
        return out

    def head(self, tokens: Any, end: int) -> Match | None:
        """The longest run ``tokens[0:x)`` (``x <= end``, at least ``HEAD`` tokens) that
        begins an exact first chunk of an earlier prompt: its KV is exact here (the same
        tokens at the same positions), a system prompt shorter than a chunk."""
        arr = as_token_array(tokens)
        n = min(end, self.chunk_size)
        if n < HEAD:
            return None
        with self._lock:
            cands = list(self._heads.get(content_hash(arr[:HEAD]), ()))
        best, best_len = None, 0
        for e in cands:
            same = arr[:n] == e.tokens[:n]
            g = n if same.all() else int(np.flatnonzero(~same)[0])
            if g > best_len:
                best, best_len = e, g
        return Match(0, best_len, best.key, 0) if best is not None and best_len >= HEAD else None

    def fetch(self, matches: Sequence[Match]) -> list[Any]:
        """The KV ``(layers, 2, tokens, heads, head_size)`` of each match (a copy), or
        ``None`` where its chunk is gone or is not a whole chunk of this engine's shape and
        dtype (then dropped as corrupt, see :meth:`lmcache.chunks.ChunkGateway.fetch`)."""
        if not matches:
            return []
        keys = [m.key for m in matches]
        with self.engine.chunks.found(keys, sizes=[self.chunk_size] * len(keys), prefix=False) as got:
            out = [r[0].tensor[:, :, m.offset : m.offset + m.length].clone() if r is not None else None
                   for m, r in zip(matches, got)]
        n = sum(x is not None for x in out)
        self.matched_chunks += n
        self.missing_chunks += len(out) - n
        return out

    # ------------------------------------------------------------ stores
    def store_shifted(self, tokens: Any, kv: Any, first_chunk: int) -> int:
        """Store the chunks of ``tokens`` from chunk ``first_chunk`` on, whose KV was built
        on reused chunks, under their shifted keys (never the exact ones), and index them
        by content. Returns the tokens stored. KV not of this engine's shape and dtype is
        a :class:`~lmcache.errors.KVShapeError`, nothing stored. The store observers are
        not told: the tokens' exact KV is not what these keys hold."""
        if self.engine.kv_spec is None:
            return 0
        chunks, keys = self.engine.chunk_keys(tokens)
        chunks, keys = chunks[first_chunk:], [shifted_key(k) for k in keys[first_chunk:]]
        if not chunks:
            return 0
        res = self.engine.chunks.store(keys, kv, chunks=chunks)
        self._remember(as_token_array(tokens), chunks, keys, exact=False)
        self.stored_chunks += res.put_chunks
        return res.stored_tokens

    def info(self) -> dict[str, Any]:
        with self._lock:
            entries = len(self._index)
        return {"index_entries": entries, "matched_chunks": self.matched_chunks,
                "missing_chunks": self.missing_chunks, "stored_chunks": self.stored_chunks}

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._heads.clear()


__all__ = ["HEAD", "Match", "ShiftedReuse", "content_hash", "shifted_key"]
