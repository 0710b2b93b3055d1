"""The ``disk`` backend: one file per chunk in a local directory.

Why one file per chunk rather than an append log: a chunk is written once and read
whole, so a file per chunk needs no compaction, eviction is one ``unlink`` that returns
the space at once, and a torn write can only ever leave a temporary file behind. Files
are created exclusively under a temporary name and renamed into place, so a reader never
sees a half-written chunk. Each file is a self-describing payload (magic, version, codec,
dtype, shape, checksums); when a process opens the directory it rebuilds its index from
the file headers (oldest file first, so that an LRU or FIFO tier evicts the oldest
entries first after a restart), so entries survive restarts, and a file that fails its
checks is removed and reported as a miss. Opened ``read_only`` (``lmcache ls`` on a
config), it creates, repairs and removes nothing.

Options: ``path`` (required), ``o_direct`` (bypass the page cache), ``fsync`` (make each
write durable before it is visible; off by default: a cache may lose entries on power
loss, but never hands out a torn one).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, Sequence

import xxhash

from lmcache import payload
from lmcache.codecs import Codec
from lmcache.dtypes import dtype_from_name
from lmcache.errors import ConfigError, CorruptPayloadError, EntryPathError
from lmcache.memory import MemoryObj
from lmcache.storage import BackendContext, BytesBackend, EntryInfo, Usage

log = logging.getLogger(__name__)
SUFFIX = ".lmc"
TMP_PREFIX = ".tmp-"
BLOCK = 4096


def _file_name(key: str) -> str:
    return xxhash.xxh3_128_hexdigest(key.encode()) + SUFFIX


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


def _unlink_file(path: Path) -> None:
    """Remove a regular file (or link); leave a directory or anything else alone."""
    try:
        if path.is_symlink() or path.is_file():
            path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)


class DiskBackend(BytesBackend):
    OPTIONS = {"path": None, "o_direct": False, "fsync": False}

    @classmethod
    def check_options(cls, options):
        opts = super().check_options(options)
        path = opts["path"]
        if not path or not isinstance(path, (str, os.PathLike)):
            raise ConfigError("path", "the disk backend needs a directory, e.g. path: /var/cache/lmcache")
        for opt in ("o_direct", "fsync"):
            if not isinstance(opts[opt], bool):
                raise ConfigError(opt, f"expected true or false, got {opts[opt]!r}")
        return opts

    def __init__(self, context: BackendContext):
        super().__init__(context)
        self.root = Path(self.options["path"]).expanduser()
        self.read_only = context.read_only
        if not self.read_only:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError("path", f"cannot create directory {self.root}: {exc.strerror}") from None
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise ConfigError("path", f"directory {self.root} is not writable")
        elif self.root.exists() and not self.root.is_dir():
            raise ConfigError("path", f"{self.root} is not a directory")
        self.o_direct = self.options["o_direct"]
        self.fsync = self.options["fsync"]
        if self.o_direct and not self.read_only:
            self._check_o_direct()
        self._lock = threading.Lock()
        self._index: dict[str, int] = {}  # key -> file size, oldest first
        self._meta: dict[str, tuple[str, float]] = {}  # key -> (codec, wall-clock time written)
        self._used = 0
        self._rebuild()

    # ------------------------------------------------------------------ files
    def _path(self, key: str) -> Path:
        name = _file_name(key)
        return self.root / name[:2] / name

    def _check_o_direct(self) -> None:
        if not hasattr(os, "O_DIRECT"):
            raise ConfigError("o_direct", "O_DIRECT is not available on this platform")
        probe = self.root / f"{TMP_PREFIX}odirect-{uuid.uuid4().hex}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
            try:
                buf = mmap.mmap(-1, BLOCK)
                os.write(fd, buf)
            finally:
                os.close(fd)
        except OSError as exc:
            raise ConfigError(
                "o_direct", f"the filesystem at {self.root} does not support O_DIRECT ({exc.strerror})"
            ) from None
        finally:
            probe.unlink(missing_ok=True)

    def _rebuild(self) -> None:
        """Index every valid chunk file, oldest first; remove temporaries and files that
        fail checks (unless read-only)."""
        removed = 0
        found: list[tuple[float, str, int, str]] = []
        if self.read_only and not self.root.exists():
            log.warning("disk tier %s: directory %s does not exist (yet): no entries", self.context.tier, self.root)
            return
        for sub in self.root.iterdir():
            if sub.name.startswith(TMP_PREFIX):
                if not self.read_only:
                    _unlink_file(sub)
                continue
            if sub.is_symlink() or not sub.is_dir() or len(sub.name) != 2:
                continue
            try:
                names = list(sub.iterdir())
            except OSError as exc:
                log.warning("disk tier %s: skipping unreadable directory %s: %s", self.context.tier, sub, exc)
                continue
            for f in names:
                if f.name.startswith(TMP_PREFIX):
                    if not self.read_only:
                        _unlink_file(f)
                    continue
                if not f.name.endswith(SUFFIX):
                    continue
                try:
                    fd = _open_entry(f)
                except _NotAFile as exc:  # a directory, FIFO, socket or link: not ours to touch
                    log.warning("disk tier %s: skipping %s: %s", self.context.tier, f, exc)
                    continue
                except OSError as exc:
                    log.warning("disk tier %s: skipping unreadable %s: %s", self.context.tier, f, exc)
                    continue
                try:
                    with open(fd, "rb", buffering=0) as fh:
                        head = fh.read(payload.HEADER_READ_HINT)
                        if len(head) >= payload.PREFIX_SIZE:
                            hlen = int.from_bytes(head[6:10], "little")
                            if payload.PREFIX_SIZE + hlen > len(head) and hlen <= payload.MAX_HEADER:
                                head += fh.read(payload.PREFIX_SIZE + hlen - len(head))
                        st = os.fstat(fh.fileno())
                        size = st.st_size
                    h = payload.parse_header(head)
                    if _file_name(h.key) != f.name:
                        raise CorruptPayloadError("file name does not match the key in its header")
                    if size != h.total_len:
                        raise CorruptPayloadError(f"file is {size} bytes, header says {h.total_len}")
                except (CorruptPayloadError, OSError) as exc:
                    removed += 1
                    if self.read_only:
                        log.warning("disk tier %s: skipping bad file %s: %s", self.context.tier, f, exc)
                        continue
                    log.warning("disk tier %s: removing bad file %s: %s", self.context.tier, f, exc)
                    _unlink_file(f)
                    continue
                found.append((st.st_mtime, h.key, size, h.codec))
        found.sort()
        for mtime, key, size, codec in found:
            self._index[key] = size
            self._meta[key] = (codec, mtime)
            self._used += size
        self.integrity.corrupt += removed

    # ------------------------------------------------------------- BytesBackend
    def exists(self, key: str) -> bool:
        return key in self._index

    def contains(self, keys):
        idx = self._index
        return [k in idx for k in keys]

    def list(self) -> Iterator[tuple[str, int]]:
        with self._lock:
            return iter(list(self._index.items()))

    def usage(self) -> Usage:
        return Usage(self._used, self.context.capacity, len(self._index))

    def entries(self) -> Iterator[EntryInfo]:
        """From the index: codec from each file's header, time from its mtime."""
        with self._lock:
            items = [(k, size, self._meta.get(k)) for k, size in self._index.items()]
        return iter(EntryInfo(k, size, *(m or (None, None))) for k, size, m in items)

    def delete(self, key: str) -> bool:
        with self._lock:
            size = self._index.pop(key, None)
            self._meta.pop(key, None)
            if size is not None:
                self._used -= size
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return size is not None
        except OSError as exc:  # a directory (or worse) where the entry's file was: forgotten, left there
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise  # the device refuses writes: the tier says so once (the key is forgotten)
            log.warning("disk tier %s: cannot remove %s: %s", self.context.tier, self._path(key), exc)
            return size is not None
        return True

    def _forget(self, key: str) -> None:
        with self._lock:
            self._meta.pop(key, None)
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size

    def write(self, key: str, buffers: Sequence[bytes | memoryview]) -> None:
        final = self._path(key)
        try:
            final.parent.mkdir(exist_ok=True)
        except FileExistsError:  # a file where the 2-hex subdirectory should be
            raise EntryPathError(f"{final.parent} is not a directory; entry {final.name} cannot be written") from None
        if final.is_dir() or (final.exists() and not final.is_file()):
            raise EntryPathError(f"{final} is not a regular file; the entry cannot be written there")
        tmp = final.parent / f"{TMP_PREFIX}{uuid.uuid4().hex}"
        total = sum(len(b) for b in buffers)
        try:
            self._write_file(tmp, buffers, total)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, final)
        try:  # the payload's own codec: a re-encoded entry (lmcache compress) has another
            codec = payload.parse_header(buffers[0]).codec
        except CorruptPayloadError:
            codec = self.context.codec.name
        with self._lock:
            old = self._index.pop(key, None)  # re-inserted last: the newest entry
            self._index[key] = total
            self._meta[key] = (codec, time.time())
            self._used += total - (old or 0)

    def reserve_size(self, key: str, obj: MemoryObj) -> int:
        size = super().reserve_size(key, obj)
        return size + BLOCK if self.o_direct else size  # the header padded to a block

    def put_one(self, key: str, obj: MemoryObj) -> int:
        if not self.o_direct:
            return super().put_one(key, obj)
        # O_DIRECT: the header padded to a block, so that the body (pool memory, page
        # aligned for large objects) is written from where it is
        bufs = payload.encode(key, obj, self.context.codec, header_align=BLOCK)
        self.write(key, bufs)
        return sum(len(b) for b in bufs)

    def _write_file(self, tmp: Path, buffers: Sequence[bytes | memoryview], total: int) -> None:
        """Create ``tmp`` exclusively and fill it with the ``total`` bytes of ``buffers``.

        The one step that moves bytes to the file, so that a subclass can move them
        another way (the gds backend through kvikio) and keep the temporary-name,
        rename and index logic of :meth:`write`."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if self.o_direct:
            flags |= os.O_DIRECT
        fd = os.open(tmp, flags, 0o644)
        try:
            direct = self.o_direct and _direct_views(buffers)
            if direct:
                _write_all(fd, direct)
            elif self.o_direct:
                padded = (total + BLOCK - 1) // BLOCK * BLOCK
                buf = mmap.mmap(-1, max(padded, BLOCK))
                pos = 0
                for b in buffers:
                    buf[pos : pos + len(b)] = b
                    pos += len(b)
                _write_all(fd, [memoryview(buf)[:padded]])
                os.ftruncate(fd, total)
            else:
                _write_all(fd, [memoryview(b).cast("B") for b in buffers])
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ batches
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

    #: :meth:`get` takes ``on_ready`` (see :meth:`lmcache.tier.Tier.get`)
    streams_gets = True

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

    def read(self, key: str) -> bytes | None:
        if key not in self._index:
            return None
        try:
            with open(_open_entry(self._path(key)), "rb", buffering=0) as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, _NotAFile):
            self._forget(key)
            return None

    def get_one(self, key: str) -> MemoryObj | None:
        """Read straight into pool memory: one copy from the kernel for ``raw`` payloads."""
        if key not in self._index:
            return None
        try:
            return self._load(self._path(key), key)
        except (FileNotFoundError, NotADirectoryError):
            self._forget(key)
            return None
        except _NotAFile as exc:  # a directory or FIFO in its place: a miss, never a hang
            self.note_corrupt(key, CorruptPayloadError(str(exc)))
            self._forget(key)
            return None
        except CorruptPayloadError as exc:
            self.note_corrupt(key, exc)
            with contextlib.suppress(OSError):  # a read-only device: forgotten, the file stays
                self.delete(key)
            return None

    def _load(self, path: Path, key: str) -> MemoryObj:
        """The checked entry in the file at ``path``; ``FileNotFoundError`` if it is gone,
        :class:`CorruptPayloadError` if it fails its checks. The file is closed on return.

        With ``o_direct`` the whole file is read into one aligned buffer (O_DIRECT wants
        block-aligned addresses, offsets and lengths); otherwise through
        :func:`read_payload`, the path that reads ``raw`` bodies straight into pool
        memory. A subclass that reads files another way overrides this."""
        fd = _open_entry(path, os.O_DIRECT if self.o_direct else 0)
        try:
            size = os.fstat(fd).st_size
            if self.o_direct:
                obj = self._load_direct(fd, size, key)
                if obj is not None:
                    return obj
                buf = mmap.mmap(-1, max((size + BLOCK - 1) // BLOCK * BLOCK, BLOCK))
                n = _read_all(fd, memoryview(buf))
                data = memoryview(buf)[:n]
                return payload.decode(data, key, self.context.codec_lookup, self.context.allocate)
            ctx = self.context
            return read_payload(lambda dst, off: _pread_all(fd, dst, off), size, key, ctx.codec_lookup, ctx.allocate)
        finally:
            os.close(fd)

    def _load_direct(self, fd: int, size: int, key: str) -> MemoryObj | None:
        """An O_DIRECT file whose header fills whole blocks and whose ``raw`` body is whole
        blocks: the body is read straight into page-aligned pool memory and checked
        there. ``None`` when the file is not laid out so (the caller then reads it whole
        into a bounce buffer)."""
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
        obj = self.context.allocate(h.shape, dtype_from_name(h.dtype))
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

    def close(self) -> None:
        pool = self.__dict__.pop("_pool_exec", None)
        if pool is not None:
            pool.shutdown(wait=True)


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


