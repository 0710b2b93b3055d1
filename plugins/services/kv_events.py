"""vLLM-compatible KV events: what this instance's tiers store and drop, published on a
ZMQ PUB socket so that KV-aware routers built for vLLM's ``--kv-events-config`` (llm-d
style) can follow lmcache tiers too.

Started by :class:`~lmcache.engine.CacheEngine` when the config has
``kv_events: {enabled: true}`` (the ``kv_events`` service, :class:`KVEventsService`). The wire format is exactly vLLM's
(``vllm.distributed.kv_events``, checked against vLLM 0.33's own msgspec decoder in
``tests/engines/test_vllm_kv_events.py``):

- each message has three frames: ``topic``, an 8-byte big-endian sequence number
  (0, 1, 2, ... per publisher), and a msgpack payload;
- the payload is a ``KVEventBatch``: the array ``[ts, events, data_parallel_rank]``;
- each event is a map tagged by ``"type"``: ``BlockStored`` (``block_hashes``,
  ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``,
  ``lora_name``), ``BlockRemoved`` (``block_hashes``, ``medium``) or
  ``AllBlocksCleared``; fields with default values are omitted, as msgspec's
  ``omit_defaults`` does.

One block is one lmcache chunk: its hash is the chunk hash (as vLLM's default
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` does: the low 64 bits of the big-endian
digest, as an int; or the 16 digest bytes with ``block_hash_format: bytes``), its
parent is the previous chunk's hash, ``block_size`` the chunk's token count and
``medium`` the tier's name. A run of chunks one store put into one tier is merged into
one ``BlockStored`` as vLLM does for one request's blocks.

Why it is shaped like this: the engine must never wait for a subscriber, and a broken
event feed must never break caching. The tier listener only appends to a bounded queue
(it runs under a tier's lock); one thread encodes and sends. A full queue drops the
event and counts it; the PUB socket itself drops at its high-water mark and never
blocks. If ``pyzmq``/``msgpack`` are missing or the endpoint cannot be bound, the
publisher logs once and stays disabled. Token ids are known when the engine stores (or
promotes) a chunk, not in the tier listener, so the engine hands them over first
(:meth:`KVEventPublisher.remember`) and they are kept, bounded, until the tiers admit
the chunk; a chunk whose tokens are no longer known (admitted long after, or adopted
from a shared store) is published as vLLM publishes such placeholders: no tokens, no
parent, ``block_size`` 0.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Sequence
from urllib.parse import quote

if TYPE_CHECKING:  # pragma: no cover
    from lmcache.config import Config, KVEventsConfig
    from lmcache.keys import Chunk
    from lmcache.services import EngineView

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'lmcache[events]'  (pyzmq and msgpack)"
#: chunk token lists remembered between the engine's store and the tiers' admit events
META_ENTRIES = 16384
#: most events packed into one KVEventBatch
MAX_BATCH_EVENTS = 1024
#: the sequence number of the replay socket's end-of-replay marker (vLLM's ``END_SEQ``)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_MASK64 = (1 << 64) - 1
#: what vLLM's publisher of a single-rank engine sends in every batch
DATA_PARALLEL_RANK = 0
_STOP = object()


class KVEventPublisher:
    """Publishes the tiers' admit/evict events of one engine until :meth:`close`.

    ``enabled`` is false when the socket could not be set up (the reason is in
    ``error``); every method is then a cheap no-op.
    """

    def __init__(self, cfg: KVEventsConfig, *, namespace: str, model: str) -> None:
        self.cfg = cfg
        self.enabled = False
        self.error: str | None = None
        #: the endpoint actually bound (``tcp://127.0.0.1:0`` resolves to the real port)
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self._prefix = f"lmc1:{namespace}:{quote(model, safe='-_.~')}:"
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=cfg.queue_size)
        self._meta: OrderedDict[str, tuple[str | None, Any]] = OrderedDict()
        self._meta_lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = 0
        self._closed = False
        #: counters (``stats()``)
        self.queued_events = 0
        self.dropped_events = 0  # the queue was full
        self.published_batches = 0
        self.published_events = 0
        self.failed_sends = 0
        self.replays = 0
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
        try:
            self._open_sockets()
        except Exception as exc:
            self._close_sockets()
            self._disable(f"cannot {'bind' if cfg.bind else 'connect'} {cfg.endpoint}: {type(exc).__name__}: {exc}")
            return
        self.enabled = True
        self._thread = threading.Thread(target=self._run, name="lmcache-kv-events", daemon=True)
        self._thread.start()
        log.info("kv events: publishing on %s (topic %r)", self.endpoint, cfg.topic)

    def _disable(self, why: str) -> None:
        self.error = why
        log.warning("kv events disabled: %s; caching is unaffected", why)

    def _open_sockets(self) -> None:
        zmq = self._zmq
        self._ctx = zmq.Context()
        pub = self._pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.cfg.hwm)
        pub.setsockopt(zmq.LINGER, 200)
        if self.cfg.bind:
            pub.bind(self.cfg.endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:  # a router that binds a SUB socket and lets publishers connect
            pub.connect(self.cfg.endpoint)
            self.endpoint = self.cfg.endpoint
        if self.cfg.replay_endpoint:
            rep = self._replay = self._ctx.socket(zmq.ROUTER)
            rep.setsockopt(zmq.SNDHWM, 2 * (self.cfg.buffer_steps + 1))  # a full replay plus its marker
            rep.setsockopt(zmq.LINGER, 0)
            rep.bind(self.cfg.replay_endpoint)
            self.replay_endpoint = rep.getsockopt_string(zmq.LAST_ENDPOINT)

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close()
        if self._ctx is not None:
            self._ctx.term()
        self._ctx = self._pub = self._replay = None

    # ------------------------------------------------------------ the engine's side
    def remember(self, tokens: Any, chunks: Sequence[Chunk], keys: Sequence[str]) -> None:
        """Note the parent hash and token ids of chunks the engine is about to store or
        promote, for the ``BlockStored`` events their admission will cause."""
        if not self.enabled or not chunks:
            return
        from lmcache.keys import as_token_array

        arr = as_token_array(tokens)
        prev: str | None = None
        with self._meta_lock:
            meta = self._meta
            for chunk, key in zip(chunks, keys):
                meta[key] = (prev, arr[chunk.start : chunk.end])
                meta.move_to_end(key)
                prev = chunk.chunk_hash
            while len(meta) > META_ENTRIES:
                meta.popitem(last=False)

    def on_tier_event(self, op: str, tier: str, key: str) -> None:
        """The hierarchy listener (``op`` is ``"admit"`` or ``"evict"``); called under a
        tier's lock, so it only queues."""
        if not self.enabled or not key.startswith(self._prefix):
            return
        if op == "admit":
            with self._meta_lock:
                meta = self._meta.get(key)
            self._put(("stored", tier, key, meta))
        elif op == "evict":
            self._put(("removed", tier, key, None))

    def cleared(self) -> None:
        """Publish ``AllBlocksCleared`` (every tier of this instance was emptied)."""
        if self.enabled:
            self._put(("cleared", None, None, None))

    def _put(self, item: tuple) -> None:
        try:
            self._queue.put_nowait(item)
            self.queued_events += 1
        except queue.Full:
            self.dropped_events += 1

    def stats(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "error": self.error,
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.cfg.topic,
            "next_seq": self._seq,
            "queued_events": self._queue.qsize(),
            "dropped_events": self.dropped_events,
            "published_batches": self.published_batches,
            "published_events": self.published_events,
            "failed_sends": self.failed_sends,
            "replays": self.replays,
        }

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is queued (for at most ``timeout`` seconds), then close."""
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        self.enabled = False  # later tier events (the hierarchy closing) are not published
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        assert self._thread is not None
        self._thread.join(timeout)
        if self._thread.is_alive():  # stuck: leave the sockets to the daemon thread
            log.warning("kv events: publisher thread did not stop within %.1fs", timeout)
            return
        self._close_sockets()

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:
                    log.exception("kv events: replay request failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
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
                try:
                    self._publish(self._events(items))
                except Exception:  # never let the publisher die
                    log.exception("kv events: unexpected error publishing a batch")
            if stop:
                return

    def _hash(self, hex_hash: str) -> int | bytes:
        raw = bytes.fromhex(hex_hash)
        if self.cfg.block_hash_format == "bytes":
            return raw
        return int.from_bytes(raw, "big") & _MASK64

    def _events(self, items: list[tuple]) -> list[dict[str, Any]]:
        """vLLM event maps for queued items, merging runs as vLLM does: consecutive
        chunks of one chain stored into one tier, consecutive removals from one tier."""
        out: list[dict[str, Any]] = []
        last_hex: str | None = None  # hash of the last block of out[-1] when it is a mergeable BlockStored
        for op, tier, key, meta in items:
            if op == "cleared":
                out.append({"type": "AllBlocksCleared"})
                last_hex = None
                continue
            h = key.rsplit(":", 1)[1]
            if op == "removed":
                prev = out[-1] if out else None
                if prev is not None and prev["type"] == "BlockRemoved" and prev["medium"] == tier:
                    prev["block_hashes"].append(self._hash(h))
                else:
                    out.append({"type": "BlockRemoved", "block_hashes": [self._hash(h)], "medium": tier})
                last_hex = None
                continue
            if meta is None:  # tokens unknown: vLLM's placeholder form
                out.append(_stored([self._hash(h)], None, [], 0, tier))
                last_hex = None
                continue
            parent, toks = meta
            prev = out[-1] if out else None
            if (
                prev is not None and last_hex is not None and parent == last_hex
                and prev["type"] == "BlockStored" and prev["medium"] == tier
                and prev["block_size"] == len(toks)
            ):
                prev["block_hashes"].append(self._hash(h))
                prev["token_ids"].extend(toks.tolist())
            else:
                out.append(_stored(
                    [self._hash(h)], None if parent is None else self._hash(parent), toks.tolist(), len(toks), tier
                ))
            last_hex = h
        return out

    def _publish(self, events: list[dict[str, Any]]) -> None:
        zmq = self._zmq
        payload = self._pack([time.time(), events, DATA_PARALLEL_RANK])
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart(  # type: ignore[union-attr]
                (self.cfg.topic.encode(), seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
            )
        except zmq.ZMQError as exc:  # a PUB socket drops at its HWM; a connect socket may not
            self.failed_sends += 1
            log.debug("kv events: batch %d not sent: %s", seq, exc)
            return
        self.published_batches += 1
        self.published_events += len(events)

    def _serve_replay(self) -> None:
        """A REQ client sent an 8-byte big-endian start sequence number: resend the
        buffered batches from there, then the end marker (vLLM's replay protocol)."""
        zmq = self._zmq
        frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)  # type: ignore[union-attr]
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.debug("kv events: ignoring a malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        topic = self.cfg.topic.encode()
        self.replays += 1
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart(  # type: ignore[union-attr]
                    (client, b"", topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)  # type: ignore[union-attr]


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
        self.publisher = KVEventPublisher(cfg.kv_events, namespace=cfg.namespace, model=cfg.model)
        self._hierarchy = engine.hierarchy
        if self.publisher.enabled:
            engine.hierarchy.add_listener(self.publisher.on_tier_event)
            engine.add_store_observer(self.publisher.remember)

    def info(self) -> dict[str, Any]:
        return self.publisher.stats()

    def close(self) -> None:
        self._hierarchy.flush()
        self.publisher.close()
