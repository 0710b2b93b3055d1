"""A disk tier's directory: its claim, its lock and shared ledger, and its listing.

Why a claim: a directory is a tier's only if the tier can tell its own files from anyone
else's. A disk tier writes a marker file, ``.lmcache-tier`` (JSON: backend and layout),
when it first takes a directory, and refuses one that another backend claimed (an ``fs``
tier names its files differently) or that holds files it did not write. A directory of
the previous version (no marker) is adopted only when every file in it has the disk
layout's names. Inside a claimed directory a tier touches only names of its layout; any
other file is left alone. A damaged marker (empty, cut, not a marker's JSON, or naming no
known layout: what a power cut or an editor leaves) is treated like none: the directory is
adopted again and the marker rewritten durably (temporary, fsync, rename, fsync of the
directory) when every file is of the layout; otherwise the tier is left out
(:class:`~lmcache.errors.TierUnusableError`: an engine runs without it and says what to do).

Why a lock and a ledger: several processes (one per tensor-parallel rank) may open one
directory. ``.lmcache-ledger`` holds the bytes of every entry file in the directory; it
is changed only under an exclusive ``flock`` on itself, together with the rename or
unlink that changes those bytes, and recomputed from the files by each opener's scan
(under the same lock), so a process killed between two steps cannot make it drift for
long. One capacity thus covers the whole directory, whatever process wrote what. The
ledger carries a check of its bytes: one that another program wrote (or an older version)
is recounted from the files under the lock, and so is one that says the directory is full
(at most every ``RECOUNT_EVERY`` seconds). Waits for the lock are bounded and reads never
take it (:class:`DirState` says how).

Why liveness files: each opener holds an exclusive ``flock`` on ``.lmcache-live-<id>``
for as long as it is open, and names its temporary files ``.tmp-<id>-...``. An opener
removes a temporary only when the lock of its writer can be taken (the writer is gone,
killed or closed), never a live writer's in-flight file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import stat
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import xxhash

from lmcache.errors import ConfigError, StoreSkipped

MARKER = ".lmcache-tier"
LEDGER = ".lmcache-ledger"
LIVE_PREFIX = ".lmcache-live-"
TMP_PREFIX = ".tmp-"
#: the disk layout: ``<xx>/<xxh3-128 hex of the key>.lmc``, ``xx`` its first two digits
DISK_LAYOUT = "disk/xxh3-128-hex"
#: a marker is a few dozen bytes; anything longer is not ours
MAX_MARKER = 4096
#: the layouts a marker may name (the disk layout and the fs backend's): a marker naming
#: any other is damaged, not another tier's
KNOWN_LAYOUTS = frozenset({DISK_LAYOUT, "fs/encoded-key"})
#: seconds a store waits for the directory's lock before it is skipped; after one such
#: wait, LOCK_WAIT_BUSY until the lock is taken again (a stopped process may hold it for
#: hours: its stores are then skipped fast). Reads never wait for it.
LOCK_WAIT = 0.5
LOCK_WAIT_BUSY = 0.05
#: the most seconds a store waits, on top of LOCK_WAIT, for this process's other threads
THREAD_WAIT = 5.0
#: seconds an opener waits for the lock before the tier is left out (an engine then runs without it)
OPEN_WAIT = 60.0
#: the ledger is recounted from the files at most this often when it says the directory is full
RECOUNT_EVERY = 30.0
#: the ledger: the bytes (8, little-endian) and a check of them (8), so that a ledger
#: another program wrote is told from ours (then recounted from the files)
LEDGER_TAG = b"lmcache-ledger-1"

ENTRY_RE = re.compile(r"[0-9a-f]{32}\.lmc\Z")
SUB_RE = re.compile(r"[0-9a-f]{2}\Z")
LIVE_RE = re.compile(re.escape(LIVE_PREFIX) + r"([0-9a-f]{32})\Z")
#: a temporary with its writer's id; ``legacy``: the previous version's, without one
OWNED_TMP_RE = re.compile(r"\.tmp-([0-9a-f]{32})-[0-9a-z]+\Z")
LEGACY_ROOT_TMP_RE = re.compile(r"\.tmp-(odirect|kvikio)-[0-9a-f]{32}\Z")
#: what a filesystem itself keeps at the root of a mount: not a foreign file
FS_OWN = frozenset({"lost+found"})


def marker_bytes(backend: str, layout: str) -> bytes:
    return json.dumps({"lmcache_tier": 1, "backend": backend, "layout": layout}).encode() + b"\n"


def parse_marker(data: bytes, where: str, key: str) -> tuple[str, str]:
    """``(backend, layout)`` of a marker's bytes; :class:`ConfigError` under ``key`` if
    they are not a marker."""
    try:
        if len(data) > MAX_MARKER:
            raise ValueError(f"{len(data)} bytes")
        doc = json.loads(data)
        backend, layout = doc["backend"], doc["layout"]
        if doc.get("lmcache_tier") != 1 or not isinstance(backend, str) or not isinstance(layout, str):
            raise ValueError("unknown fields")
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(key, f"{where} is not an lmcache tier marker ({exc}); the directory is not this tier's") from None
    return backend, layout


def check_marker(claim: tuple[str, str], root: object, layout: str, backend: str, key: str) -> None:
    """Refuse a directory whose marker names another layout."""
    if claim[1] != layout:
        raise ConfigError(
            key,
            f"{root} belongs to a {claim[0]} tier (layout {claim[1]}, marker {MARKER}); "
            f"a {backend} tier needs a directory of its own",
        )


def read_marker(root: Path, backend: str, key: str = "path") -> tuple[tuple[str, str] | None, str | None]:
    """The claim on ``root`` and, when there is none, why: ``(claim, None)``, ``(None,
    None)`` (unclaimed) or ``(None, what is wrong)`` (a damaged marker: empty, cut, not a
    marker's JSON or naming no known layout, which a power cut or an editor leaves; the
    caller adopts the directory only if every file in it is of the layout). A whole marker
    of another layout is refused (:class:`ConfigError`)."""
    path = root / MARKER
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from None
    with open(fd, "rb", buffering=0) as f:
        data = f.read(MAX_MARKER + 1)
    try:
        claim = parse_marker(data, str(path), key)
    except ConfigError:
        return None, f"{len(data)} bytes that are not a marker" if data else "empty"
    if claim[1] not in KNOWN_LAYOUTS:
        return None, f"it names no known layout ({claim[1][:64]!r})"
    check_marker(claim, root, DISK_LAYOUT, backend, key)
    return claim, None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(root: Path, tmp_name: str, data: bytes, replace: bool) -> bool:
    """Claim ``root`` durably: the marker is written under ``tmp_name`` and fsynced, then
    linked into place (``replace``: renamed over a damaged one), and the directory is
    fsynced, so that a power cut leaves the whole marker or none. False when another
    claim got there first (the caller reads it)."""
    tmp = root / tmp_name
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, root / MARKER)
        else:
            try:
                os.link(tmp, root / MARKER)
            except FileExistsError:
                return False
        fsync_dir(root)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def lock_holder(path: Path) -> int | None:
    """The process holding an ``flock`` on ``path``, from ``/proc/locks`` (Linux; None when
    unknown)."""
    try:
        ino = os.stat(path).st_ino
        with open("/proc/locks") as f:
            lines = f.read(1 << 20).splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK" or "->" in parts:
            continue
        try:
            if int(parts[5].rsplit(":", 1)[1]) == ino:
                return int(parts[4])
        except (ValueError, IndexError):
            continue
    return None


class DirBusy(StoreSkipped):
    """The directory's lock was held by another process past the bound: this store is skipped."""


