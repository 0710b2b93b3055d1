"""Moving payload bytes between files and memory, shared by the file backends (disk,
gds, fs): opening an entry's file without following links or blocking on a FIFO, a
payload read header first with a ``raw`` body straight into the memory it is served from
(:func:`read_payload`), a ``raw`` payload written body first and hashed as it goes
(:func:`write_raw_payload`), vectored writes and positioned reads that loop until done,
and the buffers an O_DIRECT write can take as they are; a store's I/O threads
(:class:`IOPool`) and the batch reads and writes of its object view on them
(:class:`ThreadedIO`)."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import threading
from pathlib import Path
from typing import Callable, Sequence

import xxhash

from lmcache import payload
from lmcache.codecs import Codec
from lmcache.dtypes import dtype_from_name
from lmcache.errors import CorruptPayloadError
from lmcache.memory import MemoryObj

log = logging.getLogger("lmcache.backends.disk")
BLOCK = 4096
#: bytes read or written, and hashed, at a time by the local-file paths: small enough
#: to be hashed from the CPU's cache right after (or before) the kernel copies it
PIECE = 1 << 20


class _NotAFile(OSError):
    """Something other than a regular file where an entry's file should be."""


def _open_entry(path: Path | str, extra: int = 0) -> int:
    """A read descriptor of the regular file at ``path``. Never blocks on a FIFO (opened
    non-blocking) and never follows a link; ``_NotAFile`` for a directory, FIFO, device,
    socket or symlink, ``FileNotFoundError`` if nothing is there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | extra)
    except IsADirectoryError:
        raise _NotAFile(f"{path} is a directory") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _NotAFile(f"{path} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _NotAFile(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


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


def _header(read_at: Callable[[memoryview, int], int], size: int, key: str) -> tuple[payload.Header, bytes]:
    """The payload header of ``key`` (read with the first body bytes, ``HEADER_READ_HINT``
    in all), checked against the key and the file's size; and the bytes read."""
    head_buf = bytearray(min(size, payload.HEADER_READ_HINT))
    head = bytes(memoryview(head_buf)[: read_at(memoryview(head_buf), 0)])
    h = payload.parse_header(head)
    if h.key != key:
        raise CorruptPayloadError(f"payload holds key {h.key!r}, expected {key!r}")
    if size != h.total_len:
        raise CorruptPayloadError(f"file is {size} bytes, header says {h.total_len}")
    return h, head


def read_payload(
    read_at: Callable[[memoryview, int], int],
    size: int,
    key: str,
    codec_lookup: Callable[[str], Codec],
    allocate: Callable[..., MemoryObj],
    piece: int | None = None,
) -> MemoryObj:
    """Check and decode the ``size``-byte payload of ``key`` that ``read_at(dst, offset)``
    reads (it fills ``dst`` from ``offset`` and returns the bytes it read); raises
    :class:`CorruptPayloadError` like :func:`lmcache.payload.decode`.

    Why not read everything and call :func:`~lmcache.payload.decode`: the header comes
    first, in one small read, and a ``raw`` body then goes straight into the memory it
    is served from and is checked there: one copy from the storage instead of two
    (every file-like backend reads this way; other codecs decode from one whole read).
    With ``piece`` (local files, where a read costs little more than its copy) the body
    is read ``piece`` bytes at a time, each hashed while it is still in the CPU's cache,
    instead of hashed in a second pass over memory."""
    h, head = _header(read_at, size, key)
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
        hasher = xxhash.xxh3_64(dst[: len(have)])
        step = piece or max(1, h.body_len)
        for at in range(len(have), h.body_len, step):
            part = dst[at : at + step]
            if read_at(part, h.header_len + at) != len(part):
                raise CorruptPayloadError("file ended before its body")
            hasher.update(part)
        if hasher.intdigest() != h.body_xxh3:
            raise CorruptPayloadError("body checksum mismatch")
    except BaseException:
        obj.unref()
        raise
    return obj


