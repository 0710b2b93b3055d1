"""A bounded, pre-allocated host memory pool handing out reference-counted objects.

One contiguous byte buffer (pinned when CUDA is available) is carved into
:class:`MemoryObj` slices by a first-fit allocator with coalescing free lists. A memory
object starts with one reference; ``ref()`` adds one, ``unref()`` drops one and the last
drop returns the bytes to the pool. Touching the tensor of a freed object, or dropping a
reference that is not there, raises :class:`MemoryPoolError` instead of corrupting data.
Objects that do not fit in the pool can be made "unpooled" (plain heap tensors, never
admitted to a CPU tier) for transient use.

The first write to a page of fresh memory costs a page fault; on virtual machines that
bounds copies into untouched memory far below memcpy (docs/benchmarks.md#measurements-behind-the-code). So an unpinned pool of at least 256 MiB asks Linux for transparent huge
pages over its buffer (``MADV_HUGEPAGE``: one fault per 2 MiB instead of per 4 KiB) and,
unless ``prefault=False``, touches every page when it is created, so that stores copy
into memory that is already mapped. A pinned (CUDA host) pool is mapped by the driver.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import sys
import threading
import time
from typing import Sequence

import torch

from .errors import MemoryPoolError

log = logging.getLogger(__name__)
ALIGN = 256
#: objects of at least LARGE bytes start on a PAGE boundary (O_DIRECT reads and writes
#: go straight to and from them)
PAGE = 4096
LARGE = 64 << 10


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
#: smaller pools use small pages: huge pages cost a couple of MiB of RSS more, which
#: matters only for small pools, and save faults, which matter only for large ones
HUGE_PAGES_FROM = 256 << 20


def advise_huge_pages(buf: torch.Tensor) -> bool:
    """``madvise(MADV_HUGEPAGE)`` over the 2 MiB-aligned part of ``buf``'s memory (before
    it is touched). True if the kernel took the advice; False elsewhere (not Linux, THP
    disabled): the pool works the same, with small pages."""
    if sys.platform != "linux":
        return False
    addr, n = buf.data_ptr(), buf.numel() * buf.element_size()
    start = (addr + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    end = (addr + n) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return libc.madvise(start, end - start, MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):  # pragma: no cover - no libc symbol
        return False


MADV_POPULATE_WRITE = 23  # Linux 5.14+


def populate(buf: torch.Tensor) -> None:
    """Map every page of ``buf`` now: ``madvise(MADV_POPULATE_WRITE)`` (the kernel faults
    the pages in, nothing is written), else a single-threaded ``memset`` (not torch's
    ``zero_``, which would start its thread pool for this alone)."""
    addr, n = buf.data_ptr(), buf.numel() * buf.element_size()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover
        buf.zero_()
        return
    if sys.platform == "linux":
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        start = addr // PAGE * PAGE
        if libc.madvise(start, addr + n - start, MADV_POPULATE_WRITE) == 0:
            return
    ctypes.memset(addr, 0, n)


class MemoryObj:
    """A typed tensor view over pool bytes (or a heap tensor) with a reference count."""

    __slots__ = ("_pool", "offset", "size", "nbytes", "shape", "dtype", "_tensor", "_refs", "_lock", "writer_refs", "__weakref__")

    def __init__(self, pool: MemoryPool | None, offset: int, size: int, shape: Sequence[int], dtype: torch.dtype, tensor: torch.Tensor):
        self._pool = pool
        self.offset = offset
        self.size = size  # bytes reserved in the pool (aligned)
        self.shape = tuple(shape)
        self.dtype = dtype
        self.nbytes = tensor.numel() * tensor.element_size()
        self._tensor: torch.Tensor | None = tensor
        self._refs = 1
        self._lock = threading.Lock()
        #: references held by queued tier writes (not readers: they never block eviction)
        self.writer_refs = 0

    @property
    def pooled(self) -> bool:
        return self._pool is not None

    @property
    def refcount(self) -> int:
        return self._refs

    @property
    def tensor(self) -> torch.Tensor:
        t = self._tensor
        if t is None:
            raise MemoryPoolError("use after free: this memory object was returned to the pool")
        return t

    def byte_view(self) -> torch.Tensor:
        """The object's bytes as a flat uint8 tensor (shares memory)."""
        return self.tensor.reshape(-1).view(torch.uint8)

    def ref(self) -> MemoryObj:
        with self._lock:
            if self._refs <= 0:
                raise MemoryPoolError("use after free: ref() on a memory object that was freed")
            self._refs += 1
        return self

    def unref(self) -> None:
        with self._lock:
            if self._refs <= 0:
                raise MemoryPoolError("double free: unref() on a memory object that was already freed")
            self._refs -= 1
            last = self._refs == 0
            if last:
                self._tensor = None
        if last and self._pool is not None:
            self._pool._free(self.offset, self.size)

    def __repr__(self) -> str:
        state = "freed" if self._refs == 0 else f"refs={self._refs}"
        where = f"pool@{self.offset}" if self._pool else "heap"
        return f"MemoryObj({where}, shape={self.shape}, dtype={self.dtype}, {state})"