class DirFull(StoreSkipped):
    """The directory shared by several processes is at its capacity: this store is skipped."""


@dataclass
class Listing:
    """A directory's files sorted by what they are to a disk tier."""

    entries: list[Path] = field(default_factory=list)  # names of the layout (checked on reading)
    temps: list[tuple[Path, str | None]] = field(default_factory=list)  # (file, writer id or None)
    live: list[tuple[Path, str]] = field(default_factory=list)  # liveness files and their ids
    foreign: list[Path] = field(default_factory=list)  # not a disk tier's: never touched


def _kind(e: os.DirEntry) -> str:
    try:
        if e.is_symlink():
            return "link"
        return "dir" if e.is_dir(follow_symlinks=False) else "file" if e.is_file(follow_symlinks=False) else "other"
    except OSError:
        return "other"


def list_dir(root: Path, warn) -> Listing:
    """Sort what ``root`` holds; ``warn(message)`` for a subdirectory it cannot read."""
    out = Listing()
    with os.scandir(root) as it:
        top = list(it)
    for e in top:
        kind, path = _kind(e), Path(e.path)
        if e.name in (MARKER, LEDGER) and kind == "file":
            continue
        if e.name in FS_OWN and kind == "dir":
            continue
        m = LIVE_RE.match(e.name)
        if m and kind == "file":
            out.live.append((path, m.group(1)))
            continue
        m = OWNED_TMP_RE.match(e.name)
        if kind == "file" and (m or LEGACY_ROOT_TMP_RE.match(e.name)):
            out.temps.append((path, m.group(1) if m else None))
            continue
        if not (SUB_RE.match(e.name) and kind == "dir"):
            out.foreign.append(path)
            continue
        try:
            with os.scandir(path) as it:
                inner = list(it)
        except OSError as exc:
            warn(f"skipping unreadable directory {path}: {exc}")
            continue
        for f in inner:
            fkind, fpath = _kind(f), Path(f.path)
            if fkind == "file" and ENTRY_RE.match(f.name):
                out.entries.append(fpath)
            elif fkind == "file" and f.name.startswith(TMP_PREFIX):
                m = OWNED_TMP_RE.match(f.name)
                out.temps.append((fpath, m.group(1) if m else None))
            else:
                out.foreign.append(fpath)
    return out


