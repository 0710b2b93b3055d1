"""The lookup channel: an engine service that answers lookups from another process, the
one between vLLM's scheduler and its workers' cache engines.

vLLM runs the scheduler (EngineCore) and the model workers in different processes (its
multiprocess executor, always with tensor parallelism). The KV lives where it is stored:
in each worker's :class:`~lmcache.engine.CacheEngine`, whose CPU tier is memory of that
worker process. So the scheduler-role connector does not look at tiers itself; it asks the
workers. Each worker-role connector opens its engine with ``lookup_socket`` set, and the
engine's ``lookup`` service (:class:`LookupChannel`) serves :class:`LookupServer` on that
Unix socket, named after the vLLM instance (``kv_transfer_config.engine_id``), its
data-parallel rank and its TP rank (:func:`socket_path`); the scheduler's :class:`LookupClient` sends one lookup to every rank and takes
the shortest answer (a prefix counts as cached only where every rank has its shard).

Why a channel and not a scheduler-side index fed by the workers: the engine that answers
is the engine that will load, so the answer covers every tier it can read (its CPU tier,
a disk directory another process filled, a Redis another instance wrote, a peer), and the
lookup takes its leases (pins) in the process that will consume them: a chunk cannot be
evicted between the lookup and the load. An index in the scheduler would know only what
this instance stored and would have to mirror every eviction of every tier.

The scheduler never waits long: :meth:`LookupClient.lookup` sends and waits a few
milliseconds; a lookup not answered by then is polled again on vLLM's next scheduling
pass (``get_num_new_matched_tokens`` returns ``None``), and one not answered within
``timeout`` is a miss. A worker that is gone, a socket that fails and a malformed reply
are misses too, with one warning per outage.

Wire format (little endian; nothing is pickled): a request is the header
``<4sBBHIQ`` (magic ``LMKL``, version, op, flags, count, sequence number) followed by
``count`` token ids as ``uint32``; a reply is the same header (count = number of hit
chunks) followed by the hit token count (``<Q``) and one byte per hit chunk: the index
of the tier that holds it. Ops: ``LOOKUP`` (flag 1: pin the hits), ``RELEASE`` (drop the
pins of an earlier lookup; no reply), ``HELLO`` (reply: JSON with chunk size and tier
names). Lookup flag 2 asks for shifted reuse past the exact prefix (``approximate_reuse``,
docs/truncation.md): the hit then counts the tokens the content index covers without a
gap after it, and the tier bytes stay those of the exact chunks (so the exact part is
``min(hit, chunks * chunk_size)``; only it is pinned). The socket is created mode 0600 in a directory only its user can enter.
A request's :class:`~lmcache.keys.KeyExtra` (a vLLM request's cache salt, LoRA adapter,
images) travels in a version-2 ``LOOKUP`` or ``RELEASE`` frame: after the token ids, its
length (``<I``, at most :data:`~lmcache.keys.MAX_EXTRA_BYTES`) and its wire form. A
worker of an older version refuses such a frame (a miss), never answers it with the keys
of the tokens alone; a lookup with an extra is never extended by shifted reuse (its
content index knows only chunks stored with no extra).
A version-3 frame also names the request: after the extra (its length 0 where there is
none), the id's length (``<H``, 1 to :data:`MAX_REQUEST_ID`) and its UTF-8 bytes; the
worker's engine keeps the request's prompt by it (:meth:`lmcache.CacheEngine.prompt`), so
the request's load and save find its keys without a digest of the whole prompt.

Bounds (a peer is not trusted to behave): a peer of another uid (``SO_PEERCRED``) is
refused unread; a frame over ``lookup_max_tokens`` (vLLM: ``max_model_len``) is refused from
its header; a body is received into one buffer, handed to the engine as a ``uint32`` view.
A connection idle ``idle_timeout``, or slower than ``frame_timeout`` with a frame or reply,
is closed; one process holds at most ``max_per_peer`` of the ``max_connections`` slots, and
with all taken a new connection closes the one idle the longest, so idle connections never
starve the scheduler, whose client reconnects quietly (and by itself before ``IDLE_TIMEOUT``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from lmcache.keys import MAX_EXTRA_BYTES, KeyExtra

log = logging.getLogger(__name__)

__all__ = ["LookupChannel", "LookupServer", "LookupReply", "socket_path", "MAX_TOKENS"]

MAGIC = b"LMKL"
VERSION = 1
#: the version of a request frame that carries a key extra after its tokens
VERSION_EXTRA = 2
#: the version that carries, after the extra (maybe of length 0), the request's id: the
#: worker's engine keeps the request's prompt by it (no digest of the tokens to find it)
VERSION_REQUEST = 3
HEADER = struct.Struct("<4sBBHIQ")
HIT = struct.Struct("<Q")
EXTRA_LEN = struct.Struct("<I")
REQUEST_LEN = struct.Struct("<H")
#: the longest request id a frame carries (UTF-8 bytes); a client sends a longer one's frame without it
MAX_REQUEST_ID = 256
OP_LOOKUP, OP_RELEASE, OP_HELLO = 1, 2, 3
FLAG_PIN, FLAG_SHIFTED = 1, 2
STATUS_OK, STATUS_ERROR = 0, 1
#: the longest lookup a client sends; a server accepts at most its ``lookup_max_tokens``
MAX_TOKENS = 1 << 24
#: seconds a server keeps a connection that sends no frame; a client reconnects after half
IDLE_TIMEOUT = 60.0


def socket_dir() -> str:
    """``$LMCACHE_VLLM_SOCKET_DIR``, else ``<tmp>/lmcache-<uid>`` (created mode 0700)."""
    d = os.environ.get("LMCACHE_VLLM_SOCKET_DIR") or os.path.join(tempfile.gettempdir(), f"lmcache-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    return d


def socket_path(instance: str, dp_rank: int, tp_rank: int) -> str:
    """The lookup socket of one worker of one vLLM instance."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in instance)[:64]
    return os.path.join(socket_dir(), f"vllm-{safe}-dp{dp_rank}-tp{tp_rank}.sock")


