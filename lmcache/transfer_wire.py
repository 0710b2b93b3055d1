"""The transfer endpoints' control protocol (:mod:`lmcache.transfer`): its constants and
errors, length-prefixed JSON frames after the token handshake of :mod:`lmcache.auth`, the
client :class:`Connection` and the :class:`ControlServer` that dispatches each message to
an endpoint. Every frame's length is bounded before it is read; nothing is pickled."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import socket
import struct
import threading
import time
from typing import Any, Callable, Iterable, Sequence


from . import auth
from .errors import LMCacheError
from .wire import recv_into_exact, send_buffers

log = logging.getLogger("lmcache.transfer")

#: channel names of config ``transfer_channel`` (LMCache's key)
CHANNELS = ("nixl", "tcp")
MAGIC = b"LMCT"
VERSION = 1
_HDR = struct.Struct("<4sBBHI")  # magic, version, kind, reserved, body length
KIND_AUTH, KIND_MSG = 1, 2
#: the largest control message (JSON) either side reads
MAX_MSG = 4 << 20
#: the most chunks one request may carry
MAX_CHUNKS = 8192
MAX_KEY = 1024
DEFAULT_PORT = 7300  # production-stack's nixlPeerInitPort


class TransferError(LMCacheError):
    """A transfer failed (peer down, timeout, refused handshake, bad answer)."""


class TransferRefused(TransferError):
    """The receiver had no room within the sender's bounded wait, or refused the request."""


class ChannelUnavailable(LMCacheError):
    """The configured channel cannot run here (its package is missing or unusable)."""


# ------------------------------------------------------------------ control protocol
def _send_frame(sock: socket.socket, kind: int, body: bytes, extra: Sequence[Any] = ()) -> None:
    send_buffers(sock, [_HDR.pack(MAGIC, VERSION, kind, 0, len(body)), body, *extra])


def _recv_frame(sock: socket.socket, limit: int) -> tuple[int, bytes]:
    hdr = bytearray(_HDR.size)
    recv_into_exact(sock, memoryview(hdr))
    magic, version, kind, _, n = _HDR.unpack(hdr)
    if magic != MAGIC:
        raise TransferError(f"bad magic {bytes(magic)!r}: not an lmcache transfer endpoint")
    if version != VERSION:
        raise TransferError(f"transfer protocol version {version}, this side speaks {VERSION}")
    if n > limit:
        raise TransferError(f"a frame of {n} bytes exceeds the limit of {limit}")
    body = bytearray(n)
    recv_into_exact(sock, memoryview(body))
    return kind, bytes(body)


def _send_msg(sock: socket.socket, msg: dict[str, Any], extra: Sequence[Any] = ()) -> None:
    _send_frame(sock, KIND_MSG, json.dumps(msg, separators=(",", ":")).encode(), extra)


def _recv_msg(sock: socket.socket) -> dict[str, Any]:
    kind, body = _recv_frame(sock, MAX_MSG)
    if kind != KIND_MSG:
        raise TransferError(f"expected a message frame, got kind {kind}")
    try:
        msg = json.loads(body)
    except ValueError:
        raise TransferError("a control message is not JSON") from None
    if not isinstance(msg, dict):
        raise TransferError("a control message is not a JSON object")
    return msg


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def _unb64(s: Any, limit: int = MAX_MSG) -> bytes | None:
    if s is None:
        return None
    if not isinstance(s, str) or len(s) > limit:
        raise ValueError("malformed binary field")
    return base64.b64decode(s, validate=True)


_nice_refused = False


def raise_priority(nice: int) -> int | None:
    """Lower the calling thread's nice value by ``-nice`` (``nice`` < 0; Linux, where the
    process may: root or CAP_SYS_NICE). Returns the value before, ``None`` when nothing
    changed (``nice`` >= 0, not permitted: one line at info per process, then silence).
    A transfer thread copies a request's KV while the engine computes on the same cores:
    at the engine's priority it gets a fair share of a core and a push takes longer
    (docs/benchmarks.md#prefilldecode-lmcache-bench-pd); threads it starts inherit the value."""
    global _nice_refused
    if nice >= 0 or not hasattr(os, "setpriority"):
        return None
    tid = threading.get_native_id()
    try:
        before = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, max(-20, before + nice))
        return before
    except OSError as exc:
        if not _nice_refused:
            _nice_refused = True
            log.info("transfer threads keep the engine's priority (transfer.thread_nice %d not permitted: %s)",
                     nice, exc.strerror or exc)
        return None


@contextlib.contextmanager
def raised_priority(nice: int):
    """:func:`raise_priority` for the body of a ``with`` block, then the value before."""
    before = raise_priority(nice)
    try:
        yield
    finally:
        if before is not None:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), before)