def read_raw_into(
    read_at: Callable[[memoryview, int], int],
    size: int,
    key: str,
    shape: Sequence[int],
    dtype: str,
    segments: Sequence[memoryview],
    readv_at: Callable[[list[memoryview], int], int] | None = None,
) -> bool:
    """Read the ``raw`` payload of ``key`` straight into ``segments`` (byte views whose
    concatenation, in order, is the body: the caller's ``(layer, k/v)`` slices of its
    output), checked as :func:`read_payload` checks it: header, key, sizes, and the
    body's xxh3 hashed piece by piece right after each piece lands. False, with nothing
    written, when the entry is not a ``raw`` payload of ``shape`` and ``dtype`` (the
    caller then reads it the usual way); :class:`CorruptPayloadError` when it fails its
    checks (the segments then hold garbage: the caller treats the chunk as a miss)."""
    h, head = _header(read_at, size, key)
    if h.codec != "raw" or tuple(h.shape) != tuple(shape) or h.dtype != dtype or \
            h.body_len != sum(len(s) for s in segments):
        return False
    have = memoryview(head)[h.header_len :]
    hasher = xxhash.xxh3_64()
    # the pieces to read, in body order: the segments past the bytes that came with the
    # header, none longer than PIECE (hashed while still in the CPU's cache)
    pieces: list[memoryview] = []
    pos = 0
    for seg in segments:
        at = 0
        if pos < len(have):  # the body's first bytes came with the header
            at = min(len(have) - pos, len(seg))
            seg[:at] = have[pos : pos + at]
            hasher.update(seg[:at])
            pos += at
        pieces.extend(seg[i : i + PIECE] for i in range(at, len(seg), PIECE))
    pos += h.header_len
    i = 0
    while i < len(pieces):  # several pieces per system call, up to PIECE bytes
        j, n = i + 1, len(pieces[i])
        while j < len(pieces) and n + len(pieces[j]) <= PIECE:
            n += len(pieces[j])
            j += 1
        group = pieces[i:j]
        got = readv_at(group, pos) if readv_at is not None else 0
        if got != n:  # a short vectored read (or none offered): piece by piece
            for p in group:
                if read_at(p, pos) != len(p):
                    raise CorruptPayloadError("file ended before its body")
                pos += len(p)
        else:
            pos += n
        for p in group:
            hasher.update(p)
        i = j
    if hasher.intdigest() != h.body_xxh3:
        raise CorruptPayloadError("body checksum mismatch")
    return True


def write_raw_payload(fd: int, key: str, obj: MemoryObj, piece: int = PIECE) -> int:
    """Write ``obj``'s ``raw`` payload (:func:`lmcache.payload.raw_header`) into the
    empty file ``fd``; return its size. The body goes to its place behind the header
    ``piece`` bytes at a time, each hashed right before it is written (in the CPU's
    cache, so that the checksum costs no pass of its own over memory), and the header,
    which holds that checksum, goes in front of it last: a reader of the finished file
    sees an ordinary payload (the caller publishes the file only once this returned)."""
    hlen = payload.raw_header_len(key, obj)
    body = memoryview(obj.byte_view().numpy()).cast("B") if obj.nbytes else memoryview(b"")
    hasher = xxhash.xxh3_64()
    for at in range(0, len(body), piece):
        part = body[at : at + piece]
        hasher.update(part)
        _pwrite_all(fd, part, hlen + at)
    _pwrite_all(fd, memoryview(payload.raw_header(key, obj, hasher.intdigest())), 0)
    return hlen + len(body)


def _pwrite_all(fd: int, src: memoryview, offset: int) -> None:
    while len(src):
        n = os.pwrite(fd, src, offset)
        src, offset = src[n:], offset + n


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


