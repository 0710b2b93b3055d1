"""The storage hierarchy: ordered tiers with byte-accurate capacities.

Methods follow the backend contract's names: batch forms take a sequence of keys
(``contains``, ``get``), single-key forms end in ``_one`` (``get_one``, ``put_one``).

- ``get``: the first tier that has a key wins; the hit is promoted into the tiers above.
- ``put_one``: into the top tier; lower tiers get it per the write policy: ``write-through``
  (every tier, asynchronously through a bounded queue) or ``write-back`` (a tier receives
  what the tier above evicts).
- capacities are accounted in stored bytes and never exceeded: space is reserved (an upper
  bound) before a write and settled after it;
- eviction never removes a pinned entry, one leased by a lookup, or one a reader holds;
- a tier that raises degrades to misses and is retried with exponential backoff.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from dataclasses import dataclass
from itertools import compress
from operator import not_
from typing import Callable, Iterator, Sequence

import torch

from .config import Config, TierConfig
from .errors import CorruptPayloadError, TierUnusableError
from .ledger import Listener
from .memory import MemoryObj, MemoryPool
from .plugin_manager import Registries, get_registries
from .storage import Store
from .tier import Tier
from .tier_setup import TierParts, build_tier, check_tier, codec_cache
from .write_behind import WRITE_BATCH, WRITER_YIELD_MAX, WriteBehind, _Write  # noqa: F401 (re-exported)

__all__ = ["HierarchyStats", "StorageHierarchy", "TierParts", "build_tier", "check_tier", "codec_cache"]

log = logging.getLogger(__name__)

def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= int(d)
    return n


@dataclass
class HierarchyStats:
    #: lower-tier writes dropped: the queue was full, too many waited for a tier in
    #: backoff, the memory pool needed what they held, or the engine closed during an outage
    dropped_writes: int = 0
    deferred_writes: int = 0  # writes that waited for their tier to come back from an outage
    skipped_no_memory: int = 0  # store chunks skipped because the pool was exhausted
    promotions: int = 0
    repairs: int = 0  # write-through: evicted chunks written down because no lower tier had them


class StorageHierarchy(WriteBehind, Store):
    def __init__(
        self,
        config: Config,
        pool: MemoryPool,
        registries: Registries | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.pool = pool
        self._writer_lock = threading.Lock()  # guards _inflight and writer_refs; one per hierarchy
        #: the most bytes one entry read from a tier may claim: a whole chunk of the
        #: engine's kv_spec once it is known (set by the engine), else the largest tier
        self.max_entry_bytes: int | None = None
        self.clock = clock
        self.registries = registries or get_registries()
        self.write_back = config.write_policy == "write-back"
        self.stats = HierarchyStats()
        #: ``codec(name, options=None)``: the codec (or chain) named ``name``
        self.codec = codec_cache(self.registries)
        self._listeners: tuple[Listener, ...] = ()
        self.tiers: list[Tier] = []
        #: tiers of the config that could not be opened, and why: the engine runs without them
        self.unusable: dict[str, str] = {}
        try:
            for i, tcfg in enumerate(config.tiers):
                try:
                    self.tiers.append(self._build_tier(i, tcfg))
                except TierUnusableError as exc:  # the others still make a cache
                    self.unusable[tcfg.name] = exc.problem
                    log.warning("tier %s: running without it: %s", tcfg.name, exc.problem)
        except BaseException:
            for t in self.tiers:
                t.backend.close()
            raise
        for i, t in enumerate(self.tiers):
            t.on_recover = functools.partial(self._recovered, i)
        for i, t in enumerate(self.tiers[:-1]):
            t.on_evict = self._demoter(i + 1)
            if not self.write_back:
                # write-through: the lower tiers got every chunk when it was stored, except
                # those a tier skipped while its store was down (or whose write queue was
                # full); such a chunk is written down when it leaves this tier, not lost
                t.demote_if = self._missing_below(i + 1)
        self._start_writer(config)

    # ------------------------------------------------------------ building
    def _build_tier(self, i: int, tcfg: TierConfig) -> Tier:
        return build_tier(
            i, tcfg, source=self.config.source, registries=self.registries, codec_for=self.codec,
            allocate=self.allocate_transient, clock=self.clock, pool=self.pool,
        )

    # ------------------------------------------------------------ memory
    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """A pool object, evicting from the CPU tiers if the pool is full; ``None`` if
        nothing more can be evicted."""
        obj = self.pool.allocate(shape, dtype) or self._unpark_for(shape, dtype)
        if obj is not None:
            return obj
        if self._stores:  # objects that queued writes hold come back to the pool when written
            self._writer_stop_yielding()
        nbytes = _nbytes(shape, dtype)
        for tier in reversed([t for t in self.tiers if t.backend.holds_memory_objects]):
            budget = 4 * nbytes  # bytes evicted before giving up (demotions free memory late)
            while budget > 0:
                freed = tier.evict_bytes(nbytes)
                if freed == 0:
                    break
                budget -= freed
                obj = self.pool.allocate(shape, dtype) or self._unpark_for(shape, dtype)
                if obj is not None:
                    return obj
        self.stats.skipped_no_memory += 1
        return None

    def allocate_transient(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj:
        """For reads: a pool object if there is room, else a heap object.

        Refuses (``CorruptPayloadError``: the entry is corrupt, a miss) a claim larger
        than :attr:`max_entry_bytes`, or than the largest tier when that is unset: a
        forged header must cost one miss, never a 16 GiB allocation."""
        nbytes = _nbytes(shape, dtype)
        limit = self.max_entry_bytes
        if limit is None:
            limit = max(t.capacity for t in self.tiers) if getattr(self, "tiers", None) else None
        if limit is not None and nbytes > limit:
            raise CorruptPayloadError(
                f"entry claims {nbytes} bytes ({tuple(shape)} {dtype}); entries here are at most {limit}"
            )
        obj = self.pool.allocate(shape, dtype)
        return obj if obj is not None else MemoryPool.allocate_unpooled(shape, dtype)

    # ------------------------------------------------------------ data path
    def exists_prefix(self, keys: Sequence[str]) -> list[str]:
        """Tier names of the longest prefix of ``keys`` that some tier holds."""
        found = self._where(keys)
        return found[: found.index(None)] if None in found else found  # type: ignore[return-value]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """For each key: whether some tier holds it (or a queued write carries it)."""
        return [name is not None for name in self._where(keys)]

    def _where(self, keys: Sequence[str]) -> list[str | None]:
        """For each key the name of the first tier that holds it, or of the tier its
        queued write goes to (``None``: neither); each tier is asked, in one batch call,
        for the keys the tiers above it did not have."""
        n = len(keys)
        found: list[str | None] = [None] * n
        remaining: Sequence[int] = range(n)  # indices not found yet, ascending
        for tier in self.tiers:
            if not remaining:
                break
            res = tier.exists(keys if len(remaining) == n else [keys[i] for i in remaining])
            if len(remaining) == n and all(res):  # the usual hit: all in the first tier asked
                return [tier.name] * n
            for i in compress(remaining, res):
                found[i] = tier.name
            remaining = list(compress(remaining, map(not_, res)))
        for i in remaining:
            entry = self._inflight.get(keys[i])
            if entry is not None:
                found[i] = self.tiers[entry[1]].name
        return found

    def get(self, keys: Sequence[str], on_ready: Callable[[int, MemoryObj], None] | None = None) -> list[MemoryObj | None]:
        """For each key its object (the caller owns one reference) or ``None``, as every
        store answers; :meth:`find` also names the tier of each hit."""
        return [hit[0] if hit is not None else None for hit in self.find(keys, on_ready)]

    def find_one(self, key: str) -> tuple[MemoryObj, Tier] | None:
        return self.find([key])[0]

    def find(self, keys: Sequence[str], on_ready: Callable[[int, MemoryObj], None] | None = None,
             accept: Callable[[int, MemoryObj], bool] | None = None) -> list[tuple[MemoryObj, Tier] | None]:
        """:meth:`get` with the tier each hit came from: for each key its object (the
        caller owns one reference) and tier, or ``None``; one batch call per tier: each
        tier is asked for the keys the tiers above it did not have. ``on_ready(j, obj)``:
        see :meth:`Tier.get` (``j`` indexes ``keys``). ``accept(j, obj)``: the caller's
        check of a hit (its shape and dtype); a hit it refuses is returned but never
        promoted into the tiers above."""
        found: list[tuple[MemoryObj, Tier] | None] = [None] * len(keys)
        remaining = list(range(len(keys)))
        # queued writes are taken before the tiers are asked: a write that lands (and
        # leaves the queue) while its tier is being read must not fall between the two
        queued: dict[int, tuple[MemoryObj, int]] = {}
        for j, key in enumerate(keys if self._inflight else ()):
            pending = self._inflight_get(key) if key in self._inflight else None
            if pending is not None:
                queued[j] = pending
        try:
            return self._get_tiers(keys, found, remaining, queued, on_ready, accept)
        except BaseException:
            for obj, _ in queued.values():
                obj.unref()
            raise

    def _get_tiers(self, keys, found, remaining, queued, on_ready, accept) -> list[tuple[MemoryObj, Tier] | None]:
        for i, tier in enumerate(self.tiers):
            if not remaining:
                break
            # on_ready with indices into keys, not into what this tier is asked
            cb = None if on_ready is None else (lambda k, obj, idx=list(remaining): on_ready(idx[k], obj))
            objs = tier.get([keys[j] for j in remaining], cb)
            nxt = []
            for j, obj in zip(remaining, objs):
                if obj is None:
                    nxt.append(j)
                    continue
                if i > 0 and (accept is None or accept(j, obj)):
                    obj = self._promote(keys[j], obj, i)
                found[j] = (obj, tier)
            remaining = nxt
        for j in remaining:
            pending = queued.pop(j, None) or self._inflight_get(keys[j])
            if pending is not None:
                obj, target = pending
                if target > 0 and (accept is None or accept(j, obj)):
                    obj = self._promote(keys[j], obj, target)
                found[j] = (obj, self.tiers[target])
        for obj, _ in queued.values():  # found in a tier after all
            obj.unref()
        return found

    def _promote(self, key: str, obj: MemoryObj, found_at: int) -> MemoryObj:
        for j in range(found_at):
            upper = self.tiers[j]
            if upper.backend.holds_memory_objects:
                if not obj.pooled:
                    pooled = self.allocate(obj.shape, obj.dtype)
                    if pooled is None:
                        continue
                    pooled.tensor.copy_(obj.tensor)
                    obj.unref()
                    obj = pooled
                if upper.put_one(key, obj):
                    self.stats.promotions += 1
            else:
                self._enqueue(_Write(j, key, obj.ref()), block=False)
        return obj

    def put_one(self, key: str, obj: MemoryObj) -> int:
        """Store into the top tier now and into lower tiers per the write policy.
        The caller keeps its reference. The bytes the entry takes in the top tier; 0 if it
        was not stored there (it is then queued for the tier below)."""
        top = self.tiers[0]
        ok = top.put_one(key, obj) if obj.pooled or not top.backend.holds_memory_objects else 0
        if not self.write_back or not ok:
            for j in range(1, len(self.tiers)):
                self._enqueue(_Write(j, key, obj.ref()), block=False)
                if self.write_back:
                    break  # not stored on top: goes one level down instead
        return ok

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove ``keys`` from every tier: for each, whether some tier held it. A write
        still queued for a key lands after this (``lmcache evict`` goes tier by tier)."""
        out = [False] * len(keys)
        for tier in self.tiers:
            out = [a or b for a, b in zip(out, tier.delete(keys))]
        return out

    def keys(self) -> Iterator[tuple[str, int]]:
        """Every key some tier holds, once, with its bytes in the highest tier holding it."""
        seen: set[str] = set()
        for tier in self.tiers:
            for key, size in tier.keys():
                if key not in seen:
                    seen.add(key)
                    yield key, size

    def _demoter(self, target: int) -> Callable[[str, MemoryObj], None]:
        def demote(key: str, obj: MemoryObj) -> None:
            if threading.current_thread() is self._worker or getattr(self._local, "writer", False):
                # already off the engine's path: write down the chain directly
                try:
                    self.tiers[target].put_one(key, obj)
                finally:
                    obj.unref()
            else:
                # write-back must not lose the chunk: wait for room in the queue; a
                # write-through repair is best effort and never blocks the engine
                self._enqueue(_Write(target, key, obj), block=self.write_back)

        return demote

    def _missing_below(self, first: int) -> Callable[[str], bool]:
        """Whether no tier from ``first`` down holds (or is about to hold) ``key``: an
        evicted entry worth writing down (into a tier in backoff, it waits for it)."""
        lower = self.tiers[first:]

        def missing(key: str) -> bool:
            if key in self._inflight or any(key in t.ledger for t in lower):  # queued, or held below
                return False
            self.stats.repairs += 1
            return True

        return missing

    def _tell(self, op: str, tier: str, key: str) -> None:
        """The ledgers' one listener."""
        for f in self._listeners:
            f(op, tier, key)

    def touch(self, keys: Sequence[str]) -> None:
        for tier in self.tiers:
            tier.touch(keys)

    @contextlib.contextmanager
    def pinned(self, keys: Sequence[str]) -> Iterator[None]:
        """Keep ``keys`` from eviction in every tier for the duration (e.g. so that a
        retrieve's own promotions cannot evict the chunks it is about to read)."""
        for tier in self.tiers:
            for k in keys:
                tier.pin(k)
        try:
            yield
        finally:
            for tier in self.tiers:
                for k in keys:
                    tier.unpin(k)

    def lease_prefix(self, keys: Sequence[str], tiers: Sequence[str], seconds: float) -> int:
        """Lease ``keys[i]`` in tier ``tiers[i]`` (what :meth:`contains_prefix` found), in
        order, while each is still there (or still queued for its tier); the number leased.
        A key evicted since it was found ends the prefix: a lookup never promises a chunk
        that its lease does not hold."""
        for i, (key, name) in enumerate(zip(keys, tiers)):
            found = self.tier(name)
            if not found.lease_held(key, seconds):
                if key not in self._inflight:
                    return i
                found.lease(key, seconds)  # its write is queued: the lease waits for it in that tier
            # the lease covers the key in every tier, one per tier, as :meth:`release_leases`
            # drops it: a release never ends a lease another lookup took in another tier
            for tier in self.tiers:
                if tier is not found:
                    tier.lease(key, seconds)
        return min(len(keys), len(tiers))

    def release_leases(self, keys: Sequence[str]) -> None:
        """Drop one lookup lease of each key (one in every tier: see :meth:`lease_prefix`)."""
        for tier in self.tiers:
            for key in keys:
                tier.release_lease(key)

    def flush(self) -> None:
        """Wait until every queued lower-tier write has been done."""
        self._queue.join()

    def pending_writes(self) -> int:
        """Lower-tier writes not done yet: queued, or waiting for their tier to recover."""
        return self._queue.qsize() + len(self._parked)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(op, tier, key)`` whenever a tier admits (``"admit"``) or drops
        (``"evict"``) a key, after the listeners added before it (the controller worker's
        index feed, the KV-event publisher); called with the tier's lock held, so it must
        not block. Each tier's :class:`~lmcache.ledger.Ledger` calls them."""
        self._set_listeners((*self._listeners, listener))

    def remove_listener(self, listener: Listener) -> None:
        self._set_listeners(tuple(f for f in self._listeners if f is not listener))

    def set_listener(self, listener: Listener | None) -> None:
        """Replace every listener with ``listener`` (``None``: none)."""
        self._set_listeners(() if listener is None else (listener,))

    def _set_listeners(self, listeners: tuple[Listener, ...]) -> None:
        self._listeners = listeners
        for t in self.tiers:
            t.ledger.listeners = (self._tell,) if listeners else ()

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r}; tiers: {', '.join(t.name for t in self.tiers)}")

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._queue.put(None)
        self._worker.join(timeout=30)
        if self._batch_pool is not None:
            self._batch_pool.shutdown(wait=True)
        self._retry()  # a last try of what waits for a tier; the rest is dropped, counted
        while self._parked:
            self._drop(self._parked.popleft(), "the engine closed")
        for t in self.tiers:
            try:
                t.backend.close()
            except Exception:
                log.exception("closing tier %s", t.name)
