"""The ``fs`` backend: one file per chunk on a shared filesystem (NFS) or any fsspec URL.

What it is for: a directory that several engine processes (on one host or many, through
NFS or another shared mount) read and write together, so that each sees the chunks the
others stored; and, through fsspec, any filesystem fsspec reaches (``memory://``,
``sftp://``, ...).

Why the key is spelled out in the file name (percent-encoded, in a subdirectory chosen
by a hash of the key) rather than hashed as the disk backend does: listing a shared
store must not read every file. On a remote filesystem each read is a round trip, while
one ``ls`` per directory returns every name with its size; with the key in the name,
``keys()`` is a walk of the directories and nothing else. Names longer than a filesystem
allows (255 bytes) are split into nested directories at fixed lengths, which the walk
joins back.

Why temporary name + rename: a reader on another host must never see a half-written
chunk. A writer creates a uniquely named temporary file in the chunk's directory and
renames it over the final name (``rename(2)`` on local and NFS mounts replaces
atomically); two writers of one key both finish and the last rename wins. Filesystems
that are object stores (``memory://``, ``s3://``...) have no rename but publish an
object whole when its upload ends, so they are written in place. A writer that dies
leaves its temporary file behind: the walk skips such files and removes those older than
``tmp_max_age`` seconds.

Why a thread pool and a deadline on every call: a hung NFS mount blocks ``open`` and
``read`` in the kernel, uninterruptibly. Each call runs its file operations on worker
threads (``concurrency`` at a time, which is also what makes batches fast on a network
filesystem) and waits at most ``timeout`` seconds; past that it raises
:class:`TimeoutError`, which the tier turns into misses and retries with backoff. The
stuck thread itself cannot be cancelled: it stays blocked until the filesystem answers,
and is replaced so that the pool keeps its size. Workers are daemon threads, so a stuck
one does not block the process from exiting either.

It is a store of payload bytes (:class:`~lmcache.storage.BytesBackend`: ``get`` returns
each file's bytes, ``put`` writes the concatenation of buffers). A tier opens it through
:class:`FSObjects`, which reads, checks and decodes on the workers, through the same path
as the disk backend's (:func:`lmcache.backends.file_io.read_payload`: a ``raw`` body goes
straight into the memory it is served from); a corrupt or truncated file is a miss and
is removed (the payload header and checksums of :mod:`lmcache.payload`).
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future, wait
from functools import partial
from typing import Any, Callable, Iterator, Mapping, Sequence
from urllib.parse import quote, unquote, urlsplit

import xxhash

from lmcache import payload
from lmcache.encoded import Encoded
from lmcache.errors import ConfigError, CorruptPayloadError
from lmcache.keys import CacheKey
from lmcache.memory import MemoryObj
from lmcache.redact import redact_text
from lmcache.storage import BackendContext, BytesBackend, EntryInfo

from . import disk_dir
from .file_io import read_payload

log = logging.getLogger(__name__)

SUFFIX = ".lmc"
TMP_PREFIX = ".tmp+"  # "+" never appears in an encoded key, so no key looks like a temporary
#: the fs layout, named in the directory's marker (``disk_dir.MARKER``)
FS_LAYOUT = "fs/encoded-key"
SEGMENT = 200  # bytes of encoded key per path component (NAME_MAX is 255)
#: filesystems whose ``mv`` is a rename that replaces the target atomically (fsspec's
#: generic ``mv`` is copy + delete); the others are written in place
RENAME_PROTOCOLS = frozenset({"file", "local", "sftp", "ssh", "hdfs", "arrow_hdfs"})
#: a listing walks the whole store: it gets this many times the per-call timeout (at least a minute)
LIST_TIMEOUT_FACTOR = 10

_worker = threading.local()


def _in_worker() -> bool:
    return getattr(_worker, "active", False)


class _Workers:
    """A fixed number of daemon threads running submitted calls.

    Not :class:`concurrent.futures.ThreadPoolExecutor`: its threads are joined when the
    interpreter exits, so one stuck in a hung mount would hang the exit of the process.
    :meth:`replace` starts a thread for each one given up on, up to four times the size;
    threads above the size end after their current call."""

    def __init__(self, size: int, name: str):
        self.size = size
        self.name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = 0
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the backend is closed")
            while self._live < self.size:
                self._start()
        self._q.put((fut, fn, args))
        return fut

    def replace(self, stuck: int) -> None:
        with self._lock:
            for _ in range(min(stuck, 4 * self.size - self._live)):
                self._start()

    def _start(self) -> None:
        self._live += 1
        threading.Thread(target=self._run, name=f"{self.name}-{self._live}", daemon=True).start()

    def _run(self) -> None:
        _worker.active = True
        while True:
            item = self._q.get()
            if item is None:
                break
            fut, fn, args = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:
                    fut.set_exception(exc)
            with self._lock:
                if self._live > self.size:
                    break
        with self._lock:
            self._live -= 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            n = self._live
        for _ in range(n):
            self._q.put(None)


def _release(fut: Future) -> None:
    """Drop the object a call returned after its caller gave up on it."""
    if not fut.cancelled() and fut.exception() is None and isinstance(fut.result(), MemoryObj):
        fut.result().unref()


def _read_at(f: Any, dst: memoryview, offset: int) -> int:
    f.seek(offset)
    got = 0
    while got < len(dst):
        n = f.readinto(dst[got:])
        if not n:
            break
        got += n
    return got


def _unref_arg(args: tuple) -> None:
    args[-1].unref()


def _mtime(info: Mapping[str, Any]) -> float | None:
    """A listing entry's modification time as ``time.time()`` seconds, where it has one."""
    for field in ("mtime", "LastModified", "last_modified", "created", "modified"):
        v = info.get(field)
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, datetime.datetime):
            return v.timestamp()
    return None


