"""vLLM-compatible KV events: what this instance's tiers store and drop, published on a
ZMQ PUB socket so that KV-aware routers built for vLLM's ``--kv-events-config`` (llm-d's
precise prefix-cache scorer, NVIDIA Dynamo's KV router) can follow lmcache tiers too.
This is the standalone publisher, for engines other than vLLM and ``lmcache server``;
inside vLLM, :mod:`lmcache.plugins.connectors.vllm.events` puts the same events into
vLLM's own stream instead.

Started by :class:`~lmcache.engine.CacheEngine` when the config has
``kv_events: {enabled: true}`` (the ``kv_events`` service, :class:`KVEventsService`). The wire format is exactly vLLM's
(``vllm.distributed.kv_events``, checked against vLLM 0.33's own msgspec decoder in
``tests/engines/test_vllm_kv_events.py``):

- each message has three frames: ``topic``, an 8-byte big-endian sequence number
  (0, 1, 2, ... per publisher), and a msgpack payload;
- the payload is a ``KVEventBatch``: the array ``[ts, events, data_parallel_rank]``;
- each event is a map tagged by ``"type"``: ``BlockStored`` (``block_hashes``,
  ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``,
  ``lora_name``, ``group_idx``) or ``BlockRemoved`` (``block_hashes``, ``medium``,
  ``group_idx``); fields with default values are omitted, as msgspec's
  ``omit_defaults`` does. With ``kv_events.event_form: array`` each event is instead the
  array ``[tag, field, ...]`` of upstream vLLM's ``array_like=True`` structs, the only form
  llm-d decodes (LlmdIndex in tests/_routers.py). ``AllBlocksCleared`` is never sent: llm-d applies it to the
  whole pod, the engine's GPU blocks included, so a tier clear is per-block removals.

Where a router finds it: the endpoint defaults to ``tcp://<host>:5558`` (vLLM's own
publisher has 5557) and the topic to ``kv@<host>:<port>@<model>``, the form llm-d's
subscriber parses; ``<host>`` is ``kv_events.host``, else ``$POD_IP``, else 127.0.0.1.

Blocks are the engine's, as vLLM and both routers count them, not lmcache chunks: a
chunk is announced as the full engine blocks of ``kv_events.block_size`` tokens whose
last token falls in it (a partial trailing block is never announced: vLLM hashes only
full blocks), with vLLM's block hashes under ``kv_events.hash_algo``
(:mod:`lmcache.vllm_block_hash`), each block's parent the previous block, as vLLM chains
them (int hashes as ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the low 64 bits of the
big-endian digest; or the digest bytes with ``block_hash_format: bytes``). A run of
blocks one store put into one medium is merged into one ``BlockStored``. Chunks whose
token ids the engine did not hand over (keyed with a :class:`~lmcache.keys.KeyExtra`:
salt, LoRA, multimodal items, whose vLLM hash needs extra keys; or adopted from a shared
store) are not announced.

``medium`` is vLLM's vocabulary (:mod:`lmcache.kv_media`: ``cpu`` tiers are ``CPU``,
others ``STORAGE``, ``kv_events.media`` overrides). A medium's ``BlockStored`` is sent
when its first tier admits a chunk and its ``BlockRemoved`` when its last tier drops it;
after such a removal, a ``BlockStored`` is repeated for each medium that still holds
the chunk, for consumers that drop a block from every medium on any removal.

Why it is shaped like this: the engine must never wait for a subscriber, and a broken
event feed must never break caching. The tier listener only updates the media (O(1),
under this publisher's lock) and appends to a bounded queue (it runs under a tier's
lock); one thread hashes, encodes and sends. A full queue drops the event and counts
it, and the next batch skips one sequence number, so a subscriber sees the gap and may
ask the replay socket for what is still buffered (dropped events never are). The PUB
socket itself drops at its high-water mark and never blocks. The replay socket has a
thread of its own (:mod:`lmcache.plugins.services.kv_replay`) that bounds what a replay
client can cost, whether or not it reads; the publishing thread only appends to its
buffer. :meth:`KVEventPublisher.close` returns within its timeout (and a second's grace)
whatever the clients do. If ``pyzmq``/``msgpack``
are missing or the endpoint cannot be bound, the publisher logs once and stays
disabled. Token ids are known when the engine stores (or promotes) a chunk, not in the
tier listener, so the engine hands them over first (:meth:`KVEventPublisher.remember`);
they are kept, bounded by ``META_ENTRIES``, until a tier admits the chunk, then, with
the chunk's block hashes, while a tier holds it (a few bytes per token, next to the
chunk's KV in that tier).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Mapping, Sequence
from urllib.parse import quote

from lmcache.kv_media import MediaTracker, tier_media
from lmcache.plugins.services.kv_replay import END_SEQ, ReplayBuffer, ReplayServer

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from lmcache.config import Config, KVEventsConfig
    from lmcache.keys import Chunk
    from lmcache.services import EngineView
    from lmcache.vllm_block_hash import BlockHasher

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'lmcache[events]'  (pyzmq and msgpack)"
#: chunks remembered between the engine's store and the tiers' admit events
META_ENTRIES = 16384
#: most events packed into one KVEventBatch
MAX_BATCH_EVENTS = 1024
#: the default port: vLLM's publisher defaults to 5557 in the same pod
DEFAULT_PORT = 5558
_MASK64 = (1 << 64) - 1
#: what vLLM's publisher of a single-rank engine sends in every batch
DATA_PARALLEL_RANK = 0
#: the KV cache group of every block (a single-group model's, as vLLM numbers it)
GROUP_IDX = 0
_STOP = object()
#: how long close() waits, past its timeout, for the threads to stop
STOP_GRACE_S = 1.0
_WILDCARDS = ("*", "0.0.0.0", "::", "")


def bind_host(cfg: KVEventsConfig) -> str:
    """The address the publisher binds and names: ``host``, else ``$POD_IP``, else loopback."""
    return cfg.host or os.environ.get("POD_IP") or "127.0.0.1"


def default_endpoint(cfg: KVEventsConfig) -> str:
    host = bind_host(cfg)
    return f"tcp://[{host}]:{DEFAULT_PORT}" if ":" in host else f"tcp://{host}:{DEFAULT_PORT}"


def default_topic(cfg: KVEventsConfig, endpoint: str, model: str) -> str:
    """``kv@<host>:<port>@<model>`` for a bound tcp endpoint (for a wildcard bind, the
    host it stands for: ``host``, ``$POD_IP`` or the host name), else ``kv@<host>@<model>``."""
    named = cfg.host or os.environ.get("POD_IP")
    if cfg.bind and endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        host = host.strip("[]")
        if host in _WILDCARDS:
            host = named or socket.gethostname()
        return f"kv@{host}:{port}@{model}"
    return f"kv@{named or socket.gethostname()}@{model}"


class _Prefix:
    """The token ids of one store (or promotion) and vLLM's hashes of its full blocks,
    computed on demand by the publisher thread (the only one that calls :meth:`hashes`)."""

    __slots__ = ("tokens", "_hashes")

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens
        self._hashes: list[bytes] = []

    def hashes(self, n: int, hasher: BlockHasher, block_size: int) -> list[bytes]:
        h = self._hashes
        while len(h) < n:
            i = len(h)
            h.append(hasher.block(h[-1] if h else None, self.tokens[i * block_size : (i + 1) * block_size].tolist()))
        return h


class _Blocks:
    """The engine blocks ``first..last`` of one chunk. Until the publisher thread first
    resolves it, it refers to its store's :class:`_Prefix`; then it keeps only its own
    hashes, parent and token ids."""

    __slots__ = ("prefix", "first", "last", "hashes", "parent", "tokens")

    def __init__(self, prefix: _Prefix, first: int, last: int) -> None:
        self.prefix: _Prefix | None = prefix
        self.first, self.last = first, last
        self.hashes: list[bytes] = []
        self.parent: bytes | None = None
        self.tokens: np.ndarray | None = None

    def resolve(self, hasher: BlockHasher, block_size: int) -> _Blocks:
        p = self.prefix
        if p is not None:
            h = p.hashes(self.last + 1, hasher, block_size)
            self.hashes = h[self.first : self.last + 1]
            self.parent = h[self.first - 1] if self.first else None
            self.tokens = p.tokens[self.first * block_size : (self.last + 1) * block_size].copy()
            self.prefix = None
        return self


class KVEventPublisher:
    """Publishes the tiers' admit/evict events of one engine until :meth:`close`.

    ``media`` is ``{tier name: medium}`` (:func:`lmcache.kv_media.tier_media`); events of
    other tiers are ignored. ``enabled`` is false when the socket could not be set up
    (the reason is in ``error``); every method is then a cheap no-op.
    """

    def __init__(self, cfg: KVEventsConfig, *, namespace: str, model: str, media: Mapping[str, str]) -> None:
        from lmcache.vllm_block_hash import BlockHasher

        self.cfg = cfg
        self.enabled = False
        self.error: str | None = None
        #: the endpoint actually bound (``tcp://127.0.0.1:0`` resolves to the real port)
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self.topic: str = cfg.topic or ""
        self._model = model
        self._prefix = f"lmc1:{namespace}:{quote(model, safe='-_.~')}:"
        self._block_size = cfg.block_size
        self._hasher = BlockHasher(cfg.hash_algo)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=cfg.queue_size)
        self._lock = threading.Lock()  # the fields below, from the engine's and the tiers' threads
        self._meta: OrderedDict[str, _Blocks] = OrderedDict()  # remembered, not yet admitted
        self._held: dict[str, _Blocks] = {}  # announced and held by a tier
        self._media = MediaTracker(media)
        self._gap = False  # events were dropped since the last batch: skip a sequence number
        #: the last ``buffer_steps`` batches, kept only for a replay socket
        self._buffer = ReplayBuffer(cfg.buffer_steps) if cfg.replay_endpoint else None
        self._replayer: ReplayServer | None = None
        self._seq = 0
        self._closed = False
        self._stopping = threading.Event()  # close() was called: stop once the queue is empty
        self._abort = False  # close()'s time is up: stop now
        #: counters (``stats()``)
        self.dropped_events = 0  # the queue was full
        self.skipped_seqs = 0  # sequence numbers left out to show drops
        self.unannounced = 0  # admits of chunks whose token ids were not handed over
        self.published_batches = 0
        self.published_events = 0
        self.failed_sends = 0
        self._ctx = self._pub = self._replay = None
        self._thread: threading.Thread | None = None
        try:
            import msgpack
            import zmq
        except ImportError as exc:
            self._disable(f"{exc.name or exc} is not installed; install it with: {INSTALL_HINT}")
            return
        self._zmq = zmq
        self._pack = msgpack.Packer(use_bin_type=True).pack
        endpoint = cfg.endpoint or default_endpoint(cfg)
        try:
            self._open_sockets(endpoint)
        except Exception as exc:
            self._close_sockets()
            self._disable(f"cannot {'bind' if cfg.bind else 'connect'} {endpoint}: {type(exc).__name__}: {exc}")
            return
        self.topic = cfg.topic or default_topic(cfg, self.endpoint or endpoint, model)
        self.enabled = True
        self._thread = threading.Thread(target=self._run, name="lmcache-kv-events", daemon=True)
        self._thread.start()
        if self._replayer is not None:
            self._replayer.start(self.topic.encode())
        log.info("kv events: publishing on %s (topic %r)", self.endpoint, self.topic)

    def _disable(self, why: str) -> None:
        self.error = why
        log.warning("kv events disabled: %s; caching is unaffected", why)

    def _open_sockets(self, endpoint: str) -> None:
        zmq = self._zmq
        self._ctx = zmq.Context()
        pub = self._pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.cfg.hwm)
        pub.setsockopt(zmq.LINGER, 200)
        if "[" in endpoint:
            pub.setsockopt(zmq.IPV6, 1)
        if self.cfg.bind:
            pub.bind(endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:  # a router that binds a SUB socket and lets publishers connect
            pub.connect(endpoint)
            self.endpoint = endpoint
        if self.cfg.replay_endpoint and self._buffer is not None:
            rep = self._replay = self._ctx.socket(zmq.ROUTER)
            ReplayServer.configure(zmq, rep)
            rep.bind(self.cfg.replay_endpoint)
            self.replay_endpoint = rep.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replayer = ReplayServer(zmq, rep, self._buffer)  # its own thread, from start()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close()
        if self._ctx is not None:
            self._ctx.term()
        self._ctx = self._pub = self._replay = None

    # ------------------------------------------------------------ the engine's side
    def remember(self, tokens: Any, chunks: Sequence[Chunk], keys: Sequence[str]) -> None:
        """Note the token ids of chunks the engine is about to store or promote (their
        engine blocks, for the ``BlockStored`` events their admission will cause)."""
        if not self.enabled or not chunks:
            return
        from lmcache.keys import as_token_array

        prefix = _Prefix(as_token_array(tokens))
        bs = self._block_size
        with self._lock:
            meta = self._meta
            for chunk, key in zip(chunks, keys):
                first, last = chunk.start // bs, chunk.end // bs - 1
                if last < first:  # no full engine block ends in this chunk: nothing to announce
                    continue
                meta[key] = _Blocks(prefix, first, last)
                meta.move_to_end(key)
            while len(meta) > META_ENTRIES:
                meta.popitem(last=False)

    def on_tier_event(self, op: str, tier: str, key: str) -> None:
        """The hierarchy listener (``op`` is ``"admit"`` or ``"evict"``); called under a
        tier's lock, so it only updates the media and queues."""
        if not self.enabled or not key.startswith(self._prefix):
            return
        with self._lock:
            if op == "admit":
                blocks = self._held.get(key) or self._meta.get(key)
                if blocks is None:
                    self.unannounced += 1
                    return
                medium = self._media.admit(tier, key)
                if medium is not None:
                    self._held[key] = blocks
                    self._put(("stored", medium, blocks))
            elif op == "evict":
                blocks = self._held.get(key)
                if blocks is None:
                    return
                gone, still = self._media.evict(tier, key)
                if not self._media.holders(key):
                    del self._held[key]
                if gone is not None:
                    self._put(("removed", gone, blocks))
                    for medium in still:  # consumers that drop every medium on a removal hear it again
                        self._put(("stored", medium, blocks))

    def ping(self) -> None:
        """Publish a batch with no events: subscribers see the stream is alive (and a
        new subscriber can tell its subscription is live)."""
        if self.enabled:
            with self._lock:
                self._put(("ping", None, None))

    def _put(self, item: tuple) -> None:  # (under self._lock)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped_events += 1
            self._gap = True

    def stats(self) -> dict[str, Any]:
        r = self._replayer
        return {
            "enabled": self.enabled,
            "error": self.error,
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic,
            "block_size": self._block_size,
            "hash_algo": self._hasher.algo,
            "next_seq": self._seq,
            "queued_events": self._queue.qsize(),
            "dropped_events": self.dropped_events,
            "skipped_seqs": self.skipped_seqs,
            "unannounced": self.unannounced,
            "held_chunks": len(self._held),
            "published_batches": self.published_batches,
            "published_events": self.published_events,
            "failed_sends": self.failed_sends,
            "replays": r.requests if r else 0,
            "replays_refused": r.refused if r else 0,
            "replays_abandoned": r.abandoned if r else 0,
        }

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is queued, then close; returns within about ``timeout`` seconds
        (plus ``STOP_GRACE_S``) whatever subscribers and replay clients do."""
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        self.enabled = False  # later tier events (the hierarchy closing) are not published
        deadline = time.monotonic() + timeout
        replay_stopped = self._replayer is None or self._replayer.stop(STOP_GRACE_S)
        self._stopping.set()  # wakes the thread even when the queue is full
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            pass
        assert self._thread is not None
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        if self._thread.is_alive():  # still draining: drop the rest
            self._abort = True
            self._thread.join(STOP_GRACE_S)
        if self._thread.is_alive() or not replay_stopped:  # stuck: leave the sockets to the daemon threads
            log.warning("kv events: publisher thread did not stop within %.1fs", timeout)
            return
        self._close_sockets()

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._abort:
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                if self._stopping.is_set():
                    return
                if self._gap:  # drops and nothing after them: show the gap now
                    self._send_batch([])
                continue
            items = [item]
            while item is not _STOP and len(items) < MAX_BATCH_EVENTS:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                items.append(item)
            stop = items[-1] is _STOP
            if stop:
                items.pop()
            if items:
                self._send_batch(items)
            if stop:
                return

    def _send_batch(self, items: list[tuple]) -> None:
        try:
            events = self._events(items)
            if events or any(op == "ping" for op, _, _ in items) or self._gap:
                self._publish(events)
        except Exception:  # never let the publisher die; the lost batch is a sequence gap
            self._gap = True
            log.exception("kv events: unexpected error publishing a batch")

    def _hash(self, raw: bytes) -> int | bytes:
        if self.cfg.block_hash_format == "bytes":
            return raw
        return int.from_bytes(raw, "big") & _MASK64

    def _events(self, items: list[tuple]) -> list[dict[str, Any]]:
        """vLLM event maps for queued items, merging runs as vLLM does: consecutive
        chunks of one chain stored into one medium, consecutive removals from one medium."""
        out: list[dict[str, Any]] = []
        last: bytes | None = None  # the last block hash of out[-1] when it is a mergeable BlockStored
        bs = self._block_size
        for op, medium, blocks in items:
            if op == "ping":
                continue
            b = blocks.resolve(self._hasher, bs)
            hashes = [self._hash(h) for h in b.hashes]
            prev = out[-1] if out else None
            if op == "removed":
                if prev is not None and prev["type"] == "BlockRemoved" and prev["medium"] == medium:
                    prev["block_hashes"].extend(hashes)
                else:
                    out.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": medium,
                                "group_idx": GROUP_IDX})
                last = None
                continue
            if (prev is not None and last is not None and b.parent == last
                    and prev["type"] == "BlockStored" and prev["medium"] == medium):
                prev["block_hashes"].extend(hashes)
                prev["token_ids"].extend(b.tokens.tolist())
            else:
                out.append(_stored(hashes, None if b.parent is None else self._hash(b.parent),
                                   b.tokens.tolist(), bs, medium))
            last = b.hashes[-1]
        return out

    def _publish(self, events: list[dict[str, Any]]) -> None:
        zmq = self._zmq
        with self._lock:
            gap, self._gap = self._gap, False
        if gap:  # events were dropped before this batch: a sequence number stands for them
            self._seq += 1
            self.skipped_seqs += 1
        wire = [_as_array(e) for e in events] if self.cfg.event_form == "array" else events
        payload = self._pack([time.time(), wire, DATA_PARALLEL_RANK])
        seq = self._seq
        self._seq += 1
        if self._buffer is not None:
            self._buffer.append(seq, payload)
        try:
            self._pub.send_multipart(  # type: ignore[union-attr]
                (self.topic.encode(), seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
            )
        except zmq.ZMQError as exc:  # a PUB socket drops at its HWM; a connect socket may not
            self.failed_sends += 1
            log.debug("kv events: batch %d not sent: %s", seq, exc)
            return
        self.published_batches += 1
        self.published_events += len(events)


def request_replay(ctx: Any, endpoint: str, start_seq: int, timeout: float = 10.0) -> list[tuple[bytes, int, bytes]]:
    """The client side of vLLM's replay protocol: ask ``endpoint`` (a replay socket) for
    the buffered batches from ``start_seq`` on; ``(topic, seq, payload)`` per batch. A
    ``TimeoutError`` if a reply does not come within ``timeout`` seconds."""
    import zmq

    req = ctx.socket(zmq.DEALER)  # not REQ: one request is answered by several messages
    req.setsockopt(zmq.LINGER, 0)
    try:
        req.connect(endpoint)
        req.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        while True:
            if not req.poll(int(timeout * 1000)):
                raise TimeoutError(f"no replay from {endpoint} within {timeout:g}s")
            frames = req.recv_multipart()
            if len(frames) != 4:
                raise ValueError(f"a replay message of {len(frames)} frames from {endpoint}, expected 4")
            _, topic, seq, payload = frames
            if seq == END_SEQ:
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        req.close()


def _as_array(ev: dict[str, Any]) -> list:
    """An event in upstream vLLM's ``array_like=True`` form (what llm-d decodes): the tag,
    then the fields in vLLM's struct order up to ``group_idx`` (``extra_keys`` nil)."""
    if ev["type"] == "BlockRemoved":
        return ["BlockRemoved", ev["block_hashes"], ev["medium"], ev["group_idx"]]
    return ["BlockStored", ev["block_hashes"], ev["parent_block_hash"], ev["token_ids"], ev["block_size"],
            ev["lora_id"], ev["medium"], ev["lora_name"], None, ev["group_idx"]]


def _stored(hashes: list, parent: int | bytes | None, tokens: list[int], block_size: int, medium: str) -> dict:
    # field order and the always-present None fields are those of vLLM's BlockStored
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "group_idx": GROUP_IDX,
    }


class KVEventsService:
    """The publisher as an engine service: it hears the tiers' admits and evictions and
    the token ids of each stored chunk, and closes after the hierarchy's queued writes are
    done (their admits are events too)."""

    @staticmethod
    def enabled(config: Config) -> bool:
        return config.kv_events.enabled

    def __init__(self, engine: EngineView):
        cfg = engine.config
        media = tier_media(engine.hierarchy.tiers, cfg.kv_events.media)
        self.publisher = KVEventPublisher(cfg.kv_events, namespace=cfg.namespace, model=cfg.model, media=media)
        self._hierarchy = engine.hierarchy
        if self.publisher.enabled:
            engine.hierarchy.add_listener(self.publisher.on_tier_event)
            engine.add_store_observer(self.publisher.remember)

    def info(self) -> dict[str, Any]:
        return self.publisher.stats()

    def close(self) -> None:
        self._hierarchy.flush()
        self.publisher.close()
