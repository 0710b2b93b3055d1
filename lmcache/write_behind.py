"""The storage hierarchy's lower-tier writer (:class:`WriteBehind`, a base of
:class:`lmcache.hierarchy.StorageHierarchy`): a bounded queue of writes into the tiers
below the top one (write-through), taken by one thread in batches; a write whose tier is
in backoff is parked and written once the tier recovers (or dropped, counted, when too
many wait or the pool needs their memory); while a store copies into the top tier the
writer holds its next write back (:meth:`WriteBehind.storing`). A queued write's chunk is
served from memory until it is written (:meth:`WriteBehind._inflight_get`)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from .config import Config
from .memory import MemoryObj

log = logging.getLogger("lmcache.hierarchy")  # the hierarchy's writer: its log lines are the hierarchy's

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


@dataclass
class _Write:
    tier: int
    key: str
    obj: MemoryObj
    parked: bool = False  # has waited for its tier to recover


#: a queue item that only wakes the writer (a tier recovered)
_WAKE = object()


class WriteBehind:
    """The lower-tier writer of a storage hierarchy (needs its ``config``, ``tiers``,
    ``pool``, ``stats``, ``_writer_lock``, ``_closed`` and ``_local``)."""

    def _start_writer(self, config: Config) -> None:
        """The writer's state and thread (once the tiers are built)."""
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
        core, which halved a CPU tier's store over a disk tier
        (docs/benchmarks.md#measurements-behind-the-code). The writer stops waiting once half its queue
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


__all__ = ["WRITER_YIELD_MAX", "WRITE_BATCH", "WriteBehind"]
