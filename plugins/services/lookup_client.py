"""The scheduler's side of the lookup channel (:mod:`lmcache.plugins.services.lookup`):
:class:`LookupClient` sends one lookup to every rank's Unix socket and gathers their
answers, reconnecting to a rank that went away."""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from array import array
from typing import Any, Sequence

from lmcache.keys import KeyExtra

from .lookup import (
    EXTRA_LEN, FLAG_PIN, FLAG_SHIFTED, HEADER, HIT, IDLE_TIMEOUT, MAGIC, MAX_REQUEST_ID, MAX_TOKENS, OP_HELLO,
    OP_LOOKUP, OP_RELEASE, REQUEST_LEN, STATUS_OK, VERSION, VERSION_EXTRA, VERSION_REQUEST, LookupReply, _Closed,
    _recv_exact, _shut,
)

log = logging.getLogger("lmcache.plugins.services.lookup")  # the channel's log, both sides'

class _Rank:
    """One connection to one worker, with a reader thread that files replies by sequence number."""

    def __init__(self, path: str, client: LookupClient):
        self.path = path
        self.client = client
        self.sock: socket.socket | None = None
        self.used = 0.0  # when a frame was last sent on sock
        self.down_since: float | None = None
        self.next_try = 0.0
        self.backoff = 0.05
        self.warned = False

    def connected(self) -> socket.socket | None:
        now = time.monotonic()
        if self.sock is not None:
            if now - self.used < self.client.max_idle:
                return self.sock
            # idle for long: the server may be about to close it, so a fresh one (quietly)
            s, self.sock = self.sock, None
            _shut(s)
            s.close()
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
        self.sock, self.used = s, now
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
            self.used = time.monotonic()
            return True
        except OSError as exc:
            self.drop(s, exc)
            return False

    def drop(self, s: socket.socket, exc: BaseException, *, quiet: bool = False) -> None:
        """Close ``s``; if it was this rank's connection, its outstanding lookups are misses
        and, unless ``quiet``, the rank is down (one warning, a reconnect after backoff)."""
        if self.sock is s:
            self.sock = None
            if not quiet:
                self._down(exc)
            self.client._fail_rank(self)
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
            # the server closed an idle connection (after its idle_timeout, or to make
            # room): no outage, the next lookup reconnects at once
            quiet = isinstance(exc, _Closed) and not self.client._outstanding(self)
            self.drop(s, exc, quiet=quiet)


class LookupClient:
    """The scheduler's side of the channel: one :class:`_Rank` per TP worker.

    :meth:`submit` sends a lookup to every rank and returns its sequence number;
    :meth:`result` waits up to ``wait`` seconds for every rank's reply and returns the
    replies (a rank that is down answers a miss) or ``None`` if some are still out.
    """

    def __init__(self, paths: Sequence[str], *, send_timeout: float = 0.5, max_idle: float = IDLE_TIMEOUT / 2):
        self.ranks = [_Rank(p, self) for p in paths]
        self.send_timeout = send_timeout
        #: a connection idle this long is replaced before a send (servers close at IDLE_TIMEOUT)
        self.max_idle = max_idle
        self.closed = False
        self._seq = 0
        self._cond = threading.Condition()
        self._pending: dict[int, dict[int, Any]] = {}  # seq -> {rank index: reply}
        self._lock = threading.Lock()  # one sender at a time

    def _frame(self, op: int, flags: int, tokens: Sequence[int], seq: int, extra: KeyExtra | None = None,
               request: str | None = None) -> bytes:
        body = array("I", tokens).tobytes() if tokens else b""
        rid = request.encode() if request else b""
        if len(rid) > MAX_REQUEST_ID:  # the worker then finds the prompt by its tokens
            rid = b""
        if not extra and not rid:
            return HEADER.pack(MAGIC, VERSION, op, flags, len(tokens), seq) + body
        raw = extra.to_bytes() if extra else b""  # a KeyExtra is bounded: never over MAX_EXTRA_BYTES
        frame = HEADER.pack(MAGIC, VERSION_REQUEST if rid else VERSION_EXTRA, op, flags, len(tokens), seq) + body
        frame += EXTRA_LEN.pack(len(raw)) + raw
        return frame + REQUEST_LEN.pack(len(rid)) + rid if rid else frame

    def submit(self, tokens: Sequence[int], *, pin: bool = True, op: int = OP_LOOKUP, shifted: bool = False,
               extra: KeyExtra | None = None, request: str | None = None) -> int:
        """Send a lookup of ``tokens`` (keyed with ``extra``; of request ``request``, whose
        prompt the workers' engines then keep by that id) to every rank; its sequence number."""
        if len(tokens) > MAX_TOKENS:
            raise ValueError(f"a lookup of {len(tokens)} tokens exceeds {MAX_TOKENS}")
        with self._lock:
            self._seq += 1
            seq = self._seq
            frame = self._frame(op, (FLAG_PIN if pin else 0) | (FLAG_SHIFTED if shifted else 0), tokens, seq, extra,
                                request)
            with self._cond:
                self._pending[seq] = {}
            for i, r in enumerate(self.ranks):
                if not r.send(frame):
                    self._deliver(r, seq, LookupReply(0, b"") if op == OP_LOOKUP else None)
        return seq

    def release(self, tokens: Sequence[int], extra: KeyExtra | None = None, request: str | None = None) -> None:
        """Drop the pins of an earlier pinned lookup of ``tokens`` (with ``extra``) on every rank (no reply)."""
        if not tokens:
            return
        with self._lock:
            frame = self._frame(OP_RELEASE, 0, tokens, 0, extra, request)
            for r in self.ranks:
                if r.sock is not None:
                    r.send(frame)

    def release_each(self, per_rank: Sequence[Sequence[int]], extra: KeyExtra | None = None,
                     request: str | None = None) -> None:
        """Release on each rank the tokens it pinned (``per_rank[i]`` for rank ``i``)."""
        with self._lock:
            for r, tokens in zip(self.ranks, per_rank):
                if tokens and r.sock is not None:
                    r.send(self._frame(OP_RELEASE, 0, tokens, 0, extra, request))

    def _deliver(self, rank: _Rank, seq: int, reply: Any) -> None:
        with self._cond:
            got = self._pending.get(seq)
            if got is not None:
                got[self.ranks.index(rank)] = reply
                if len(got) == len(self.ranks):
                    self._cond.notify_all()

    def _outstanding(self, rank: _Rank) -> bool:
        """Whether a lookup still waits for ``rank``'s reply."""
        i = self.ranks.index(rank)
        with self._cond:
            return any(i not in got for got in self._pending.values())

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
                _shut(s)
                s.close()


__all__ = ["LookupClient"]