def load_direct(fd: int, size: int, key: str, allocate: Callable[..., MemoryObj]) -> MemoryObj | None:
    """An O_DIRECT file whose header fills whole blocks and whose ``raw`` body is whole
    blocks: the body is read straight into page-aligned pool memory and checked
    there. ``None`` when the file is not laid out so (the caller then reads it whole
    into a bounce buffer). Used by the disk backend's O_DIRECT reads."""
    if size < BLOCK or size % BLOCK:
        return None
    head = mmap.mmap(-1, BLOCK)
    try:
        if _pread_all(fd, memoryview(head), 0) != BLOCK:
            return None
        try:
            h = payload.parse_header(memoryview(head))
        except CorruptPayloadError:
            if size <= payload.HEADER_READ_HINT:
                raise
            return None  # the header runs past the first block: not laid out for this path
    finally:
        head.close()
    if h.header_len % BLOCK or h.codec != "raw" or h.body_len % BLOCK or h.body_len != h.nbytes:
        return None
    if h.key != key:
        raise CorruptPayloadError(f"payload holds key {h.key!r}, expected {key!r}")
    if size != h.total_len:
        raise CorruptPayloadError(f"file is {size} bytes, header says {h.total_len}")
    obj = allocate(h.shape, dtype_from_name(h.dtype))
    try:
        dst = memoryview(obj.byte_view().numpy())
        if obj.byte_view().data_ptr() % BLOCK:
            obj.unref()
            return None
        if _pread_all(fd, dst, h.header_len) != h.body_len:
            raise CorruptPayloadError("file ended before its body")
        if xxhash.xxh3_64_intdigest(dst) != h.body_xxh3:
            raise CorruptPayloadError("body checksum mismatch")
    except BaseException:
        obj.unref()
        raise
    return obj


def write_buffers(fd: int, buffers: Sequence[bytes | memoryview], total: int, o_direct: bool) -> None:
    """Write the ``total`` bytes of ``buffers`` into the empty file ``fd``. With
    ``o_direct`` (``fd`` opened so) buffers laid out for it go as they are
    (:func:`_direct_views`); others through one aligned bounce buffer, the file then cut
    to ``total``."""
    direct = o_direct and _direct_views(buffers)
    if direct:
        _write_all(fd, direct)
    elif o_direct:
        padded = (total + BLOCK - 1) // BLOCK * BLOCK
        buf = mmap.mmap(-1, max(padded, BLOCK))
        pos = 0
        for b in buffers:
            mv = memoryview(b).cast("B")
            buf[pos : pos + len(mv)] = mv
            pos += len(mv)
        _write_all(fd, [memoryview(buf)[:padded]])
        os.ftruncate(fd, total)
    else:
        _write_all(fd, [memoryview(b).cast("B") for b in buffers])


