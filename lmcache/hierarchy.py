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
import queue
import threading
import time
from collections import deque
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
from .tier import Tier
from .tier_setup import TierParts, build_tier, check_tier, codec_cache

__all__ = ["HierarchyStats", "StorageHierarchy", "TierParts", "build_tier", "check_tier", "codec_cache"]

log = logging.getLogger(__name__)

#: the longest the lower-tier writer holds a write back while stores copy (see
#: :meth:`StorageHierarchy.storing`): a bound, so that no chain of stores starves it
WRITER_YIELD_MAX = 0.25
#: queued writes the writer takes at once; those for distinct keys of a tier whose
#: backend says ``parallel_puts`` go out together on this many threads (as many as
#: LMCache's disk workers: a file write is a kernel copy that another core can overlap)
#: Their keys are admitted (and the listeners told) in queue order (:class:`_Turns`).
WRITE_BATCH = 4


class _Turns:
    """Turns in a batch of writes: :meth:`wait` for turn ``j`` returns once turns
    ``0 .. j-1`` are :meth:`done`."""

    def __init__(self) -> None:
        self._next = 0
        self._cv = threading.Condition()

    def wait(self, j: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._next >= j)

    def done(self, j: int) -> None:
        with self._cv:
            self._next = max(self._next, j + 1)
            self._cv.notify_all()


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= int(d)
    return n


@dataclass
class _Write:
    tier: int
    key: str
    obj: MemoryObj
    parked: bool = False  # has waited for its tier to recover


#: a queue item that only wakes the writer (a tier recovered)
_WAKE = object()


@dataclass
class HierarchyStats:
    #: lower-tier writes dropped: the queue was full, too many waited for a tier in
    #: backoff, the memory pool needed what they held, or the engine closed during an outage
    dropped_writes: int = 0
    deferred_writes: int = 0  # writes that waited for their tier to come back from an outage
    skipped_no_memory: int = 0  # store chunks skipped because the pool was exhausted
    promotions: int = 0
    repairs: int = 0  # write-through: evicted chunks written down because no lower tier had them


