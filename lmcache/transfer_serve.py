"""The answering half of a transfer endpoint (:class:`Serving`, mixed into
:class:`lmcache.transfer.ChannelEndpoint`): what each control message a peer sends does
here. A peer's ``alloc``/``write``/``commit``/``abort`` (its push by write), ``fetch`` (its
push by read: this side reads), ``describe``/``claim``/``read``/``release`` (its pull of
this side's offer), ``stats``. Every field is checked before it is used: the peer has
proved the transfer token, but its messages are still hostile input."""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from .memory import MemoryObj
from .transfer_buffer import Allocation, ChunkMeta, Offer, checksum
from .transfer_wire import MAX_CHUNKS, MAX_KEY, TransferError, _ServerConn, boot_id, same_clock

log = logging.getLogger("lmcache.transfer")


class Serving:
    """The control messages' handlers of :class:`lmcache.transfer.ChannelEndpoint` (its
    attributes: ``buffer``, ``channel``, ``stats``, ``_offers``, ``_lock``, ...)."""

    buffer: Any
    channel: Any
    stats: Any
    sink: Any
    identity: str
    name: str
    slot_timeout: float
    _offers: dict[str, Offer]
    _lock: Any
    _reads: bool

    def _handle(self, conn: _ServerConn, msg: dict[str, Any]) -> dict[str, Any] | None:
        op = msg.get("op")
        if op == "hello":
            conn.state["same_clock"] = same_clock(msg.get("boot"))
            return {"ok": True, "identity": self.identity, "channel": self.name, "fetch": self._reads,
                    "boot": boot_id(), **self.channel.on_hello(conn, msg)}
        if op == "fetch":
            return self._stamped(conn, self._serve_fetch(conn, msg))
        if op == "alloc":
            return self._serve_alloc(msg)
        if op == "write":
            a = self._alloc_of(msg)
            self.channel.serve_write(conn, msg, a)  # type: ignore[attr-defined]
            return None
        if op == "commit":
            return self._stamped(conn, self._serve_commit(msg))
        if op == "abort":
            return {"ok": True, "aborted": self.buffer.abort(str(msg.get("alloc")))}
        if op == "read":
            o = self._offer_of(msg)
            idx = msg.get("index")
            if not isinstance(idx, list) or not all(isinstance(i, int) and 0 <= i < len(o.items) for i in idx):
                raise ValueError("read: bad chunk indices")
            self.channel.serve_read(conn, msg, [o.items[i][1] for i in idx])  # type: ignore[attr-defined]
            return None
        if op == "describe":  # a puller that knows only the offer's name (pull_named)
            return {"ok": True, "offer": self._offer_of(msg).description}
        if op == "claim":  # a puller starts reading: the offer lives for slot_timeout from now
            o = self._offer_of(msg)
            with self._lock:
                o.deadline = max(o.deadline, time.monotonic() + self.slot_timeout)
                left = o.deadline - time.monotonic()
            return {"ok": True, "expires_in": round(left, 3)}
        if op == "release":
            done = self._release(str(msg.get("offer")))
            self.stats.offers_released += done
            return {"ok": True, "released": done}
        if op == "stats":
            return {"ok": True, **self.info()}
        raise ValueError(f"unknown op {str(op)[:40]!r}")

    @staticmethod
    def _stamped(conn: _ServerConn, answer: dict[str, Any]) -> dict[str, Any]:
        """A commit's answer with ``ready_at`` (this side's monotonic clock once the chunks
        are in the sink) for a peer on the same clock: its push's time until this side was ready."""
        if answer.get("ok") and conn.state.get("same_clock"):
            answer["ready_at"] = time.monotonic()
        return answer

    def _alloc_of(self, msg: dict[str, Any]) -> Allocation:
        a = self.buffer.get(str(msg.get("alloc")))
        if a is None:
            raise TransferError("unknown or expired allocation")
        return a

    def _offer_of(self, msg: dict[str, Any]) -> Offer:
        with self._lock:
            o = self._offers.get(str(msg.get("offer")))
        if o is None:
            raise TransferError("unknown or expired offer")
        return o

    @staticmethod
    def _metas(op: str, request: Any, chunks: Any) -> list[ChunkMeta]:
        """A peer's request id and chunk list, checked, as the chunks' metadata."""
        if not isinstance(request, str) or not 0 < len(request) <= MAX_KEY:
            raise ValueError(f"{op}: request id must be a string of 1-1024 characters")
        if not isinstance(chunks, list) or not 0 < len(chunks) <= MAX_CHUNKS:
            raise ValueError(f"{op}: 1-{MAX_CHUNKS} chunks")
        return [ChunkMeta.from_json(c) for c in chunks]

    def _full(self) -> dict[str, Any]:
        return {"ok": False, "full": True, "error": f"receive buffer full ({self.buffer.in_flight} of "
                                                    f"{self.buffer.capacity} bytes in flight)"}

    def _serve_alloc(self, msg: dict[str, Any]) -> dict[str, Any]:
        request = msg.get("request")
        a = self.buffer.reserve(request, self._metas("alloc", request, msg.get("chunks")))
        if a is None:
            return self._full()
        self._kick()
        return {"ok": True, "alloc": a.id, "slots": [self.channel.describe(o) for o in a.objs],
                "expires_in": round(a.deadline - self.buffer.clock(), 3)}

    def _serve_commit(self, msg: dict[str, Any]) -> dict[str, Any]:
        a = self._alloc_of(msg)
        sums = msg.get("checksums")
        if sums is not None and (not isinstance(sums, list) or len(sums) != len(a.objs)):
            raise ValueError("commit: one checksum per chunk")
        if not self.channel.written(a, a.deadline):  # type: ignore[attr-defined]
            raise TransferError("commit: the chunks' bytes have not arrived")
        a = self.buffer.take(a.id)
        if a is None:
            raise TransferError("unknown or expired allocation")
        n, bad = self._commit(a.metas, a.objs, sums, str(msg.get("verify", "full")))
        a.objs = []
        self.buffer.stats.committed += 1
        return {"ok": True, "committed": n, "rejected": bad}

    def _serve_fetch(self, conn: _ServerConn, msg: dict[str, Any]) -> dict[str, Any]:
        """A peer's push by read: reserve slots for its offer (*full* at once when they do
        not fit: the peer retries within its ``alloc_wait``), read the chunks from the
        peer's memory on this connection's channel state, check and commit them, answer."""
        if not self._reads:
            raise TransferError(f"fetch: channel {self.name} cannot read a peer's memory here")
        desc, left = msg.get("offer"), msg.get("expires_in")
        if not isinstance(desc, dict) or isinstance(left, bool) or not isinstance(left, (int, float)) or not left > 0:
            raise ValueError("fetch: an offer and a positive expires_in")
        request, sums = desc.get("request"), desc.get("checksums")
        metas = self._metas("fetch", request, desc.get("chunks"))
        if sums is not None and (not isinstance(sums, list) or len(sums) != len(metas)):
            raise ValueError("fetch: one checksum per chunk")
        a = self.buffer.reserve(request, metas)
        if a is None:
            return self._full()
        # the slots count as in flight until committed; the read ends well before either side
        # frees memory: the peer keeps its chunks for expires_in, the reaper these slots until
        # their deadline
        left = min(float(left), a.deadline - self.buffer.clock()) * 0.8
        t = time.perf_counter()
        try:
            self.channel.read(conn, desc, a.objs, time.monotonic() + left)  # type: ignore[attr-defined]
        except BaseException:
            gone = self.buffer.take(a.id)
            if gone is not None:
                gone.release()
            self.stats.fetch_failed += 1
            raise
        read = time.perf_counter() - t
        a = self.buffer.take(a.id)
        if a is None:  # pragma: no cover - the reaper's deadline is past the read's
            raise TransferError("fetch: the slots expired during the read")
        n, bad = self._commit(a.metas, a.objs, sums, str(desc.get("verify", "full")))
        a.objs = []
        self.buffer.stats.committed += 1
        self.stats.fetched_requests += 1
        self.stats.fetched_bytes += sum(m.nbytes for m in metas)
        self.stats.fetch_read_seconds += read
        return {"ok": True, "committed": n, "rejected": bad, "read_seconds": round(read, 6)}

    def _commit(self, metas: Sequence[ChunkMeta], objs: Sequence[MemoryObj], sums: Sequence[Any] | None,
                mode: str) -> tuple[int, list[str]]:
        """Check and sink each chunk (references taken over); returns (committed, rejected keys)."""
        n, bad = 0, []
        for j, (m, o) in enumerate(zip(metas, objs)):
            want = sums[j] if sums is not None else None
            if want is not None and mode in ("full", "sample") and checksum(o, mode) != want:
                o.unref()
                bad.append(m.key)
                log.error("transfer: chunk %s failed its checksum; dropped", m.key[:100])
                continue
            try:
                ok = self.sink(m.key, o)  # takes over o's reference
            except Exception as exc:
                log.error("transfer: chunk %s refused: %s", m.key[:100], exc)
                ok = False
            if ok:
                n += 1
            else:
                bad.append(m.key)
        self.buffer.stats.committed_chunks += n
        self.buffer.stats.rejected_chunks += len(bad)
        return n, bad

    def _conn_closed(self, conn: _ServerConn) -> None:
        close = getattr(self.channel, "on_close", None)
        if close is not None:
            close(conn)


__all__ = ["Serving"]
