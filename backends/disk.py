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

The directory is claimed with a marker file and shared safely by several processes (the
tensor-parallel ranks of one server): one capacity for the whole directory, kept in a
ledger under a lock, and no process removes another's temporaries; a directory of
another backend, or holding files the tier did not write, is refused
(:mod:`lmcache.backends.disk_dir` says how and why). No read waits for another process:
an eviction that finds the directory's lock busy leaves the file's removal to this
process's next holder of the lock, and a store waits for it a bounded time, then is
skipped (counted, no backoff).

Two levels: :class:`DiskBackend` is the byte store (each key's value is its file's bytes;
``put`` writes a file atomically), and :class:`DiskObjects`, the object view a tier opens
it through (:func:`lmcache.storage.open_objects`), moves memory objects between pool
memory and the files without an intermediate copy: a ``raw`` payload is read straight
into pool memory and checked there, written from pool memory and hashed as it goes, and
with ``o_direct`` its header is padded to a block so that the body moves as it is; batches
run on the store's I/O threads.

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
from typing import Any, Callable, Iterator, Mapping, Sequence

import xxhash

from lmcache import payload
from lmcache.encoded import Encoded
from lmcache.errors import ConfigError, CorruptPayloadError, EntryPathError, TierUnusableError
from lmcache.memory import MemoryObj
from lmcache.storage import BackendContext, BytesBackend, EntryInfo, Usage

from . import disk_dir
from .file_io import (
    BLOCK,
    IOPool,
    ThreadedIO,
    _NotAFile,
    _open_entry,
    load_file,
    read_file_into,
    read_payload,  # noqa: F401 - re-exported: older imports and docs/reliability.md name it here
    write_buffers,
    write_raw_payload,
)

log = logging.getLogger(__name__)
SUFFIX = ".lmc"
TMP_PREFIX = disk_dir.TMP_PREFIX


def _file_name(key: str) -> str:
    return xxhash.xxh3_128_hexdigest(key.encode()) + SUFFIX


def _unlink_file(path: Path) -> None:
    """Remove a regular file (or link); leave a directory or anything else alone."""
    try:
        if path.is_symlink() or path.is_file():
            path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)


