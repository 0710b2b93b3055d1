"""What a transfer moves and where it lands (:mod:`lmcache.transfer`): a chunk's
description (:class:`ChunkMeta`), its checksum by ``verify`` mode, and the receiver's
bounded :class:`ReceiveBuffer` of slots inside the memory pool."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import xxhash

from .dtypes import dtype_from_name, dtype_name
from .memory import MemoryObj

from .transfer_wire import MAX_KEY, TransferRefused

log = logging.getLogger("lmcache.transfer")

# ------------------------------------------------------------------ chunks
@dataclass(frozen=True)
class ChunkMeta:
    """What a receiver needs to allocate one chunk: its key, shape and dtype."""

    key: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=dtype_from_name(self.dtype)).element_size()
        for d in self.shape:
            n *= d
        return n

    @classmethod
    def of(cls, key: str, obj: MemoryObj) -> ChunkMeta:
        return cls(key, tuple(int(d) for d in obj.shape), dtype_name(obj.dtype))

    def to_json(self) -> list[Any]:
        return [self.key, list(self.shape), self.dtype]

    @classmethod
    def from_json(cls, v: Any) -> ChunkMeta:
        """Checked: a key of at most :data:`MAX_KEY` characters, up to 8 non-negative dims,
        a known dtype (ValueError otherwise)."""
        if not (isinstance(v, list) and len(v) == 3 and isinstance(v[0], str) and 0 < len(v[0]) <= MAX_KEY
                and isinstance(v[1], list) and len(v[1]) <= 8 and isinstance(v[2], str)
                and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in v[1])):
            raise ValueError("malformed chunk description")
        dtype_from_name(v[2])
        return cls(v[0], tuple(v[1]), v[2])


#: bytes of each window a ``sample`` checksum hashes (the first, the middle and the last)
SAMPLE = 64 << 10
VERIFY = ("full", "sample", "off")


def checksum(obj: MemoryObj, mode: str = "full") -> int:
    """xxh3-64 of a chunk's bytes (the payload checksum of :mod:`lmcache.payload`); with
    ``mode="sample"`` of its first, middle and last :data:`SAMPLE` bytes only (and the
    length): enough to catch a slot never written or written elsewhere, at a cost that does
    not grow with the chunk."""
    mv = memoryview(obj.byte_view().numpy())
    n = len(mv)
    if mode != "sample" or n <= 3 * SAMPLE:
        return xxhash.xxh3_64_intdigest(mv)
    h = xxhash.xxh3_64(n.to_bytes(8, "little"))
    mid = (n - SAMPLE) // 2 // 256 * 256
    for start in (0, mid, n - SAMPLE):
        h.update(mv[start : start + SAMPLE])
    return h.intdigest()


def verify_mode(v: Any) -> str:
    """``True`` -> ``full``, ``False`` -> ``off``, or one of :data:`VERIFY`."""
    if v is True:
        return "full"
    if v is False:
        return "off"
    if v not in VERIFY:
        raise ValueError(f"verify must be one of {', '.join(VERIFY)}; got {v!r}")
    return v


def byte_buffer(obj: MemoryObj) -> memoryview:
    """A writable memoryview of the object's bytes (no copy)."""
    return memoryview(obj.byte_view().numpy())


# ------------------------------------------------------------------ receive buffer
@dataclass
class Allocation:
    """Slots of one request: pool objects awaiting their bytes, until a deadline."""

    id: str
    request: str
    metas: list[ChunkMeta]
    objs: list[MemoryObj]
    nbytes: int
    deadline: float
    written: bool = False  # the channel saw the sender's completion notification

    def release(self) -> None:
        objs, self.objs = self.objs, []
        for o in objs:
            o.unref()


@dataclass
class BufferStats:
    allocated: int = 0  # allocations granted
    full: int = 0  # allocation requests answered "full" (the sender may retry)
    refused: int = 0  # requests given up on (the sender's wait ran out, or never fits)
    committed: int = 0  # allocations committed
    committed_chunks: int = 0
    rejected_chunks: int = 0  # failed their checksum or the sink's check
    aborted: int = 0
    expired: int = 0  # freed by the reaper: neither committed nor aborted in time


