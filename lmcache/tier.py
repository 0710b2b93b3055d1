"""One storage tier: a backend, which only moves entries; the :class:`~lmcache.ledger.Ledger`
that alone keeps the tier's books (keys and their bytes, used and reserved bytes, the
policy's state, the listeners); and what the tier decides itself, under its lock: what to
evict, pins and leases, and health (backoff after failures, writes a device refuses).
:class:`lmcache.hierarchy.StorageHierarchy` orders tiers and moves entries between them.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from .config import TierConfig
from .errors import EntryPathError, StoreSkipped
from .redact import redact_text
from .leases import Leases
from .ledger import Ledger
from .memory import MemoryObj
from .storage import EntryInfo, StorageBackend, Store, Usage
from .encoded import bytes_store, open_objects

log = logging.getLogger("lmcache.hierarchy")  # the tiers' messages keep the logger operators filter on

#: a failing tier serves misses for BACKOFF_START seconds, doubling up to BACKOFF_MAX
BACKOFF_START = 0.05
BACKOFF_MAX = 10.0


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0
    get_seconds: float = 0.0
    puts: int = 0
    put_bytes: int = 0
    put_seconds: float = 0.0
    evictions: int = 0
    skipped_puts: int = 0  # did not fit (everything pinned, or larger than the tier)
    errors: int = 0
    corrupt: int = 0  # entries dropped by a check above the backend (the engine's shape/dtype check)
    refused_writes: int = 0  # puts and removes the device refused (full, or read-only)
    lost: int = 0  # entries a shared store no longer held when the tier came back from an outage
    last_error: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Health:
    failures: int = 0
    down_until: float = 0.0
    since: float = 0.0


#: errors with which a device refuses writes while its reads still work
_WRITE_REFUSALS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
#: a device that refuses writes again within this many seconds of the last time it was
#: said is not said again (a nearly full disk alternates refused and accepted stores)
REFUSAL_LOG_EVERY = 60.0


def _write_refused(exc: BaseException) -> bool:
    return isinstance(exc, (EntryPathError, StoreSkipped)) or (
        isinstance(exc, OSError) and exc.errno in _WRITE_REFUSALS
    )


class Tier(Store):
    """One backend plus its ledger, eviction, pins and health."""

    def __init__(
        self,
        cfg: TierConfig,
        backend: StorageBackend,
        ledger: Ledger,
        clock: Callable[[], float] = time.monotonic,
        *,
        trim: bool = True,
    ):
        """``trim``: evict at once if the backend already holds more than the capacity
        (off when a tier is only opened for inspection)."""
        self.cfg = cfg
        self.name = cfg.name
        self.capacity = ledger.capacity
        #: the backend as the tier uses it, a store of memory objects
        #: (:func:`lmcache.encoded.open_objects`): a byte store is seen through its object
        #: view, which encodes and checks payloads and fits them into its declared
        #: ``max_value_size``/``max_key_length`` (larger values split, longer keys hashed),
        #: so the tier and its callers never meet those limits
        self.backend = open_objects(backend)
        self.ledger = ledger
        self.clock = clock
        self.stats = TierStats()
        self._lock = threading.RLock()
        self._pins: dict[str, int] = {}
        self._leases = Leases(clock)
        self._health = _Health()
        #: a shared store back from an outage: its books are checked against it (:meth:`resync`)
        self.resync_due = False
        #: called (without the lock) when the tier recovers from an outage
        self.on_recover: Callable[[], None] | None = None
        #: why the device refuses writes (full, read-only), since when, the refusals counted
        #: before, whether that was said; None: it takes them
        self._write_refusal: tuple[str, float, int, bool] | None = None
        self._refusal_said_at: float | None = None  # when "refuses writes" was last logged
        #: called with (key, obj) for each evicted entry when the hierarchy demotes
        self.on_evict: Callable[[str, MemoryObj], None] | None = None
        #: with ``on_evict``: which evicted keys to demote (``None``: all of them)
        self.demote_if: Callable[[str], bool] | None = None
        if not self.backend.shared:
            try:
                for key, size in self.backend.keys():
                    ledger.admit(key, size)
            except Exception as exc:  # unreachable at start: serve misses, retry later
                self._failed("listing entries", exc)
        if trim and ledger.over(0):
            with self._lock:
                self._make_room(0)

    @property
    def used(self) -> int:
        return self.ledger.used

    # -------------------------------------------------------------- health
    @property
    def available(self) -> bool:
        return self.clock() >= self._health.down_until

    def _failed(self, what: str, exc: BaseException) -> None:
        """An error from the backend: serve misses for a while (doubling each time), and
        say so once per outage, not once per call."""
        h = self._health
        h.failures += 1
        delay = min(BACKOFF_START * (2 ** (h.failures - 1)), BACKOFF_MAX)
        h.down_until = self.clock() + delay
        self.stats.errors += 1
        why = redact_text(f"{type(exc).__name__}: {exc}")  # a client library's text may hold a URL's password
        self.stats.last_error = f"{what}: {why}"
        if h.failures == 1:
            h.since = self.clock()
            log.warning(
                "tier %s: %s failed (%s); serving misses and retrying with backoff until it recovers",
                self.name, what, why,
            )
        else:
            log.debug("tier %s: %s failed again (%s); next try in %.2fs", self.name, what, why, delay)

    def retry_in(self) -> float:
        """Seconds until a tier in backoff is tried again (0 when it is available)."""
        return max(0.0, self._health.down_until - self.clock())

    def _ok(self) -> None:
        h = self._health
        if h.failures:
            self._health = _Health()
            log.warning(
                "tier %s: recovered after %d failed calls over %.1fs", self.name, h.failures, self.clock() - h.since
            )
            # a shared store may have lost entries meanwhile (a restart, maxmemory)
            self.resync_due = self.resync_due or self.backend.shared
            if self.on_recover is not None:
                self.on_recover()

    def _refused(self, what: str, exc: BaseException) -> None:
        """The device refused a write (full, or remounted read-only): that write is
        skipped, and the tier keeps serving what it holds; no backoff, since reads still
        work. Said once when it starts and once when writes are taken again, not per call,
        and not again within ``REFUSAL_LOG_EVERY`` seconds. A :class:`StoreSkipped` (a
        shared directory at its capacity, or its lock busy) is not the device: counted in
        ``skipped_puts`` by the caller, nothing more."""
        if isinstance(exc, StoreSkipped):
            return
        self.stats.refused_writes += 1
        self.stats.last_error = f"{what}: {exc}"
        if isinstance(exc, EntryPathError):
            return  # one entry's path is blocked, not the device
        if self._write_refusal is None:
            now = self.clock()
            say = self._refusal_said_at is None or now - self._refusal_said_at >= REFUSAL_LOG_EVERY
            self._write_refusal = (f"{type(exc).__name__}: {exc}", now, self.stats.refused_writes, say)
            if say:
                self._refusal_said_at = now
                log.warning(
                    "tier %s: the device refuses writes (%s); stores to it are skipped while it keeps serving "
                    "its %d entries", self.name, exc, len(self.ledger),
                )

    def _writes_ok(self) -> None:
        r = self._write_refusal
        if r is not None:
            self._write_refusal = None
            if r[3]:
                log.warning(
                    "tier %s: takes writes again after %d refused over %.1fs",
                    self.name, self.stats.refused_writes - r[2] + 1, self.clock() - r[1],
                )

    # ---------------------------------------------------------------- pins
    def pin(self, key: str) -> None:
        with self._lock:
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        with self._lock:
            n = self._pins.get(key, 0)
            if n <= 1:
                self._pins.pop(key, None)
            else:
                self._pins[key] = n - 1

    def lease(self, key: str, seconds: float) -> None:
        with self._lock:
            self._leases.take(key, seconds)

    def lease_held(self, key: str, seconds: float) -> bool:
        """Lease ``key`` if this tier still holds it (checked under the lock, so that an
        eviction between a lookup's ``contains`` and its lease cannot leave a lease on
        nothing); a shared store's index is not authoritative, so there it always leases."""
        with self._lock:
            if not self.backend.shared and key not in self.ledger:
                return False
            self._leases.take(key, seconds)
        return True

    def release_lease(self, key: str) -> None:
        """Drop one live lease of ``key`` (the one that ends first)."""
        with self._lock:
            self._leases.drop(key)

    def is_pinned(self, key: str) -> bool:
        """Pinned, or leased by a lookup whose lease has not ended."""
        if key in self._pins:
            return True
        with self._lock:
            return self._leases.held(key)

    def _held(self, key: str) -> bool:
        """Not evictable: pinned, leased, or held by a reader."""
        return self.is_pinned(key) or self.backend.in_use(key)

    # --------------------------------------------------------- data path
    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not self.available:
            return [False] * len(keys)
        try:
            out = self.backend.exists(keys)
        except Exception as exc:
            self._failed("exists", exc)
            return [False] * len(keys)
        self._ok()
        if self.backend.shared:
            # a shared store loses entries behind our back (a peer evicts, the server
            # restarts empty, maxmemory): forget them, or a later put would skip them
            with self._lock:
                for key, present in zip(keys, out):
                    if not present:
                        self.ledger.forget(key)
        return out

    def get(self, keys: Sequence[str], on_ready: Callable[[int, MemoryObj], None] | None = None) -> list[MemoryObj | None]:
        """Objects for ``keys`` in one batch call to the backend (a pipeline or a
        concurrent fetch for remote stores); the caller owns one reference of each.
        ``on_ready`` reaches only a backend that declares ``streams_gets``, which calls
        ``on_ready(i, obj)`` (possibly from its I/O threads) as each hit arrives, before
        this returns; for other backends it is never called
        (:meth:`lmcache.storage.StorageBackend.get`)."""
        if not keys:
            return []
        if not self.available:
            self.stats.misses += len(keys)
            return [None] * len(keys)
        with self._lock:
            born = [self.ledger.born.get(k) for k in keys]
        t0 = time.perf_counter()
        try:
            if on_ready is not None and self.backend.streams_gets:
                objs = self.backend.get(keys, on_ready)
            else:
                objs = self.backend.get(keys) if len(keys) > 1 else [self.backend.get_one(keys[0])]
        except Exception as exc:
            self._failed("get", exc)
            self.stats.misses += len(keys)
            return [None] * len(keys)
        self._ok()
        dt = time.perf_counter() - t0
        with self._lock:
            for key, obj, b in zip(keys, objs, born):
                if obj is None:
                    self.stats.misses += 1
                    # vanished (corrupt, or removed by a peer): forget it, unless a put
                    # stored it again while this read ran (its file is there and counted)
                    if self.ledger.born.get(key) == b:
                        self.ledger.forget(key)
                    continue
                self.stats.hits += 1
                self.stats.hit_bytes += obj.nbytes
                self.ledger.access([key])
            self.stats.get_seconds += dt
        return objs

    def _make_room(self, need: int) -> bool:
        """Evict until ``need`` more bytes fit. Called with the lock held."""
        return self._evict_until(lambda: not self.ledger.over(need))

    def _evict_until(self, done: Callable[[], bool]) -> bool:
        """Evict by policy until ``done()``; False if the evictable entries ran out first."""
        while not done():
            victim = self.ledger.victim(self._held)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, key: str) -> None:
        demote = None
        if self.on_evict is not None and (self.demote_if is None or self.demote_if(key)):
            try:
                demote = self.backend.get_one(key)
            except Exception as exc:  # the entry is lost to the lower tier, not to correctness
                self._failed("read for demotion", exc)
        try:
            self.backend.delete_one(key)
        except Exception as exc:
            self._write_failed("delete", exc)
        self.ledger.forget(key)
        self.stats.evictions += 1
        if demote is not None:
            self.on_evict(key, demote)  # takes over the reference

    def touch(self, keys: Sequence[str]) -> None:
        """Count a use of entries without reading them (a store that found them cached)."""
        with self._lock:
            self.ledger.access(keys)

    def evict_bytes(self, nbytes: int) -> int:
        """Evict unpinned entries until ``nbytes`` were freed (or nothing is left)."""
        with self._lock:
            before = self.ledger.used
            self._evict_until(lambda: before - self.ledger.used >= nbytes)
            return before - self.ledger.used

    def put_one(self, key: str, obj: MemoryObj, *, before_admit: Callable[[], None] | None = None) -> int:
        """Store ``obj`` unless present; the caller keeps its reference. The bytes the
        entry takes (the stored entry's when it was present), 0 if not stored.

        ``before_admit`` is called once the backend stored it, before the key is admitted
        (outside the tier's lock): the hierarchy's batch writer admits in queue order."""
        if not self.available:
            self.stats.skipped_puts += 1
            return 0
        need = self.backend.reserve_size(key, obj)
        with self._lock:
            if key in self.ledger:
                return self.ledger.sizes[key] or 1
            if need > self.capacity or not self._make_room(need):
                self.stats.skipped_puts += 1
                return 0
            self.ledger.reserved += need
        t0 = time.perf_counter()
        try:
            stored = self.backend.put_one(key, obj)
        except Exception as exc:
            with self._lock:
                self.ledger.reserved -= need
            self.stats.skipped_puts += _write_refused(exc)  # the device refused this chunk
            self._write_failed("put", exc)
            return 0
        self._ok()
        self._writes_ok()
        dt = time.perf_counter() - t0
        if before_admit is not None:
            before_admit()
        with self._lock:
            self.ledger.reserved -= need
            self.ledger.admit(key, stored)
            if stored > need:  # a backend that under-reserved: settle at once
                self._make_room(0)
            self.stats.puts += 1
            self.stats.put_bytes += stored
            self.stats.put_seconds += dt
        return stored or 1

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove ``keys``: for each, whether the tier held it (in its books or in the
        store); one that failed to delete is ``False`` and stays counted."""
        out: list[bool] = []
        with self._lock:
            for k in keys:
                try:
                    removed = self.backend.delete_one(k)
                except Exception as exc:
                    self._write_failed("delete", exc)
                    out.append(False)
                    continue
                size = self.ledger.forget(k)
                out.append(bool(removed or size is not None))
        return out

    def _write_failed(self, what: str, exc: BaseException) -> None:
        """A device that refuses writes (full, read-only, or one blocked path) still
        serves what it holds: not an outage, unlike any other error."""
        (self._refused if _write_refused(exc) else self._failed)(what, exc)

    def usage(self) -> Usage:
        return Usage(self.ledger.used, self.capacity, len(self.ledger))

    # --------------------------------------------------------- inspection
    def info(self) -> dict:
        """Counters and usage as plain data (``CacheEngine.stats()["tiers"][name]``).

        ``bytes_in`` are the bytes written into the tier, ``bytes_out`` those read from
        it by hits; ``hit_rate`` is hits / (hits + misses), ``None`` before any get.
        """
        st = self.stats.as_dict()
        integrity = self.backend.integrity  # a byte backend's checksum/header failures
        st["corrupt"] += integrity.corrupt if integrity is not None else 0
        looked = st["hits"] + st["misses"]
        with self._lock:
            pinned = sum(1 for k in self._pins if k in self.ledger)
        return {
            "name": self.name,
            "backend": self.cfg.backend,
            "codec": self.cfg.codec,
            "policy": self.cfg.policy,
            **st,
            **self.usage().__dict__,
            "hit_rate": st["hits"] / looked if looked else None,
            "bytes_in": st["put_bytes"],
            "bytes_out": st["hit_bytes"],
            "pinned": pinned,
            "available": self.available,
            # None, or why the device refuses writes (full, read-only): reads still served
            "write_refused": None if self._write_refusal is None else self._write_refusal[0],
            # a store other processes share: usage counts only what this instance wrote
            "shared": self.backend.shared,
        }

    def entries(self) -> Iterator[tuple[EntryInfo, bool]]:
        """``(entry, pinned)`` for every entry the tier accounts for (for a shared store:
        every entry in it, adopted into the index, see :meth:`refresh`)."""
        if self.backend.shared:
            found = list(self.backend.entries())
            self._adopt([(e.key, e.size) for e in found])
            for e in found:
                yield e, self.is_pinned(e.key)
            return
        for e in self.backend.entries():
            if e.key in self.ledger:
                yield e, self.is_pinned(e.key)

    def refresh(self) -> None:
        """For a shared store, which is not listed when the tier opens: list it now and
        account for what it holds (entries other processes wrote are adopted, entries
        that vanished are dropped), so that an operator's ``ls``, ``evict`` or
        ``compress`` sees the whole store. A no-op for other tiers."""
        if not self.backend.shared:
            return
        try:
            listed = list(self.backend.keys())
        except Exception as exc:
            self._failed("listing entries", exc)
            return
        self._ok()
        self._adopt(listed)

    def resync(self, batch: int = 512) -> int:
        """After an outage of a shared store: ask it (``contains``, in batches) for each
        key the ledger counts, and forget those it no longer holds (a server that
        restarted empty, or evicted while it was unreachable), through
        :meth:`Ledger.forget`, so bytes used, the policy and the admit/evict listeners
        agree with the store again; counted in ``lost``, said once. Keys admitted while it
        runs are kept. Only this instance's entries are asked about (a listing of a shared
        store would walk every instance's). Returns the number forgotten; an error puts
        the tier back in backoff, and the next recovery resyncs again."""
        self.resync_due = False
        with self._lock:
            mark = self.ledger.admits
            keys = [k for k, n in self.ledger.born.items() if n <= mark]
        gone: list[str] = []
        try:
            for i in range(0, len(keys), batch):
                part = keys[i : i + batch]
                gone += [k for k, here in zip(part, self.backend.exists(part)) if not here]
        except Exception as exc:
            self._failed("resync after an outage", exc)
            return 0
        lost = nbytes = 0
        with self._lock:
            for key in gone:
                if self.ledger.born.get(key, mark + 1) <= mark:  # not stored again meanwhile
                    nbytes += self.ledger.forget(key) or 0
                    lost += 1
            self.stats.lost += lost
        if lost:
            log.warning(
                "tier %s: after its outage the store no longer holds %d of the %d entries counted (%d bytes); "
                "forgotten", self.name, lost, len(keys), nbytes,
            )
        return lost

    def _adopt(self, listed: Sequence[tuple[str, int]]) -> None:
        with self._lock:
            present = dict(listed)
            for key in [k for k in self.ledger.sizes if k not in present]:
                self.ledger.forget(key)
            for key, size in listed:
                self.ledger.admit(key, size)

    def eviction_order(self) -> list[str]:
        """The keys this tier's policy would evict next, first first (pinned ones and
        those a reader holds left out)."""
        with self._lock:
            return [k for k in self.ledger.eviction_order() if not self._held(k)]

    def size_of(self, key: str) -> int | None:
        return self.ledger.sizes.get(key)

    def keys(self) -> list[tuple[str, int]]:
        """Every ``(key, stored bytes)`` this tier accounts for, as the backend's
        :meth:`~lmcache.storage.StorageBackend.keys` names it, copied under the tier's lock
        (a consistent snapshot for the controller worker: events after it arrive through
        its ledger's listeners)."""
        with self._lock:
            return list(self.ledger.sizes.items())

    def key_list(self) -> list[str]:
        """Deprecated: ``[key for key, _ in tier.keys()]``."""
        warnings.warn("Tier.key_list() is deprecated; use Tier.keys(), which gives (key, stored bytes) pairs",
                      DeprecationWarning, stacklevel=2)
        return [k for k, _ in self.keys()]

    def evict_keys(self, keys: Sequence[str]) -> tuple[list[tuple[str, int]], list[tuple[str, str]]]:
        """Evict these entries now (an operator's request: nothing is demoted to the
        tier below). Returns ``([(key, bytes)], [(key, why not)])``: a pinned entry, one a
        reader holds and one the tier does not have are skipped."""
        done: list[tuple[str, int]] = []
        skipped: list[tuple[str, str]] = []
        with self._lock:
            for key in keys:
                size = self.ledger.sizes.get(key)
                if size is None:
                    skipped.append((key, "not in this tier"))
                    continue
                if self.is_pinned(key):
                    skipped.append((key, "pinned"))
                    continue
                if self.backend.in_use(key):
                    skipped.append((key, "in use by a reader"))
                    continue
                try:
                    self.backend.delete_one(key)
                except Exception as exc:
                    self._failed("delete", exc)
                    skipped.append((key, f"delete failed: {exc}"))
                    continue
                self.ledger.forget(key)
                self.stats.evictions += 1
                done.append((key, size))
        return done, skipped

    def rewrite(self, key: str, buffers: Sequence[bytes | memoryview]) -> tuple[int, int] | str:
        """Replace the stored bytes of ``key`` with ``buffers`` in one atomic ``put_one``
        to the tier's byte store (a reader sees the old payload or the new one), settling the books:
        ``(bytes before, bytes after)``, or why not (the key left the tier, or a larger
        payload found no room). The admin layer's re-encoding (``lmcache compress``) uses
        it; the caller pins the key while it prepares ``buffers``."""
        store = bytes_store(self.backend)
        if store is None:
            return "the tier keeps objects, not payload bytes"
        new = sum(len(b) for b in buffers)
        with self._lock:
            old = self.ledger.sizes.get(key)
            if old is None:
                return "evicted meanwhile"
            if new > old and not self._make_room(new - old):
                return "no room in the tier for the larger encoding"
            new = store.put_one(key, buffers)
            self.ledger.admit(key, new)
        return old, new

    def __len__(self) -> int:
        return len(self.ledger)

    def __repr__(self) -> str:
        return f"Tier({self.name!r}, backend={self.cfg.backend}, used={self.used}/{self.capacity})"
