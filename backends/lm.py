"""The ``lm`` backend: a remote tier on an ``lmcache server`` (``lm://host:port``).

Why our own server: it speaks the framed protocol of :mod:`lmcache.server.cache`, the same one
peers use to fetch chunks from each other, so a value moves as one header and the raw
payload bytes both ways, with nothing to parse in between. The server never decodes a
value; what it stores is the self-describing payload (magic, version, codec, dtype,
shape, checksums), so a reader checks what it got and a truncated or foreign value is a
miss and is deleted. Every instance that points at the same server shares its entries
(``shared = True``); the server's own capacity and eviction policy bound the total.

Why batches are pipelined: a chunk is one round trip otherwise. ``get``, ``put``,
``exists`` and ``delete`` write up to ``batch`` requests on one pooled connection and
then read the responses, which come back in order. PUT values go out as the payload's
header and body buffers (a view of the chunk's memory), never joined. A tier opens this
byte store through :class:`LMObjects`, which decodes each GET answer straight out of the
connection's reused receive buffer into pool memory, with no copy in between.

Why every call raises instead of waiting: the tier above turns an exception into a miss
and backs off, so the backend fails within ``timeout`` (connect, and each send or
receive) and never retries a request the server may have answered. Connections are
opened lazily (an engine starts while the server is down) and kept in a small pool
(``max_connections``); any error closes the connection it happened on and drops the idle
ones (after a server restart they are all dead), so the first call after the server is
back connects afresh. A pooled connection that the server closed while it sat idle (a
newcomer needed its slot) fails before any answer: the requests go once more, on a new
connection, and the call does not fail.

Why the token is never sent: each new connection runs the mutual handshake of
:mod:`lmcache.auth`; the server must prove it knows the token before this side proves
it, so an address that is not a real server of the cluster learns nothing usable and
gets no request. With ``peer_id`` (set by the peer-to-peer client to the instance id it
resolved) the server must also announce that identity, so a relay to another peer is
refused.

Options: ``url`` (required, ``lm://host[:port]``, default port 7171), ``timeout``
(seconds), ``token`` (proved on each new connection, never sent), ``peer_id`` (the
identity the server must announce), ``prefix`` (put in
front of every key on the server, to share one server between separate caches),
``batch`` (requests per round trip), ``max_connections``, ``max_value_size`` (the
largest value this client accepts from the server).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterator, Mapping, Sequence
from urllib.parse import urlsplit

from lmcache import wire as proto
from lmcache.errors import BackendError, ConfigError
from lmcache.keys import CacheKey
from lmcache.memory import MemoryObj
from lmcache.encoded import Encoded, release
from lmcache.storage import BackendContext, BytesBackend
from lmcache.wire_client import Connection

log = logging.getLogger(__name__)


def parse_url(url: Any) -> tuple[str, int]:
    """``lm://host[:port]`` -> (host, port); anything else is a config error naming ``url``."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("url", f"a server URL is required, e.g. lm://127.0.0.1:{proto.DEFAULT_PORT}; got {url!r}")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ConfigError("url", f"malformed URL {url!r}: {exc}") from None
    if parts.scheme.lower() != "lm":
        raise ConfigError("url", f"unsupported scheme {parts.scheme!r} in {url!r}; use lm://host:port")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError("url", f"{url!r}: only lm://host:port (put the token in the tier's 'token' key)")
    if not parts.hostname:
        raise ConfigError("url", f"{url!r} names no host")
    if port == 0:
        raise ConfigError("url", f"{url!r}: bad port 0")
    return parts.hostname, port or proto.DEFAULT_PORT


