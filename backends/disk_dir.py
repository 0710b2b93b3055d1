"""A disk tier's directory: its claim, its lock and shared ledger, and its listing.

Why a claim: a directory is a tier's only if the tier can tell its own files from anyone
else's. A disk tier writes a marker file, ``.lmcache-tier`` (JSON: backend and layout),
when it first takes a directory, and refuses one that another backend claimed (an ``fs``
tier names its files differently) or that holds files it did not write. A directory of
the previous version (no marker) is adopted only when every file in it has the disk
layout's names. Inside a claimed directory a tier touches only names of its layout; any
other file is left alone.

Why a lock and a ledger: several processes (one per tensor-parallel rank) may open one
directory. ``.lmcache-ledger`` holds the bytes of every entry file in the directory; it
is changed only under an exclusive ``flock`` on itself, together with the rename or
unlink that changes those bytes, and recomputed from the files by each opener's scan
(under the same lock), so a process killed between two steps cannot make it drift for
long. One capacity thus covers the whole directory, whatever process wrote what.

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
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from lmcache.errors import ConfigError

MARKER = ".lmcache-tier"
LEDGER = ".lmcache-ledger"
LIVE_PREFIX = ".lmcache-live-"
TMP_PREFIX = ".tmp-"
#: the disk layout: ``<xx>/<xxh3-128 hex of the key>.lmc``, ``xx`` its first two digits
DISK_LAYOUT = "disk/xxh3-128-hex"
#: a marker is a few dozen bytes; anything longer is not ours
MAX_MARKER = 4096

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


def read_marker(root: Path, backend: str, key: str = "path") -> tuple[str, str] | None:
    """The claim on ``root`` (``None``: unclaimed), refused unless it is the disk layout's."""
    path = root / MARKER
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from None
    with open(fd, "rb", buffering=0) as f:
        data = f.read(MAX_MARKER + 1)
    claim = parse_marker(data, str(path), key)
    check_marker(claim, root, DISK_LAYOUT, backend, key)
    return claim


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


class DirState:
    """One opener's hold on a writable disk directory: its id and liveness lock, and
    the directory's lock and ledger of bytes (shared by every process that opens it)."""

    def __init__(self, root: Path):
        self.root = root
        self.id = uuid.uuid4().hex
        self._thread_lock = threading.Lock()  # flock excludes other open files, not our threads
        self._ledger_fd: int | None = None
        self._live_fd: int | None = None

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

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The directory's exclusive lock, across threads and processes."""
        assert self._ledger_fd is not None
        with self._thread_lock:
            fcntl.flock(self._ledger_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._ledger_fd, fcntl.LOCK_UN)

    def total(self) -> int:
        """The bytes of every entry file in the directory, as the ledger says."""
        if self._ledger_fd is None:
            return 0
        data = os.pread(self._ledger_fd, 8, 0)
        return int.from_bytes(data, "little") if len(data) == 8 else 0

    def set_total(self, n: int) -> None:
        """Write the ledger (under :meth:`locked`)."""
        fd = os.open(self.root / LEDGER, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            os.pwrite(fd, max(0, n).to_bytes(8, "little"), 0)
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
        for name in ("_live_fd", "_ledger_fd"):
            fd = getattr(self, name)
            setattr(self, name, None)
            if fd is None:
                continue
            if name == "_live_fd":
                with contextlib.suppress(OSError):
                    (self.root / f"{LIVE_PREFIX}{self.id}").unlink()
            os.close(fd)