class DiskBackend(IOPool, BytesBackend):
    """The byte store: one file per key (see the module docstring); its object view is
    :class:`DiskObjects`."""

    OPTIONS = {"path": None, "o_direct": False, "fsync": False}
    #: the backend named in the directory's marker (the layout is the disk layout's)
    CLAIM_BACKEND = "disk"
    #: ``put_one`` may run on several threads at once for distinct keys (each file is
    #: written under a name of its own and renamed into place)
    parallel_puts = True
    #: entries :meth:`DiskObjects.read_into` read straight into the caller's memory so far
    direct_reads = 0

    @classmethod
    def check_options(cls, options: Mapping[str, Any], capacity: int | None = None) -> dict[str, Any]:
        opts = super().check_options(options, capacity)
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
        self._lock = threading.Lock()
        self._index: dict[str, int] = {}  # key -> file size, oldest first
        self._meta: dict[str, tuple[str, float]] = {}  # key -> (codec, wall-clock time written)
        self._used = 0
        #: the directory's lock, shared ledger and this opener's liveness (None: read-only)
        self._dir: disk_dir.DirState | None = None
        try:
            self._rebuild()
            if self.o_direct and not self.read_only:
                self._check_o_direct()
        except BaseException:
            self._close_dir()
            raise
        if self._index and not self.read_only:
            self._start_io()  # a restart: the first request is likely a hit; its reads find the threads running

    # ------------------------------------------------------------------ files
    def _path(self, key: str) -> Path:
        name = _file_name(key)
        return self.root / name[:2] / name

    def _check_o_direct(self) -> None:
        if not hasattr(os, "O_DIRECT"):
            raise ConfigError("o_direct", "O_DIRECT is not available on this platform")
        probe = self.root / (self._dir.tmp_name() if self._dir else f"{TMP_PREFIX}odirect-{uuid.uuid4().hex}")
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
        """Claim the directory (or refuse it), then index every valid entry file, oldest
        first; unless read-only, remove the temporaries of writers that are gone and the
        files of the layout that fail their checks, and set the shared ledger. Nothing
        outside the layout's names is ever touched."""
        if self.read_only and not self.root.exists():
            log.warning("disk tier %s: directory %s does not exist (yet): no entries", self.context.tier, self.root)
            return
        claim, damaged = disk_dir.read_marker(self.root, self.CLAIM_BACKEND)
        if claim is None:  # unclaimed (or a damaged marker): adopted only if every file in it is of the layout
            self._refuse_foreign(disk_dir.list_dir(self.root, self._warn), damaged)
        if self.read_only:
            if damaged:
                self._warn(f"its marker {self.root / disk_dir.MARKER} is damaged ({damaged}); every file is this "
                           "tier's own: an engine opening the directory rewrites it")
            found, _bad = self._index_files(disk_dir.list_dir(self.root, self._warn))
            self._admit_found(found)
            return
        state = self._dir = disk_dir.DirState(self.root, self._warn)
        state.open()
        try:
            with state.locked(disk_dir.OPEN_WAIT, store=False):
                listing, found = self._scan(state)
        except disk_dir.DirBusy as exc:
            raise TierUnusableError(
                "path", f"{exc}; running without this tier: let that process finish (or end it), then restart"
            ) from None
        if listing.foreign:
            log.warning(
                "disk tier %s: %d files in %s are not this tier's (e.g. %s); left alone",
                self.context.tier, len(listing.foreign), self.root, listing.foreign[0],
            )
        self._admit_found(found)

    def _scan(self, state: disk_dir.DirState) -> tuple[disk_dir.Listing, list[tuple[float, str, int, str]]]:
        """Under the directory's lock: claim it (a missing or damaged marker is written
        again, durably, if every file is of the layout), register this opener, remove
        the temporaries of writers that are gone and the files that fail their checks,
        and set the ledger to the bytes of the valid entries."""
        claim, damaged = disk_dir.read_marker(self.root, self.CLAIM_BACKEND)
        listing = disk_dir.list_dir(self.root, self._warn)
        if claim is None:
            self._refuse_foreign(listing, damaged)
            marker = disk_dir.marker_bytes(self.CLAIM_BACKEND, disk_dir.DISK_LAYOUT)
            if not disk_dir.write_marker(self.root, state.tmp_name("marker"), marker, replace=damaged is not None):
                disk_dir.read_marker(self.root, self.CLAIM_BACKEND)  # another claim won: refused unless ours
            if damaged:
                self._warn(f"its marker {self.root / disk_dir.MARKER} was damaged ({damaged}); every file in it is "
                           "this tier's own: adopted with its entries, marker written again")
        state.register()
        gone = state.dead(listing.live)
        alive = {owner for _, owner in listing.live} - gone
        for path, owner in listing.temps:
            if owner is None or (owner not in alive and owner != state.id):
                _unlink_file(path)
        found, bad = self._index_files(listing)
        for path in bad:
            _unlink_file(path)
        state.set_total(sum(size for _, _, size, _ in found))
        return listing, found

    def _warn(self, message: str) -> None:
        log.warning("disk tier %s: %s", self.context.tier, message)

    def _refuse_foreign(self, listing: disk_dir.Listing, damaged: str | None = None) -> None:
        if not listing.foreign:
            return
        n, example = len(listing.foreign), listing.foreign[0]
        if damaged is not None:  # was it ever ours? A cache still starts: without this tier
            raise TierUnusableError(
                "path",
                f"{self.root}: its marker {disk_dir.MARKER} is damaged ({damaged}) and it holds {n} files that a "
                f"disk tier did not write (e.g. {example}); nothing was changed. To use it again, move those files "
                "out (or give the tier an empty directory) and restart",
            )
        raise ConfigError(
            "path",
            f"{self.root} holds {n} files that a disk tier did not write "
            f"(e.g. {example}); give the tier an empty directory of its own (nothing was changed)",
        )

    def _index_files(self, listing: disk_dir.Listing) -> tuple[list[tuple[float, str, int, str]], list[Path]]:
        """``(mtime, key, size, codec)`` of each valid entry file, and the entry files
        that fail their checks (counted as corrupt; the caller removes them unless
        read-only)."""
        found: list[tuple[float, str, int, str]] = []
        bad: list[Path] = []
        for f in listing.entries:
            try:
                found.append(self._check_file(f))
            except CorruptPayloadError as exc:
                bad.append(f)
                self._warn(f"{'skipping' if self.read_only else 'removing'} bad file {f}: {exc}")
            except FileNotFoundError:
                continue  # removed meanwhile (another opener's eviction)
            except _NotAFile as exc:  # a directory, FIFO, socket or link: not ours to touch
                self._warn(f"skipping {f}: {exc}")
            except OSError as exc:
                self._warn(f"skipping unreadable {f}: {exc}")
        self.integrity.corrupt += len(bad)
        return found, bad

    def _check_file(self, f: Path) -> tuple[float, str, int, str]:
        fd = _open_entry(f)
        with open(fd, "rb", buffering=0) as fh:
            head = fh.read(payload.HEADER_READ_HINT)
            if len(head) >= payload.PREFIX_SIZE:
                hlen = int.from_bytes(head[6:10], "little")
                if payload.PREFIX_SIZE + hlen > len(head) and hlen <= payload.MAX_HEADER:
                    head += fh.read(payload.PREFIX_SIZE + hlen - len(head))
            st = os.fstat(fh.fileno())
        h = payload.parse_header(head)
        if _file_name(h.key) != f.name or f.parent.name != f.name[:2]:
            raise CorruptPayloadError("file name does not match the key in its header")
        if st.st_size != h.total_len:
            raise CorruptPayloadError(f"file is {st.st_size} bytes, header says {h.total_len}")
        return st.st_mtime, h.key, st.st_size, h.codec

    def _admit_found(self, found: list[tuple[float, str, int, str]]) -> None:
        found.sort()
        for mtime, key, size, codec in found:
            self._index[key] = size
            self._meta[key] = (codec, mtime)
            self._used += size

    # ------------------------------------------------ the five verbs, over bytes
    def exists(self, keys: Sequence[str]) -> list[bool]:
        idx = self._index
        return [k in idx for k in keys]

    def get_one(self, key: str) -> bytes | None:
        """The bytes of ``key``'s file, as they are (the object view checks them);
        ``None`` if absent, or gone or not a regular file (then forgotten)."""
        if key not in self._index:
            return None
        try:
            with open(_open_entry(self._path(key)), "rb", buffering=0) as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, _NotAFile):
            self._forget(key)
            return None

    def put_one(self, key: str, buffers: Sequence[bytes | memoryview]) -> int:
        """Store the concatenation of ``buffers`` as ``key``'s file, atomically (a new file
        renamed into place); return its size."""
        try:  # the payload's own codec, for listings: a re-encoded entry (lmcache compress) has another
            codec = payload.parse_header(buffers[0]).codec
        except (CorruptPayloadError, IndexError):
            codec = self.context.codec.name
        return self._write(key, buffers, codec)

    def delete_one(self, key: str) -> bool:
        with self._lock:
            size = self._index.pop(key, None)
            self._meta.pop(key, None)
            if size is not None:
                self._used -= size
        try:
            self._unlink_entry(self._path(key))
        except FileNotFoundError:
            return size is not None
        except OSError as exc:  # a directory (or worse) where the entry's file was: forgotten, left there
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise  # the device refuses writes: the tier says so once (the key is forgotten)
            log.warning("disk tier %s: cannot remove %s: %s", self.context.tier, self._path(key), exc)
            return size is not None
        return True

    def keys(self) -> Iterator[tuple[str, int]]:
        with self._lock:
            return iter(list(self._index.items()))

    def usage(self) -> Usage:
        return Usage(self._used, self.context.capacity, len(self._index))

    def entries(self) -> Iterator[EntryInfo]:
        """From the index: codec from each file's header, time from its mtime."""
        with self._lock:
            items = [(k, size, self._meta.get(k)) for k, size in self._index.items()]
        return iter(EntryInfo(k, size, *(m or (None, None))) for k, size, m in items)

    def _unlink_entry(self, path: Path) -> None:
        """Remove an entry's file; the shared ledger loses its bytes (only the process
        whose unlink succeeded counts it). Never waits for another process: when the
        directory's lock is busy, the removal is made by this process's next holder of
        it (:meth:`lmcache.backends.disk_dir.DirState.remove`)."""
        if self._dir is None:
            path.unlink()
            return
        self._dir.remove(path)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._meta.pop(key, None)
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size

    def _write(self, key: str, buffers: Sequence[bytes | memoryview], codec: str) -> int:
        """Store ``buffers`` (a payload of ``codec``) as ``key``'s file; return its size."""
        total = sum(memoryview(b).nbytes for b in buffers)
        self._commit(key, total, codec, lambda tmp: self._write_file(tmp, buffers, total))
        return total

    def _commit(self, key: str, total: int, codec: str, fill: Callable[[Path], None]) -> None:
        """Store the ``total``-byte entry of ``key`` that ``fill(tmp)`` writes into the
        new file ``tmp``: the file is renamed into place (and indexed) only once
        ``fill`` returned; on any error it is removed and nothing changes."""
        final = self._path(key)
        try:
            final.parent.mkdir(exist_ok=True)
        except FileExistsError:  # a file where the 2-hex subdirectory should be
            raise EntryPathError(f"{final.parent} is not a directory; entry {final.name} cannot be written") from None
        try:
            if not stat.S_ISREG(os.stat(final).st_mode):  # a directory, FIFO, ... (links followed)
                raise EntryPathError(f"{final} is not a regular file; the entry cannot be written there")
        except FileNotFoundError:
            pass
        tmp = final.parent / (self._dir.tmp_name() if self._dir else f"{TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            fill(tmp)
            self._publish(tmp, final, total)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            old = self._index.pop(key, None)  # re-inserted last: the newest entry
            self._index[key] = total
            self._meta[key] = (codec, time.time())
            self._used += total - (old or 0)

    def _publish(self, tmp: Path, final: Path, total: int) -> None:
        """Rename ``tmp`` into place and add its bytes to the shared ledger, in one step
        under the directory's lock. A write that would carry the directory past the
        capacity (other processes filled it meanwhile) is skipped (:class:`DirFull`), and
        so is one that cannot take the lock within its bound (:class:`DirBusy`): the tier
        counts the store as skipped and keeps serving. A ledger that says the directory
        is full is recounted from the files first (at most every ``RECOUNT_EVERY`` s)."""
        state = self._dir
        if state is None:
            os.replace(tmp, final)
            return
        with state.locked():
            try:
                st = os.lstat(final)
                old = st.st_size if stat.S_ISREG(st.st_mode) else 0
            except FileNotFoundError:
                old = 0
            before = state.checked_total()
            after = before - old + total
            if after > before and after > self.context.capacity and state.recount_due():
                before = state.recount()
                after = before - old + total
            if after > before and after > self.context.capacity:
                raise disk_dir.DirFull(
                    f"the directory {self.root} is at its capacity ({before} of {self.context.capacity} bytes, "
                    "shared by every process that opens it)"
                )
            os.replace(tmp, final)
            state.set_total(after)

    def reserve_size(self, key: str, obj: MemoryObj) -> int:
        """The payload's bound, plus the bytes other processes hold in the directory:
        the tier then evicts until the whole directory, not only this process's
        entries, has room (its books hold this process's entries only). Removals still
        waiting for the lock are not another process's bytes; a ledger that is not ours
        counts nothing here (the store recounts it under the lock)."""
        size = super().reserve_size(key, obj)
        if self.o_direct:
            size += BLOCK  # the header padded to a block
        state = self._dir
        if state is not None:
            total = state.total()
            others = 0 if total is None else max(0, total - self._used - state.pending_bytes())
            if size + others > self.context.capacity and state.recount_due():
                with contextlib.suppress(disk_dir.DirBusy):  # a ledger that drifted: counted again, if free now
                    with state.locked(0, store=False):
                        others = max(0, state.recount() - self._used)
            size += others
        return size

    # ------------------------------ what the object view (DiskObjects) moves objects with
    def _streams_raw(self) -> bool:
        """Whether a ``raw`` entry is written by :func:`write_raw_payload` (hashed as it
        is written): with the ``raw`` codec, unless :meth:`_write_file` was replaced (a
        subclass, or a hook on the instance, that moves bytes another way)."""
        step = getattr(self._write_file, "__func__", None)
        return self.context.codec.name == "raw" and step is DiskBackend._write_file

    def _write_raw(self, tmp: Path, key: str, obj: MemoryObj) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_raw_payload(fd, key, obj)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _write_file(self, tmp: Path, buffers: Sequence[bytes | memoryview], total: int) -> None:
        """Create ``tmp`` exclusively and fill it with the ``total`` bytes of ``buffers``.

        The one step that moves bytes to the file, so that a subclass can move them
        another way (the gds backend through kvikio) and keep the temporary-name,
        rename and index logic of :meth:`put_one`."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if self.o_direct:
            flags |= os.O_DIRECT
        fd = os.open(tmp, flags, 0o644)
        try:
            write_buffers(fd, buffers, total, self.o_direct)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _load(self, path: Path, key: str) -> MemoryObj:
        """The checked entry in the file at ``path`` (:func:`load_file`: a ``raw`` body
        straight into pool memory); ``FileNotFoundError`` if it is gone,
        :class:`CorruptPayloadError` if it fails its checks. The file is closed on return.
        The object view's read (:meth:`DiskObjects.get_one`); a subclass that reads files
        another way overrides this."""
        fd = _open_entry(path, os.O_DIRECT if self.o_direct else 0)
        try:
            return load_file(fd, key, self.context.codec_lookup, self.context.allocate, self.o_direct)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._stop_io()
        self._close_dir()

    def _close_dir(self) -> None:
        """Let go of the directory: this opener's liveness lock (its temporaries are
        then anyone's to remove) and the ledger's descriptor."""
        state, self._dir = self._dir, None
        if state is not None:
            state.close()


class DiskObjects(ThreadedIO, Encoded):
    """Memory objects over a :class:`DiskBackend` (``raw``), as a tier opens it: the
    store's files read straight into pool memory and checked there (one copy from the
    kernel for ``raw`` payloads; with ``o_direct``, a body of whole blocks into
    page-aligned pool memory), ``raw`` payloads written from pool memory and hashed as they
    go, and batches on the store's I/O threads, each hit handed to ``on_ready`` on the
    thread that read it. A payload that fails its checks is counted and deleted, a miss;
    a directory or FIFO where a file should be is counted and forgotten, never a hang."""

    #: :meth:`get` calls ``on_ready`` on the I/O thread that read each hit
    streams_gets = True
    #: ``put_one`` runs on several threads at once for distinct keys
    parallel_puts = True
    #: :meth:`read_into` reads a ``raw`` entry straight into the caller's memory (one copy)
    reads_into = True
    raw: DiskBackend

    def __init__(self, store: DiskBackend):
        super().__init__(store)
        if self.store is not store:  # its reads and writes go to the files as they are
            raise TypeError(f"{type(store).__qualname__} declares size limits: its objects_view cannot be "
                            f"{type(self).__qualname__} (set objects_view = None)")

    def _io_pool(self):
        return self.raw._io_pool()  # the store's threads: one pool however many views

    @property
    def direct_reads(self) -> int:
        """Entries :meth:`read_into` read straight into the caller's memory so far."""
        return self.raw.direct_reads

    # ------------------------------------------------------------ reads (get: ThreadedIO's)
    def get_native(self, keys: Sequence[str]) -> list[MemoryObj | None]:
        return ThreadedIO.get(self, keys)

    def get_one(self, key: str) -> MemoryObj | None:
        """Read straight into pool memory: one copy from the kernel for ``raw`` payloads."""
        raw = self.raw
        return self._checked(key, lambda path: raw._load(path, key))

    def _checked(self, key: str, read: Callable[[Path], Any]) -> Any:
        """``read(path)`` of ``key``'s file, or ``None``: absent; gone (forgotten); not a
        regular file (counted as corrupt and forgotten; the thing is left there); or
        failing its checks (counted and deleted)."""
        raw = self.raw
        if key not in raw._index:
            return None
        try:
            return read(raw._path(key))
        except (FileNotFoundError, NotADirectoryError):
            raw._forget(key)
        except _NotAFile as exc:  # a directory or FIFO in its place: a miss, never a hang
            self.note_corrupt(key, CorruptPayloadError(str(exc)))
            raw._forget(key)
        except CorruptPayloadError as exc:
            self.note_corrupt(key, exc)
            self.drop_corrupt([key])
        return None

    def read_into(self, items: Sequence[tuple[str, Sequence[int], str, Sequence[memoryview]]]) -> list[bool | None]:
        """For each ``(key, shape, dtype, segments)``: its entry read straight into
        ``segments`` and checked (True); a miss (None: absent, or corrupt, then removed
        as :meth:`get_one` removes it); or False, nothing written, when it cannot be read
        that way (not ``raw``, another shape, or the store reads files otherwise: the
        caller uses :meth:`get`). On the I/O threads when there are several."""
        raw = self.raw
        if raw.o_direct or type(raw)._load is not DiskBackend._load:
            return [False] * len(items)

        def one(item: tuple[str, Sequence[int], str, Sequence[memoryview]]) -> bool | None:
            key = item[0]
            return self._checked(key, lambda path: read_file_into(path, *item))

        got = [one(i) for i in items] if len(items) < 2 else list(self._io_pool().map(one, items))
        raw.direct_reads += sum(1 for g in got if g is True)
        return got

    # ------------------------------------------------------------ writes (put: ThreadedIO's)
    def put_one(self, key: str, obj: MemoryObj) -> int:
        raw = self.raw
        if not raw.o_direct and raw._streams_raw():  # from pool memory, hashed as it is written
            size = payload.raw_header_len(key, obj) + obj.nbytes
            raw._commit(key, size, "raw", lambda tmp: raw._write_raw(tmp, key, obj))
            return size
        # with O_DIRECT, the header padded to a block, so that the body (pool memory, page
        # aligned for large objects) is written from where it is
        codec = self.context.codec
        return raw._write(key, payload.encode(key, obj, codec, header_align=BLOCK if raw.o_direct else None),
                          codec.name)


DiskBackend.objects_view = DiskObjects
