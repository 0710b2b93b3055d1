"""The ``gds`` backend: chunk files moved by GPUDirect Storage (kvikio), or by O_DIRECT.

Why a subclass of the disk backend: the on-disk layout, the atomic publish (temporary
name, then rename), the index rebuilt from headers and the corrupt-entry handling are
exactly the disk backend's, so a ``gds`` directory and a ``disk`` directory hold the
same files and either backend can open the other's. What differs is only how bytes move
between a file and memory, and that is two overridable steps of the disk store
(``_write_file`` and ``_load``, which its object view, :class:`GDSObjects`, reads
through), and the threads batches run on (``concurrency``).

Two ways to move them, chosen when the backend opens and reported by :attr:`io_path`
and one log line:

- ``kvikio``: when ``kvikio`` imports *and* a probe file round-trips through
  ``kvikio.CuFile`` in the store's directory. Importing kvikio needs no GPU, but any read
  or write needs ``libcuda.so.1`` (even in kvikio's compatibility mode), so importable is
  not the same as usable: without the probe a host with kvikio but no CUDA driver would
  fail every call. On a GDS-capable host cuFile moves the bytes; elsewhere kvikio's
  compatibility mode does POSIX I/O from its own thread pool, splitting large files into
  parallel reads. Reads land in the tier's host memory (pinned when CUDA is present),
  because every payload is checked (header and body checksums) before it is handed out,
  and those checks run on the CPU.
- ``posix``: O_DIRECT with block-aligned buffers (the disk backend's ``o_direct`` path):
  no page-cache pollution and no double buffering, the closest plain-POSIX equivalent
  of a DMA transfer.

``use_kvikio``: ``auto`` (kvikio when usable, else POSIX), ``true`` (kvikio or a
:class:`ConfigError` saying why not), ``false`` (always POSIX). Batches are read and
written ``concurrency`` files at a time.
"""

from __future__ import annotations

import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import urlsplit

from lmcache.errors import ConfigError
from lmcache.memory import MemoryObj
from lmcache.storage import BackendContext

from .disk import TMP_PREFIX, DiskBackend, DiskObjects
from .file_io import read_payload

log = logging.getLogger(__name__)

_USE_KVIKIO = ("auto", True, False)


