"""The replay socket of the KV events publisher (:mod:`lmcache.plugins.services.kv_events`):
vLLM's replay protocol on a ZMQ ROUTER socket, served by a thread of its own.

The protocol is vLLM 0.33's ``ZmqEventPublisher``'s: a client (REQ, or DEALER sending an
empty delimiter first) sends the 8-byte big-endian sequence number to start from; the
answer is every batch still buffered from there, one message ``[topic, seq, payload]`` each
(a DEALER sees the empty delimiter first), then the end marker ``["", END_SEQ, ""]``
(``END_SEQ`` is -1 as 8 signed bytes). The batches sent are those published before the
request came (the live feed carries the later ones); vLLM sends them all at once, this
server a few at a time, in the same order and frames.

Why it is shaped like this: a client must never be able to stop the live feed or grow this
process, whatever it sends and whether or not it reads. So:

- the publishing thread never touches this socket; it only appends to :class:`ReplayBuffer`
  (O(1), under a lock held for at most one bounded slice);
- a request costs O(log n): it only sets where that client's replay starts and ends. The
  batches are then sent a few at a time (``BURST`` per client per round, clients in turn),
  and the thread pauses after each round that did work, so a flood of requests costs a
  bounded share of one core;
- one replay per client connection (a new request from it replaces the one in progress),
  at most ``MAX_REPLAYS`` at once: a request beyond that is answered with the end marker
  only (``replays_refused``), so a vLLM REQ client is never left waiting for an answer;
- at most ``CLIENT_HWM`` messages wait for one client (``ROUTER_MANDATORY``: a full pipe is
  ``EAGAIN``, so sending pauses instead of dropping), each referring to a buffered payload
  rather than a copy; a replay whose client read nothing for ``STALL_S`` seconds is
  abandoned (``replays_abandoned``);
- requests are read ``REQUESTS_PER_ROUND`` at a time; a frame larger than
  ``MAX_REQUEST_BYTES`` drops the connection (``MAXMSGSIZE``), at most ``CLIENT_RCVHWM``
  requests wait per connection, and a malformed request is ignored.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Any

log = logging.getLogger(__name__)

#: the sequence number of the end-of-replay marker (vLLM's ``END_SEQ``)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: replays in progress at once (one per client connection)
MAX_REPLAYS = 8
#: batches sent per replay per round
BURST = 64
#: requests read per round
REQUESTS_PER_ROUND = 32
#: the pause after each round that did work (it bounds the thread's share of a core)
PAUSE_S = 0.002
#: how long the thread waits for a request when it has nothing to send
IDLE_POLL_MS = 50
#: a replay whose client read nothing for this long is abandoned
STALL_S = 2.0
#: messages waiting to be sent to one client (the ROUTER's send high-water mark)
CLIENT_HWM = 256
#: requests waiting from one client connection (the ROUTER's receive high-water mark)
CLIENT_RCVHWM = 32
#: the largest frame a request may have (a request is a delimiter and 8 bytes)
MAX_REQUEST_BYTES = 64


class ReplayBuffer:
    """The last ``maxlen`` published batches, ``(seq, payload)`` in increasing ``seq``;
    appended by the publishing thread, read by the replay thread."""

    def __init__(self, maxlen: int) -> None:
        self._items: deque[tuple[int, bytes]] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def append(self, seq: int, payload: bytes) -> None:
        with self._lock:
            self._items.append((seq, payload))

    def __len__(self) -> int:
        return len(self._items)

    def since(self, start: int, stop: int, n: int) -> list[tuple[int, bytes]]:
        """At most ``n`` batches with ``start <= seq < stop``, oldest first."""
        with self._lock:
            items = self._items
            lo = bisect.bisect_left(items, start, key=lambda item: item[0])
            return [item for item in islice(items, lo, lo + n) if item[0] < stop]

    def next_seq(self) -> int:
        """One more than the newest buffered batch's seq (0 when empty)."""
        with self._lock:
            return self._items[-1][0] + 1 if self._items else 0


@dataclass
class _Replay:
    client: bytes
    next: int  # the first seq not sent yet
    stop: int  # batches from ``stop`` on were published after the request
    progress_at: float  # when a message last left for this client (or the request came)


