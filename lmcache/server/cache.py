"""``lmcache server``: a cache server speaking one framed binary protocol over TCP.

Why our own server rather than only Redis: peers fetch chunks from each other (P2P) and
prefill instances push KV to decode instances over a protocol that must move tens of MiB
per chunk at close to the speed of the socket, with no text encoding of values and
nothing that a malformed peer can use to make a process allocate without bound. The
same frames serve the ``lm`` backend (``backends/lm.py``), which uses this server as a
shared remote tier.

The frames, and why batches are pipelined rather than framed, are :mod:`lmcache.wire`'s.

Why malformed input closes the connection: after a bad header the stream cannot be
resynchronised. The server checks magic, version, op, both lengths and the op's value
rules before it allocates anything, so a declared length of 2**40 costs nothing; it
answers FATAL with a message where it can and closes the connection; other connections
and the server carry on. A request that is well-formed but cannot be served (a value
larger than the whole capacity) is an ERROR response and the connection stays open.

When a token is set, a connection starts with the mutual token handshake of
:mod:`lmcache.auth` (AUTH frames; the server proves it knows the token before the
client proves it, and the token itself never crosses the wire); anything else is
answered FATAL and closed as soon as its header is read, before any of its key or
value: an unauthenticated peer can make the server hold no more than one AUTH frame (at
most 4 KiB). With ``legacy_auth`` (``lmcache server``'s default, for clients older than
the handshake) an AUTH frame whose value is the token itself is accepted too; peer
endpoints refuse it.

Why idle sockets cannot keep clients out: a connection that has not authenticated (without
a token: that has sent no complete frame) must do so within ``auth_timeout``; such
connections have a budget of their own (``max_unauthenticated``) in which a newcomer
closes the oldest (from the address holding the most) rather than being refused, and with
``max_connections`` taken a newcomer closes the connection idle the longest
(:mod:`lmcache.server.cache_slots`).
"""

from __future__ import annotations

import hmac
import json
import logging
import signal
import socket
import struct
import threading
import time
from typing import Any, Callable

from .. import auth
from .cache_slots import Slot, Slots, shut as _shut
from .cache_store import ENTRY_OVERHEAD, ByteStore, ServedStore, load_policy  # noqa: F401 (re-exported)
from ..wire import (
    AUTH, DEFAULT_MAX_VALUE, DELETE, ERROR, EXISTS, FATAL, Frame, GET, HEADER_SIZE, HEALTH,
    LAZY_ALLOC, LIST, LIST_PAGE, MAGIC, MORE, NOT_FOUND, OK, PUT, ProtocolError, VERSION, alloc,
    check_request, encode, encode_list_page, pack_header, parse_header, recv_into_exact, send_buffers,
)

log = logging.getLogger(__name__)