class ReceiveBuffer:
    """In-flight slots, bounded by ``capacity`` bytes, each allocation with a deadline.

    ``allocate(shape, dtype)`` gives one pool object or ``None`` (an engine passes its
    gateway's, which checks the chunk's shape first and evicts from the CPU tier);
    ``reserve`` takes all of a request's slots or none."""

    def __init__(self, allocate: Callable[[Sequence[int], torch.dtype], MemoryObj | None], capacity: int,
                 slot_timeout: float, clock: Callable[[], float] = time.monotonic):
        self._allocate = allocate
        self.capacity = int(capacity)
        self.slot_timeout = float(slot_timeout)
        self.clock = clock
        self._open: dict[str, Allocation] = {}
        self.in_flight = 0
        self.stats = BufferStats()
        self._lock = threading.Lock()

    def reserve(self, request: str, metas: Sequence[ChunkMeta], timeout: float | None = None) -> Allocation | None:
        """All slots of ``metas``, or ``None`` when they do not fit now (counted as full).
        :class:`TransferRefused` when they can never fit (more than the whole buffer)."""
        need = sum(m.nbytes for m in metas)
        if need > self.capacity:
            with self._lock:
                self.stats.refused += 1
            raise TransferRefused(f"request {request[:100]!r} needs {need} bytes, more than the whole receive "
                                  f"buffer ({self.capacity})")
        with self._lock:
            if self.in_flight + need > self.capacity:
                self.stats.full += 1
                return None
            self.in_flight += need  # reserved before allocating: concurrent requests cannot overshoot
        objs: list[MemoryObj] = []
        try:
            for m in metas:
                o = self._allocate(m.shape, dtype_from_name(m.dtype))
                if o is None:
                    break
                objs.append(o)
        except BaseException:
            for o in objs:
                o.unref()
            with self._lock:
                self.in_flight -= need
            raise
        if len(objs) < len(metas):  # the pool itself is full: the same as a full buffer
            for o in objs:
                o.unref()
            with self._lock:
                self.in_flight -= need
                self.stats.full += 1
            return None
        a = Allocation(secrets.token_hex(8), request, list(metas), objs, need,
                       self.clock() + (self.slot_timeout if timeout is None else timeout))
        with self._lock:
            self._open[a.id] = a
            self.stats.allocated += 1
        return a

    def get(self, alloc_id: str) -> Allocation | None:
        with self._lock:
            return self._open.get(alloc_id)

    def take(self, alloc_id: str) -> Allocation | None:
        """Remove an open allocation to commit it (the caller then owns its objects)."""
        with self._lock:
            a = self._open.pop(alloc_id, None)
            if a is not None:
                self.in_flight -= a.nbytes
            return a

    def abort(self, alloc_id: str) -> bool:
        a = self.take(alloc_id)
        if a is None:
            return False
        a.release()
        with self._lock:
            self.stats.aborted += 1
        return True

    def expire(self) -> list[Allocation]:
        """Free every allocation past its deadline; returns them (already released)."""
        now = self.clock()
        with self._lock:
            gone = [a for a in self._open.values() if a.deadline <= now]
            for a in gone:
                del self._open[a.id]
                self.in_flight -= a.nbytes
            self.stats.expired += len(gone)
        for a in gone:
            log.warning("transfer: request %r: %d slot(s) neither committed nor aborted within %gs; freed, "
                        "nothing committed", a.request[:100], len(a.objs), self.slot_timeout)
            a.release()
        return gone

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((a.deadline for a in self._open.values()), default=None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def close(self) -> None:
        with self._lock:
            gone, self._open = list(self._open.values()), {}
            self.in_flight = 0
        for a in gone:
            a.release()


@dataclass
class EndpointStats:
    pushed_requests: int = 0
    pushed_chunks: int = 0
    pushed_bytes: int = 0
    push_seconds: float = 0.0
    push_alloc_seconds: float = 0.0  # of push_seconds: until the receiver granted slots
    push_write_seconds: float = 0.0  # of push_seconds: the channel's move of the bytes
    push_commit_seconds: float = 0.0  # of push_seconds: the commit's round trip (checks and sink there)
    #: the last RECENT pushes' seconds each, oldest first (a median per request for benches)
    push_recent: list[float] = field(default_factory=list)
    #: of the pushes to a receiver on this host (same boot, one monotonic clock): seconds from
    #: the push's start until the receiver had committed it (its answer's trip back excluded)
    push_ready_count: int = 0
    push_ready_seconds: float = 0.0
    push_ready_recent: list[float] = field(default_factory=list)
    pushed_by_read: int = 0  # of pushed_requests: the receiver read them (push_by: read)
    push_refused: int = 0  # gave up: the receiver stayed full for alloc_wait, or refused
    push_failed: int = 0
    pulled_requests: int = 0
    pulled_chunks: int = 0
    pulled_bytes: int = 0
    pull_failed: int = 0
    release_failed: int = 0  # a pull's bytes arrived but its release did not reach the offering side
    fetched_requests: int = 0  # peers' pushes by read that this side read and committed
    fetched_bytes: int = 0
    fetch_read_seconds: float = 0.0
    fetch_failed: int = 0
    offers: int = 0
    offers_released: int = 0
    offers_expired: int = 0


#: how many pushes' durations :attr:`EndpointStats.push_recent` keeps
RECENT = 256


@dataclass
class Offer:
    id: str
    request: str
    items: list[tuple[ChunkMeta, MemoryObj]]
    deadline: float
    sums: list[int] | None = None
    #: the JSON-able description a puller needs (what :meth:`ChannelEndpoint.offer` returns)
    description: dict[str, Any] | None = None

    def release(self) -> None:
        items, self.items = self.items, []
        for _, o in items:
            o.unref()


#: an offer's name: what a peer's kv_transfer_params carry (hostile: bounded and plain)
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")


def offer_name(name: Any) -> str:
    """``name`` if it is a usable offer name (1-128 characters of letters, digits and
    ``-_.:``), else ValueError (one line)."""
    if not isinstance(name, str) or not 0 < len(name) <= 128 or not set(name) <= _NAME_CHARS:
        raise ValueError(f"offer name must be 1-128 characters of letters, digits and -_.:, got {str(name)[:40]!r}")
    return name