def _filesystem_class(url: str) -> type:
    import fsspec
    from fsspec.core import split_protocol

    protocol = split_protocol(url)[0] or "file"
    try:
        return fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ConfigError("url", f"unknown filesystem protocol {protocol!r} in {url!r}") from None
    except ImportError as exc:
        raise ConfigError("url", f"the {protocol}:// filesystem needs a package that is not installed: {exc}") from None


_CORRUPT = object()  # a step's answer for a payload that failed its checks


class FSObjects(Encoded):
    """The fs store as a tier opens it (:attr:`FSBackend.objects_view`).

    Reads are checked and decoded on the workers, through the disk backend's path
    (:func:`~lmcache.backends.file_io.read_payload`): a ``raw`` body goes straight from
    the file into the memory it is served from, with no intermediate bytes. Writes are
    encoded on the workers, each holding its own reference to its object, so a write
    given up on past the timeout never reads memory that was reused meanwhile."""

    raw: FSBackend

    def get_native(self, keys: Sequence[str]) -> list[MemoryObj | None]:
        got = self.raw._batch(self._get_step, [(k,) for k in keys], "get")
        corrupt = [k for k, g in zip(keys, got) if g is _CORRUPT]
        if corrupt:
            self.drop_corrupt(corrupt)
        return [None if g is _CORRUPT else g for g in got]

    def _get_step(self, key: str) -> Any:
        """On a worker: one entry read, checked and decoded; ``_CORRUPT`` (counted) if it
        fails its checks."""
        ctx, fs = self.context, self.raw
        try:
            with fs._fs().open(fs._path(key), "rb") as f:
                size = f.seek(0, 2)
                return read_payload(partial(_read_at, f), size, key, ctx.codec_lookup, ctx.allocate)
        except FileNotFoundError:
            return None
        except CorruptPayloadError as exc:
            self.note_corrupt(key, exc)
            return _CORRUPT

    def put(self, items: Sequence[tuple[str, MemoryObj]]) -> list[int]:
        if self.store is not self.raw:  # seen within limits (lmcache.fit): its parts are bytes
            return super().put(items)
        return self.raw._batch(self._put_step, [(k, o.ref()) for k, o in items], "put", not_run=_unref_arg)

    def _put_step(self, key: str, obj: MemoryObj) -> int:
        # holds its own reference: a call given up on must not write memory reused meanwhile
        try:
            return self.raw._write(key, payload.encode(key, obj, self.context.codec))
        finally:
            obj.unref()