class _Closed(ConnectionError):
    """The peer closed the connection (end of stream)."""


def _recv_into(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    """Fill ``view`` from ``sock``: :class:`_Closed` at end of stream, ``TimeoutError`` once
    ``deadline`` (``time.monotonic``; ``None``: none) has passed."""
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("lookup frame deadline passed")
            sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if not n:
            raise _Closed("lookup channel closed")
        got += n


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), None)
    return bytes(buf)


def _peer(conn: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of a Unix socket's peer; ``(-1, our uid)`` without ``SO_PEERCRED``."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return -1, os.getuid()
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i")))
    return pid, uid


@dataclass
class LookupReply:
    """One rank's answer: ``hit`` leading tokens cached, ``tiers[i]`` the tier index of
    exact hit chunk i (past them, a shifted lookup's hit is shifted reuse)."""

    hit: int
    tiers: bytes

    def exact(self, chunk_size: int) -> int:
        """The exact (pinned) part of the hit."""
        return min(self.hit, len(self.tiers) * chunk_size)


# ------------------------------------------------------------------ worker side
@dataclass(eq=False)
class _Conn:
    """One accepted connection: its peer's pid, and since when it waits for a frame
    (``None`` while one is read or answered: it cannot be closed to make room then)."""

    sock: socket.socket
    pid: int
    idle_since: float | None
    evicted: bool = False


def _field(conn: socket.socket, size: struct.Struct, lo: int, hi: int, what: str, deadline: float) -> bytearray | None:
    """A length-prefixed field of a frame: its length (``size``), refused unread (``None``,
    one log line) outside ``lo..hi`` bytes, then its bytes."""
    head = bytearray(size.size)
    _recv_into(conn, memoryview(head), deadline)
    (n,) = size.unpack(head)
    if not lo <= n <= hi:
        log.warning("lmcache: lookup %s of %d bytes refused (%d to %d); closing", what, n, lo, hi)
        return None
    raw = bytearray(n)
    if n:
        _recv_into(conn, memoryview(raw), deadline)
    return raw


class LookupServer:
    """Answers lookups for one worker's cache engine on a Unix socket, on daemon threads.

    ``lookup(tokens, pin, shifted, extra, request) -> (hit_tokens, tier_indexes)`` and
    ``release(tokens, extra, request)`` are the engine calls (``tokens``: a ``uint32`` numpy
    array, ``extra``: a :class:`~lmcache.keys.KeyExtra` or ``None``, ``request``: the
    request's id or ``None``), ``info()`` the HELLO reply;
    ``max_tokens`` and the class attributes are the bounds of the module docstring."""

    max_connections = 16
    max_per_peer = 4
    idle_timeout = IDLE_TIMEOUT
    frame_timeout = 5.0

    def __init__(self, path: str,
                 lookup: Callable[[Any, bool, bool, KeyExtra | None, str | None], tuple[int, Sequence[int]]],
                 release: Callable[[Any, KeyExtra | None, str | None], None], info: Callable[[], dict[str, Any]], *,
                 max_tokens: int = 1 << 20):
        self.path = path
        self.max_tokens = max_tokens
        self._lookup, self._release, self._info = lookup, release, info
        self._closed = False
        self._conns: set[_Conn] = set()
        self._lock = threading.Lock()
        self.stats = {"lookups": 0, "releases": 0, "errors": 0, "hit_tokens": 0,
                      "refused": 0, "evicted": 0, "idle_closed": 0}
        try:
            os.unlink(path)  # a socket left by a killed worker of the same name
        except FileNotFoundError:
            pass
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(path)
        finally:
            os.umask(old)
        self._sock.listen(self.max_connections)
        self._thread = threading.Thread(target=self._accept, name="lmcache-vllm-lookup", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        """Connections held now."""
        with self._lock:
            return len(self._conns)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            c = self._admit(conn)
            if c is not None:
                threading.Thread(target=self._serve, args=(c,), name="lmcache-vllm-lookup-conn", daemon=True).start()

    def _admit(self, conn: socket.socket) -> _Conn | None:
        """A slot for a new connection, or ``None`` (it is closed, with one log line): a
        peer of another uid, a process at ``max_per_peer``, or every slot busy with a frame.
        With every slot taken, the connection idle the longest is closed to make room."""
        try:
            pid, uid = _peer(conn)
        except OSError:
            conn.close()
            return None
        why, victim = None, None
        with self._lock:
            if self._closed:
                why = "closing"
            elif uid != os.getuid():
                why = f"peer uid {uid} is not this process's uid {os.getuid()}"
            elif pid >= 0 and sum(c.pid == pid for c in self._conns) >= self.max_per_peer:
                why = f"process {pid} already holds {self.max_per_peer} connections"
            elif len(self._conns) >= self.max_connections:
                idle = [c for c in self._conns if c.idle_since is not None]
                if not idle:
                    why = f"all {self.max_connections} connections are busy"
                else:
                    victim = min(idle, key=lambda c: c.idle_since or 0.0)
                    victim.evicted = True
                    self._conns.discard(victim)
                    self.stats["evicted"] += 1
            if why is None:
                c = _Conn(conn, pid, time.monotonic())
                self._conns.add(c)
            else:
                self.stats["refused"] += 1
        if victim is not None:
            log.debug("lmcache: lookup connection of process %d closed to make room (idle the longest)", victim.pid)
            _shut(victim.sock)
        if why is not None:
            log.warning("lmcache: lookup connection refused: %s", why)
            conn.close()
            return None
        return c

    def _busy(self, c: _Conn, busy: bool) -> bool:
        """Mark ``c`` reading/answering a frame (``busy``) or waiting for one; ``False`` if
        it was closed to make room meanwhile (the frame is then dropped unanswered)."""
        with self._lock:
            if c.evicted:
                return False
            c.idle_since = None if busy else time.monotonic()
            return True

    def _serve(self, c: _Conn) -> None:
        conn = c.sock
        head = bytearray(HEADER.size)
        try:
            while not self._closed:
                try:
                    _recv_into(conn, memoryview(head), time.monotonic() + self.idle_timeout)
                except TimeoutError:
                    self.stats["idle_closed"] += 1
                    log.debug("lmcache: closing a lookup connection idle for %.0f s", self.idle_timeout)
                    return
                if not self._busy(c, True):
                    return
                deadline = time.monotonic() + self.frame_timeout
                body = self._body(conn, head, deadline)
                if body is None:
                    return
                tokens, extra, request = body
                magic, version, op, flags, count, seq = HEADER.unpack(head)
                conn.settimeout(self.frame_timeout)  # a reply the peer does not take is dropped
                if op == OP_RELEASE:
                    self.stats["releases"] += 1
                    self._safe(lambda: self._release(tokens, extra, request))
                elif op == OP_HELLO:
                    body = json.dumps(self._info()).encode()
                    conn.sendall(HEADER.pack(MAGIC, VERSION, op, STATUS_OK, 0, seq) + HIT.pack(len(body)) + body)
                else:
                    hit, tiers, status = self._answer(tokens, flags, extra, request)
                    conn.sendall(HEADER.pack(MAGIC, VERSION, op, status, len(tiers), seq) + HIT.pack(hit) + bytes(tiers))
                if not self._busy(c, False):
                    return
        except _Closed:
            pass
        except Exception as exc:  # a reset, a frame or reply past frame_timeout, a failed HELLO
            if not c.evicted and not self._closed:
                log.warning("lmcache: dropping a lookup connection of process %d: %s", c.pid, exc or "timed out")
        finally:
            with self._lock:
                self._conns.discard(c)
            conn.close()

    def _body(self, conn: socket.socket, head: bytearray,
              deadline: float) -> tuple[np.ndarray, KeyExtra | None, str | None] | None:
        """The token ids, key extra and request id of the frame whose header is ``head``,
        each received into one buffer (``None``, with one log line, for a bad header, one
        over ``max_tokens``, an extra over ``MAX_EXTRA_BYTES`` or a request id over
        ``MAX_REQUEST_ID``, refused before their bytes are read, or an extra or an id that
        does not parse)."""
        magic, version, op, _flags, count, _seq = HEADER.unpack(head)
        if magic != MAGIC or op not in (OP_LOOKUP, OP_RELEASE, OP_HELLO) or not (
                version == VERSION or (version in (VERSION_EXTRA, VERSION_REQUEST) and op != OP_HELLO)):
            log.warning("lmcache: bad lookup frame (magic %r, version %d, op %d); closing", magic, version, op)
            return None
        if count > self.max_tokens:
            log.warning("lmcache: lookup of %d tokens refused (lookup_max_tokens %d); closing", count, self.max_tokens)
            return None
        body = bytearray(4 * count)
        if count:
            _recv_into(conn, memoryview(body), deadline)
        extra = request = None
        if version in (VERSION_EXTRA, VERSION_REQUEST):
            raw = _field(conn, EXTRA_LEN, 0, MAX_EXTRA_BYTES, "key extra", deadline)
            if raw is None:
                return None
            try:
                extra = KeyExtra.from_bytes(bytes(raw)) if raw or version == VERSION_EXTRA else None
            except ValueError as exc:
                log.warning("lmcache: bad lookup frame: %s; closing", exc)
                return None
        if version == VERSION_REQUEST:
            raw = _field(conn, REQUEST_LEN, 1, MAX_REQUEST_ID, "request id", deadline)
            if raw is None:
                return None
            try:
                request = raw.decode("utf-8")
            except UnicodeDecodeError:
                log.warning("lmcache: bad lookup frame: a request id that is not UTF-8; closing")
                return None
        return np.frombuffer(body, dtype="<u4"), extra, request

    def _answer(self, tokens: np.ndarray, flags: int, extra: KeyExtra | None,
                request: str | None = None) -> tuple[int, Sequence[int], int]:
        self.stats["lookups"] += 1
        try:
            hit, tiers = self._lookup(tokens, bool(flags & FLAG_PIN), bool(flags & FLAG_SHIFTED), extra, request)
            status = STATUS_OK
        except Exception:
            log.exception("lmcache: lookup for the vLLM scheduler failed; answering a miss")
            self.stats["errors"] += 1
            hit, tiers, status = 0, (), STATUS_ERROR
        self.stats["hit_tokens"] += hit
        return hit, tiers, status

    def _safe(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            self.stats["errors"] += 1
            log.exception("lmcache: release for the vLLM scheduler failed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _shut(self._sock)
        self._sock.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            _shut(c.sock)
            c.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _shut(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways (which wakes a thread blocked on it); gone already is fine."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class LookupChannel:
    """The ``lookup`` service: :class:`LookupServer` on ``config.lookup_socket`` for this
    engine's locate (with leases) and release. A socket that cannot be bound is a warning,
    not a failed engine: the scheduler then sees this rank as a miss, and a scheduler in
    the same process still calls :meth:`lookup` directly. With no ``lookup_socket`` (the
    vLLM connector's in-band lookups, ``vllm.lookup: inband``) it serves no socket: the
    worker-role connector calls :meth:`lookup` and :meth:`release` itself."""

    def __init__(self, view: Any):
        self._view = view
        #: tier name -> its index in the replies (the hierarchy's tiers do not change)
        self._tier_index = {t.name: min(i, 255) for i, t in enumerate(view.hierarchy.tiers)}
        self.server: LookupServer | None = None
        if not view.config.lookup_socket:  # in-band (vllm.lookup): the connector calls lookup itself
            return
        try:
            self.server = LookupServer(view.config.lookup_socket, self.lookup, self.release, self.hello,
                                       max_tokens=view.config.lookup_max_tokens)
        except OSError as exc:
            log.warning("lmcache: no lookup channel on %s (%s); lookups from other processes will miss",
                        view.config.lookup_socket, exc)

    @staticmethod
    def enabled(config: Any) -> bool:
        return bool(config.lookup_socket)

    def lookup(self, tokens: Any, pin: bool, shifted: bool = False, extra: KeyExtra | None = None,
               request: str | None = None) -> tuple[int, list[int]]:
        """The cached prefix of ``tokens`` (a list or a 1-D integer array) keyed with
        ``extra`` and, per hit chunk, the index of its tier.
        ``shifted``: past the exact prefix, also the tokens that shifted reuse covers
        without a gap (where this engine has ``approximate_reuse``; never the last token,
        never with an extra). ``request``: the request's id (the engine keeps its prompt by
        it: the worker's load and save of the request find its keys by the id)."""
        n, tiers = self._view.locate(self._keyed(tokens, extra, request, shifted), pin=pin, extra=extra)
        out = [self._tier_index.get(t, 0) for t in tiers]
        svc = self._view.service("approximate_reuse") if shifted and not extra else None
        if svc is not None and n < len(tokens) - 1:
            run = svc.cover(tokens, n, len(tokens) - 1)
            if run:
                n = run[-1].start + run[-1].length
        return n, out

    def release(self, tokens: Any, extra: KeyExtra | None = None, request: str | None = None) -> None:
        """Drop the leases of a pinned :meth:`lookup` of ``tokens`` with ``extra``."""
        self._view.release(self._keyed(tokens, extra, request), extra=extra)

    def _keyed(self, tokens: Any, extra: KeyExtra | None, request: str | None, shifted: bool = False) -> Any:
        """``tokens`` as request ``request``'s prompt where the engine can key them (shifted
        reuse's cover reads the tokens themselves)."""
        if request is None or shifted or self._view.kv_spec is None:
            return tokens
        return self._view.prompt(tokens, extra, request)

    def hello(self) -> dict[str, Any]:
        spec = self._view.kv_spec
        return {"chunk_size": self._view.config.chunk_size, "tp_rank": spec.tp_rank if spec else 0,
                "kv": spec.signature if spec else None, "tiers": [t.name for t in self._view.hierarchy.tiers]}

    def info(self) -> dict[str, Any]:
        if self.server is None:
            return {"socket": None}
        return {"socket": self.server.path, "connections": self.server.connections, **self.server.stats}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