#: queued responses are sent once this many bytes wait (or before the server waits for input)
FLUSH_BYTES = 4 << 20
DEFAULT_MAX_CONNECTIONS = 256
#: seconds an unauthenticated connection has to send its AUTH frame (with a token set)
DEFAULT_AUTH_TIMEOUT = 5.0
#: connections that may wait for their AUTH frame (or first frame, without a token) at once
DEFAULT_MAX_UNAUTHENTICATED = 32
#: pauses before each try to admit a connection when every slot is busy (then it is refused)
ADMIT_WAITS = (0.0, *(0.005,) * 10)
class _ConnIO:
    """Buffered reads and coalesced writes on one server connection.

    Why: a pipelined batch of small requests would otherwise cost two or three ``recv``
    calls and one ``sendmsg`` per request. Requests are parsed out of one receive buffer
    (values at least :data:`LAZY_ALLOC` large are received straight into their own
    buffer), and responses are queued (references to stored values, never copies) and
    sent together just before the connection would wait for more input, or once
    :data:`FLUSH_BYTES` are queued."""

    BUF = 256 << 10

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray(self.BUF)
        self.view = memoryview(self.buf)
        self.start = self.end = 0
        self.out: list[Any] = []
        self.out_bytes = 0
        #: called once the queued buffers are out (a store's ``release``)
        self.after: list[Callable[[], None]] = []
        #: the connection's slot while it is pending: marked stuck while it waits for input
        self.pending: Slot | None = None

    def _fill(self) -> int:
        """Receive more input (flushing queued responses first: we may wait)."""
        self.flush()
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):  # compact
            n = self.end - self.start
            self.buf[:n] = self.buf[self.start : self.end]
            self.start, self.end = 0, n
        s = self.pending
        if s is not None:
            s.stuck = True
        r = self.sock.recv_into(self.view[self.end :])
        if s is not None:
            s.stuck = False
        self.end += r
        return r

    def wait(self, n: int) -> bool:
        """Until ``n`` (<= BUF) bytes are buffered; False on EOF with nothing buffered."""
        while self.end - self.start < n:
            if self._fill() == 0:
                if self.end == self.start:
                    return False
                raise ConnectionError("connection closed in the middle of a frame")
        return True

    def take(self, n: int) -> bytearray | memoryview:
        """The next ``n`` bytes as a buffer of their own."""
        have = self.end - self.start
        if n >= LAZY_ALLOC or n > self.BUF:
            out = alloc(n)
            mv = memoryview(out)
            k = min(have, n)
            mv[:k] = self.view[self.start : self.start + k]
            self.start += k
            if k < n:
                self.flush()
                if self.pending is not None:  # a first frame without a token, stalled or slow
                    self.pending.stuck = True
                recv_into_exact(self.sock, mv[k:])
            return out
        if not self.wait(n):
            raise ConnectionError("connection closed in the middle of a frame")
        out = bytearray(self.view[self.start : self.start + n])
        self.start += n
        return out

    def send(self, *bufs: Any, after: Callable[[], None] | None = None) -> None:
        for b in bufs:
            self.out.append(b)
            self.out_bytes += len(b)
        if after is not None:
            self.after.append(after)
        if self.out_bytes >= FLUSH_BYTES or len(self.out) >= 256:
            self.flush()

    def flush(self) -> None:
        try:
            if self.out:
                out, self.out, self.out_bytes = self.out, [], 0
                send_buffers(self.sock, out)
        finally:
            self.release()

    def release(self) -> None:
        """Run the ``after`` callbacks (also when sending failed: the buffers are dropped)."""
        while self.after:
            fn = self.after.pop()
            try:
                fn()
            except Exception:  # pragma: no cover - a store's bug must not kill the connection
                log.exception("lmcache server: releasing a response buffer failed")


