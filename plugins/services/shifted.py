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

import xxhash

from lmcache.keys import as_token_array

if TYPE_CHECKING:
    from lmcache.config import Config
    from lmcache.keys import Chunk
    from lmcache.services import EngineView

log = logging.getLogger(__name__)
_CONTENT = b"lmcache-content\0"
_SHIFTED = b"lmcache-shifted\0"


@dataclass(frozen=True)
class Match:
    """Prompt tokens ``[start, start + length)`` equal the chunk stored under ``key``, which
    was computed for the tokens at ``old_start`` of an earlier prompt."""

    start: int
    length: int
    key: str
    old_start: int

    @property
    def delta(self) -> int:
        return self.start - self.old_start


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
        #: content hash -> (key, position it was computed at, exact: computed on exact KV)
        self._index: OrderedDict[bytes, tuple[str, int, bool]] = OrderedDict()
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
        full = [(c, k) for c, k in zip(chunks, keys) if c.num_tokens == self.chunk_size]
        hashes = [content_hash(arr[c.start : c.end]) for c, _ in full]
        with self._lock:
            for h, (c, k) in zip(hashes, full):
                old = self._index.get(h)
                if old is None or exact or not old[2]:
                    self._index[h] = (k, c.start, exact)
                self._index.move_to_end(h)
            while len(self._index) > self.cfg.index_entries:
                self._index.popitem(last=False)

    def find(self, tokens: Any, start: int, end: int) -> list[Match]:
        """Runs of ``tokens[start:end]`` that equal indexed chunks, left to right, not
        overlapping (each the first match at or after the end of the one before)."""
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
                out.append(Match(i, c, hit[0], hit[1]))
                i += c
        return out

    def fetch(self, matches: Sequence[Match]) -> list[Any]:
        """The KV ``(layers, 2, tokens, heads, head_size)`` of each match (a copy), or
        ``None`` where its chunk is gone or is not of this engine's shape."""
        if not matches:
            return []
        spec = self.engine.kv_spec
        got = self.engine.hierarchy.get([m.key for m in matches])
        out = []
        for m, r in zip(matches, got):
            if r is None:
                out.append(None)
                continue
            obj, _tier = r
            try:
                ok = spec is not None and tuple(obj.shape) == tuple(spec.chunk_shape(m.length))
                out.append(obj.tensor.clone() if ok else None)
            finally:
                obj.unref()
        n = sum(x is not None for x in out)
        self.matched_chunks += n
        self.missing_chunks += len(out) - n
        return out

    # ------------------------------------------------------------ stores
    def store_shifted(self, tokens: Any, kv: Any, first_chunk: int) -> int:
        """Store the chunks of ``tokens`` from chunk ``first_chunk`` on, whose KV was built
        on reused chunks, under their shifted keys (never the exact ones), and index them
        by content. Returns the tokens stored."""
        from lmcache.engine_io import _KV, store_chunks

        spec = self.engine.kv_spec
        if spec is None:
            return 0
        chunks, keys = self.engine.chunk_keys(tokens)
        chunks, keys = chunks[first_chunk:], [shifted_key(k) for k in keys[first_chunk:]]
        if not chunks:
            return 0
        h = self.engine.hierarchy
        present = h.contains(keys)
        src = _KV.wrap(kv)
        res = store_chunks(h, src, spec, chunks, keys, present, None, 1)
        self._remember(as_token_array(tokens), chunks, keys, exact=False)
        self.stored_chunks += sum(1 for here in present if not here)
        return res.stored_tokens

    def info(self) -> dict[str, Any]:
        with self._lock:
            entries = len(self._index)
        return {"index_entries": entries, "matched_chunks": self.matched_chunks,
                "missing_chunks": self.missing_chunks, "stored_chunks": self.stored_chunks}

    def close(self) -> None:
        with self._lock:
            self._index.clear()


__all__ = ["Match", "ShiftedReuse", "content_hash", "shifted_key"]