class StorageHierarchy:
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
        self._queue: queue.Queue[_Write | object | None] = queue.Queue(maxsize=config.write_queue_size)
        #: writes a tier in backoff could not take, oldest first (still in _inflight: served
        #: from memory), retried when it recovers; at most write_queue_size
        self._parked: deque[_Write] = deque()
        self._drops_said: set[int] = set()  # tiers whose dropped writes were logged this outage
        # key -> (the objects of its queued writes, oldest first; the tier they go to). Two
        # writes of one key may carry different objects (two threads stored the same chunk):
        # each stays listed until its own write is done, so a reader is never handed an
        # object that a finished write released.
        self._inflight: dict[str, tuple[list[MemoryObj], int]] = {}
        self._closed = False
        # stores copying into the top tier right now (see storing()), and the queue length
        # at which the writer stops yielding to them
        self._stores = 0
        self._stores_cv = threading.Condition(threading.Lock())
        self._stores_need_memory = False  # the writer's queued objects may free pool memory
        self._yield_backlog = max(1, config.write_queue_size // 2)
        self._local = threading.local()  # .writer: a thread of the writer's batches
        self._batch_pool = None  # the threads of parallel writes, made on first use
        self._worker = threading.Thread(target=self._run_writes, name="lmcache-tier-writer", daemon=True)
        self._worker.start()

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
    def contains_prefix(self, keys: Sequence[str]) -> list[str]:
        """Tier names of the longest prefix of ``keys`` that some tier holds."""
        found = self._where(keys)
        return found[: found.index(None)] if None in found else found  # type: ignore[return-value]

    def contains(self, keys: Sequence[str]) -> list[bool]:
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
            res = tier.contains(keys if len(remaining) == n else [keys[i] for i in remaining])
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

    def get_one(self, key: str) -> tuple[MemoryObj, Tier] | None:
        return self.get([key])[0]

    def get(self, keys: Sequence[str], on_ready: Callable[[int, MemoryObj], None] | None = None,
            accept: Callable[[int, MemoryObj], bool] | None = None) -> list[tuple[MemoryObj, Tier] | None]:
        """For each key: its object (the caller owns one reference) and the tier it came
        from, or ``None``; one batch call per tier: each tier is asked for the keys the
        tiers above it did not have. ``on_ready(j, obj)``: see :meth:`Tier.get` (``j``
        indexes ``keys``). ``accept(j, obj)``: the caller's check of a hit (its shape and
        dtype); a hit it refuses is returned but never promoted into the tiers above."""
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

    def put_one(self, key: str, obj: MemoryObj) -> bool:
        """Store into the top tier now and into lower tiers per the write policy.
        The caller keeps its reference."""
        top = self.tiers[0]
        ok = (obj.pooled or not top.backend.holds_memory_objects) and top.put_one(key, obj)
        if not self.write_back or not ok:
            for j in range(1, len(self.tiers)):
                self._enqueue(_Write(j, key, obj.ref()), block=False)
                if self.write_back:
                    break  # not stored on top: goes one level down instead
        return ok

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

    def _enqueue(self, w: _Write, block: bool) -> None:
        """Queue a lower-tier write; ``w.obj`` carries a reference the writer drops."""
        if self._closed:
            w.obj.unref()
            return
        with self._writer_lock:
            w.obj.writer_refs += 1
            self._inflight.setdefault(w.key, ([], w.tier))[0].append(w.obj)
        try:
            self._queue.put(w, block=block, timeout=1.0 if block else None)
        except queue.Full:
            self.stats.dropped_writes += 1
            self._release(w)
            return
        if self._stores and self._queue.qsize() >= self._yield_backlog:
            with self._stores_cv:  # a long store: the writer stops waiting for it
                self._stores_cv.notify_all()

    def _release(self, w: _Write) -> None:
        with self._writer_lock:
            w.obj.writer_refs -= 1
            entry = self._inflight.get(w.key)
            if entry is not None:
                objs = entry[0]
                for i, o in enumerate(objs):
                    if o is w.obj:
                        del objs[i]
                        break
                if not objs:
                    del self._inflight[w.key]
        w.obj.unref()

    def _inflight_get(self, key: str) -> tuple[MemoryObj, int] | None:
        """A queued (not yet written) entry: it is served from memory, never lost."""
        with self._writer_lock:
            entry = self._inflight.get(key)
            if entry is None:
                return None
            return entry[0][-1].ref(), entry[1]  # the newest queued object: still referenced

    @contextlib.contextmanager
    def storing(self) -> Iterator[None]:
        """Around a store's copies into the top tier: until it ends, the lower-tier writer
        holds its next write back (the one under way finishes), so that the store's copy
        has the cores to itself and its writes follow it.

        Why: a write-behind of pool memory into a file (checksum, then ``writev`` into
        fresh page cache, kernel time) on one core of a small machine makes torch's
        multi-threaded gather copy wait for its slowest thread, the one sharing that
        core: a 256-token SmolLM2 fp32 chunk (11.8 MB) took 3.5 to 5 ms on average with
        a writer busy beside it instead of 0.9 (2 cores, 2 torch threads), which halved
        a CPU tier's store over a disk tier. The writer stops waiting once half its queue
        is waiting (a long store then drops nothing), when the memory pool runs short
        (what queued writes hold is freed once they are written) or after
        ``WRITER_YIELD_MAX``."""
        with self._stores_cv:
            self._stores += 1
        try:
            yield
        finally:
            with self._stores_cv:
                self._stores -= 1
                if not self._stores:
                    self._stores_need_memory = False
                    self._stores_cv.notify_all()

    def _writer_stop_yielding(self) -> None:
        with self._stores_cv:
            self._stores_need_memory = True
            self._stores_cv.notify_all()

    def _yield_to_stores(self) -> None:
        with self._stores_cv:
            self._stores_cv.wait_for(
                lambda: not self._stores or self._stores_need_memory or self._closed
                or self._queue.qsize() >= self._yield_backlog,
                timeout=WRITER_YIELD_MAX,
            )

    def _run_writes(self) -> None:
        while True:
            try:  # while writes are parked, wake when the first of their tiers is retried
                w = self._queue.get(timeout=self._retry_wait())
                got = True
            except queue.Empty:
                w, got = _WAKE, False
            try:
                if w is None:
                    return
                if isinstance(w, _Write):
                    if self._stores and not self._stores_need_memory:
                        self._yield_to_stores()
                    more = self._take_more()
                    try:  # done or parked: flush() waits for the queue, not for a tier's outage
                        self._write_batch([w, *(x for x in more if isinstance(x, _Write))])
                    finally:
                        for _ in more:
                            self._queue.task_done()
                    if more and more[-1] is None:
                        return
                self._retry()
            except Exception:  # never let the writer die
                log.exception("lmcache tier writer: unexpected error")
            finally:
                if got:
                    self._queue.task_done()

    def _take_more(self) -> list[object]:
        """Up to ``WRITE_BATCH - 1`` more queued items, without waiting; the last may be
        a wake-up or the stop sentinel (the caller acts on it after the batch)."""
        more: list[object] = []
        while len(more) < WRITE_BATCH - 1:
            try:
                more.append(self._queue.get_nowait())
            except queue.Empty:
                break
            if not isinstance(more[-1], _Write):
                break
        return more

    def _write_batch(self, writes: list[_Write]) -> None:
        """Write ``writes``: those for distinct keys of tiers whose backend takes
        ``put_one`` from several threads at once (``parallel_puts``, e.g. the disk
        backend) together, the others one by one in queue order."""
        seen: set[tuple[int, str]] = set()
        together, alone = [], []
        for w in writes:
            fast = self.tiers[w.tier].backend.parallel_puts and (w.tier, w.key) not in seen
            (together if fast else alone).append(w)
            seen.add((w.tier, w.key))
        if len(together) > 1:
            if self._batch_pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._batch_pool = ThreadPoolExecutor(WRITE_BATCH, thread_name_prefix="lmcache-tier-writer",
                                                      initializer=lambda: setattr(self._local, "writer", True))
            # the writes run side by side, but each admits its key (and tells the listeners,
            # under its tier's lock, as a lone write does) in queue order: a KV-event
            # consumer hears a chunk after its parent, and events are never told late
            turns = _Turns()
            for f in [self._batch_pool.submit(self._write_in_turn, w, j, turns) for j, w in enumerate(together)]:
                f.result()
        else:
            alone = together + alone
        for w in alone:
            self._write_logged(w)

    def _write_in_turn(self, w: _Write, j: int, turns: _Turns) -> None:
        """:meth:`_write_logged` on a batch thread, admitting only after write ``j - 1``."""
        self._local.turn = lambda: turns.wait(j)
        try:
            self._write_logged(w)
        finally:
            self._local.turn = None
            turns.wait(j)
            turns.done(j)

    def _tell(self, op: str, tier: str, key: str) -> None:
        """The ledgers' one listener."""
        for f in self._listeners:
            f(op, tier, key)

    def _write_logged(self, w: _Write) -> None:
        try:
            self._write(w)
        except Exception:  # never let the writer die; the batch's other writes still go out
            log.exception("lmcache tier writer: unexpected error")

    def _write(self, w: _Write) -> None:
        """Write ``w`` into its tier; if the tier is in backoff (or this write put it
        there), park it until the tier recovers instead of losing the chunk."""
        tier = self.tiers[w.tier]
        try:
            done = tier.available and tier.put_one(w.key, w.obj, before_admit=getattr(self._local, "turn", None))
        except BaseException:
            self._release(w)
            raise
        if done or tier.available:  # written, or skipped for good (no room, the device refused it)
            self._release(w)
            return
        with self._writer_lock:
            self.stats.deferred_writes += not w.parked
            w.parked = True
            self._parked.append(w)
            over = self._parked.popleft() if len(self._parked) > self.config.write_queue_size else None
        if over is not None:
            self._drop(over, f"more than write_queue_size ({self.config.write_queue_size}) writes wait for it")

    def _drop(self, w: _Write, why: str) -> None:
        """A parked write given up: counted, and said once per outage of its tier."""
        self.stats.dropped_writes += 1
        if w.tier not in self._drops_said:
            self._drops_said.add(w.tier)
            log.warning("tier %s: in backoff; dropping chunks queued for it (%s); counted in dropped_writes",
                        self.tiers[w.tier].name, why)
        self._release(w)

    def _retry_wait(self) -> float | None:
        with self._writer_lock:
            tiers = {w.tier for w in self._parked}
        if not tiers and not any(t.resync_due for t in self.tiers):
            return None
        return min(1.0, max(0.01, min((self.tiers[i].retry_in() for i in tiers), default=0.0)))

    def _retry(self) -> None:
        """Resync each shared tier back from an outage, then write what was parked for it."""
        for t in self.tiers:
            if t.resync_due:
                t.resync()
        with self._writer_lock:
            up = {w.tier for w in self._parked if self.tiers[w.tier].available}
            due = [w for w in self._parked if w.tier in up]
            self._parked = deque(w for w in self._parked if w.tier not in up)
        for w in due:
            self._write(w)  # a tier that fails again parks the rest again, without calling it

    def _unpark_for(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """Drop parked writes whose chunk nothing else holds (evicted from the CPU tier
        already), oldest first, until the pool has room: the pool bounds memory."""
        while self._parked:
            with self._writer_lock:
                w = next((w for w in self._parked if w.obj.pooled and w.obj.refcount == 1), None)
                if w is None:
                    return None
                self._parked.remove(w)
            self._drop(w, "the memory pool needs the memory they hold")
            obj = self.pool.allocate(shape, dtype)
            if obj is not None:
                return obj
        return None

    def _recovered(self, tier: int) -> None:
        """Tier ``tier`` is back from an outage: wake the writer (resync, parked writes)."""
        self._drops_said.discard(tier)
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_WAKE)

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
