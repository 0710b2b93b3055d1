"""Real servers on loopback ports, for the test suite and for ``lmcache bench``.

Each networked backend's store (redis-server, valkey-server, an S3-compatible server, the
Mooncake master) is started here as a child process bound to ``127.0.0.1`` on a free port,
with its files in a private temporary directory, and stopped (or killed, for fault
tests) through :class:`LocalServer`. Nothing is started or installed on import.

:func:`ensure_binary` finds a server's executable and, when it is missing and the process
runs as root on Debian (CI), installs the Debian package that provides it (optionally from
a named suite such as ``bookworm-backports``). :func:`start` opens the loopback store for a
backend name and returns what the backend needs to reach it::

    with loopback.start("redis") as store:
        backend = RedisBackend(BackendContext.standalone(store.options))

Backend-specific launchers live in this package's modules (``redis``, ``s3``,
``mooncake``) and are looked up by name in :data:`LAUNCHERS`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from lmcache.errors import LMCacheError

log = logging.getLogger(__name__)

#: backend name -> "module:function" of a context manager yielding a :class:`Store`
LAUNCHERS: dict[str, str] = {
    "redis": "lmcache.testing.stores.redis:redis_store",
    "redis-cluster": "lmcache.testing.stores.redis:redis_cluster_store",
    "redis-sentinel": "lmcache.testing.stores.redis:redis_sentinel_store",
    "valkey": "lmcache.testing.stores.redis:valkey_store",
    "valkey-cluster": "lmcache.testing.stores.redis:valkey_cluster_store",
    "s3": "lmcache.testing.stores.s3:s3_store",
    "mooncake": "lmcache.testing.stores.mooncake:mooncake_store",
    "lm": "lmcache.testing.stores.lm:lm_store",
}


class ServerUnavailable(LMCacheError):
    """A store's server could not be found, installed or started (the message says which
    and why)."""


@dataclass
class Store:
    """A running loopback store: the backend options that reach it and its servers."""

    backend: str
    options: dict[str, Any]
    servers: list[LocalServer] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def kill(self) -> None:
        for s in self.servers:
            s.kill()

    def restart(self) -> None:
        for s in self.servers:
            s.restart()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


#: what installs the system packages the stores need (``make test`` runs it as root)
INSTALL_SCRIPT = "requirements/install-test-servers.sh"


def ensure_library(soname: str, *, apt_package: str, components: str = "main") -> None:
    """Make sure the shared library ``soname`` (e.g. ``libcuda.so.1``) can be loaded, or
    raise :class:`ServerUnavailable` naming the Debian package that provides it."""
    import ctypes

    try:
        ctypes.CDLL(soname)
        return
    except OSError:
        pass
    where = f" (Debian components: {components})" if components != "main" else ""
    raise ServerUnavailable(
        f"{soname} cannot be loaded: install {apt_package}{where}, e.g. `bash {INSTALL_SCRIPT}` as root"
    )


def ensure_binary(name: str, *, apt_package: str | None = None, suite: str | None = None) -> str:
    """The path of executable ``name`` (on ``PATH`` or beside the interpreter), or
    :class:`ServerUnavailable` saying which package provides it. Nothing is installed
    here: ``requirements/install-test-servers.sh`` does that (``make test`` runs it)."""
    found = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
    if found:
        return found
    if apt_package:
        how = f"apt-get install -y {'-t ' + suite + ' ' if suite else ''}{apt_package}"
        raise ServerUnavailable(f"{name} is not installed: install it with `{how}` or `bash {INSTALL_SCRIPT}`, as root")
    raise ServerUnavailable(f"{name} is not installed")


class LocalServer:
    """One server process on a loopback port.

    ``argv`` is the command line; ``ready`` (default: the port accepts TCP connections)
    says when it serves. ``kill()`` sends SIGKILL (a crash), ``restart()`` starts the same
    command line again on the same port and directory (so a store with persistence comes
    back with its data, one without comes back empty).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        port: int,
        *,
        workdir: Path | None = None,
        ready: Callable[[], bool] | None = None,
        env: dict[str, str] | None = None,
        start_timeout: float = 30.0,
    ):
        self.name = name
        self.argv = [str(a) for a in argv]
        self.port = port
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"lmcache-{name}-"))
        self.ready = ready or (lambda: port_open(self.port))
        self.env = {**os.environ, **(env or {})}
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / f"{name}.log"

    def start(self) -> LocalServer:
        logf = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                self.argv, cwd=self.workdir, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, start_new_session=True,
            )
        except OSError as exc:
            raise ServerUnavailable(f"cannot start {self.name} ({self.argv[0]}): {exc}") from None
        finally:
            logf.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerUnavailable(
                    f"{self.name} exited with status {self.proc.returncode} while starting: {self.log_tail()}"
                )
            try:
                if self.ready():
                    return self
            except Exception:
                pass
            time.sleep(0.05)
        self.kill()
        raise ServerUnavailable(f"{self.name} did not become ready within {self.start_timeout:.0f}s: {self.log_tail()}")

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:].strip() or "(no output)"
        except OSError:
            return "(no log)"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the server (and anything it started); wait until it is gone."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while port_open(self.port) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def restart(self) -> LocalServer:
        self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launcher(backend: str) -> Callable[..., contextlib.AbstractContextManager[Store]]:
    try:
        target = LAUNCHERS[backend]
    except KeyError:
        known = ", ".join(sorted(LAUNCHERS))
        raise ServerUnavailable(f"no loopback launcher for backend {backend!r}; known: {known}") from None
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


@contextlib.contextmanager
def start(backend: str, **kwargs: Any) -> Iterator[Store]:
    """Start the loopback store for ``backend`` (see :data:`LAUNCHERS`); stop it on exit."""
    with launcher(backend)(**kwargs) as store:
        yield store
