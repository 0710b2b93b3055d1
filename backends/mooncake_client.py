"""The Mooncake client's side of the ``mooncake`` backend (:mod:`lmcache.backends.mooncake`):
the master's URL and defaults, importing the client, bounded calls on worker threads, the
staging groups of a batch and the client's setup arguments."""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Mapping, Sequence

from lmcache.errors import BackendError, ConfigError, MissingDependencyError
from lmcache.units import parse_size

log = logging.getLogger("lmcache.backends.mooncake")  # the backend's log

DEFAULT_MASTER_PORT = 50051  # mooncake_master --rpc_port
DEFAULT_METADATA_PORT = 8080  # mooncake_master --http_metadata_server_port
DEFAULT_ADMIN_PORT = 9003  # mooncake_master --metrics_port (the HTTP admin server)
WORKERS = 4  # threads per backend that make client calls (and the most a stuck store holds)
QUERY_BATCH = 100  # keys per /batch_query_keys request
UPSERT_STRIPES = 64  # locks that keep one key's upserts from this process apart

#: Mooncake's error codes (mooncake-store/include/types.h), for messages
ERROR_NAMES = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND", -102: "SEGMENT_ALREADY_EXISTS", -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE (no room, or no segment mounted yet)", -300: "INVALID_VERSION",
    -400: "INVALID_KEY", -500: "WRITE_FAIL", -600: "INVALID_PARAMS (or the local buffer is full)",
    -601: "ILLEGAL_CLIENT", -700: "INVALID_WRITE", -701: "INVALID_READ", -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED", -708: "OBJECT_HAS_REPLICATION_TASK",
    -800: "TRANSFER_FAIL", -801: "CHECKSUM_MISMATCH", -900: "RPC_FAIL (master unreachable)",
    -901: "RPC_TIMEOUT",
}
OBJECT_NOT_FOUND = -704
_PROTOCOL = re.compile(r"^[a-z][a-z0-9_]*$")


class MooncakeError(BackendError):
    """A Mooncake client call returned an error code."""

    def __init__(self, what: str, code: int):
        self.code = code
        super().__init__(f"mooncake {what} failed: {code} {ERROR_NAMES.get(code, 'unknown error')}")


def parse_url(url: object) -> tuple[str, int]:
    """``mooncake://host[:port]`` -> (host, port); :class:`ConfigError` on ``url`` otherwise."""
    example = "e.g. url: mooncake://mooncake-master:50051"
    if not isinstance(url, str) or not url:
        raise ConfigError("url", f"the mooncake backend needs the master's address, {example}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "mooncake":
        raise ConfigError("url", f"expected a mooncake:// URL, got {url!r} ({example})")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError("url", f"{url!r}: only mooncake://host[:port] is understood ({example})")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError("url", f"{url!r} has an invalid port ({example})") from None
    host = parts.hostname
    if not host:
        raise ConfigError("url", f"{url!r} names no host ({example})")
    return host, port if port is not None else DEFAULT_MASTER_PORT


def _http_url(key: str, value: object, example: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(key, f"expected a URL such as {example}, got {value!r}")
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(key, f"expected an http:// URL such as {example}, got {value!r}")
    try:
        parts.port
    except ValueError:
        raise ConfigError(key, f"{value!r} has an invalid port") from None
    return value


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def import_client() -> Any:
    """The ``mooncake.store`` module, or :class:`MissingDependencyError` saying what to
    install (the wheel, or Debian's ``libibverbs1``, which it needs even for TCP)."""
    try:
        import mooncake.store as store
    except ModuleNotFoundError as exc:
        raise MissingDependencyError(
            f"backend 'mooncake' needs the Mooncake client ({exc}); install it with: "
            "pip install 'lmcache[mooncake]' (mooncake-transfer-engine-non-cuda; "
            "mooncake-transfer-engine on CUDA hosts)"
        ) from exc
    except ImportError as exc:
        hint = (
            "; install libibverbs1 (apt-get install libibverbs1), which the client needs even for protocol tcp"
            if "libibverbs" in str(exc) else ""
        )
        raise MissingDependencyError(f"backend 'mooncake': the Mooncake client cannot be loaded: {exc}{hint}") from exc
    return store


class BoundedCalls:
    """Make blocking client calls on worker threads, waiting at most ``timeout`` each.

    A call that overruns raises :class:`TimeoutError` and keeps running in the
    background; until it returns, every new call raises :class:`TimeoutError` at once
    (so a hung store holds at most one worker, and waiting callers never pile up).
    """

    def __init__(self, timeout: float, workers: int = WORKERS, name: str = "lmcache-mooncake"):
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._stuck: tuple[str, float, Future] | None = None

    def run(self, what: str, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """``fn(*args)`` on a worker, waited for ``timeout`` (default: the configured one)."""
        timeout = self.timeout if timeout is None else max(timeout, 0.001)
        with self._lock:
            stuck = self._stuck
            if stuck is not None:
                if not stuck[2].done():
                    raise TimeoutError(
                        f"mooncake {stuck[0]} has not returned for {time.monotonic() - stuck[1]:.1f}s "
                        f"(store unreachable or overloaded); not starting {what}"
                    )
                self._stuck = None
            fut = self._pool.submit(fn, *args)
        try:
            return fut.result(timeout)
        except TimeoutError:
            if fut.cancel():  # still queued behind other callers' calls: nothing is stuck
                raise TimeoutError(f"mooncake {what}: no worker free within {timeout:.3g}s") from None
            with self._lock:
                if self._stuck is None or self._stuck[2].done():
                    self._stuck = (what, time.monotonic(), fut)
            raise TimeoutError(f"mooncake {what} did not return within {timeout:.3g}s") from None

    def shutdown(self) -> None:
        """Stop taking calls; what runs or was submitted last still finishes."""
        self._pool.shutdown(wait=False)


def _view(handle: Any) -> memoryview:
    """The bytes of a client ``BufferHandle`` (valid while the handle lives), uncopied."""
    n = handle.size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(handle.ptr())).cast("B")


def _groups(sizes: Sequence[int], budget: int) -> Iterator[list[int]]:
    """Indices in consecutive groups whose sizes sum to at most ``budget`` (a larger
    single item gets a group of its own)."""
    group: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if group and total + n > budget:
            yield group
            group, total = [], 0
        group.append(i)
        total += n
    if group:
        yield group


def _setup_args(options: Mapping[str, Any], *, segment: int | None = None) -> tuple:
    """Arguments of ``MooncakeDistributedStore.setup`` for checked ``options``."""
    host, port = parse_url(options["url"])
    local = options["local_hostname"] or _local_address(host, port)
    metadata = options["metadata_server"] or f"http://{_url_host(host)}:{DEFAULT_METADATA_PORT}/metadata"
    return (
        local, metadata,
        parse_size(options["global_segment_size"]) if segment is None else segment,
        parse_size(options["local_buffer_size"]),
        options["protocol"], options["device_name"], f"{_url_host(host)}:{port}",
    )


def _local_address(host: str, port: int) -> str:
    """The address other clients reach this one at: loopback for a master on loopback,
    else the local address the kernel routes to the master from (a UDP "connect" sends
    nothing)."""
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass
    try:
        fam = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(fam[0], socket.SOCK_DGRAM) as s:
            s.connect(fam[4])
            return s.getsockname()[0]
    except OSError as exc:
        raise ConnectionError(f"cannot resolve or route to mooncake master {host}:{port}: {exc}") from None


def _reachable(host: str, port: int, timeout: float, what: str) -> None:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except OSError as exc:
        raise ConnectionError(f"mooncake {what} {host}:{port} is unreachable: {exc}") from None