class MemoryPool:
    """Pre-allocated host memory of ``capacity`` bytes."""

    def __init__(self, capacity: int, pin: bool | None = None, prefault: bool = True):
        if capacity <= 0:
            raise ValueError("memory pool capacity must be positive")
        self.capacity = _align(capacity)
        if pin is None:
            pin = torch.cuda.is_available()
        self.pinned = bool(pin)
        # the usable part starts on a 2 MiB boundary: huge pages cover it whole, and object
        # offsets aligned to PAGE are page-aligned addresses
        raw = torch.empty(self.capacity + HUGE_PAGE, dtype=torch.uint8, pin_memory=self.pinned)
        skip = (-raw.data_ptr()) % HUGE_PAGE
        self._buf = raw[skip : skip + self.capacity]
        self.huge_pages = False
        self.prefault_seconds: float | None = None
        if not self.pinned:
            self.huge_pages = self.capacity >= HUGE_PAGES_FROM and advise_huge_pages(self._buf)
            if prefault:
                t0 = time.perf_counter()
                populate(self._buf)  # map every page now, not during the first stores
                self.prefault_seconds = time.perf_counter() - t0
        self._lock = threading.Lock()
        # free extents, sorted by offset: parallel lists of offsets and sizes
        self._free_off: list[int] = [0]
        self._free_len: list[int] = [self.capacity]
        self.used = 0
        self.live = 0

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """A new object of ``shape``/``dtype``, or ``None`` if the pool has no room."""
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        size = _align(max(nbytes, 1))
        align = PAGE if size >= LARGE else ALIGN
        with self._lock:
            for i, length in enumerate(self._free_len):
                start = self._free_off[i]
                pad = (-start) % align  # stays free, in front of the object
                if length < pad + size:
                    continue
                off = start + pad
                rest = length - pad - size
                if pad:
                    self._free_len[i] = pad
                    if rest:
                        self._free_off.insert(i + 1, off + size)
                        self._free_len.insert(i + 1, rest)
                elif rest:
                    self._free_off[i] = off + size
                    self._free_len[i] = rest
                else:
                    del self._free_off[i]
                    del self._free_len[i]
                self.used += size
                self.live += 1
                break
            else:
                return None
        t = self._buf[off : off + nbytes].view(dtype).view(tuple(shape))
        return MemoryObj(self, off, size, shape, dtype, t)

    @staticmethod
    def allocate_unpooled(shape: Sequence[int], dtype: torch.dtype) -> MemoryObj:
        """A heap-backed object for transient use when the pool is full."""
        t = torch.empty(tuple(shape), dtype=dtype)
        return MemoryObj(None, -1, t.numel() * t.element_size(), shape, dtype, t)

    def _free(self, off: int, size: int) -> None:
        with self._lock:
            i = bisect.bisect_left(self._free_off, off)
            if (i < len(self._free_off) and self._free_off[i] < off + size) or (
                i > 0 and self._free_off[i - 1] + self._free_len[i - 1] > off
            ):
                raise MemoryPoolError(f"double free of pool bytes [{off}, {off + size})")
            self._free_off.insert(i, off)
            self._free_len.insert(i, size)
            # coalesce with the next, then the previous extent
            if i + 1 < len(self._free_off) and off + size == self._free_off[i + 1]:
                self._free_len[i] += self._free_len.pop(i + 1)
                self._free_off.pop(i + 1)
            if i > 0 and self._free_off[i - 1] + self._free_len[i - 1] == off:
                self._free_len[i - 1] += self._free_len.pop(i)
                self._free_off.pop(i)
            self.used -= size
            self.live -= 1

    def close(self) -> None:
        """Give the memory back now, not whenever the garbage collector breaks the cycles
        around an engine (a process that opens and closes engines would hold every pool);
        an object still alive keeps its own bytes, and allocations after this fail."""
        with self._lock:
            self._free_off, self._free_len = [], []
            self._buf = torch.empty(0, dtype=torch.uint8)

    @property
    def region(self) -> tuple[int, int]:
        """``(address, bytes)`` of the pool's one buffer: what a transfer channel registers
        once with NIXL (every pooled object lies inside it)."""
        return self._buf.data_ptr(), self.capacity

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        with self._lock:
            return max(self._free_len, default=0)

    def __repr__(self) -> str:
        return f"MemoryPool(capacity={self.capacity}, used={self.used}, live={self.live}, pinned={self.pinned})"
