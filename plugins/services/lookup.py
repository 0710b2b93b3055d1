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
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Sequence

log = logging.getLogger(__name__)

__all__ = ["LookupChannel", "LookupServer", "LookupClient", "LookupReply", "socket_path", "MAX_TOKENS"]

MAGIC = b"LMKL"
VERSION = 1
HEADER = struct.Struct("<4sBBHIQ")
HIT = struct.Struct("<Q")
OP_LOOKUP, OP_RELEASE, OP_HELLO = 1, 2, 3
FLAG_PIN, FLAG_SHIFTED = 1, 2
STATUS_OK, STATUS_ERROR = 0, 1
#: the longest prompt a lookup may carry (vLLM's max_model_len is far below)
MAX_TOKENS = 1 << 24


def socket_dir() -> str:
    """``$LMCACHE_VLLM_SOCKET_DIR``, else ``<tmp>/lmcache-<uid>`` (created mode 0700)."""
    d = os.environ.get("LMCACHE_VLLM_SOCKET_DIR") or os.path.join(tempfile.gettempdir(), f"lmcache-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    return d


def socket_path(instance: str, dp_rank: int, tp_rank: int) -> str:
    """The lookup socket of one worker of one vLLM instance."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in instance)[:64]
    return os.path.join(socket_dir(), f"vllm-{safe}-dp{dp_rank}-tp{tp_rank}.sock")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("lookup channel closed")
        buf += part
    return bytes(buf)


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
class LookupServer:
    """Answers lookups for one worker's cache engine on a Unix socket.

    ``lookup(tokens, pin) -> (hit_tokens, tier_indexes)`` and ``release(tokens)`` are the
    engine calls; ``info()`` is the HELLO reply. Runs on daemon threads; :meth:`close`
    stops them and removes the socket.
    """

    max_connections = 16

    def __init__(self, path: str, lookup: Callable[[list[int], bool, bool], tuple[int, Sequence[int]]],
                 release: Callable[[list[int]], None], info: Callable[[], dict[str, Any]]):
        self.path = path
        self._lookup, self._release, self._info = lookup, release, info
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.stats = {"lookups": 0, "releases": 0, "errors": 0, "hit_tokens": 0}
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

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                if self._closed or len(self._conns) >= self.max_connections:
                    conn.close()
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="lmcache-vllm-lookup-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._closed:
                magic, version, op, flags, count, seq = HEADER.unpack(_recv_exact(conn, HEADER.size))
                if magic != MAGIC or version != VERSION or op not in (OP_LOOKUP, OP_RELEASE, OP_HELLO):
                    raise ValueError(f"bad lookup frame (magic {magic!r}, version {version}, op {op})")
                if count > MAX_TOKENS:
                    raise ValueError(f"lookup of {count} tokens (limit {MAX_TOKENS})")
                tokens = array("I")
                if count:
                    tokens.frombytes(_recv_exact(conn, 4 * count))
                if op == OP_RELEASE:
                    self.stats["releases"] += 1
                    self._safe(lambda: self._release(tokens.tolist()))
                    continue
                if op == OP_HELLO:
                    body = json.dumps(self._info()).encode()
                    conn.sendall(HEADER.pack(MAGIC, VERSION, op, STATUS_OK, 0, seq) + HIT.pack(len(body)) + body)
                    continue
                self.stats["lookups"] += 1
                try:
                    hit, tiers = self._lookup(tokens.tolist(), bool(flags & FLAG_PIN), bool(flags & FLAG_SHIFTED))
                    status = STATUS_OK
                except Exception:
                    log.exception("lmcache: lookup for the vLLM scheduler failed; answering a miss")
                    self.stats["errors"] += 1
                    hit, tiers, status = 0, (), STATUS_ERROR
                self.stats["hit_tokens"] += hit
                conn.sendall(HEADER.pack(MAGIC, VERSION, op, status, len(tiers), seq) + HIT.pack(hit) + bytes(tiers))
        except (ConnectionError, OSError):
            pass
        except Exception as exc:
            log.warning("lmcache: dropping a lookup connection: %s", exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

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
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


# ------------------------------------------------------------------ scheduler side
class _Rank:
    """One connection to one worker, with a reader thread that files replies by sequence number."""

    def __init__(self, path: str, client: LookupClient):
        self.path = path
        self.client = client
        self.sock: socket.socket | None = None
        self.down_since: float | None = None
        self.next_try = 0.0
        self.backoff = 0.05
        self.warned = False

    def connected(self) -> socket.socket | None:
        if self.sock is not None:
            return self.sock
        now = time.monotonic()
        if now < self.next_try:
            return None
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.client.send_timeout)
        try:
            s.connect(self.path)
        except OSError as exc:
            s.close()
            self._down(exc)
            return None
        self.sock = s
        self.backoff = 0.05
        if self.warned:
            log.warning("lmcache: lookup channel to %s is back", self.path)
            self.warned = False
        threading.Thread(target=self._read, args=(s,), name="lmcache-vllm-lookup-client", daemon=True).start()
        return s

    def _down(self, exc: BaseException) -> None:
        if not self.warned and not self.client.closed:
            log.warning("lmcache: lookup channel to %s unavailable (%s); lookups are misses until it is back",
                        self.path, exc)
            self.warned = True
        self.next_try = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, 2.0)

    def send(self, frame: bytes) -> bool:
        s = self.connected()
        if s is None:
            return False
        try:
            s.sendall(frame)
            return True
        except OSError as exc:
            self.drop(s, exc)
            return False

    def drop(self, s: socket.socket, exc: BaseException) -> None:
        if self.sock is s:
            self.sock = None
            self._down(exc)
        try:
            s.close()
        except OSError:
            pass

    def _read(self, s: socket.socket) -> None:
        s.settimeout(None)
        try:
            while True:
                magic, version, op, status, count, seq = HEADER.unpack(_recv_exact(s, HEADER.size))
                if magic != MAGIC or version != VERSION:
                    raise ConnectionError(f"bad reply frame (magic {magic!r}, version {version})")
                (value,) = HIT.unpack(_recv_exact(s, HIT.size))
                if op == OP_HELLO:
                    if value > 1 << 20:
                        raise ConnectionError("oversized HELLO reply")
                    self.client._deliver(self, seq, json.loads(_recv_exact(s, value)))
                    continue
                tiers = _recv_exact(s, count) if count else b""
                reply = LookupReply(value if status == STATUS_OK else 0, tiers if status == STATUS_OK else b"")
                self.client._deliver(self, seq, reply)
        except (OSError, ConnectionError, ValueError, struct.error) as exc:
            self.drop(s, exc)
            self.client._fail_rank(self)


class LookupClient:
    """The scheduler's side of the channel: one :class:`_Rank` per TP worker.

    :meth:`submit` sends a lookup to every rank and returns its sequence number;
    :meth:`result` waits up to ``wait`` seconds for every rank's reply and returns the
    replies (a rank that is down answers a miss) or ``None`` if some are still out.
    """

    def __init__(self, paths: Sequence[str], *, send_timeout: float = 0.5):
        self.ranks = [_Rank(p, self) for p in paths]
        self.send_timeout = send_timeout
        self.closed = False
        self._seq = 0
        self._cond = threading.Condition()
        self._pending: dict[int, dict[int, Any]] = {}  # seq -> {rank index: reply}
        self._lock = threading.Lock()  # one sender at a time

    def _frame(self, op: int, flags: int, tokens: Sequence[int], seq: int) -> bytes:
        body = array("I", tokens).tobytes() if tokens else b""
        return HEADER.pack(MAGIC, VERSION, op, flags, len(tokens), seq) + body

    def submit(self, tokens: Sequence[int], *, pin: bool = True, op: int = OP_LOOKUP, shifted: bool = False) -> int:
        if len(tokens) > MAX_TOKENS:
            raise ValueError(f"a lookup of {len(tokens)} tokens exceeds {MAX_TOKENS}")
        with self._lock:
            self._seq += 1
            seq = self._seq
            frame = self._frame(op, (FLAG_PIN if pin else 0) | (FLAG_SHIFTED if shifted else 0), tokens, seq)
            with self._cond:
                self._pending[seq] = {}
            for i, r in enumerate(self.ranks):
                if not r.send(frame):
                    self._deliver(r, seq, LookupReply(0, b"") if op == OP_LOOKUP else None)
        return seq

    def release(self, tokens: Sequence[int]) -> None:
        """Drop the pins of an earlier pinned lookup of ``tokens`` on every rank (no reply)."""
        if not tokens:
            return
        with self._lock:
            frame = self._frame(OP_RELEASE, 0, tokens, 0)
            for r in self.ranks:
                if r.sock is not None:
                    r.send(frame)

    def release_each(self, per_rank: Sequence[Sequence[int]]) -> None:
        """Release on each rank the tokens it pinned (``per_rank[i]`` for rank ``i``)."""
        with self._lock:
            for r, tokens in zip(self.ranks, per_rank):
                if tokens and r.sock is not None:
                    r.send(self._frame(OP_RELEASE, 0, tokens, 0))

    def _deliver(self, rank: _Rank, seq: int, reply: Any) -> None:
        with self._cond:
            got = self._pending.get(seq)
            if got is not None:
                got[self.ranks.index(rank)] = reply
                if len(got) == len(self.ranks):
                    self._cond.notify_all()

    def _fail_rank(self, rank: _Rank) -> None:
        """A rank's connection died: its outstanding lookups are misses."""
        i = self.ranks.index(rank)
        with self._cond:
            for got in self._pending.values():
                got.setdefault(i, LookupReply(0, b""))
            self._cond.notify_all()

    def result(self, seq: int, wait: float) -> list[Any] | None:
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                got = self._pending.get(seq)
                if got is None:
                    raise KeyError(f"no lookup {seq} is pending")
                if len(got) == len(self.ranks):
                    del self._pending[seq]
                    return [got[i] for i in range(len(self.ranks))]
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def forget(self, seq: int) -> None:
        with self._cond:
            self._pending.pop(seq, None)

    def hello(self, wait: float = 2.0) -> list[Any] | None:
        seq = self.submit((), pin=False, op=OP_HELLO)
        got = self.result(seq, wait)
        if got is None:
            self.forget(seq)
        return got

    def close(self) -> None:
        self.closed = True
        for r in self.ranks:
            # taken first: shutting it down wakes the reader thread, which drops it too
            s, r.sock = r.sock, None
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:  # already gone (ENOTCONN)
                    pass
                s.close()


class LookupChannel:
    """The ``lookup`` service: :class:`LookupServer` on ``config.lookup_socket`` for this
    engine's locate (with leases) and release. A socket that cannot be bound is a warning,
    not a failed engine: the scheduler then sees this rank as a miss, and a scheduler in
    the same process still calls :meth:`lookup` directly."""

    def __init__(self, view: Any):
        self._view = view
        #: tier name -> its index in the replies (the hierarchy's tiers do not change)
        self._tier_index = {t.name: min(i, 255) for i, t in enumerate(view.hierarchy.tiers)}
        self.server: LookupServer | None = None
        try:
            self.server = LookupServer(view.config.lookup_socket, self.lookup, view.release, self.hello)
        except OSError as exc:
            log.warning("lmcache: no lookup channel on %s (%s); lookups from other processes will miss",
                        view.config.lookup_socket, exc)

    @staticmethod
    def enabled(config: Any) -> bool:
        return bool(config.lookup_socket)

    def lookup(self, tokens: list[int], pin: bool, shifted: bool = False) -> tuple[int, list[int]]:
        """The cached prefix of ``tokens`` and, per hit chunk, the index of its tier.
        ``shifted``: past the exact prefix, also the tokens that shifted reuse covers
        without a gap (where this engine has ``approximate_reuse``; never the last token)."""
        n, tiers = self._view.locate(tokens, pin=pin)
        out = [self._tier_index.get(t, 0) for t in tiers]
        svc = self._view.service("approximate_reuse") if shifted else None
        if svc is not None and n < len(tokens) - 1:
            run = svc.cover(tokens, n, len(tokens) - 1)
            if run:
                n = run[-1].start + run[-1].length
        return n, out

    def hello(self) -> dict[str, Any]:
        spec = self._view.kv_spec
        return {"chunk_size": self._view.config.chunk_size, "tp_rank": spec.tp_rank if spec else 0,
                "kv": spec.signature if spec else None, "tiers": [t.name for t in self._view.hierarchy.tiers]}

    def info(self) -> dict[str, Any]:
        return {"socket": self.server.path, **self.server.stats} if self.server else {"socket": None}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