def _chunks(seq: Sequence[Any], n: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


class _Stale(Exception):
    """A pooled connection was closed by the server before it answered anything."""


class LMObjects(Encoded):
    """The ``lm`` store as a tier opens it: GET answers are decoded straight out of the
    connection's scratch buffer (into pool memory), with no copy of the payload bytes."""

    raw: LMBackend

    def get_native(self, keys: Sequence[str]) -> list[MemoryObj | None]:
        store = self.raw
        out: list[MemoryObj | None] = []
        try:
            for part in _chunks(keys, store.batch):
                corrupt: list[str] = []

                def consume(i: int, f: proto.Frame, data: Any, part: Sequence[str] = part) -> None:
                    if f.status != proto.OK:
                        out.append(None)
                        return
                    obj = self.decode_checked(part[i], data)  # copies out of the scratch buffer
                    if obj is None:
                        corrupt.append(part[i])
                    out.append(obj)

                store._exchange("GET", [(proto.GET, store._k(k), ()) for k in part], consume)
                if corrupt:
                    self.drop_corrupt(corrupt)
        except BaseException:
            release(out)
            raise
        return out


class LMBackend(BytesBackend):
    OPTIONS = {
        "url": None,
        "timeout": 2.0,
        "token": None,
        "peer_id": None,
        "prefix": "",
        "batch": 64,
        "max_connections": 8,
        "max_value_size": proto.DEFAULT_MAX_VALUE,
    }
    shared = True
    objects_view = LMObjects

    @classmethod
    def check_options(cls, options: Mapping[str, Any], capacity: int | None = None) -> dict[str, Any]:
        opts = super().check_options(options, capacity)
        parse_url(opts["url"])
        t = opts["timeout"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ConfigError("timeout", f"expected a positive number of seconds, got {t!r}")
        if opts["token"] is not None and (not isinstance(opts["token"], str) or not opts["token"]):
            raise ConfigError("token", "expected a non-empty string (or none)")
        if opts["peer_id"] is not None and (not isinstance(opts["peer_id"], str) or not opts["peer_id"]):
            raise ConfigError("peer_id", "expected a non-empty string (or none)")
        if not isinstance(opts["prefix"], str):
            raise ConfigError("prefix", f"expected a string, got {opts['prefix']!r}")
        for key in ("batch", "max_connections", "max_value_size"):
            v = opts[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(key, f"expected a positive integer, got {v!r}")
        return opts

    def __init__(self, context: BackendContext):
        super().__init__(context)
        self.host, self.port = parse_url(self.options["url"])
        self.timeout = float(self.options["timeout"])
        self.prefix: str = self.options["prefix"]
        self.batch: int = self.options["batch"]
        #: the wire bounds a key (prefix included) to proto.MAX_KEY bytes; a value to what
        #: this client accepts back (the server's own max_value_size may be lower)
        self.max_key_length = proto.MAX_KEY - len(self.prefix.encode())
        self.max_value_size = int(self.options["max_value_size"])
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.options["max_connections"])
        self._closed = False

    def describe(self) -> str:
        return f"lm://{self.host}:{self.port}"

    # ------------------------------------------------------------ connections
    def _exchange(self, what: str, reqs: Sequence[tuple[int, bytes, Sequence[Any]]],
                  consume: Callable[[int, proto.Frame, Any], None] | None = None) -> list[tuple[proto.Frame, Any]]:
        """Run pipelined requests on a pooled connection; any failure is a
        :class:`BackendError` naming the server, and drops the connection and the idle ones."""
        if self._closed:
            raise BackendError(f"tier {self.context.tier}: the lm backend is closed")
        if not self._slots.acquire(timeout=self.timeout):
            raise BackendError(f"tier {self.context.tier}: no free connection to {self.describe()} within {self.timeout}s")
        try:
            try:
                return self._attempt(reqs, consume)
            except _Stale:  # closed by the server while pooled: once more, on a new connection
                return self._attempt(reqs, consume, reuse=False)
        except (OSError, BackendError) as exc:
            raise BackendError(
                f"tier {self.context.tier}: {what} on {self.describe()} failed: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            self._slots.release()

    def _attempt(self, reqs: Sequence[tuple[int, bytes, Sequence[Any]]],
                 consume: Callable[[int, proto.Frame, Any], None] | None, reuse: bool = True) -> list[tuple[proto.Frame, Any]]:
        """One try of :meth:`_exchange` on a pooled connection (``reuse``) or a new one;
        :class:`_Stale` when a pooled one turns out closed before it answered anything."""
        conn: Connection | None = None
        pooled = False
        try:
            if reuse:
                with self._lock:
                    conn = self._idle.pop() if self._idle else None
                pooled = conn is not None
            answered = conn.answered if conn is not None else 0
            if conn is None:
                conn = Connection(self.host, self.port, self.timeout, self.options["token"], self.options["max_value_size"],
                                  self.options["peer_id"])
            if consume is None:
                res = conn.request(reqs)
            else:
                res = []
                for i, (f, val) in enumerate(conn.request(reqs, scratch=True)):
                    consume(i, f, val)
        except (OSError, BackendError) as exc:
            if conn is not None:
                conn.close()
            self._drop_idle()
            if pooled and conn is not None and conn.answered == answered and isinstance(exc, ConnectionError):
                raise _Stale() from exc
            raise
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        with self._lock:
            if self._closed:
                conn.close()
            else:
                self._idle.append(conn)
        return res

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def _k(self, key: str) -> bytes:
        return (self.prefix + key).encode()

    def _each(self, op: int, keys: Sequence[str]) -> list[proto.Frame]:
        out: list[proto.Frame] = []
        for part in _chunks(keys, self.batch):
            res = self._exchange(proto.OP_NAMES[op], [(op, self._k(k), ()) for k in part])
            out.extend(f for f, _ in res)
        return out

    # ------------------------------------------------------ the byte store
    def get(self, keys: Sequence[str], on_ready: Callable[[int, Any], None] | None = None) -> list[Any]:
        """The stored payload bytes of each key (``None``: missing), ``batch`` GETs per
        round trip. Each value is received into a buffer of its own (the caller owns it),
        not into the connection's scratch buffer, which only :class:`LMObjects` reads."""
        out: list[Any] = []
        for part in _chunks(keys, self.batch):
            res = self._exchange("GET", [(proto.GET, self._k(k), ()) for k in part])
            out.extend(val if f.status == proto.OK else None for f, val in res)
        return out

    def put(self, items: Sequence[tuple[str, Sequence[Any]]]) -> list[int]:
        """``batch`` PUTs per round trip, each value sent as its buffers (never joined);
        a PUT the server refuses (over its value limit) raises :class:`BackendError`.
        Returns the bytes of each value."""
        sizes: list[int] = []
        for part in _chunks(items, self.batch):
            res = self._exchange("PUT", [(proto.PUT, self._k(k), list(bufs)) for k, bufs in part])
            for f, val in res:
                self._check_put(f, val)
            sizes.extend(sum(memoryview(b).nbytes for b in bufs) for _, bufs in part)
        return sizes

    def _check_put(self, f: proto.Frame, val: Any) -> None:
        if f.status != proto.OK:
            raise BackendError(f"tier {self.context.tier}: PUT on {self.describe()} refused: "
                               f"{bytes(val).decode(errors='replace')}")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [f.status == proto.OK for f in self._each(proto.EXISTS, keys)]

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key was there (the server answers OK or NOT_FOUND)."""
        return [f.status == proto.OK for f in self._each(proto.DELETE, keys)]

    def keys(self) -> Iterator[tuple[str, int]]:
        ((f, page),) = self._exchange("LIST", [(proto.LIST, self.prefix.encode(), ())])
        try:
            entries = proto.decode_list_page(page)
        except proto.ProtocolError as exc:
            raise BackendError(f"tier {self.context.tier}: LIST on {self.describe()}: {exc}") from None
        n = len(self.prefix)
        for name, size in entries:
            key = name[n:]
            try:
                CacheKey.parse(key)
            except ValueError:
                continue  # not one of ours
            yield key, size

    def health(self) -> dict[str, Any]:
        """The server's HEALTH answer (status, used/capacity bytes, entries, ...)."""
        import json

        ((f, val),) = self._exchange("HEALTH", [(proto.HEALTH, b"", ())])
        return json.loads(bytes(val))

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._drop_idle()