def _tag(total: bytes) -> bytes:
    return xxhash.xxh3_64_digest(LEDGER_TAG + total)


class DirState:
    """One opener's hold on a writable disk directory: its id and liveness lock, and
    the directory's lock and ledger of bytes (shared by every process that opens it).

    Why bounded waits and late removals: another process may hold the lock for long (an
    opener's scan of a large directory, or ``lmcache evict`` stopped with Ctrl-Z while it
    scans). A store waits for it at most :data:`LOCK_WAIT` and is then skipped
    (:class:`DirBusy`); a removal (an eviction, which runs under the tier's lock that
    reads take too) never waits: when the lock is not free at once, the file is removed,
    and its bytes taken off the ledger, by the next holder of the lock in this process.
    Until then it is counted as used, so the capacity is never passed."""

    def __init__(self, root: Path, warn: Callable[[str], None] = lambda message: None):
        self.root = root
        self.id = uuid.uuid4().hex
        self._warn = warn
        self._thread_lock = threading.Lock()  # flock excludes other open files, not our threads
        self._ledger_fd: int | None = None
        self._live_fd: int | None = None
        #: removals that wait for the lock: path -> its bytes when it was queued
        self._pending: dict[Path, int] = {}
        self._pending_lock = threading.Lock()
        #: since when stores find the lock busy (None: not busy), and how many were skipped
        self._busy: tuple[float, int] | None = None
        self._recounted_at: float | None = None
        self._said_recount_at: float | None = None

    def tmp_name(self, what: str | None = None) -> str:
        """A temporary file name that says it is this opener's."""
        return f"{TMP_PREFIX}{self.id}-{what or uuid.uuid4().hex}"

    def open(self) -> None:
        """Create the ledger (the lock file); call with the directory known to be ours
        (claimed or adoptable). Descriptors stay open read-only (``flock`` needs no
        more), so that the filesystem can still be remounted read-only under a live
        tier; the ledger is opened for writing only while it is written."""
        path = self.root / LEDGER
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))
        self._ledger_fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)

    def register(self) -> None:
        """Hold this opener's liveness lock (call under :meth:`locked`, so that no
        scan sees the file before it is locked)."""
        path = self.root / f"{LIVE_PREFIX}{self.id}"
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._live_fd = fd

    # ------------------------------------------------------------------ the lock
    def _acquire(self, timeout: float) -> bool:
        """Take the lock (this process's threads, then the other processes) within
        ``timeout`` seconds (0: only if free now)."""
        assert self._ledger_fd is not None
        # this process's threads hold it for a rename (or for their own bounded wait):
        # a slow machine must not turn them into "another process" (0: only if free now)
        if not self._thread_lock.acquire(timeout=timeout + THREAD_WAIT if timeout > 0 else 0):
            return False
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            try:
                fcntl.flock(self._ledger_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                pass
            except BaseException:
                self._thread_lock.release()
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                self._thread_lock.release()
                return False
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.02)

    def _release(self) -> None:
        """Let go of the lock, once the removals queued while it was held are made."""
        assert self._ledger_fd is not None
        try:
            self._drain()
        finally:
            fcntl.flock(self._ledger_fd, fcntl.LOCK_UN)
            self._thread_lock.release()

    @contextlib.contextmanager
    def locked(self, timeout: float | None = None, *, store: bool = True) -> Iterator[None]:
        """The directory's exclusive lock, across threads and processes, within
        ``timeout`` seconds (default :data:`LOCK_WAIT`, or :data:`LOCK_WAIT_BUSY` while
        another process is known to hold it), else :class:`DirBusy` (``store``: a store
        is skipped, said once while the lock stays busy). The removals that waited for
        it are made first."""
        if timeout is None:
            timeout = LOCK_WAIT if self._busy is None else LOCK_WAIT_BUSY
        if not self._acquire(timeout):
            if store:
                self._note_busy(timeout)
            raise DirBusy(f"{self._holder()} has held the lock of {self.root} for over {timeout:.1f}s")
        try:
            self._note_free()
            self._drain()
            yield
        finally:
            self._release()

    def _note_busy(self, waited: float) -> None:
        since, skipped = self._busy or (time.monotonic(), 0)
        self._busy = (since, skipped + 1)
        who = self._holder()
        if not skipped:
            self._warn(
                f"{who} holds the lock of {self.root} (its start-up scan, or a stopped lmcache command); "
                "stores that need it are skipped until it lets go, reads go on"
            )
        raise DirBusy(f"{who} has held the lock of {self.root} for over {waited:.2f}s")

    def _holder(self) -> str:
        holder = lock_holder(self.root / LEDGER)
        return f"process {holder}" if holder is not None else "another process"

    def _note_free(self) -> None:
        if self._busy is not None:
            since, skipped = self._busy
            self._busy = None
            self._warn(f"the lock of {self.root} is free again after {time.monotonic() - since:.1f}s "
                       f"({skipped} stores skipped)")

    # ---------------------------------------------------------------- removals
    def remove(self, path: Path) -> None:
        """Remove the entry file ``path`` and take its bytes off the ledger: now if the
        lock is free, else by the next holder of the lock (never waits).
        ``FileNotFoundError`` if there is no such file."""
        if self._acquire(0):
            try:
                self._note_free()
                self._drain()
                self._unlink_counted(path)
            finally:
                self._release()
            return
        st = os.lstat(path)
        with self._pending_lock:
            self._pending[path] = st.st_size if stat.S_ISREG(st.st_mode) else 0
        if self._acquire(0):  # its holder let go meanwhile (before it saw this removal)
            self._release()

    def pending_bytes(self) -> int:
        """The bytes of the removals waiting for the lock (still in the ledger)."""
        with self._pending_lock:
            return sum(self._pending.values())

    def _drain(self) -> None:
        """Make the removals that waited for the lock (call under it)."""
        if not self._pending:
            return
        with self._pending_lock:
            todo, self._pending = self._pending, {}
        for path in todo:
            try:
                self._unlink_counted(path)
            except FileNotFoundError:
                pass
            except OSError as exc:  # a read-only remount meanwhile: the file stays, and counted
                self._warn(f"cannot remove {path}: {exc}")

    def _unlink_counted(self, path: Path) -> None:
        st = os.lstat(path)
        total = self.checked_total()  # before the unlink: a recount still sees the file
        path.unlink()
        self.set_total(total - (st.st_size if stat.S_ISREG(st.st_mode) else 0))

    # ------------------------------------------------------------------ the ledger
    def total(self) -> int | None:
        """The bytes of every entry file in the directory, as the ledger says; ``None``
        when the ledger is not one this version wrote (damaged, overwritten, or an older
        version's): then :meth:`checked_total` recounts it."""
        if self._ledger_fd is None:
            return 0
        data = os.pread(self._ledger_fd, 2 * 8 + 1, 0)
        if len(data) != 16 or _tag(data[:8]) != data[8:]:
            return None
        return int.from_bytes(data[:8], "little")

    def checked_total(self) -> int:
        """:meth:`total`, recounted from the files when the ledger is not ours (under
        :meth:`locked`)."""
        n = self.total()
        return self.recount("it was not this tier's ledger (overwritten or damaged)") if n is None else n

    def recount_due(self) -> bool:
        return self._recounted_at is None or time.monotonic() - self._recounted_at >= RECOUNT_EVERY

    def recount(self, why: str | None = None) -> int:
        """Set the ledger to the bytes of the entry files in the directory (under
        :meth:`locked`); ``why``: said, at most once per :data:`RECOUNT_EVERY`."""
        n = 0
        for path in list_dir(self.root, self._warn).entries:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            n += st.st_size if stat.S_ISREG(st.st_mode) else 0
        before = self.total()
        self.set_total(n)
        now = self._recounted_at = time.monotonic()
        if why and (self._said_recount_at is None or now - self._said_recount_at >= RECOUNT_EVERY):
            self._said_recount_at = now
            self._warn(f"the ledger {self.root / LEDGER} was recounted from the files ({n} bytes"
                       f"{'' if before is None else f', it said {before}'}): {why}")
        return n

    def set_total(self, n: int) -> None:
        """Write the ledger (under :meth:`locked`)."""
        data = max(0, n).to_bytes(8, "little")
        fd = os.open(self.root / LEDGER, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            os.pwrite(fd, data + _tag(data), 0)
            if os.fstat(fd).st_size > 16:
                os.ftruncate(fd, 16)
        finally:
            os.close(fd)

    def dead(self, live: list[tuple[Path, str]]) -> set[str]:
        """The ids of openers that are gone (their liveness lock can be taken); their
        liveness files are removed. Call under :meth:`locked`."""
        gone: set[str] = set()
        for path, owner in live:
            if owner == self.id:
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                gone.add(owner)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            else:
                gone.add(owner)
                path.unlink(missing_ok=True)
            finally:
                os.close(fd)
        return gone

    def close(self) -> None:
        if self._pending and self._ledger_fd is not None:
            try:
                with self.locked(LOCK_WAIT, store=False):
                    pass  # the removals that waited for the lock are made
            except DirBusy:
                self._warn(f"{len(self._pending)} evicted entries stay in {self.root} (its lock is busy); "
                           "the next opener indexes them again")
        for name in ("_live_fd", "_ledger_fd"):
            fd = getattr(self, name)
            setattr(self, name, None)
            if fd is None:
                continue
            if name == "_live_fd":
                with contextlib.suppress(OSError):
                    (self.root / f"{LIVE_PREFIX}{self.id}").unlink()
            os.close(fd)