# ------------------------------------------------------------------ server
class CacheServer:
    """The server: one thread per connection, requests answered in order.

    ``port=0`` picks a free port (see :attr:`address` after :meth:`bind`). ``token``
    (optional) must be the value of each connection's first frame, AUTH.
    ``max_value_size`` bounds every frame's value, so what one connection can make the
    server allocate is bounded; ``max_connections`` bounds the connections (one more
    closes one that waits to authenticate or is idle, see :mod:`lmcache.server.cache_slots`,
    and is answered FATAL and closed only when every connection is busy)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        capacity: int = 4 << 30,
        policy: str = "lru",
        token: str | None = None,
        max_value_size: int = DEFAULT_MAX_VALUE,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        store: ServedStore | None = None,
        name: str = "lmcache server",
        auth_timeout: float = DEFAULT_AUTH_TIMEOUT,
        max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
        identity: str = "",
        legacy_auth: bool = True,
    ):
        """``store``: serve this :class:`ServedStore` instead of a new :class:`ByteStore` of
        ``capacity`` bytes evicting with ``policy`` (a peer endpoint serves its engine's
        tiers); ``name`` is how logs call this server. ``identity`` is the name the
        handshake announces and both proofs cover (a peer endpoint's instance id);
        ``legacy_auth`` also accepts the token sent in clear (clients that predate the
        handshake)."""
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if max_value_size < 1:
            raise ValueError(f"max value size must be positive, got {max_value_size}")
        if max_connections < 1:
            raise ValueError(f"max connections must be positive, got {max_connections}")
        if not auth_timeout > 0 or max_unauthenticated < 1:
            raise ValueError("auth timeout and max unauthenticated connections must be positive")
        self.host, self.port = host, port
        self.store: ServedStore = store if store is not None else ByteStore(capacity, load_policy(policy))
        self.policy_name = policy if store is None else None
        self.name = name
        self.token = token.encode() if token else None
        self.identity = identity.encode()
        if len(self.identity) > auth.MAX_IDENTITY:
            raise ValueError(f"identity of {len(self.identity)} bytes is over {auth.MAX_IDENTITY}")
        self.legacy_auth = legacy_auth
        self.max_value_size = max_value_size
        self.max_connections = max_connections
        self.auth_timeout = float(auth_timeout)
        self.max_unauthenticated = max_unauthenticated
        self._slots = Slots(max_connections, max_unauthenticated)
        self.started = time.time()
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.protocol_errors = 0
        self.refused = 0

    @property
    def address(self) -> tuple[str, int]:
        assert self._sock is not None, "bind() first"
        host, port = self._sock.getsockname()[:2]
        return host, port

    def bind(self) -> CacheServer:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, self.port))
        s.listen(128)
        self._sock = s
        return self

    def serve_forever(self) -> None:
        if self._sock is None:
            self.bind()
        assert self._sock is not None
        self._sock.settimeout(0.2)  # to notice close()
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    break
                raise
            # a timer closes the connection unless it authenticated (or, without a token,
            # sent a complete frame) within auth_timeout
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            source = str(peer[0]) if isinstance(peer, tuple) else ""
            for wait in ADMIT_WAITS:  # every connection busy: one may be about to go idle
                if wait:
                    time.sleep(wait)
                slot, victims = self._slots.admit(conn, source)
                for victim, why in victims:
                    if why:  # one waiting to authenticate is told; an idle established one just closes
                        self._fatal(victim.sock, 0, 0, why, wait=0.0)  # never wait on the accepting thread
                    _shut(victim.sock)
                if slot is not None:
                    break
            if slot is None:
                self.refused += 1
                self._fatal(conn, 0, 0, f"too many connections (limit {self.max_connections}), every one busy")
                conn.close()
                continue
            threading.Thread(target=self._serve_conn, args=(slot,), daemon=True, name="lmcache-server-conn").start()

    def start(self) -> CacheServer:
        """Serve in a background thread (tests, embedding)."""
        if self._sock is None:
            self.bind()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True, name="lmcache-server")
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            self._sock.close()
        for c in self._slots.sockets():
            _shut(c)

    def __enter__(self) -> CacheServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------- one connection
    def _fatal(self, conn: socket.socket, op: int, seq: int, message: str, wait: float = 1.0) -> None:
        """Best effort: tell the peer why its connection is being closed (waiting at most ``wait``)."""
        msg = message.encode()[:1024]
        try:
            conn.settimeout(wait)
            conn.sendall(encode(op, seq, b"", msg, status=FATAL))
        except OSError:
            pass

    def _serve_conn(self, slot: Slot) -> None:
        conn = slot.sock
        io = _ConnIO(conn)
        io.pending = slot
        authed: list[Any] = [self.token is None]  # [done, handshake state (nc, ns) once the hello came]

        # the whole AUTH frame (without a token: the first frame) within auth_timeout,
        # however slowly its bytes come
        def expire() -> None:
            if slot.pending and not slot.evicted:
                what = "AUTH frame" if self.token is not None else "complete frame"
                log.info("%s: closing a connection that sent no %s within %gs", self.name, what, self.auth_timeout)
                self._fatal(conn, 0, 0, f"no {what} within {self.auth_timeout:g}s")
                _shut(conn)

        timer = threading.Timer(self.auth_timeout, expire)
        timer.daemon = True
        timer.start()
        try:
            self._loop(slot, io, authed)
        except ProtocolError as exc:
            self.protocol_errors += 1
            log.info("%s: closing a connection: %s", self.name, exc)
        except (ConnectionError, OSError):
            pass
        except Exception:  # pragma: no cover - never let one connection take the server down
            log.exception("%s: unexpected error on a connection", self.name)
        finally:
            timer.cancel()
            io.release()
            self._slots.release(slot)
            try:
                conn.close()
            except OSError:
                pass

    def _loop(self, slot: Slot, io: _ConnIO, authed: list[Any]) -> None:
        conn = slot.sock
        while True:
            # the first byte may take forever (an idle pooled connection; once every slot is
            # taken, the one idle the longest is closed); EOF here is a clean close
            if io.start == io.end and not slot.pending:
                io.flush()  # nothing unanswered once idle: closing it loses no response
                slot.idle_since = time.monotonic()
            if not io.wait(HEADER_SIZE):
                return
            slot.idle_since = None
            hdr = io.take(HEADER_SIZE)
            try:
                f = parse_header(hdr, self.max_value_size)
                check_request(f)
            except ProtocolError as exc:
                op, seq = (hdr[5], struct.unpack_from("<I", hdr, 8)[0]) if hdr[:4] == MAGIC else (0, 0)
                io.flush()
                self._fatal(conn, op, seq, str(exc))
                raise
            if not authed[0] and f.op != AUTH:  # refused before a byte of its key or value is read
                why = "authentication required: the first frame must be AUTH"
                io.flush()
                self._fatal(conn, f.op, f.seq, why)
                raise ProtocolError(why)
            key_b = io.take(f.key_len) if f.key_len else b""
            try:
                key = bytes(key_b).decode()
            except UnicodeDecodeError:
                io.flush()
                self._fatal(conn, f.op, f.seq, "key is not UTF-8")
                raise ProtocolError("key is not UTF-8") from None
            value = io.take(f.value_len) if f.value_len else bytearray()
            if not authed[0]:
                answer = self._auth_step(authed, bytes(value))
                if answer is not None:
                    if authed[0]:
                        self._slots.established(slot)
                        io.pending = None
                    io.send(encode(AUTH, f.seq, b"", answer))
                    continue
                why = "wrong token"
                io.flush()
                self._fatal(conn, f.op, f.seq, why)
                raise ProtocolError(why)
            self._handle(io, f, key, value)
            if io.pending is not None:  # without a token: its first complete frame
                self._slots.established(slot)
                io.pending = None

    def _auth_step(self, authed: list[Any], value: bytes) -> bytes | None:
        """One AUTH frame of an unauthenticated connection: the value to answer OK with
        (``authed[0]`` set once the client proved it knows the token), or ``None`` to
        refuse it. See :mod:`lmcache.auth` for the handshake."""
        assert self.token is not None
        hs = authed[1] if len(authed) > 1 else None
        n = len(auth.HELLO) + auth.NONCE
        if len(value) != n or not value.startswith(auth.HELLO):
            if hs is None and self.legacy_auth and hmac.compare_digest(value, self.token):
                authed[0] = True  # a client that predates the handshake: the token itself
                return b""
            return None
        if hs is None:  # the hello: prove we know the token, bound to the client's nonce
            nc, ns = value[len(auth.HELLO):], auth.nonce()
            authed.append((nc, ns))
            return ns + auth.proof(self.token, "server", nc, ns, self.identity) + self.identity
        nc, ns = hs
        if not hmac.compare_digest(value[len(auth.HELLO):], auth.proof(self.token, "client", nc, ns, self.identity)):
            return None
        authed[0] = True
        return b""

    def _handle(self, io: _ConnIO, f: Frame, key: str, value: bytearray | memoryview) -> None:
        op, seq = f.op, f.seq
        if op == GET:
            v = self.store.get_one(key)
            if v is None:
                io.send(pack_header(GET, seq, status=NOT_FOUND))
            else:
                release = getattr(self.store, "release", None)
                after = (lambda: release(v)) if release is not None else None
                bufs = v if isinstance(v, (list, tuple)) else (v,)
                io.send(pack_header(GET, seq, b"", sum(len(b) for b in bufs)), *bufs, after=after)
        elif op == PUT:
            if self.store.put_one(key, value):
                io.send(pack_header(PUT, seq))
            else:
                msg = self.store.refusal(value)[:4096]
                io.send(encode(PUT, seq, b"", msg.encode(), status=ERROR))
        elif op == EXISTS:
            io.send(pack_header(EXISTS, seq, status=OK if self.store.exists_one(key) else NOT_FOUND))
        elif op == DELETE:
            io.send(pack_header(DELETE, seq, status=OK if self.store.delete_one(key) else NOT_FOUND))
        elif op == LIST:
            entries = self.store.snapshot(key)
            for i in range(0, max(len(entries), 1), LIST_PAGE):
                part = entries[i : i + LIST_PAGE]
                page = encode_list_page([(k.encode(), n) for k, n in part])
                more = MORE if i + LIST_PAGE < len(entries) else 0
                io.send(pack_header(LIST, seq, b"", len(page), flags=more), page)
        elif op == HEALTH:
            body = json.dumps(self.health(), separators=(",", ":")).encode()
            io.send(encode(HEALTH, seq, b"", body))
        elif op == AUTH:  # no token configured, or already authenticated: nothing to check
            io.send(pack_header(AUTH, seq))

    def health(self) -> dict[str, Any]:
        n = len(self._slots)
        return {
            "status": "ok",
            "protocol": VERSION,
            "policy": self.policy_name,
            **self.store.stats(),
            "max_value_size": self.max_value_size,
            "connections": n,
            "connections_refused": self.refused,
            "connections_evicted": self._slots.stats["evicted_pending"] + self._slots.stats["evicted_idle"],
            "protocol_errors": self.protocol_errors,
            "uptime_s": round(time.time() - self.started, 3),
        }


# ------------------------------------------------------------- entry point
def exposure_warning(host: str, token: str | None) -> str | None:
    """What ``lmcache server`` says on stderr at start when it listens beyond loopback
    with no token (anyone who reaches the port may read, overwrite and delete every
    entry); ``None`` on loopback or with a token. A host name other than ``localhost``
    counts as beyond loopback."""
    import ipaddress

    if token:
        return None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return (f"WARNING: lmcache server listens on {host}, beyond loopback, with NO TOKEN: anyone who can reach "
            "this port can read, overwrite and delete every entry. Set --token (or $LMCACHE_SERVER_TOKEN), "
            "or bind 127.0.0.1.")


def _stderr(message: str) -> None:
    import sys

    print(message, file=sys.stderr, flush=True)


def run(
    host: str,
    port: int,
    *,
    capacity: int,
    policy: str,
    token: str | None,
    max_value_size: int,
    max_connections: int,
    announce: Callable[[str], None] = print,
    auth_timeout: float = DEFAULT_AUTH_TIMEOUT,
    warn: Callable[[str], None] = _stderr,
    max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
) -> None:
    """Bind, print ``LISTENING host:port`` once ready, serve until SIGTERM or SIGINT.
    Listening beyond loopback with no token is said through ``warn`` (stderr) first
    (:func:`exposure_warning`)."""
    server = CacheServer(host, port, capacity=capacity, policy=policy, token=token,
                         max_value_size=max_value_size, max_connections=max_connections,
                         auth_timeout=auth_timeout, max_unauthenticated=max_unauthenticated).bind()
    exposed = exposure_warning(host, token)
    if exposed is not None:
        warn(exposed)

    def stop(signum: int, frame: Any) -> None:
        server._stop.set()

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        h, p = server.address
        announce(f"LISTENING {h}:{p}")
        server.serve_forever()
    finally:
        server.close()
        for s, handler in old.items():
            signal.signal(s, handler)