def load_file(fd: int, key: str, codec_lookup: Callable[[str], Codec], allocate: Callable[..., MemoryObj],
              o_direct: bool) -> MemoryObj:
    """The checked payload of ``key`` in the file ``fd``; :class:`CorruptPayloadError` if
    it fails its checks. With ``o_direct`` (``fd`` opened so) through :func:`load_direct`,
    else the whole file read into one aligned buffer (O_DIRECT wants block-aligned
    addresses, offsets and lengths); otherwise through :func:`read_payload`, the path
    that reads ``raw`` bodies straight into pool memory."""
    size = os.fstat(fd).st_size
    if o_direct:
        obj = load_direct(fd, size, key, allocate)
        if obj is not None:
            return obj
        buf = mmap.mmap(-1, max((size + BLOCK - 1) // BLOCK * BLOCK, BLOCK))
        n = _read_all(fd, memoryview(buf))
        return payload.decode(memoryview(buf)[:n], key, codec_lookup, allocate)
    return read_payload(lambda dst, off: _pread_all(fd, dst, off), size, key, codec_lookup, allocate, piece=PIECE)


def read_file_into(path: Path, key: str, shape: Sequence[int], dtype: str, segments: Sequence[memoryview]) -> bool:
    """:func:`read_raw_into` from the entry file at ``path`` (see :func:`_open_entry`)."""
    fd = _open_entry(path)
    try:
        return read_raw_into(lambda dst, off: _pread_all(fd, dst, off), os.fstat(fd).st_size, key, shape, dtype,
                             segments, lambda views, off: os.preadv(fd, views, off))
    finally:
        os.close(fd)


class IOPool:
    """A file store's few I/O threads, made on first use (or at once by :meth:`_start_io`)
    and shut by :meth:`_stop_io`. The class provides ``context`` and ``_lock``."""

    #: files read or written at once by one batch call: the reads and writes release the
    #: GIL, so one chunk's file I/O overlaps another's checksum and bookkeeping
    IO_THREADS = 4

    def _io_pool(self):
        pool = self.__dict__.get("_pool_exec")
        if pool is None:
            from concurrent.futures import ThreadPoolExecutor

            with self._lock:
                pool = self.__dict__.get("_pool_exec")
                if pool is None:
                    workers = max(2, min(self.IO_THREADS, os.cpu_count() or 2))
                    pool = self._pool_exec = ThreadPoolExecutor(workers, thread_name_prefix=f"lmcache-{self.context.tier}-io")
        return pool

    def _start_io(self) -> None:
        """Start every I/O thread now (a ``ThreadPoolExecutor`` starts one per submit, on
        the first requests otherwise)."""
        pool = self._io_pool()
        n = pool._max_workers
        arrived = threading.Barrier(n)  # each task waits for the others: n threads, not one reused
        for f in [pool.submit(arrived.wait, 5.0) for _ in range(n)]:
            f.exception()

    def _stop_io(self) -> None:
        """Shut the I/O threads down (after the work handed to them)."""
        pool = self.__dict__.pop("_pool_exec", None)
        if pool is not None:
            pool.shutdown(wait=True)


class ThreadedIO:
    """Batch ``get``/``put`` of memory objects over a file store, on the store's I/O
    threads (:class:`IOPool`: the reads and writes release the GIL, so one chunk's file
    I/O overlaps another's checksum and bookkeeping). The class provides ``get_one``,
    ``put_one``, ``context`` and ``_io_pool()``."""

    #: :meth:`get` takes ``on_ready`` (see :meth:`lmcache.tier.Tier.get`)
    streams_gets = True
    #: ``put_one`` may run on several threads at once for distinct keys (the
    #: hierarchy's writer then writes queued chunks together, see its ``WRITE_BATCH``)
    parallel_puts = True

    def get(self, keys: Sequence[str], on_ready: Callable[[int, MemoryObj], None] | None = None) -> list[MemoryObj | None]:
        """Read the files of ``keys`` on the I/O threads; ``on_ready(i, obj)`` is called
        on the thread that read ``keys[i]`` as soon as it is checked, so that the caller's
        use of it (the engine's copy into its output) overlaps the other reads."""
        def one(i: int, key: str) -> MemoryObj | None:
            obj = self.get_one(key)
            if obj is not None and on_ready is not None:
                try:
                    on_ready(i, obj)
                except Exception:  # the caller's business: the read itself succeeded
                    log.exception("tier %s: on_ready for %s failed", self.context.tier, key)
            return obj

        if len(keys) < 2:
            return [one(i, k) for i, k in enumerate(keys)]
        futures = [self._io_pool().submit(one, i, k) for i, k in enumerate(keys)]
        out: list[MemoryObj | None] = []
        error: BaseException | None = None
        for f in futures:  # every read finishes (and is released on an error) before returning
            try:
                out.append(f.result())
            except BaseException as exc:  # noqa: BLE001 - the first is raised below
                error = error or exc
                out.append(None)
        if error is not None:
            for o in out:
                if o is not None:
                    o.unref()
            raise error
        return out

    def put(self, items: Sequence[tuple[str, MemoryObj]]) -> list[int]:
        if len(items) < 2:
            return [self.put_one(k, o) for k, o in items]
        futures = [self._io_pool().submit(self.put_one, k, o) for k, o in items]
        sizes, error = [], None
        for f in futures:
            try:
                sizes.append(f.result())
            except BaseException as exc:  # noqa: BLE001
                error = error or exc
        if error is not None:
            raise error
        return sizes