class ReplayServer:
    """Serves replay requests on ``sock`` (a bound ROUTER socket, used only by this
    server's thread from :meth:`start` on) from ``buffer`` until :meth:`stop`."""

    def __init__(self, zmq: Any, sock: Any, buffer: ReplayBuffer, clock=time.monotonic) -> None:
        self._zmq = zmq
        self._topic = b""
        self._sock = sock
        self._buffer = buffer
        self._clock = clock
        self._replays: dict[bytes, _Replay] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        #: counters (the publisher's ``stats()``)
        self.requests = 0  # well-formed requests accepted
        self.refused = 0  # answered with the end marker only: MAX_REPLAYS in progress
        self.abandoned = 0  # the client read nothing for STALL_S
        self.malformed = 0
        self.sent = 0  # batches sent

    @staticmethod
    def configure(zmq: Any, sock: Any) -> None:
        """The bounds above, set on a ROUTER socket before it binds."""
        sock.setsockopt(zmq.SNDHWM, CLIENT_HWM)
        sock.setsockopt(zmq.RCVHWM, CLIENT_RCVHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.copy_threshold = 0  # queued messages refer to the buffer's payloads, never copies

    def start(self, topic: bytes) -> None:
        """Serve requests from now on, every batch under ``topic`` (the PUB socket's)."""
        self._topic = topic
        self._thread = threading.Thread(target=self._run, name="lmcache-kv-replay", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> bool:
        """Stop the thread (it closes the socket); false if it did not stop within ``timeout``."""
        self._stopping.set()
        if self._thread is None:
            self._sock.close(linger=0)
            return True
        self._thread.join(max(timeout, 0.0))
        return not self._thread.is_alive()

    @property
    def active(self) -> int:
        return len(self._replays)

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        zmq = self._zmq
        try:
            while not self._stopping.is_set():
                try:
                    busy = self._round()
                except zmq.ZMQError as exc:
                    if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):  # the context is going away
                        return
                    log.warning("kv events: replay socket error: %s", exc)  # keep serving the others
                    self._stopping.wait(0.1)
                    continue
                if busy:
                    time.sleep(PAUSE_S)
        except Exception:
            log.exception("kv events: replay thread failed; replays are off")
        finally:
            self._sock.close(linger=0)

    def _round(self) -> bool:
        """Read some requests, send each replay its next batches; true if it did work."""
        zmq = self._zmq
        wait = 0 if self._replays else IDLE_POLL_MS
        did = False
        if self._sock.poll(wait, zmq.POLLIN):
            for _ in range(REQUESTS_PER_ROUND):
                try:
                    frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._request(frames)
                did = True
        now = self._clock()
        for replay in list(self._replays.values()):
            n = self._advance(replay, now)
            did = did or n > 0
        if self._replays and not did:  # every client's pipe is full: wait for one to read
            self._sock.poll(10, zmq.POLLIN)
        return did

    def _request(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.malformed += 1
            log.debug("kv events: ignoring a malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        old = self._replays.get(client)
        if old is None and len(self._replays) >= MAX_REPLAYS:
            self.refused += 1
            log.debug("kv events: %d replays in progress; answering a new request with the end marker", MAX_REPLAYS)
            self._send(client, b"", END_SEQ, b"")
            return
        self.requests += 1
        # a request is not progress: a client that asks again without reading is still stalled
        since = old.progress_at if old is not None else self._clock()
        self._replays[client] = _Replay(client, int.from_bytes(start, "big"), self._buffer.next_seq(), since)

    def _advance(self, replay: _Replay, now: float) -> int:
        """Send ``replay`` up to ``BURST`` batches, then, once none is left, its end
        marker; the number of messages sent."""
        batch = self._buffer.since(replay.next, replay.stop, BURST)
        sent = 0
        for seq, payload in batch:
            ok = self._send(replay.client, self._topic, seq.to_bytes(8, "big"), payload)
            if not ok:
                break
            replay.next = seq + 1
            replay.progress_at = now
            sent += 1
        else:
            ok = True
        self.sent += sent
        if ok is None:  # the client is gone
            del self._replays[replay.client]
            return sent
        if ok and len(batch) < BURST:  # nothing buffered is left for it
            end = self._send(replay.client, b"", END_SEQ, b"")
            if end is not False:
                del self._replays[replay.client]
                return sent + bool(end)
        if sent == 0 and now - replay.progress_at > STALL_S:
            self.abandoned += 1
            log.debug("kv events: a replay client read nothing for %.0fs; its replay is abandoned", STALL_S)
            del self._replays[replay.client]
        return sent

    def _send(self, client: bytes, topic: bytes, seq: bytes, payload: bytes) -> bool | None:
        """True if sent, false if ``client``'s pipe is full, ``None`` if it is gone."""
        zmq = self._zmq
        try:
            self._sock.send_multipart((client, b"", topic, seq, payload), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return None
            raise
        return True