class FSBackend(BytesBackend):
    OPTIONS = {
        "url": None, "fs_options": {}, "prefix": "", "concurrency": 16, "timeout": 5.0, "tmp_max_age": 3600.0,
    }
    shared = True
    objects_view = FSObjects

    @classmethod
    def check_options(cls, options: Mapping[str, Any], capacity: int | None = None) -> dict[str, Any]:
        opts = super().check_options(options, capacity)
        url = opts["url"]
        if not isinstance(url, str) or not url.strip():
            raise ConfigError("url", f"expected a directory URL such as file:///mnt/nfs/lmcache, got {url!r}")
        if "::" in url:
            raise ConfigError("url", f"chained fsspec URLs are not supported, got {url!r}")
        parts = urlsplit(url)
        if parts.scheme == "file" and (parts.netloc not in ("", "localhost") or not parts.path.startswith("/")):
            raise ConfigError("url", f"a file URL is file:///absolute/path (or a plain path), got {url!r}")
        _filesystem_class(url)
        if not isinstance(opts["fs_options"], Mapping):
            raise ConfigError("fs_options", f"expected a mapping of filesystem arguments, got {opts['fs_options']!r}")
        if not isinstance(opts["prefix"], str) or any(c in opts["prefix"] for c in "/\\"):
            raise ConfigError("prefix", f"expected a string without slashes, got {opts['prefix']!r}")
        n = opts["concurrency"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError("concurrency", f"expected a whole number of threads >= 1, got {n!r}")
        for key in ("timeout", "tmp_max_age"):
            v = opts[key]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ConfigError(key, f"expected a number of seconds > 0, got {v!r}")
        return opts

    def __init__(self, context: BackendContext):
        super().__init__(context)
        self.url: str = self.options["url"]
        self.prefix: str = self.options["prefix"]
        self.timeout = float(self.options["timeout"])
        cls = _filesystem_class(self.url)
        self._fs_cls = cls
        self._fs_kwargs = {**cls._get_kwargs_from_urls(self.url), **self.options["fs_options"]}
        self.root: str = cls._strip_protocol(self.url).rstrip("/") or "/"
        protocols = (cls.protocol,) if isinstance(cls.protocol, str) else tuple(cls.protocol)
        self.atomic_rename = any(p in RENAME_PROTOCOLS for p in protocols)
        self._fs_obj: Any = None
        self._fs_lock = threading.Lock()
        self._dirs: set[str] = set()
        self._workers = _Workers(self.options["concurrency"], f"lmcache-fs-{context.tier}")
        try:  # connect now if the filesystem answers in time; a bad argument is a config error
            self._call(self._fs)
        except ConfigError:  # the directory is claimed by a tier of another layout
            self._workers.close()
            raise
        except TypeError as exc:
            raise ConfigError("fs_options", f"{cls.__name__} rejected its arguments: {exc}") from None
        except Exception as exc:  # unreachable: open anyway, serve misses, retry on each call
            log.warning("fs tier %s: %s is not reachable yet (%s)", context.tier, redact_text(self.url),
                        redact_text(f"{type(exc).__name__}: {exc}"))

    # ------------------------------------------------------------- plumbing
    def _fs(self) -> Any:
        """The filesystem object, built on first use (building one may connect)."""
        fs = self._fs_obj
        if fs is None:
            with self._fs_lock:
                if self._fs_obj is None:
                    fs = self._fs_cls(**self._fs_kwargs)
                    if not self.context.read_only:
                        fs.makedirs(self.root, exist_ok=True)
                    self._claim(fs)
                    self._fs_obj = fs
                fs = self._fs_obj
        return fs

    def _claim(self, fs: Any) -> None:
        """Refuse a directory that a tier of another layout claimed (a ``disk`` tier
        names its files by a hash and would not know ours); claim an unclaimed one
        (unless read-only) with the marker ``.lmcache-tier``."""
        marker = f"{self.root.rstrip('/')}/{disk_dir.MARKER}"
        for attempt in range(2):
            try:
                data = fs.cat_file(marker, start=0, end=disk_dir.MAX_MARKER + 1)
            except FileNotFoundError:
                if self.context.read_only or attempt:
                    return
                fs.pipe_file(marker, disk_dir.marker_bytes("fs", FS_LAYOUT))
                continue  # read it back: a disk tier claiming it at the same time may have won
            claim = disk_dir.parse_marker(data, marker, "url")
            disk_dir.check_marker(claim, self.url, FS_LAYOUT, "fs", "url")
            return

    def _batch(
        self,
        fn: Callable[..., Any],
        calls: Sequence[tuple],
        what: str,
        timeout: float | None = None,
        not_run: Callable[[tuple], None] | None = None,
    ) -> list:
        """``fn(*args)`` for each of ``calls`` on the workers, all within the timeout.

        Raises :class:`TimeoutError` when they are not all done in time, or the first
        error one raised; objects the others returned are released, and so are those
        that stuck calls return later. ``not_run(args)`` is called for each call that was
        given up on before it started."""
        if _in_worker():  # a step of a call already bounded by its caller
            return [fn(*args) for args in calls]
        if not calls:
            return []
        limit = self.timeout if timeout is None else timeout
        futures = [self._workers.submit(fn, *args) for args in calls]
        done, pending = wait(futures, timeout=limit)
        if pending:
            stuck = 0
            for f, args in zip(futures, calls):
                if f in pending:
                    if f.cancel():
                        if not_run is not None:
                            not_run(args)
                    else:
                        stuck += 1
                        f.add_done_callback(_release)
            for f in done:
                _release(f)
            self._workers.replace(stuck)
            raise TimeoutError(
                f"fs tier {self.context.tier}: {what} of {len(calls)} entries did not finish within "
                f"{limit:g}s ({self.url} is slow or hung; {stuck} calls still blocked)"
            )
        error = next((f.exception() for f in futures if f.exception() is not None), None)
        if error is not None:
            for f in futures:
                _release(f)
            raise error
        return [f.result() for f in futures]

    def _call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        return self._batch(fn, [args], getattr(fn, "__name__", "call"), timeout)[0]

    # ----------------------------------------------------------------- layout
    def _path(self, key: str) -> str:
        name = quote(self.prefix + key, safe="-_.~") + SUFFIX
        sub = xxhash.xxh3_64_hexdigest(key.encode())[:2]
        return "/".join([self.root, sub, *(name[i : i + SEGMENT] for i in range(0, len(name), SEGMENT))])

    def _key_of(self, path: str) -> str | None:
        """The key a stored file's path spells, or ``None`` if it is not an lmcache entry."""
        parts = path[len(self.root) :].strip("/").split("/")
        name = "".join(parts[1:])
        if len(parts) < 2 or len(parts[0]) != 2 or not name.endswith(SUFFIX):
            return None
        text = unquote(name[: -len(SUFFIX)])
        if not text.startswith(self.prefix):
            return None
        key = text[len(self.prefix) :]
        try:
            CacheKey.parse(key)
        except ValueError:
            return None
        return key

    # --------------------------------------------------------- the five verbs, over bytes
    def get(self, keys: Sequence[str], on_ready: Callable[[int, Any], None] | None = None) -> list[bytes | None]:
        """Each file's bytes (the caller's own), read on the workers."""
        return self._batch(self._read, [(k,) for k in keys], "get")

    def get_one(self, key: str) -> bytes | None:
        return self._batch(self._read, [(key,)], "get")[0]

    def _read(self, key: str) -> bytes | None:
        try:
            return self._fs().cat_file(self._path(key))
        except FileNotFoundError:
            return None

    def put(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> list[int]:
        """Each value written on the workers (temporary file and rename where the
        filesystem has one). A write given up on past the timeout may still finish later,
        from the caller's buffers: should they have been reused meanwhile, the payload's
        checksums make the entry a miss (and it is removed), never wrong KV. The tier's
        own writes (:class:`FSObjects`) hold their object instead."""
        return self._batch(self._write, [(k, bufs) for k, bufs in items], "put")

    def put_one(self, key: str, buffers: Sequence[bytes | memoryview]) -> int:
        return self._batch(self._write, [(key, buffers)], "put")[0]

    def _write(self, key: str, buffers: Sequence[bytes | memoryview]) -> int:
        fs = self._fs()
        final = self._path(key)
        parent = final.rsplit("/", 1)[0]
        if parent not in self._dirs:
            fs.makedirs(parent, exist_ok=True)
            self._dirs.add(parent)
        target = f"{parent}/{TMP_PREFIX}{uuid.uuid4().hex}" if self.atomic_rename else final
        size = 0
        try:
            try:
                f = fs.open(target, "wb")
            except FileNotFoundError:  # the directory was removed under us (a peer cleaning up)
                fs.makedirs(parent, exist_ok=True)
                f = fs.open(target, "wb")
            with f:
                for b in buffers:
                    f.write(b)
                    size += memoryview(b).nbytes
            if self.atomic_rename:
                fs.mv(target, final)
        except BaseException:
            if self.atomic_rename:
                try:
                    fs.rm_file(target)
                except Exception:
                    pass
            raise
        return size

    def delete(self, keys: Sequence[str]) -> list[bool]:
        return self._batch(self._delete, [(k,) for k in keys], "delete")

    def _delete(self, key: str) -> bool:
        try:
            self._fs().rm_file(self._path(key))
        except FileNotFoundError:
            return False
        return True

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._batch(self._exists, [(k,) for k in keys], "exists")

    def _exists(self, key: str) -> bool:
        return bool(self._fs().exists(self._path(key)))

    def keys(self) -> Iterator[tuple[str, int]]:
        return iter([(e.key, e.size) for e in self.entries()])

    def entries(self) -> Iterator[EntryInfo]:
        """Keys and sizes from directory listings alone (no file is opened); the time
        stored is the file's modification time, the codec is unknown without a read."""
        limit = max(self.timeout * LIST_TIMEOUT_FACTOR, 60.0)
        return iter(self._call(self._entries, timeout=limit))

    def _entries(self) -> list[EntryInfo]:
        fs = self._fs()
        out: list[EntryInfo] = []
        stale_before = time.time() - float(self.options["tmp_max_age"])
        pending = [self.root]
        while pending:
            listing = self._ls(fs, pending.pop())
            for info in listing:
                name = info["name"]
                if info.get("type") == "directory":
                    pending.append(name)
                    continue
                if name.rsplit("/", 1)[-1].startswith(TMP_PREFIX):
                    mtime = _mtime(info)
                    if not self.context.read_only and mtime is not None and mtime < stale_before:
                        try:
                            fs.rm_file(name)
                            log.info("fs tier %s: removed stale temporary file %s", self.context.tier, name)
                        except FileNotFoundError:
                            pass
                    continue
                key = self._key_of(name)
                if key is not None:
                    out.append(EntryInfo(key, int(info.get("size") or 0), None, _mtime(info)))
        return out

    @staticmethod
    def _ls(fs: Any, d: str) -> list[dict]:
        """One directory's entries. A local listing fails as a whole when one file in it
        vanishes between ``readdir`` and ``stat`` (a peer's rename or delete): try again."""
        for _ in range(5):
            try:
                return fs.ls(d, detail=True)
            except FileNotFoundError:
                if not fs.isdir(d):  # removed meanwhile (or the store is still empty)
                    return []
        return []

    def close(self) -> None:
        self._workers.close()
