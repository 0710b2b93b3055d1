"""Moving payload bytes between files and memory, shared by the file backends (disk,
gds, fs): a payload read header first with a ``raw`` body straight into the memory it is
served from (:func:`read_payload`), vectored writes and positioned reads that loop until
done, and the buffers an O_DIRECT write can take as they are."""

from __future__ import annotations

import mmap
import os
from typing import Callable, Sequence

import xxhash

from lmcache import payload
from lmcache.codecs import Codec
from lmcache.dtypes import dtype_from_name
from lmcache.errors import CorruptPayloadError
from lmcache.memory import MemoryObj

BLOCK = 4096


def _direct_views(buffers: Sequence[bytes | memoryview]) -> list[memoryview] | None:
    """``buffers`` as they can go to an O_DIRECT write as they are (every one a whole
    number of blocks at a block-aligned address, the header copied into an aligned
    block first), or ``None``."""
    if len(buffers) != 2 or len(buffers[0]) % BLOCK or len(buffers[1]) % BLOCK:
        return None
    body = memoryview(buffers[1]).cast("B")
    if not body.contiguous or len(body) == 0:
        return None
    import numpy as np

    addr = np.frombuffer(body, dtype=np.uint8).ctypes.data
    if addr % BLOCK:
        return None
    head = mmap.mmap(-1, len(buffers[0]))
    head[:] = buffers[0]
    return [memoryview(head), body]


def read_payload(
    read_at: Callable[[memoryview, int], int],
    size: int,
    key: str,
    codec_lookup: Callable[[str], Codec],
    allocate: Callable[..., MemoryObj],
) -> MemoryObj:
    """Check and decode the ``size``-byte payload of ``key`` that ``read_at(dst, offset)``
    reads (it fills ``dst`` from ``offset`` and returns the bytes it read); raises
    :class:`CorruptPayloadError` like :func:`lmcache.payload.decode`.

    Why not read everything and call :func:`~lmcache.payload.decode`: the header comes
    first, in one small read, and a ``raw`` body then goes straight into the memory it
    is served from and is checked there: one copy from the storage instead of two
    (every file-like backend reads this way; other codecs decode from one whole read)."""
    head_buf = bytearray(min(size, payload.HEADER_READ_HINT))
    head = bytes(memoryview(head_buf)[: read_at(memoryview(head_buf), 0)])
    h = payload.parse_header(head)
    if h.key != key:
        raise CorruptPayloadError(f"payload holds key {h.key!r}, expected {key!r}")
    if size != h.total_len:
        raise CorruptPayloadError(f"file is {size} bytes, header says {h.total_len}")
    if h.codec != "raw":
        whole = bytearray(size)
        whole[: len(head)] = head
        got = len(head) + (read_at(memoryview(whole)[len(head) :], len(head)) if size > len(head) else 0)
        return payload.decode(memoryview(whole)[:got], key, codec_lookup, allocate)
    obj = allocate(h.shape, dtype_from_name(h.dtype))
    try:
        dst = memoryview(obj.byte_view().numpy()) if h.nbytes else memoryview(bytearray())
        have = head[h.header_len :]
        dst[: len(have)] = have
        if h.body_len > len(have):
            got = read_at(dst[len(have) :], len(head))
            if got != h.body_len - len(have):
                raise CorruptPayloadError("file ended before its body")
        if xxhash.xxh3_64_intdigest(dst) != h.body_xxh3:
            raise CorruptPayloadError("body checksum mismatch")
    except BaseException:
        obj.unref()
        raise
    return obj


def _write_all(fd: int, bufs: list[memoryview]) -> None:
    bufs = [b for b in bufs if len(b)]
    while bufs:
        try:
            n = os.writev(fd, bufs)
        except InterruptedError:  # pragma: no cover
            continue
        while n and bufs:
            if n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][n:]
                n = 0


def _pread_all(fd: int, dst: memoryview, offset: int) -> int:
    got = 0
    while got < len(dst):
        n = os.preadv(fd, [dst[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _read_all(fd: int, dst: memoryview) -> int:
    got = 0
    while got < len(dst):
        n = os.readv(fd, [dst[got:]])
        if n == 0:
            break
        got += n
    return got