def path_from_url(url: Any) -> str:
    """The directory of a ``gds:///abs/path`` URL; :class:`ConfigError` on ``url`` if it
    is anything else."""
    if not isinstance(url, str) or not url:
        raise ConfigError("url", f"expected a URL such as gds:///var/cache/lmcache, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme != "gds":
        raise ConfigError("url", f"expected a gds:///absolute/path URL, got {url!r}")
    if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
        raise ConfigError("url", f"a gds URL names a local directory, gds:///absolute/path; got {url!r}")
    if parts.query or parts.fragment:
        raise ConfigError("url", f"a gds URL takes no query or fragment, got {url!r}")
    return parts.path


class GDSBackend(DiskBackend):
    OPTIONS = {
        "url": None, "path": None, "use_kvikio": "auto", "o_direct": True, "fsync": False, "concurrency": 8,
    }

    @classmethod
    def check_options(cls, options: Mapping[str, Any], capacity: int | None = None) -> dict[str, Any]:
        opts = dict(options)
        url, path = opts.get("url"), opts.get("path")
        if url is not None:
            from_url = path_from_url(url)
            if path is not None and os.path.abspath(str(path)) != os.path.abspath(from_url):
                raise ConfigError("path", f"give url or path, not both (url names {from_url}, path {path})")
            opts["path"] = from_url
        elif path is None:
            raise ConfigError("url", "the gds backend needs a directory, e.g. url: gds:///mnt/nvme/lmcache")
        opts = super().check_options(opts, capacity)
        use = opts["use_kvikio"]
        if isinstance(use, str):
            use = {"auto": "auto", "true": True, "false": False}.get(use.lower(), use)
        if use not in _USE_KVIKIO or not isinstance(use, (bool, str)):
            raise ConfigError("use_kvikio", f"expected auto, true or false, got {opts['use_kvikio']!r}")
        opts["use_kvikio"] = use
        n = opts["concurrency"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError("concurrency", f"expected a whole number of threads >= 1, got {n!r}")
        return opts

    def __init__(self, context: BackendContext):
        super().__init__(context)
        self._kvikio: Any = None
        #: why the kvikio path is not used ("" when it is)
        self.kvikio_problem = "use_kvikio is false"
        if self.options["use_kvikio"] is not False:
            self.kvikio_problem = self._open_kvikio()
            if self.kvikio_problem and self.options["use_kvikio"] is True:
                raise ConfigError("use_kvikio", f"kvikio is not usable here: {self.kvikio_problem}")
        self._pool = ThreadPoolExecutor(self.options["concurrency"], thread_name_prefix=f"lmcache-gds-{context.tier}")
        if self._kvikio is not None:
            log.info("gds tier %s: %s at %s", context.tier, self.io_path, self.root)
        else:
            why = self.kvikio_problem
            log.info("gds tier %s: %s at %s (kvikio not used: %s)", context.tier, self.io_path, self.root, why)

    def _open_kvikio(self) -> str:
        """Import kvikio and round-trip a probe file through it; "" if that worked, else
        why not (kvikio imports without a GPU but fails on I/O without libcuda)."""
        try:
            import kvikio
            import kvikio.defaults
        except Exception as exc:  # ImportError, or a broken install failing to load its libraries
            return f"cannot import kvikio ({type(exc).__name__}: {exc}); install lmcache[gds]"
        if self.read_only:
            self._kvikio = kvikio  # nothing may be written; the first read tells
            return ""
        # a temporary of this process's own (backends/disk_dir.py): another opener of the
        # directory removes it only once this process has exited
        name = self._dir.tmp_name("kvikio") if self._dir is not None else f"{TMP_PREFIX}kvikio-{uuid.uuid4().hex}"
        probe = self.root / name
        data = bytes(range(256)) * 16
        back = bytearray(len(data))
        try:
            with kvikio.CuFile(str(probe), "w") as f:
                f.pwrite(memoryview(data), len(data), 0).get()
            with kvikio.CuFile(str(probe), "r") as f:
                f.pread(memoryview(back), len(back), 0).get()
        except Exception as exc:
            return f"a probe file did not round-trip through kvikio.CuFile ({type(exc).__name__}: {exc})"
        finally:
            probe.unlink(missing_ok=True)
        if back != data:
            return "a probe file read back through kvikio.CuFile differs from what was written"
        self._kvikio = kvikio
        return ""

    @property
    def io_path(self) -> str:
        """How bytes move: ``kvikio (cuFile)``, ``kvikio (compat mode: POSIX)``,
        ``posix (O_DIRECT)`` or ``posix (page cache)``."""
        if self._kvikio is not None:
            compat = self._kvikio.defaults.is_compat_mode_preferred()
            return "kvikio (compat mode: POSIX)" if compat else "kvikio (cuFile)"
        return "posix (O_DIRECT)" if self.o_direct else "posix (page cache)"

    # ----------------------------------------------------------- the two I/O steps
    def _write_file(self, tmp: Path, buffers: Sequence[bytes | memoryview], total: int) -> None:
        if self._kvikio is None:
            return super()._write_file(tmp, buffers, total)
        with self._kvikio.CuFile(str(tmp), "w") as f:  # the name is fresh (a uuid): exclusive in effect
            offset, pending = 0, []
            for b in buffers:
                mv = memoryview(b).cast("B")
                if len(mv):
                    pending.append(f.pwrite(mv, len(mv), offset))
                    offset += len(mv)
            for fut in pending:
                fut.get()
        if self.fsync:
            fd = os.open(tmp, os.O_WRONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _load(self, path: Path, key: str) -> MemoryObj:
        if self._kvikio is None:
            return super()._load(path, key)
        size = os.stat(path).st_size  # FileNotFoundError: gone (evicted by a peer)
        try:
            f = self._kvikio.CuFile(str(path), "r")
        except RuntimeError:
            if not path.exists():
                raise FileNotFoundError(path) from None
            raise
        with f:
            ctx = self.context
            return read_payload(
                lambda dst, off: f.pread(dst, len(dst), off).get() if len(dst) else 0,
                size, key, ctx.codec_lookup, ctx.allocate,
            )

    # ------------------------------------------------------------------ batches
    def delete(self, keys: Sequence[str]) -> list[bool]:
        return _each(self._pool, self.delete_one, keys)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        super().close()


def _each(pool: ThreadPoolExecutor, fn: Callable[[Any], Any], args: Sequence[Any]) -> list[Any]:
    """``fn`` over ``args`` on ``pool`` (``concurrency`` at a time); the first error is
    raised after every call finished (objects read by the others are released)."""
    if len(args) <= 1:
        return [fn(a) for a in args]
    futures = [pool.submit(fn, a) for a in args]
    errors = [f.exception() for f in futures]
    if any(errors):
        for f, e in zip(futures, errors):
            if e is None and isinstance(f.result(), MemoryObj):
                f.result().unref()
        raise next(e for e in errors if e is not None)
    return [f.result() for f in futures]


class GDSObjects(DiskObjects):
    """Memory objects over a :class:`GDSBackend`: the disk view, its files read and
    written through the store's kvikio (or O_DIRECT) steps, and batches run on the store's
    ``concurrency`` threads."""

    #: reads run on the ``concurrency`` threads; :meth:`get` hands each hit to ``on_ready`` there
    streams_gets = True
    raw: GDSBackend

    def get(self, keys: Sequence[str], on_ready: Callable[[int, MemoryObj], None] | None = None) -> list[MemoryObj | None]:
        """Read ``keys`` on the store's threads; ``on_ready(i, obj)`` is called on the
        thread that read hit ``i``, once, before this returns (an error in it is logged)."""
        if on_ready is None:
            return _each(self.raw._pool, self.get_one, keys)

        def one(item: tuple[int, str]) -> MemoryObj | None:
            i, key = item
            obj = self.get_one(key)
            if obj is not None:
                try:
                    on_ready(i, obj)
                except Exception:
                    log.exception("tier %s: on_ready for %s failed", self.context.tier, key)
            return obj

        return _each(self.raw._pool, one, list(enumerate(keys)))

    def get_native(self, keys: Sequence[str]) -> list[MemoryObj | None]:
        return self.get(keys)

    def put(self, items: Sequence[tuple[str, MemoryObj]]) -> list[int]:
        return _each(self.raw._pool, lambda item: self.put_one(*item), items)


GDSBackend.objects_view = GDSObjects
