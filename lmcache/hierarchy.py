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
import logging
import queue
import threading
import time
from dataclasses import dataclass
from itertools import compress
from operator import not_
from typing import Callable, Iterator, Sequence

import torch

from .codecs import ChainError, chain_names, load_codec
from .config import Config, TierConfig
from .errors import ConfigError, CorruptPayloadError
from .ledger import Ledger, Listener
from .memory import MemoryObj, MemoryPool
from .plugin_manager import Registries, get_registries
from .policies import EvictionPolicy
from .storage import BackendContext, StorageBackend, check_backend_options
from .tier import Tier

log = logging.getLogger(__name__)

#: the longest the lower-tier writer holds a write back while stores copy (see
#: :meth:`StorageHierarchy.storing`): a bound, so that no chain of stores starves it
WRITER_YIELD_MAX = 0.25


@dataclass
class TierParts:
    """A tier's plugins, loaded and checked, before its backend is opened."""

    backend_cls: type[StorageBackend]
    codec: object
    policy: EvictionPolicy
    options: dict


def check_tier(
    i: int,
    tcfg: TierConfig,
    *,
    source: str | None = None,
    registries: Registries | None = None,
    codec_for: Callable[..., object] | None = None,
) -> TierParts:
    """Load tier ``i``'s backend class, codec and policy and check its backend keys,
    opening nothing. Errors are :class:`ConfigError` naming ``tiers[i].<key>``."""
    regs = registries or get_registries()
    prefix = f"tiers[{i}]"
    options = dict(tcfg.options)
    codec_options = options.pop("codec_options", None)
    try:
        backend_cls = regs.backends.load(tcfg.backend)
    except Exception as exc:
        raise ConfigError(f"{prefix}.backend", str(exc), source) from exc
    try:
        for name in chain_names(tcfg.codec):
            regs.codecs.load(name)
    except Exception as exc:
        raise ConfigError(f"{prefix}.codec", str(exc), source) from exc
    try:
        codec = (codec_for or codec_cache(regs))(tcfg.codec, codec_options)
    except ChainError as exc:
        raise ConfigError(f"{prefix}.codec", str(exc), source) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{prefix}.codec_options", str(exc), source) from None
    except Exception as exc:
        raise ConfigError(f"{prefix}.codec", str(exc), source) from exc
    try:
        policy = regs.policies.load(tcfg.policy)()
    except Exception as exc:
        raise ConfigError(f"{prefix}.policy", str(exc), source) from exc
    if getattr(backend_cls, "check_options", None) is not None:
        try:
            check_backend_options(backend_cls, options, tcfg.capacity)
        except ConfigError as exc:
            raise ConfigError(f"{prefix}.{exc.key}", exc.problem, source) from None
    return TierParts(backend_cls, codec, policy, options)


def build_tier(
    i: int,
    tcfg: TierConfig,
    *,
    source: str | None = None,
    registries: Registries | None = None,
    codec_for: Callable[..., object] | None = None,
    allocate: Callable[[Sequence[int], torch.dtype], MemoryObj] | None = None,
    clock: Callable[[], float] = time.monotonic,
    pool: MemoryPool | None = None,
    read_only: bool = False,
    trim: bool = True,
    parts: TierParts | None = None,
) -> Tier:
    """Open tier ``i`` of a config: its backend, codec and policy. Used by the hierarchy,
    and on its own by tools that inspect a config's persisted tiers (``lmcache ls``).
    Without ``allocate``, reads go to heap memory; without ``codec_for``, payloads of any
    registered codec are readable."""
    regs = registries or get_registries()
    codec_for = codec_for or codec_cache(regs)
    parts = parts or check_tier(i, tcfg, source=source, registries=regs, codec_for=codec_for)
    ctx = BackendContext(
        tier=tcfg.name,
        capacity=tcfg.capacity,
        options=parts.options,
        codec=parts.codec,  # type: ignore[arg-type]
        codec_lookup=codec_for,  # type: ignore[arg-type]
        allocate=allocate or MemoryPool.allocate_unpooled,
        clock=clock,
        pool=pool,
        read_only=read_only,
    )
    try:
        backend = parts.backend_cls(ctx)
    except ConfigError as exc:
        raise ConfigError(f"tiers[{i}].{exc.key}", exc.problem, source) from None
    return Tier(tcfg, backend, Ledger(tcfg.name, tcfg.capacity, parts.policy), clock, trim=trim)


def codec_cache(regs: Registries) -> Callable[..., object]:
    """``codec(name, options=None)``: the codec (or chain) named ``name``, built once
    per name without options (a tier's reads look a payload's codec up per entry)."""
    cache: dict[str, object] = {}

    def codec(name: str, options: dict | None = None) -> object:
        if options:
            return load_codec(regs.codecs.load, name, options)
        if name not in cache:
            cache[name] = load_codec(regs.codecs.load, name)
        return cache[name]

    return codec


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


@dataclass
class HierarchyStats:
    dropped_writes: int = 0  # lower-tier writes dropped because the queue was full
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
        try:
            for i, tcfg in enumerate(config.tiers):
                self.tiers.append(self._build_tier(i, tcfg))
        except BaseException:
            for t in self.tiers:
                t.backend.close()
            raise
        for i, t in enumerate(self.tiers[:-1]):
            t.on_evict = self._demoter(i + 1)
            if not self.write_back:
                # write-through: the lower tiers got every chunk when it was stored, except
                # those a tier skipped while its store was down (or whose write queue was
                # full); such a chunk is written down when it leaves this tier, not lost
                t.demote_if = self._missing_below(i + 1)
        self._queue: queue.Queue[_Write | None] = queue.Queue(maxsize=config.write_queue_size)
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
        obj = self.pool.allocate(shape, dtype)
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
                obj = self.pool.allocate(shape, dtype)
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
            if threading.current_thread() is self._worker:
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
        """Whether no tier from ``first`` down holds (or is about to hold) ``key``, and
        one of them is up to take it: an evicted entry worth writing down."""
        lower = self.tiers[first:]

        def missing(key: str) -> bool:
            # not if a write of it is queued, a lower tier has it, or none is up to take it
            if key in self._inflight or any(key in t.ledger for t in lower) or not any(t.available for t in lower):
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
            w = self._queue.get()
            try:
                if w is None:
                    return
                if self._stores and not self._stores_need_memory:
                    self._yield_to_stores()
                try:
                    self.tiers[w.tier].put_one(w.key, w.obj)
                finally:
                    self._release(w)
            except Exception:  # never let the writer die
                log.exception("lmcache tier writer: unexpected error")
            finally:
                self._queue.task_done()

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
        return self._queue.qsize()

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
            t.ledger.listeners = listeners

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
        for t in self.tiers:
            try:
                t.backend.close()
            except Exception:
                log.exception("closing tier %s", t.name)
