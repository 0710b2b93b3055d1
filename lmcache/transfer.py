"""Transfer channels: moving a request's KV chunks from one instance's memory pool into
another's, as prefill->decode (PD) disaggregation needs.

Two directions, one contract (:class:`ChannelEndpoint`):

* **push** (LMCache's PD flow), by *read* (``push_by: read``, channels that read
  one-sidedly): the sender holds the chunks as an offer and asks the receiver to
  ``fetch`` them; the receiver reserves slots, reads the bytes from the sender's pool,
  checks and commits them, and answers (one round trip; the receiver's core copies).
  By *write*: the sender asks the receiver to *allocate* slots for a request
  (``alloc``), writes its chunks straight from its own pool memory into those slots, and
  *commits* them (``commit``), or *aborts* (``abort``). Either way the receiver checks
  each chunk and hands it to its sink (an engine's top tier).
* **pull** (vLLM's flow, ``do_remote_decode`` / ``remote_block_ids``): the prefiller
  *offers* a request's chunks (:meth:`ChannelEndpoint.offer`: it holds them, and returns a
  JSON-able description with the chunks' addresses); the decoder *pulls* them
  (:meth:`ChannelEndpoint.pull`: allocates its own slots, reads, checks, commits locally)
  and *releases* the offer. An offer not released within its ``ttl`` is dropped.

What moves the bytes is the channel (a plugin, ``lmcache_register_channels``): ``nixl``
(:mod:`lmcache.plugins.channels.nixl`: one NIXL WRITE or READ per batch between the two
registered pools, no copy on either side) or ``tcp`` (:mod:`lmcache.plugins.channels.tcp`:
the bytes follow the control message on the same authenticated connection, sent from and
received into pool memory, no copy beyond the socket's). Config ``transfer_channel``
(LMCache's key) picks one; see :func:`open_channel`.

Why a receive buffer of slots with deadlines (:class:`ReceiveBuffer`): LMCache users
report requests that hang forever on a full buffer and buffers that leak when a prefiller
dies. Here the in-flight bytes are bounded (``buffer_size``); an ``alloc`` that does not
fit is answered *full* at once and the sender retries with backoff for at most
``alloc_wait`` seconds, then gives up (:class:`TransferRefused`, counted on both sides):
never an endless retry. Every allocation has a deadline (``slot_timeout``): one neither
committed nor aborted by then (its sender was killed, or hangs) is freed by the reaper and
nothing of it is committed. A sender gives up on its own transfer well before that
deadline, so freed slots are never written late. Slots are ordinary pool objects: a
committed chunk *is* the tier's entry (no copy), and the receive buffer is a budget over
the pool rather than a second region.

Why a control protocol of its own (:class:`ControlServer`, ``LMCT`` frames) rather than
the ``lm`` server's frames: those are a key/value store's (PUT answers OK or an error);
a transfer needs answers with data (slot addresses, NIXL agent metadata). It keeps the
same rules: the mutual token handshake of :mod:`lmcache.auth` first (nothing else is read
before it, within ``auth_timeout``), every frame's length checked against a bound before
it is read, JSON only (nothing pickled: NIXL's own ``get_serialized_descs`` pickles, we
send addresses as numbers), a timeout on every remote call, bounded connections.

Progress costs nothing while idle: the endpoint's background thread waits on a condition
while no allocation or offer is open; while one is, it drives the channel's progress
(``Channel.progress``: NIXL notifications, which also progress UCX for a peer's one-sided
operations over TCP) and frees what expired.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, Callable, Sequence

import torch

from .memory import MemoryObj, MemoryPool

from .transfer_buffer import (  # noqa: F401 (re-exported: the channels and the service import them from here)
    RECENT, SAMPLE, VERIFY, Allocation, BufferStats, ChunkMeta, EndpointStats, Offer, ReceiveBuffer, byte_buffer, checksum,
    offer_name, verify_mode)
from .transfer_serve import Serving
from .transfer_channel import Channel  # noqa: F401 (re-exported: the plugin contract)
from .transfer_wire import (  # noqa: F401 (re-exported)
    CHANNELS, DEFAULT_PORT, KIND_AUTH, KIND_MSG, MAGIC, MAX_CHUNKS, MAX_KEY, MAX_MSG, VERSION, ChannelUnavailable,
    Connection, ControlServer, TransferError, TransferRefused, _ServerConn, boot_id, raise_priority, raised_priority,
    same_clock, split_url)

log = logging.getLogger(__name__)

Sink = Callable[[str, MemoryObj], bool]


class ChannelEndpoint(Serving):
    """One instance's side of the transfer channel: both roles (it receives pushes and
    serves pulls on its control endpoint, and pushes to and pulls from peers).

    ``pool``: the memory pool chunks are sent from and received into (registered with
    the channel once). ``allocate``: how slots are allocated (default ``pool.allocate``;
    an engine passes its gateway's, which checks the chunk's shape first).
    ``sink(key, obj) -> bool`` takes each committed chunk (it takes over the reference;
    an engine puts it into its top tier). ``buffer_size``: bytes in flight at most.
    ``slot_timeout``: seconds an allocation or offer lives without commit/release.
    ``alloc_wait``: how long a push retries a full receiver before giving up.
    ``timeout``: every control call. ``verify``: the checksums a sender sends and the
    receiver checks before it commits: ``full`` (xxh3-64 of every byte, as a p2p PUT
    checks its payload), ``sample`` (of each chunk's first, middle and last 64 KiB: a
    slot never written or written elsewhere), ``off``; ``None`` is the channel's default
    (``tcp``: full; ``nixl``: sample, since the transport moves the bytes and the full
    hash on both sides costs more than the move itself). The sender's choice travels
    with the chunks and the receiver checks accordingly. ``thread_nice``: lowers the nice
    value of the endpoint's threads by that much where permitted
    (:func:`~lmcache.transfer_wire.raise_priority`; 0 leaves them alone)."""

    def __init__(self, channel: str, pool: MemoryPool, *, sink: Sink | None = None,
                 allocate: Callable[[Sequence[int], torch.dtype], MemoryObj | None] | None = None,
                 host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 buffer_size: int | None = None, slot_timeout: float = 10.0, alloc_wait: float = 2.0,
                 timeout: float = 5.0, verify: bool | str | None = None, identity: str | None = None,
                 options: dict[str, Any] | None = None, registries: Any = None, thread_nice: int = 0,
                 push_by: str = "read"):
        if push_by not in ("read", "write"):
            raise ValueError(f"push_by must be read or write, got {str(push_by)[:40]!r}")
        self.pool = pool
        self.push_by = push_by
        self.thread_nice = thread_nice
        self.sink: Sink = sink if sink is not None else _drop
        self.token = token
        self.timeout = float(timeout)
        self.alloc_wait = float(alloc_wait)
        self.slot_timeout = float(slot_timeout)
        self._verify = verify
        self.options = dict(options or {})
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.buffer = ReceiveBuffer(allocate or pool.allocate, buffer_size or pool.capacity // 2, slot_timeout)
        self.stats = EndpointStats()
        self._offers: dict[str, Offer] = {}
        self._conns: dict[str, list[Connection]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition()
        self._closed = False
        if registries is None:
            from .plugin_manager import get_registries

            registries = get_registries()
        cls = registries.channels.load(channel)  # an unknown name: one line naming the registered ones
        try:
            self.channel: Channel = cls(self)
        except ModuleNotFoundError as exc:
            raise ChannelUnavailable(str(registries.channels.missing(channel, exc))) from None
        self.name = channel
        #: whether this side can read a peer's memory one-sidedly, and so serve a ``fetch``
        self._reads = bool(getattr(cls, "one_sided", False))
        self.verify = verify_mode(getattr(cls, "default_verify", "full") if verify is None else verify)
        try:
            self.server = ControlServer(host, port, token, self.identity, self._handle, self._conn_closed,
                                        thread_nice=thread_nice)
        except OSError as exc:
            self.channel.close()
            raise TransferError(f"transfer endpoint cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        h, p = self.server.address
        self.url = f"[{h}]:{p}" if ":" in h else f"{h}:{p}"
        self._thread = threading.Thread(target=self._background, daemon=True, name="lmcache-transfer-progress")
        self._thread.start()

    # ------------------------------------------------------------ background: progress and expiry
    def _busy(self) -> bool:
        return bool(len(self.buffer) or self._offers)

    def _background(self) -> None:
        """Idle (no open allocation or offer): waits on a condition, no CPU. Busy: drives
        the channel's progress every millisecond (a channel that needs none: sleeps until
        the next deadline) and frees what expired."""
        poll = getattr(self.channel, "needs_progress", False)
        raise_priority(self.thread_nice)
        while not self._closed:
            with self._wake:
                if not self._busy():
                    self._wake.wait()  # woken by reserve/offer/close
                    continue
                if not poll:
                    due = [d for d in (self.buffer.next_deadline(), self._next_offer_deadline()) if d is not None]
                    wait = min(due) - time.monotonic() if due else 1.0
                    if wait > 0:
                        self._wake.wait(min(wait + 0.001, 1.0))  # a new allocation wakes it too
            if poll:
                self.channel.progress()
            self.buffer.expire()
            self._expire_offers()
            if poll:
                time.sleep(0.001)

    def _next_offer_deadline(self) -> float | None:
        with self._lock:
            return min((o.deadline for o in self._offers.values()), default=None)

    def _kick(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _expire_offers(self) -> None:
        now = time.monotonic()
        with self._lock:
            gone = [o for o in self._offers.values() if o.deadline <= now]
            for o in gone:
                del self._offers[o.id]
        for o in gone:
            self.stats.offers_expired += 1
            log.warning("transfer: offer of request %r not pulled within its ttl; released", o.request[:100])
            o.release()

    # ------------------------------------------------------------ client side
    def _connect(self, url: str, identity: str | None = None) -> Connection:
        """An authenticated connection to ``url`` (pooled); with ``identity``, the endpoint
        must announce that identity in the handshake (an offer names its endpoint's)."""
        with self._lock:
            idle = self._conns.get(url)
            while idle:
                c = idle.pop()
                if not c.closed and not c.stale() and identity in (None, c.peer_identity):
                    return c
                c.close()
        c = Connection(url, self.token, self.timeout, identity)
        r = c.call({"op": "hello", "identity": self.identity, "channel": self.name, "boot": boot_id(),
                    **self.channel.hello()})
        if r.get("channel") != self.name:
            c.close()
            raise TransferError(f"transfer endpoint {url} runs channel {str(r.get('channel'))[:20]!r}, "
                                f"this side {self.name!r}")
        self.channel.on_hello(c, r)
        c.state["fetch"] = r.get("fetch") is True
        c.state["same_clock"] = same_clock(r.get("boot"))
        return c

    def _done(self, c: Connection) -> None:
        if c.closed:
            return
        with self._lock:
            idle = self._conns.setdefault(c.url, [])
            if len(idle) < 4:
                idle.append(c)
                return
        c.close()

    def push(self, url: str, request: str, items: Sequence[tuple[str, MemoryObj]], *,
             alloc_wait: float | None = None) -> dict[str, Any]:
        """Send ``items`` (``(key, pool object)``; the caller keeps its references) to the
        endpoint at ``url`` as request ``request``, one of two ways:

        * by *read* (``push_by: read``, a channel that reads one-sidedly (nixl) on both
          sides): this side holds the chunks as an offer and asks the receiver to ``fetch``
          them; the receiver reserves slots, reads the bytes from this side's pool, checks
          and commits them, and answers: one round trip, and the copy is made by the
          receiver's core (a prefiller's core is the busy one);
        * by *write*: allocate there, write from this side, commit.

        A full receiver is retried with backoff for at most ``alloc_wait`` seconds, then
        :class:`TransferRefused`. Returns ``{chunks, bytes, seconds, waited, write_seconds,
        commit_seconds, committed, rejected, by}`` (``waited``: until the slots were granted;
        ``write_seconds``: the channel's move, made by the receiver when ``by`` is ``read``);
        :class:`TransferError` on any failure (nothing of it is committed there)."""
        if not items:
            return {"chunks": 0, "bytes": 0, "seconds": 0.0, "waited": 0.0, "committed": 0, "rejected": [],
                    "by": self.push_by}
        t0, m0 = time.perf_counter(), time.monotonic()
        wait = self.alloc_wait if alloc_wait is None else alloc_wait
        c = self._connect(url)
        by = "read" if self.push_by == "read" and self._reads and c.state.get("fetch") else "write"
        if by == "read":
            try:
                for _, o in items:
                    self.channel.describe(o)
            except TransferError:  # a chunk outside the registered pool: only a write sends it
                by = "write"
        try:
            if by == "read":
                r, waited, write_seconds = self._push_by_read(c, url, request, items, wait, t0)
            else:
                r, waited, write_seconds = self._push_by_write(c, url, request, items, wait, t0)
        except TransferRefused:
            c.close()
            raise
        except TransferError:
            self.stats.push_failed += 1
            c.close()
            raise
        self._done(c)
        nbytes = sum(o.nbytes for _, o in items)
        seconds = time.perf_counter() - t0
        commit_seconds = max(seconds - waited - write_seconds, 0.0)
        self.stats.pushed_requests += 1
        self.stats.pushed_by_read += by == "read"
        self.stats.pushed_chunks += len(items)
        self.stats.pushed_bytes += nbytes
        self.stats.push_seconds += seconds
        recent = self.stats.push_recent
        recent.append(round(seconds, 6))
        del recent[:-RECENT]
        self.stats.push_alloc_seconds += waited
        self.stats.push_write_seconds += write_seconds
        self.stats.push_commit_seconds += commit_seconds
        ready = self._ready_after(c, r, m0, seconds)
        return {"ready_seconds": ready, "chunks": len(items), "bytes": nbytes, "seconds": seconds, "waited": waited,
                "write_seconds": write_seconds, "commit_seconds": commit_seconds, "by": by,
                "committed": int(r.get("committed", 0)), "rejected": list(r.get("rejected", []))}

    def _ready_after(self, c: Connection, r: dict[str, Any], m0: float, seconds: float) -> float | None:
        """Seconds from the push's start until the receiver had committed it (its
        ``ready_at``, a monotonic stamp taken after the commit), where both sides share the
        clock (:func:`same_clock`); counted in ``push_ready_*``. ``None`` elsewhere, or for
        a stamp outside the push's own span (never trusted past it)."""
        at = r.get("ready_at")
        if not c.state.get("same_clock") or isinstance(at, bool) or not isinstance(at, (int, float)):
            return None
        ready = float(at) - m0
        if not 0.0 <= ready <= seconds:
            return None
        self.stats.push_ready_count += 1
        self.stats.push_ready_seconds += ready
        recent = self.stats.push_ready_recent
        recent.append(round(ready, 6))
        del recent[:-RECENT]
        return ready

    def _granted(self, c: Connection, msg: Callable[[], dict[str, Any]], url: str, request: str, wait: float,
                 timeout: Callable[[], float | None] = lambda: None) -> dict[str, Any]:
        """``c.call(msg())`` until the receiver has room: a *full* answer is retried with
        backoff for at most ``wait`` seconds, then :class:`TransferRefused`."""
        deadline, backoff = time.monotonic() + wait, 0.005
        while True:
            try:
                return c.call(msg(), timeout=timeout())
            except TransferRefused as exc:
                if "full" not in str(exc) or time.monotonic() + backoff > deadline:
                    self.stats.push_refused += 1
                    raise TransferRefused(f"push of request {request[:100]!r} to {url}: {exc} "
                                          f"(gave up after {wait:g}s)") from None
                time.sleep(backoff)
                backoff = min(backoff * 2, 0.1)

    def _push_by_write(self, c: Connection, url: str, request: str, items: Sequence[tuple[str, MemoryObj]],
                       wait: float, t0: float) -> tuple[dict[str, Any], float, float]:
        metas = [ChunkMeta.of(k, o) for k, o in items]
        objs = [o for _, o in items]
        msg = {"op": "alloc", "request": request, "chunks": [m.to_json() for m in metas]}
        r = self._granted(c, lambda: msg, url, request, wait)
        waited = time.perf_counter() - t0
        alloc, slots = r.get("alloc"), r.get("slots")
        if not isinstance(alloc, str) or not isinstance(slots, list) or len(slots) != len(objs):
            raise TransferError(f"transfer endpoint {url}: a malformed alloc answer for {len(objs)} chunks")
        # give up well before the receiver frees the slots, so a late write never lands in reused memory
        expires = r.get("expires_in", self.slot_timeout)
        expires = float(expires) if isinstance(expires, (int, float)) else self.slot_timeout
        xfer_deadline = time.monotonic() + max(expires * 0.8, 0.05)
        try:
            sums = [checksum(o, self.verify) for o in objs] if self.verify != "off" else None
            tw = time.perf_counter()
            self.channel.write(c, objs, slots, alloc, xfer_deadline)  # type: ignore[attr-defined]
            write_seconds = time.perf_counter() - tw
            r = c.call({"op": "commit", "alloc": alloc, "checksums": sums, "verify": self.verify},
                       timeout=max(xfer_deadline - time.monotonic(), 0.05) + self.timeout)
        except BaseException:
            try:
                if not c.closed:
                    c.call({"op": "abort", "alloc": alloc})
            except TransferError:
                pass
            raise
        return r, waited, write_seconds

    def _push_by_read(self, c: Connection, url: str, request: str, items: Sequence[tuple[str, MemoryObj]],
                      wait: float, t0: float) -> tuple[dict[str, Any], float, float]:
        # the offer outlives every attempt: a receiver reads only within the life it is told
        o = self._hold(secrets.token_hex(8), request, items, wait + self.slot_timeout)
        desc = {k: o.description[k] for k in ("offer", "request", "chunks", "addrs", "checksums", "verify")}  # type: ignore[index]
        sent = [t0]

        def msg() -> dict[str, Any]:
            sent[0] = time.perf_counter()
            return {"op": "fetch", "offer": desc, "expires_in": round(max(o.deadline - time.monotonic(), 0.0), 3)}

        try:
            r = self._granted(c, msg, url, request, wait, lambda: max(o.deadline - time.monotonic(), 0.0) + self.timeout)
        finally:
            if not c.closed:  # the receiver answered: it is not reading (any more)
                self._release(o.id)
            # no answer: it may still be reading; the offer is freed at its deadline, after the read's
        read = r.get("read_seconds")
        read = float(read) if isinstance(read, (int, float)) and not isinstance(read, bool) else 0.0
        waited = sent[0] - t0
        return r, waited, min(max(read, 0.0), time.perf_counter() - sent[0])

    def offer(self, request: str, items: Sequence[tuple[str, MemoryObj]], ttl: float | None = None, *,
              name: str | None = None) -> dict[str, Any]:
        """Hold ``items`` (a reference each is taken) for a peer to pull, for at most
        ``ttl`` seconds (default ``slot_timeout``). Returns a JSON-able description to hand
        to the puller. ``name``: the offer's id (:func:`offer_name`; default random), so a
        peer that knows only the name and this endpoint's URL can :meth:`pull_named` it
        (vLLM's kv_transfer_params flow); an offer of the same name is replaced."""
        oid = offer_name(name) if name is not None else secrets.token_hex(8)
        o = self._hold(oid, request, items, self.slot_timeout if ttl is None else ttl)
        self.stats.offers += 1
        return o.description  # type: ignore[return-value]

    def _hold(self, oid: str, request: str, items: Sequence[tuple[str, MemoryObj]], ttl: float) -> Offer:
        metas = [ChunkMeta.of(k, o) for k, o in items]
        for _, o in items:
            o.ref()
        sums = [checksum(o, self.verify) for _, o in items] if self.verify != "off" else None
        o = Offer(oid, request, list(zip(metas, [x for _, x in items])), time.monotonic() + ttl, sums)
        o.description = {"url": self.url, "identity": self.identity, "channel": self.name, "offer": o.id,
                         "request": request, "chunks": [m.to_json() for m in metas],
                         "addrs": [self.channel.describe(x) for _, x in o.items], "checksums": sums,
                         "verify": self.verify}
        with self._lock:
            old = self._offers.pop(oid, None)
            self._offers[o.id] = o
        if old is not None:
            old.release()
        self._kick()
        return o

    def _release(self, oid: str) -> bool:
        with self._lock:
            o = self._offers.pop(oid, None)
        if o is not None:
            o.release()
        return o is not None

    def pull_named(self, url: str, name: str, *, identity: str | None = None, deadline: float | None = None,
                   alloc_wait: float | None = None) -> dict[str, Any]:
        """:meth:`pull` the offer ``name`` of the endpoint at ``url`` (which must announce
        ``identity`` when given), waiting for it to appear until ``deadline`` (monotonic;
        default ``timeout`` from now): the peer may still be creating it."""
        end = time.monotonic() + self.timeout if deadline is None else deadline
        offer_name(name)
        backoff = 0.005
        while True:  # the offer may not exist yet, or the peer may be slow to answer: until the deadline
            try:
                c = self._connect(url, identity)
                # at least a second (or the whole timeout) for the answer: a handshake that got
                # through after a pause of the host must not then give its peer 50 ms
                r = c.call({"op": "describe", "offer": name},
                           timeout=max(min(self.timeout, end - time.monotonic()), min(self.timeout, 1.0)))
            except TransferError as exc:
                final = ("transfer token", "token proof", ", not ", "runs channel", "cannot reach")  # never better
                if any(f in str(exc) for f in final) or time.monotonic() + backoff > end:
                    self.stats.pull_failed += 1
                    raise TransferError(f"offer {name!r} of {url}: {exc}") from None
                time.sleep(backoff)
                backoff = min(backoff * 2, 0.05)
                continue
            self._done(c)
            break
        desc = r.get("offer")
        if not isinstance(desc, dict) or desc.get("offer") != name or not isinstance(desc.get("chunks"), list):
            raise TransferError(f"transfer endpoint {url}: a malformed description of offer {name!r}")
        desc["url"] = url  # the address this side dialled, not one the answer names
        wait = max(0.0, end - time.monotonic()) if alloc_wait is None else alloc_wait
        return self.pull(desc, alloc_wait=wait)

    def pull(self, offer: dict[str, Any], *, alloc_wait: float | None = None) -> dict[str, Any]:
        """Fetch the chunks of a peer's :meth:`offer` into this side's slots, check them,
        sink them, and release the offer. Returns ``{chunks, bytes, seconds, committed,
        rejected}``; :class:`TransferRefused` when this side's buffer stays full for
        ``alloc_wait``; :class:`TransferError` on failure (nothing committed)."""
        t0 = time.perf_counter()
        metas = [ChunkMeta.from_json(c) for c in offer["chunks"]]
        sums = offer.get("checksums")
        wait = self.alloc_wait if alloc_wait is None else alloc_wait
        deadline, backoff = time.monotonic() + wait, 0.005
        while True:
            a = self.buffer.reserve(str(offer.get("request", "?")), metas)
            if a is not None:
                break
            if time.monotonic() + backoff > deadline:
                self.buffer.stats.refused += 1
                raise TransferRefused(f"pull of request {str(offer.get('request'))[:100]!r}: receive buffer full "
                                      f"for {wait:g}s")
            time.sleep(backoff)
            backoff = min(backoff * 2, 0.1)
        self._kick()
        try:
            a = self.buffer.take(a.id)  # ours alone now: the reaper cannot free it under the read
            assert a is not None
            ident = offer.get("identity")
            c = self._connect(str(offer["url"]), ident if isinstance(ident, str) else None)
            try:
                # the offering side keeps the chunks for expires_in from now; the read ends well before
                left = float(c.call({"op": "claim", "offer": offer["offer"]}).get("expires_in", 0))
                self.channel.read(c, offer, a.objs, time.monotonic() + left * 0.8)  # type: ignore[attr-defined]
            except BaseException:
                c.close()
                raise
            try:
                # the bytes are here (the read is done; the checksums below check them): a
                # release that fails only leaves the offering side to free them at its ttl
                c.call({"op": "release", "offer": offer["offer"]})
                self._done(c)
            except TransferError as exc:
                c.close()
                self.stats.release_failed += 1
                log.warning("transfer: releasing offer %r of %s failed (%s); it expires there", str(offer["offer"])[:100],
                            offer["url"], exc)
        except BaseException:
            a.release()
            self.stats.pull_failed += 1
            raise
        if sums is not None and (not isinstance(sums, list) or len(sums) != len(metas)):
            a.release()
            raise TransferError("the offer carries another number of checksums than chunks")
        n, bad = self._commit(a.metas, a.objs, sums, str(offer.get("verify", "full")))
        a.objs = []
        nbytes = sum(m.nbytes for m in metas)
        self.stats.pulled_requests += 1
        self.stats.pulled_chunks += n
        self.stats.pulled_bytes += nbytes
        return {"chunks": len(metas), "bytes": nbytes, "seconds": time.perf_counter() - t0, "committed": n,
                "rejected": bad}

    def remote_stats(self, url: str) -> dict[str, Any]:
        c = self._connect(url)
        try:
            r = c.call({"op": "stats"})
        except TransferError:
            c.close()
            raise
        self._done(c)
        return r

    def info(self) -> dict[str, Any]:
        import dataclasses

        b = self.buffer
        return {"channel": self.name, "url": self.url, "buffer_bytes": b.capacity, "in_flight_bytes": b.in_flight,
                "open_allocations": len(b), "open_offers": len(self._offers), "verify": self.verify, **dataclasses.asdict(b.stats),
                **dataclasses.asdict(self.stats)}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._kick()
        self.server.close()
        with self._lock:
            conns = [c for cs in self._conns.values() for c in cs]
            self._conns.clear()
            offers, self._offers = list(self._offers.values()), {}
        for c in conns:
            c.close()
        for o in offers:
            o.release()
        self._thread.join(2)
        self.buffer.close()
        self.channel.close()


def _drop(key: str, obj: MemoryObj) -> bool:
    obj.unref()
    return False


def open_channel(channel: str, pool: MemoryPool, **kw: Any) -> ChannelEndpoint:
    """A :class:`ChannelEndpoint` on ``pool`` moving bytes with the registered channel
    ``channel`` (``nixl`` or ``tcp``, or a plugin's). A channel that cannot run here
    raises :class:`ChannelUnavailable` with one line saying what to install or fix."""
    return ChannelEndpoint(channel, pool, **kw)


__all__ = ["CHANNELS", "Allocation", "Channel", "ChannelEndpoint", "ChannelUnavailable", "ChunkMeta", "Connection",
           "ControlServer", "ReceiveBuffer", "TransferError", "TransferRefused", "byte_buffer", "checksum",
           "open_channel", "split_url", "verify_mode"]
