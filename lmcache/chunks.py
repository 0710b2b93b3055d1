"""One gateway for chunks into and out of an engine's tiers (connectors and services use
it), so the shape check, the observers and the reference counting live in one place. It
speaks the stores' verbs (:mod:`lmcache.storage`) with the hierarchy's tier-naming read:
``exists``/``exists_prefix``, :meth:`~ChunkGateway.put_one` (a chunk already in memory,
e.g. a peer's), :meth:`~ChunkGateway.find`/:meth:`~ChunkGateway.found` (objects back with
their tiers, each checked), plus :meth:`~ChunkGateway.store` (the engine's store: KV copied
into pool memory, put into the hierarchy or a named tier) and
:meth:`~ChunkGateway.allocate` (memory for a chunk about to arrive, refused before any byte
is allocated if its claimed shape is not one of ours).

The check is one: a chunk of ``n`` tokens is exactly ``layout.chunk_shape(n)`` of
``layout.dtype`` (the engine's :class:`~lmcache.config.KVSpec`, or a connector's
:class:`PageLayout`). KV that is not is refused whole, nothing stored, with a one-line
:class:`KVShapeError` naming both shapes; such an entry from a tier is corrupt: dropped from
it, counted in its ``stats.corrupt``, a miss.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from .direct_read import Direct, fetch_direct
from .dtypes import dtype_name
from .engine_io import _KV, StoreResult, store_chunks
from .errors import KVShapeError
from .keys import Chunk
from .memory import MemoryObj

log = logging.getLogger(__name__)

Observer = Callable[[Any, list[Chunk], list[str]], None]
Hit = tuple[MemoryObj, Any]  # an object (the caller owns one reference) and the tier it came from


@dataclass(frozen=True)
class PageLayout:
    """A fixed chunk layout (a connector's pages, e.g. SGLang's MLA pages
    ``(layers, 1, page, 1, dim)``): every chunk is a whole page of ``shape``."""

    shape: tuple[int, ...]
    dtype: str

    signature = property(lambda self: f"{self.dtype} pages of {self.shape}")

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        return self.shape


@dataclass
class ChunkStoreResult(StoreResult):
    """:class:`~lmcache.engine_io.StoreResult` plus, per chunk, whether it is held now
    (present before, or put and taken by its tier)."""

    held: list[bool] = field(default_factory=list)
    put_chunks: int = 0  # chunks put (not present before, memory found)


class _Pages:
    """A store's source of one tensor per chunk (any strides), in the chunks' order."""

    def __init__(self, chunks: Sequence[Chunk], tensors: Sequence[torch.Tensor]):
        self._at = {c.start: t for c, t in zip(chunks, tensors)}

    def copy_chunk(self, start: int, end: int, out: torch.Tensor) -> None:
        out.copy_(self._at[start])


class _Target:
    """The hierarchy as :func:`~lmcache.engine_io.store_chunks` sees it: puts go to
    ``tier`` when one is named, and what each returned is noted."""

    def __init__(self, hierarchy: Any, tier: Any | None):
        self.into, self.taken, self.allocate, self.storing = tier or hierarchy, {}, hierarchy.allocate, hierarchy.storing
        self.tiers = hierarchy.tiers if tier is None else [tier]

    def put_one(self, key: str, obj: MemoryObj) -> int:
        self.taken[key] = ok = self.into.put_one(key, obj)
        return ok


class ChunkGateway:
    """Chunks into and out of one engine's hierarchy. ``layout()``: the current layout
    (``None`` until the engine knows its KV shape: stores refused, every entry a miss);
    ``observers``: told ``observer(tokens, chunks, keys)`` once per store given ``tokens``."""

    def __init__(self, hierarchy: Any, layout: Callable[[], Any], chunk_size: int,
                 observers: Sequence[Observer] = ()):
        self.hierarchy, self.layout, self.chunk_size, self.observers = hierarchy, layout, chunk_size, observers

    @classmethod
    def of(cls, engine: Any) -> ChunkGateway:
        """The gateway of a :class:`~lmcache.CacheEngine` (its kv spec, its store observers)."""
        return cls(engine.hierarchy, lambda: engine.kv_spec, engine.config.chunk_size, engine.store_observers)

    def with_layout(self, layout: Any) -> ChunkGateway:
        """This gateway for chunks of a fixed ``layout`` (no observers: pages carry no tokens)."""
        return ChunkGateway(self.hierarchy, lambda: layout, self.chunk_size)

    # ------------------------------------------------------------ the check
    def check(self, shape: Sequence[int], dtype: torch.dtype | str, num_tokens: int | None = None) -> None:
        """Raise a one-line :class:`KVShapeError` naming both shapes unless a chunk of
        ``shape`` and ``dtype`` is one of this engine's chunks (of ``num_tokens`` tokens;
        ``None``: of any count from 1 to ``chunk_size``)."""
        shape, name, n = tuple(shape), dtype if isinstance(dtype, str) else dtype_name(dtype), num_tokens
        if n is None:
            n = shape[2] if len(shape) == 5 and 0 < shape[2] <= self.chunk_size else self.chunk_size
        lay = self.layout()
        if lay is None:
            raise KVShapeError("this engine does not know its KV shape yet (no kv_spec): no chunk can be checked")
        want = tuple(lay.chunk_shape(n))
        if shape != want or name != lay.dtype:
            raise KVShapeError(f"a chunk of {shape} {name} is not KV of {lay.signature}: "
                               f"this engine's chunk is {want} {lay.dtype}")

    def fits(self, obj: MemoryObj, num_tokens: int | None = None) -> bool:
        """Whether ``obj`` passes :meth:`check`."""
        try:
            self.check(obj.shape, obj.dtype, num_tokens)
        except KVShapeError:
            return False
        return True

    # ------------------------------------------------------------ presence
    def exists(self, keys: Sequence[str], tier: str | None = None) -> list[bool]:
        """For each key whether a tier (``tier`` alone when named) holds it."""
        return self.hierarchy.exists(keys) if tier is None else self.hierarchy.tier(tier).exists(keys)

    def exists_prefix(self, keys: Sequence[str]) -> list[str]:
        return self.hierarchy.exists_prefix(keys)  # the tiers of the longest prefix held

    # ------------------------------------------------------------ writes
    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """Pool memory for a chunk about to arrive (``None``: no room); :class:`KVShapeError`
        before anything is allocated unless ``shape`` and ``dtype`` pass :meth:`check`."""
        self.check(shape, dtype)
        return self.hierarchy.allocate(shape, dtype)

    def store(self, keys: Sequence[str], kv: Any, *, chunks: Sequence[Chunk] | None = None,
              tokens: Any = None, tier: str | None = None, pool: Any = None, in_flight: int = 1) -> ChunkStoreResult:
        """Store KV under ``keys``: chunks no tier holds (``tier`` alone when named) are
        copied into pool memory and put there, the others touched. ``kv``: KV over the
        tokens of ``chunks`` (``(layers, 2, tokens, heads, head_size)`` or per-layer
        ``(key, value)`` pairs), or without ``chunks`` one whole-chunk tensor per key. All
        of it is checked first (:meth:`check`): a mismatch stores nothing. ``observers``
        are told once, before the puts, when ``tokens`` (what ``chunks`` are of) is given.
        References are released on every path; ``pool``/``in_flight``: see
        :func:`~lmcache.engine_io.store_chunks` (the pool is used where two chunks or more
        are put: one has nothing to overlap with). :meth:`CacheEngine.store
        <lmcache.CacheEngine.store>` stores through here."""
        keys = list(keys)
        if chunks is None:
            pages = list(kv)
            if len(pages) != len(keys):
                raise KVShapeError(f"{len(pages)} pages for {len(keys)} keys")
            for page in pages:
                self.check(page.shape, page.dtype, page.shape[2] if page.dim() == 5 else None)
            ends = list(itertools.accumulate(p.shape[2] for p in pages))
            chunks = [Chunk(end - p.shape[2], end, "") for p, end in zip(pages, ends)]
            src: Any = _Pages(chunks, pages)
        else:
            chunks = list(chunks)
            if len(chunks) != len(keys):
                raise KVShapeError(f"{len(chunks)} chunks for {len(keys)} keys")
            src = kv if isinstance(kv, _KV) else _KV.wrap(kv)
            if chunks and src.num_tokens < chunks[-1].end:
                raise KVShapeError(f"kv holds {src.num_tokens} tokens but the chunks end at token {chunks[-1].end}")
            for n in {c.num_tokens for c in chunks}:  # the chunks' shapes, checked once each
                self.check((src.num_layers, 2, n, src.num_kv_heads, src.head_size), src.dtype, n)
        target = _Target(self.hierarchy, None if tier is None else self.hierarchy.tier(tier))
        for observe in self.observers if tokens is not None else ():
            observe(tokens, list(chunks), keys)
        present = self.exists(keys, tier)
        self.hierarchy.touch([k for k, here in zip(keys, present) if here])
        if sum(1 for here in present if not here) < 2:  # one chunk to put: nothing to overlap it with
            pool = None
        res = store_chunks(target, src, self.layout(), list(chunks), keys, present, pool, in_flight)
        held = [bool(here or target.taken.get(k, 0)) for k, here in zip(keys, present)]
        return ChunkStoreResult(res.stored_tokens, res.skipped_tokens, res.dropped_tokens, held, len(target.taken))

    def put_one(self, key: str, obj: MemoryObj, *, tier: str | None = None, num_tokens: int | None = None) -> int:
        """Put one chunk already in memory (a peer's) into the hierarchy (or ``tier``),
        taking over the caller's reference (released on every path): what ``put_one``
        returned (the bytes it takes; 0: not stored), or :class:`KVShapeError` (nothing
        stored) unless it passes :meth:`check`."""
        try:
            self.check(obj.shape, obj.dtype, num_tokens)
            return (self.hierarchy if tier is None else self.hierarchy.tier(tier)).put_one(key, obj)
        finally:
            obj.unref()

    # ------------------------------------------------------------ reads
    def find(self, keys: Sequence[str], *, sizes: Sequence[int] | None = None, prefix: bool = True,
              on_ready: Callable[[int, MemoryObj], None] | None = None, tier: str | None = None,
              raw: bool = False, pin: bool = True, direct: Direct | None = None) -> list[Hit | None]:
        """The objects of ``keys`` (pinned while read) and their tiers, one reference each
        for the caller (or use :meth:`read`). Each is checked as a chunk of ``sizes[j]``
        tokens (default: any count up to ``chunk_size``); one that fails is corrupt:
        removed from its tier, counted in its ``stats.corrupt``, never promoted, a miss.
        ``prefix``: the result ends before the first miss (else ``None`` per miss).
        ``tier``: that tier alone. ``raw``: unchecked (passed on to a peer, whose own
        gateway checks them). ``on_ready``: see :meth:`lmcache.tier.Tier.get`. ``pin=False``:
        the caller's lookup leases keep the keys from eviction (no pins taken here).
        ``direct``: chunks a file tier can read straight into the caller's memory
        (:mod:`lmcache.direct_read`); ``on_ready`` is not called for them."""
        keys = list(keys)
        if not raw and self.layout() is None:
            return [] if prefix else [None] * len(keys)

        def fits(j: int, obj: MemoryObj) -> bool:
            return raw or self.fits(obj, sizes[j] if sizes is not None else None)

        with self.hierarchy.pinned(keys) if pin else contextlib.nullcontext():
            if tier is not None:
                t = self.hierarchy.tier(tier)
                results: list[Hit | None] = [(o, t) if o is not None else None for o in t.get(keys, on_ready)]
            elif direct is not None and not raw:
                results = self._get_direct(keys, on_ready, fits, direct)
            else:
                results = self.hierarchy.find(keys, on_ready, accept=fits)
        out: list[Hit | None] = []
        try:
            for j, r in enumerate(results):
                if r is not None and not fits(j, r[0]):
                    log.error("tier %s returned %s for %s; dropping it", r[1].name, r[0], keys[j])
                    r[1].stats.corrupt += 1
                    r[1].delete([keys[j]])
                    r = None  # (still in results: released below)
                elif r is not None:
                    results[j] = None  # owned by out from here
                if r is None and prefix:
                    break
                out.append(r)
        except BaseException:
            _release(out)
            raise
        finally:
            _release(results)  # past the prefix, or dropped
        return out

    def _get_direct(self, keys: list[str], on_ready: Callable[[int, MemoryObj], None] | None,
                    fits: Callable[[int, MemoryObj], bool], direct: Direct) -> list[Hit | None]:
        """:meth:`StorageHierarchy.find` for the chunks :func:`fetch_direct` did not read."""
        results: list[Hit | None] = [None] * len(keys)
        done = fetch_direct(self.hierarchy, keys, direct)
        for j, hit in done.items():
            results[j] = hit
        rest = [j for j in range(len(keys)) if j not in done]
        if rest:
            cb = None if on_ready is None else (lambda k, obj: on_ready(rest[k], obj))
            for j, hit in zip(rest, self.hierarchy.find([keys[j] for j in rest], cb,
                                                       accept=lambda k, obj: fits(rest[k], obj))):
                results[j] = hit
        return results

    @contextlib.contextmanager
    def found(self, keys: Sequence[str], **kw: Any) -> Iterator[list[Hit | None]]:
        """:meth:`find` whose references are released when the block ends."""
        got = self.find(keys, **kw)
        try:
            yield got
        finally:
            _release(got)


def _release(hits: Sequence[Hit | None]) -> None:
    for r in hits:
        if r is not None:
            r[0].unref()


__all__ = ["ChunkGateway", "ChunkStoreResult", "PageLayout"]