class Connection:
    """One authenticated control connection to a peer endpoint (client side)."""

    def __init__(self, url: str, token: str | None, timeout: float, identity: str | None = None):
        host, port = split_url(url)
        self.url = url
        self.timeout = timeout
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise TransferError(f"cannot reach transfer endpoint {url}: {exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peer_identity = ""
        try:
            self._handshake((token or "").encode(), identity)
        except BaseException:
            self.close()
            raise
        self.state: dict[str, Any] = {}  # what a channel keeps per connection (the peer's agent name)

    def _handshake(self, token: bytes, identity: str | None) -> None:
        nc = auth.nonce()
        try:
            _send_frame(self.sock, KIND_AUTH, auth.HELLO + nc)
            kind, body = _recv_frame(self.sock, 4096)
        except (OSError, ConnectionError) as exc:
            raise TransferError(f"transfer endpoint {self.url}: handshake failed: {exc}") from None
        if kind != KIND_AUTH or len(body) < auth.NONCE + 32:
            raise TransferError(f"transfer endpoint {self.url}: handshake refused")
        ns, proof, ident = body[: auth.NONCE], body[auth.NONCE : auth.NONCE + 32], body[auth.NONCE + 32 :]
        import hmac

        if not hmac.compare_digest(proof, auth.proof(token, "server", nc, ns, ident)):
            raise TransferError(f"transfer endpoint {self.url} does not know the transfer token")
        if identity is not None and ident.decode(errors="replace") != identity:
            raise TransferError(f"transfer endpoint {self.url} is {ident[:100]!r}, not {identity!r}")
        self.peer_identity = ident.decode(errors="replace")
        _send_frame(self.sock, KIND_AUTH, auth.HELLO + auth.proof(token, "client", nc, ns, ident))
        kind, body = _recv_frame(self.sock, 4096)
        if kind != KIND_AUTH or body != b"OK":
            raise TransferError(f"transfer endpoint {self.url} refused this side's token proof")

    def call(self, msg: dict[str, Any], extra: Sequence[Any] = (), timeout: float | None = None) -> dict[str, Any]:
        """Send ``msg`` (then the raw buffers ``extra``) and return the answer; an answer
        ``{"ok": false}`` raises :class:`TransferRefused` (``full``) or :class:`TransferError`."""
        self.sock.settimeout(self.timeout if timeout is None else timeout)
        try:
            _send_msg(self.sock, msg, extra)
            r = _recv_msg(self.sock)
        except (OSError, ConnectionError) as exc:
            self.close()
            raise TransferError(f"transfer endpoint {self.url}: {msg.get('op')} failed: {exc}") from None
        except TransferError:
            self.close()
            raise
        if not r.get("ok"):
            why = str(r.get("error", "refused"))[:1000]
            if r.get("full") or r.get("refused"):
                raise TransferRefused(why)
            raise TransferError(f"transfer endpoint {self.url}: {msg.get('op')}: {why}")
        return r

    def send(self, msg: dict[str, Any], extra: Sequence[Any] = ()) -> None:
        """Send without waiting for an answer."""
        self.sock.settimeout(self.timeout)
        try:
            _send_msg(self.sock, msg, extra)
        except OSError as exc:
            self.close()
            raise TransferError(f"transfer endpoint {self.url}: {msg.get('op')} failed: {exc}") from None

    def recv_into(self, views: Iterable[memoryview], timeout: float | None = None) -> None:
        self.sock.settimeout(self.timeout if timeout is None else timeout)
        try:
            for v in views:
                recv_into_exact(self.sock, v)
        except (OSError, ConnectionError) as exc:
            self.close()
            raise TransferError(f"transfer endpoint {self.url}: receiving chunk bytes failed: {exc}") from None

    @property
    def closed(self) -> bool:
        return self.sock.fileno() < 0

    def stale(self) -> bool:
        """Whether the peer closed this idle connection (readable with nothing asked: EOF)."""
        import select

        try:
            return bool(select.select([self.sock], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


_BOOT: list[str | None] = []


def boot_id() -> str | None:
    """This kernel's boot id (``/proc/sys/kernel/random/boot_id``), ``None`` where it cannot
    be read. Two endpoints that announce the same one share ``time.monotonic()``'s clock
    (CLOCK_MONOTONIC is one clock per boot), so a receiver's monotonic stamp can be set
    against the sender's: a push's time until the receiver is ready, measured on one host."""
    if not _BOOT:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
                _BOOT.append(f.read(64).strip() or None)
        except OSError:
            _BOOT.append(None)
    return _BOOT[0]


def same_clock(peer_boot: Any) -> bool:
    """Whether a peer announcing ``peer_boot`` in its hello shares this side's monotonic clock."""
    mine = boot_id()
    return mine is not None and isinstance(peer_boot, str) and peer_boot == mine


def split_url(url: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``; an optional ``lmct://``) -> (host, port)."""
    u = url.split("://", 1)[1] if "://" in url else url
    host, sep, port = u.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{url[:100]!r} is not host:port")
    return host.strip("[]"), int(port)


class _ServerConn:
    """The server side of one control connection (what handlers may keep per peer)."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self.state: dict[str, Any] = {}

    def send(self, msg: dict[str, Any], extra: Sequence[Any] = ()) -> None:
        _send_msg(self.sock, msg, extra)

    def recv_into(self, views: Iterable[memoryview]) -> None:
        for v in views:
            recv_into_exact(self.sock, v)


class ControlServer:
    """The control endpoint: one thread per connection, the handshake first, then JSON
    requests answered in order by ``handler(conn, msg) -> dict | None`` (``None``: the
    handler answered itself, or the op takes no answer). ``on_close(conn)`` runs when a
    connection ends."""

    def __init__(self, host: str, port: int, token: str | None, identity: str,
                 handler: Callable[[_ServerConn, dict[str, Any]], dict[str, Any] | None],
                 on_close: Callable[[_ServerConn], None] = lambda c: None, *, auth_timeout: float = 5.0,
                 idle_timeout: float = 600.0, max_connections: int = 64, thread_nice: int = 0):
        self.thread_nice = thread_nice  # of the accepting thread, and so of every connection's thread
        self.token = (token or "").encode()
        self.identity = identity.encode()[: auth.MAX_IDENTITY]
        self.handler, self.on_close = handler, on_close
        self.auth_timeout, self.idle_timeout = auth_timeout, idle_timeout
        self.max_connections = max_connections
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(64)
        self._sock = s
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.refused = 0
        self._thread = threading.Thread(target=self._accept, daemon=True, name="lmcache-transfer-ctl")
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._sock.getsockname()[:2]

    def _accept(self) -> None:
        raise_priority(self.thread_nice)
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()  # blocks: costs nothing while idle
            except OSError:
                return
            with self._lock:
                if len(self._conns) >= self.max_connections:
                    self.refused += 1
                    conn.close()
                    continue
                self._conns.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, f"{peer[0]}:{peer[1]}"), daemon=True,
                             name="lmcache-transfer-conn").start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        c = _ServerConn(sock, peer)
        try:
            sock.settimeout(self.auth_timeout)  # the whole handshake, however slowly it comes
            deadline = time.monotonic() + self.auth_timeout
            if not self._handshake(sock, deadline):
                return
            while not self._stop.is_set():
                sock.settimeout(self.idle_timeout)
                try:
                    msg = _recv_msg(sock)
                except TransferError as exc:
                    log.info("transfer endpoint: closing a connection from %s: %s", peer, exc)
                    return
                try:
                    answer = self.handler(c, msg)
                except TransferRefused as exc:
                    answer = {"ok": False, "refused": True, "error": str(exc)}
                except (TransferError, ValueError, KeyError, TypeError) as exc:
                    answer = {"ok": False, "error": str(exc) or type(exc).__name__}
                if answer is not None:
                    sock.settimeout(self.idle_timeout)
                    _send_msg(sock, answer)
        except (OSError, ConnectionError):
            pass
        except Exception:  # pragma: no cover - one connection never takes the endpoint down
            log.exception("transfer endpoint: unexpected error on a connection from %s", peer)
        finally:
            try:
                self.on_close(c)
            finally:
                with self._lock:
                    self._conns.discard(sock)
                try:
                    sock.close()
                except OSError:
                    pass

    def _handshake(self, sock: socket.socket, deadline: float) -> bool:
        import hmac

        kind, body = _recv_frame(sock, 4096)
        if kind != KIND_AUTH or len(body) != len(auth.HELLO) + auth.NONCE or not body.startswith(auth.HELLO):
            return False
        nc, ns = body[len(auth.HELLO):], auth.nonce()
        _send_frame(sock, KIND_AUTH, ns + auth.proof(self.token, "server", nc, ns, self.identity) + self.identity)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        kind, body = _recv_frame(sock, 4096)
        want = auth.HELLO + auth.proof(self.token, "client", nc, ns, self.identity)
        if kind != KIND_AUTH or not hmac.compare_digest(body, want):
            log.info("transfer endpoint: a peer failed the token handshake")
            return False
        _send_frame(sock, KIND_AUTH, b"OK")
        return True

    def close(self) -> None:
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


