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

Launchers are found by name in the plugin registry: the built-in ones (in this package's
modules ``redis``, ``s3``, ``mooncake``, ``lm``) and any a third-party plugin registers through
the hook ``lmcache_register_store_launchers``, so a plugin's own server starts here too (and in
``lmcache bench tiers --backend NAME`` and the ``lmcache_store`` fixture of
:mod:`lmcache.testing.pytest_plugin`). A :class:`Store`'s servers can be killed (SIGKILL),
frozen (SIGSTOP: a hung server), thawed and restarted, for fault tests.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from lmcache.errors import LMCacheError, UnknownPluginError

if TYPE_CHECKING:
    from lmcache.plugin_manager import Registries

log = logging.getLogger(__name__)

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
        """SIGKILL every server (a crash); :meth:`restart` brings them back."""
        for s in self.servers:
            s.kill()

    def freeze(self) -> None:
        """SIGSTOP every server (a hung store: connections stay open, nothing answers);
        returns once all their threads are stopped."""
        for s in self.servers:
            s.freeze()

    def thaw(self) -> None:
        """SIGCONT every server: a frozen store answers again, with its data."""
        for s in self.servers:
            s.thaw()

    def restart(self) -> None:
        """Start every server again, on the same ports (killed, frozen or running)."""
        for s in self.servers:
            s.restart()


#: ports handed out by :func:`free_port` in this process (not handed out twice)
_given: set[int] = set()
_given_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, chosen at random below the
    kernel's ephemeral range (``ip_local_port_range``) and never twice in a process.

    Why not ``bind(0)``: that returns an ephemeral port, which the kernel hands to the
    next process that binds 0 or connects out; a test that chose a port for a server it
    starts later (vllm serve's decoder listening on its PD init ports half a minute
    later) found it taken by the other servers it had started meanwhile (``Address
    already in use``). Below the ephemeral range only another explicit choice can take it."""
    import random

    hi = min(_ephemeral_low(), 65536)
    lo = max(1024, hi - 16384)
    for _ in range(200):
        port = random.randrange(lo, hi) if hi - lo >= 1024 else 0
        with _given_lock:
            if port in _given:
                continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        with _given_lock:
            if port in _given:
                continue
            if len(_given) > 8192:
                _given.clear()
            _given.add(port)
        return port
    raise OSError("no free TCP port on 127.0.0.1")


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

    def freeze(self) -> None:
        """SIGSTOP the server (and anything it started): it hangs with its connections
        open. Returns once every thread of the server is stopped."""
        if self.proc is None or self.proc.poll() is not None:
            raise ServerUnavailable(f"{self.name} is not running; nothing to freeze")
        self._signal_group(signal.SIGSTOP)
        wait_stopped(self.proc.pid)

    def thaw(self) -> None:
        """SIGCONT the server after :meth:`freeze` (nothing happens to a running one)."""
        self._signal_group(signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s (a frozen server is thawed to take the SIGTERM)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            self._signal_group(signal.SIGCONT)
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


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Wait until every thread of ``pid`` is stopped (after a SIGSTOP).

    ``kill(pid, SIGSTOP)`` wakes one thread of the process, which then stops the others;
    until it has run, the other threads go on (on a loaded machine, a connection thread of
    a "stopped" server answered a request: 2 in 200 tries under 6 CPU burners)."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for path in glob.glob(f"/proc/{pid}/task/*/stat"):
            try:
                with open(path) as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                continue  # a thread that exited meanwhile
        if states and all(s in ("T", "t") for s in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop within {timeout}s (thread states {states})")
        time.sleep(0.001)


def launchers(registries: Registries | None = None) -> list[str]:
    """The names of every registered launcher (built-in and from plugins)."""
    from lmcache.plugin_manager import get_registries

    return (registries or get_registries()).launchers.names()


def launcher(backend: str, registries: Registries | None = None) -> Callable[..., contextlib.AbstractContextManager[Store]]:
    """The launcher registered as ``backend`` through ``lmcache_register_store_launchers``
    (``registries``: the process-wide ones unless given); an unknown name is an
    :class:`~lmcache.errors.UnknownPluginError` listing the known launchers."""
    from lmcache.plugin_manager import get_registries

    regs = registries or get_registries()
    if backend not in regs.launchers:
        known = ", ".join(regs.launchers.names()) or "none"
        raise UnknownPluginError(
            f"no loopback launcher for backend {backend!r}; known launchers: {known} "
            "(a plugin adds one through the hook lmcache_register_store_launchers)"
        )
    return regs.launchers.load(backend)


@contextlib.contextmanager
def start(backend: str, registries: Registries | None = None, **kwargs: Any) -> Iterator[Store]:
    """Start the loopback store of launcher ``backend`` (see :func:`launcher`) with the
    launcher's keyword arguments ``kwargs``; stop it on exit."""
    with launcher(backend, registries)(**kwargs) as store:
        yield store
