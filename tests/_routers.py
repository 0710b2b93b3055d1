"""Pure-Python encodings of how two KV-aware routers ingest vLLM's KV events, so that
tests can check what they would make of lmcache's events without their binaries.

Each class states the rules it encodes and the file (repository, path, commit) that
states them. These are our readings of their code, re-expressed here; none of it was
run against llm-d's or Dynamo's binaries.

- :class:`LlmdIndex`: llm-d's KV-cache indexer (``llm-d/llm-d-kv-cache``);
- :class:`DynamoIndex`: Dynamo's KV router (``ai-dynamo/dynamo``);
- :class:`EventSubscriber`: a ZMQ SUB helper for live tests (``zmq`` imported lazily);
- :class:`PrefixRouter`: picks the instance with the best score (ties: round robin);
- :func:`block_stored` / :func:`block_removed` / :func:`all_blocks_cleared` /
  :func:`encode_batch`: vLLM-format events and payloads, built with msgpack as vLLM's
  msgspec encoder lays them out (map form: vLLM 0.32/0.33 here, where ``KVCacheEvent`` is
  ``tag=True`` without ``array_like``; array form: upstream vLLM's ``array_like=True``).

Needs only the standard library and ``msgpack`` (``xxhash`` for :class:`DynamoIndex`'s
scores); every size and count read from a payload is bounded.
"""

from __future__ import annotations

import struct
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import msgpack

from lmcache.errors import LMCacheError

#: largest payload decoded (bytes)
MAX_PAYLOAD = 64 << 20
#: most events in one batch, most hashes or tokens in one event
MAX_ITEMS = 1 << 20
_U64 = (1 << 64) - 1


class RouterRuleError(LMCacheError, ValueError):
    """A payload the encoded router would reject (the message says why)."""


# -- building vLLM-format events ---------------------------------------------------


def block_stored(block_hashes: Sequence[int | bytes], parent_block_hash: int | bytes | None,
                 token_ids: Sequence[int], block_size: int, medium: str | None = None,
                 lora_id: int | None = None, lora_name: str | None = None) -> dict:
    """A ``BlockStored`` as vLLM's msgspec map form: ``type`` tag, then the fields in the
    struct's order; ``lora_id``, ``medium``, ``lora_name`` have no default so they are always
    present (``None`` as nil); ``extra_keys`` and later fields default and are omitted."""
    return {"type": "BlockStored", "block_hashes": list(block_hashes),
            "parent_block_hash": parent_block_hash, "token_ids": list(token_ids),
            "block_size": block_size, "lora_id": lora_id, "medium": medium, "lora_name": lora_name}


def block_removed(block_hashes: Sequence[int | bytes], medium: str | None = None) -> dict:
    """A ``BlockRemoved`` (map form): ``block_hashes``, ``medium``."""
    return {"type": "BlockRemoved", "block_hashes": list(block_hashes), "medium": medium}


def all_blocks_cleared() -> dict:
    """An ``AllBlocksCleared`` (map form): the tag only."""
    return {"type": "AllBlocksCleared"}


#: vLLM 0.33's struct fields after those the builders set (all default to ``None``)
_LATER_FIELDS = {
    "BlockStored": ("extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                    "locality", "ownership", "session_id", "lookahead_token_ids"),
    "BlockRemoved": ("group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}


def as_array(event: Mapping[str, Any]) -> list:
    """The same event as upstream vLLM's ``array_like=True`` encoding: ``[tag, field, ...]``
    in vLLM 0.33's struct order, every field written (msgspec 0.23 does not omit defaults
    from array-like structs: the later fields are nil)."""
    later = [event.get(k) for k in _LATER_FIELDS[event["type"]]]
    return [event["type"], *(v for k, v in event.items() if k != "type"), *later]


def encode_batch(events: Iterable[Mapping[str, Any] | list], ts: float = 0.0,
                 data_parallel_rank: int | None = 0, array_like: bool = False) -> bytes:
    """``KVEventBatch`` payload: the array ``[ts, events, data_parallel_rank]`` (the rank
    omitted when ``None``, as msgspec's ``omit_defaults`` does)."""
    evs = [as_array(e) if array_like and isinstance(e, Mapping) else e for e in events]
    body: list = [float(ts), evs] + ([] if data_parallel_rank is None else [data_parallel_rank])
    return msgpack.packb(body, use_bin_type=True)


def frames(topic: str | bytes, seq: int, payload: bytes) -> list[bytes]:
    """The three ZMQ frames vLLM's ``ZmqEventPublisher`` sends: topic, 8-byte big-endian
    sequence number, payload."""
    t = topic.encode() if isinstance(topic, str) else topic
    return [t, seq.to_bytes(8, "big", signed=seq < 0), payload]


def _unpack(payload: bytes) -> Any:
    if len(payload) > MAX_PAYLOAD:
        raise RouterRuleError(f"payload of {len(payload)} bytes is over {MAX_PAYLOAD}")
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False, max_array_len=MAX_ITEMS,
                               max_map_len=MAX_ITEMS, max_str_len=1 << 20, max_bin_len=1 << 20)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise RouterRuleError(f"payload is not msgpack: {type(exc).__name__}: {exc}") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# -- llm-d ------------------------------------------------------------------------------

_LLMD = "llm-d/llm-d-kv-cache@7be76e119ca50c5700b3bca65a19b6a0218a9b62"


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for ai, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | ai]) + struct.pack(fmt, n)
    raise RouterRuleError(f"integer {n} does not fit in CBOR's 64 bits")


def cbor_canonical(v: Any) -> bytes:
    """CBOR canonical encoding of the values llm-d hashes: unsigned ints, text, arrays and
    nil (shortest heads; what fxamacker/cbor's ``CanonicalEncOptions`` writes for them)."""
    if v is None:
        return b"\xf6"
    if _is_int(v) and v >= 0:
        return _cbor_head(0, v)
    if isinstance(v, str):
        b = v.encode()
        return _cbor_head(3, len(b)) + b
    if isinstance(v, (list, tuple)):
        return _cbor_head(4, len(v)) + b"".join(cbor_canonical(x) for x in v)
    raise RouterRuleError(f"cannot CBOR-encode {type(v).__name__} here")


def fnv1a64(data: bytes) -> int:
    """FNV-1a, 64 bits (Go's ``hash/fnv.New64a``)."""
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & _U64
    return h


def _llmd_hash(raw: Any) -> int:
    # engineadapter/common.go getHashAsUint64: ints as uint64; bytes: the last 8, big-endian
    if _is_int(raw):
        return raw & _U64
    if isinstance(raw, bytes):
        if not raw:
            raise RouterRuleError("hash byte slice is empty")
        return int.from_bytes(raw[-8:], "big")
    raise RouterRuleError(f"unsupported hash type: {type(raw).__name__}")


def _opt(fields: list, i: int, kind: type, name: str) -> Any:
    v = fields[i] if i < len(fields) else None
    if v is not None and not (isinstance(v, kind) and not isinstance(v, bool)):
        raise RouterRuleError(f"{name} is not a {kind.__name__}: {type(v).__name__}")
    return v


class LlmdIndex:
    """llm-d's indexer as its code states it (``%s``):

    Subscription and decode:
    - SUB filter ``topic_filter`` (default ``"kv@"``, ``pkg/kvevents/pool.go`` ``DefaultConfig``),
      a ZMQ prefix match; a message without exactly 3 frames or with a sequence frame under
      8 bytes is skipped; sequence numbers are not checked for gaps
      (``pkg/kvevents/zmq_subscriber.go``).
    - Topic ``kv@<pod>@<model>``: split on ``@``; exactly 3 parts give (pod, model), anything
      else makes the whole topic the pod and the model ``""``
      (``pkg/kvevents/engineadapter/common.go`` ``parseTopic``).
    - Payload ``[ts, events, dp_rank?]``; every event must be a msgpack ARRAY ``[tag, ...]``
      (upstream vLLM's ``array_like=True``): a map-form event (vLLM 0.32/0.33 here, lmcache's
      map form) fails the decode and the whole message is dropped; so does an unknown tag,
      a bool/float where an int is due, or a non-string medium
      (``pkg/kvevents/engineadapter/vllm_adapter.go``). Hashes: ints as uint64, bytes as
      their last 8 bytes big-endian (``common.go`` ``getHashAsUint64``).

    Per event (``pkg/kvevents/pool.go`` ``processEventBatch``):
    - ``BlockStored``: tier = ``medium`` lowercased (absent: ``gpu``); any name is kept
      (``cpu``, ``storage``, ...). A non-empty ``lora_name`` replaces the model. A non-zero
      ``parent_block_hash`` is resolved to the LAST request key its engine key maps to; an
      unknown parent skips the event. Request keys are recomputed from ``token_ids`` in
      llm-d's own block size (``blockSizeTokens``, default 16; the event's ``block_size`` is
      not used for keys); partial trailing tokens give no key. Engine keys map to request
      keys by the ratio of their counts (1:1, many:1, 1:many; ``kvblock/in_memory.go`` ``Add``),
      and the (pod, tier) entry is added to every request key (an LRU of 10 entries per key).
      With empty ``token_ids`` the engine keys' existing request keys get the entry
      (``handleDeviceTierUpdate``); non-empty tokens shorter than one block do nothing.
    - ``BlockRemoved``: PER MEDIUM: removes only the (pod, tier) entry from the request keys
      of each engine key (unknown engine keys are ignored); the engine-key mapping goes
      when none of its request keys holds any entry (``in_memory.go`` ``Evict``).
    - ``AllBlocksCleared``: pod-wide, every tier (``in_memory.go`` ``Clear``).

    Request keys (``pkg/kvcache/kvblock/token_processor.go``): FNV-1a 64 over the CBOR
    canonical encoding of ``[parent, tokens, extra]``; the chain starts from
    ``hash(fnv1a64(hashSeed), nil, model)``; ``extra`` is nil without multimodal data
    (``extra_keys`` are not encoded here: such an event is skipped and counted).

    Score (``pkg/kvcache/kvblock_scorer.go`` ``LongestPrefixScorer``, weights from
    ``pkg/kvcache/backend.go``: ``gpu`` 1.0, ``cpu`` 0.8, nothing else; a tier without a
    weight counts 1.0): walk the prompt's request keys from the first; a pod stays while
    it holds each key on some tier and adds the largest weight of its tiers there.
    """

    DEFAULT_WEIGHTS = {"gpu": 1.0, "cpu": 0.8}

    def __init__(self, *, topic_filter: str = "kv@", block_size_tokens: int = 16, hash_seed: str = "",
                 weights: Mapping[str, float] | None = None, pod_cache_size: int = 10):
        if block_size_tokens <= 0:
            raise RouterRuleError(f"blockSizeTokens must be greater than 0, got {block_size_tokens}")
        self.topic_filter = topic_filter.encode()
        self.block_size = block_size_tokens
        self.weights = dict(self.DEFAULT_WEIGHTS if weights is None else weights)
        self.pod_cache_size = pod_cache_size
        self._init_hash = fnv1a64(hash_seed.encode())
        self.data: dict[int, OrderedDict] = {}  # request key -> LRU of (pod, tier, group)
        self.engine_to_request: dict[int, list[int]] = {}
        self.dropped: list[str] = []  # why messages or events were not applied

    # - keys
    def _hash(self, parent: int, tokens: list[int] | None, extra: Any) -> int:
        return fnv1a64(cbor_canonical([parent, tokens, extra]))

    def request_keys(self, model: str, token_ids: Sequence[int], parent: int = 0) -> list[int]:
        """llm-d's request keys for ``token_ids`` (full blocks only), chained from
        ``parent`` (0: from the model's initial hash)."""
        prefix = parent or self._hash(self._init_hash, None, model)
        out = []
        bs = self.block_size
        for i in range(0, len(token_ids) - bs + 1, bs):
            prefix = self._hash(prefix, [t & 0xFFFFFFFF for t in token_ids[i:i + bs]], None)
            out.append(prefix)
        return out

    # - ingest
    def ingest(self, msg: Sequence[bytes]) -> bool:
        """One ZMQ message (its frames): ``True`` if decoded and applied; otherwise the
        reason is appended to ``dropped``."""
        if msg and not bytes(msg[0]).startswith(self.topic_filter):
            self.dropped.append(f"topic {bytes(msg[0])!r} does not match filter {self.topic_filter!r}")
            return False
        if len(msg) != 3 or len(msg[1]) < 8:
            self.dropped.append("not 3 frames with an 8-byte sequence number")
            return False
        topic = bytes(msg[0]).decode(errors="replace")
        parts = topic.split("@")
        pod, model = (parts[1], parts[2]) if len(parts) == 3 else (topic, "")
        try:
            events = self.decode(bytes(msg[2]))
        except RouterRuleError as exc:
            self.dropped.append(f"failed to decode vLLM event batch: {exc}")
            return False
        self.apply(pod, model, events)
        return True

    @staticmethod
    def decode(payload: bytes) -> list[tuple]:
        """The batch's events as ``(tag, fields)``; raises :class:`RouterRuleError` where
        llm-d's adapter fails the whole message."""
        batch = _unpack(payload)
        if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
            raise RouterRuleError("batch is not an array [ts, events, ...]")
        out = []
        for ev in batch[1]:
            if not isinstance(ev, list):
                raise RouterRuleError(f"failed to decode tagged union: event is a {type(ev).__name__}, "
                                      "not an array (map-form events are not decoded)")
            if not ev or not isinstance(ev[0], str):
                raise RouterRuleError("malformed tagged union: no string tag")
            if ev[0] == "BlockStored":
                if len(ev) < 5:
                    raise RouterRuleError(f"BlockStored: need at least 5 fields, got {len(ev)}")
                if not isinstance(ev[1], list) or not isinstance(ev[3], list):
                    raise RouterRuleError("BlockStored: block_hashes/token_ids is not an array")
                if not _is_int(ev[4]) or not all(_is_int(t) for t in ev[3]):
                    raise RouterRuleError("BlockStored: block_size/token_ids: unsupported numeric type")
                group = _opt(ev, 9, int, "group_idx")
                if group is not None and group < 0:
                    raise RouterRuleError(f"BlockStored: group_idx: negative value: {group}")
                fields = {"hashes": [_llmd_hash(h) for h in ev[1]],
                          "parent": 0 if ev[2] is None else _llmd_hash(ev[2]),
                          "tokens": [t & 0xFFFFFFFF for t in ev[3]], "block_size": ev[4],
                          "lora_id": _opt(ev, 5, int, "lora_id"), "medium": _opt(ev, 6, str, "medium"),
                          "lora_name": _opt(ev, 7, str, "lora_name"),
                          "extra_keys": _opt(ev, 8, list, "extra_keys"), "group": group}
            elif ev[0] == "BlockRemoved":
                if len(ev) < 2 or not isinstance(ev[1], list):
                    raise RouterRuleError("BlockRemoved: block_hashes is not an array")
                fields = {"hashes": [_llmd_hash(h) for h in ev[1]], "medium": _opt(ev, 2, str, "medium"),
                          "group": _opt(ev, 3, int, "group_idx")}
            elif ev[0] == "AllBlocksCleared":
                fields = {}
            else:
                raise RouterRuleError(f"unknown vLLM event tag: {ev[0]}")
            out.append((ev[0], fields))
        return out

    def apply(self, pod: str, model: str, events: Iterable[tuple]) -> None:
        """Apply decoded events of ``pod`` (``pool.go`` ``processEventBatch``)."""
        for tag, f in events:
            if tag == "AllBlocksCleared":
                self.clear(pod)
                continue
            entry = (pod, (f["medium"] or "gpu").lower(), f["group"])
            if tag == "BlockRemoved":
                for h in f["hashes"]:
                    self._evict(h, entry)
                continue
            eff_model = f["lora_name"] or model
            parent_rk = 0
            if f["parent"] != 0:
                rks = self.engine_to_request.get(f["parent"])
                if not rks:
                    self.dropped.append(f"BlockStored: parent {f['parent']} not found; event skipped")
                    continue
                parent_rk = rks[-1]
            if f["extra_keys"] is not None and any(k is not None for k in f["extra_keys"]):
                self.dropped.append("BlockStored: extra_keys are not encoded by this model; event skipped")
                continue
            rks = self.request_keys(eff_model, f["tokens"], parent_rk)
            if rks:
                self._add(f["hashes"], rks, entry)
            elif not f["tokens"] and f["hashes"]:  # handleDeviceTierUpdate
                found = [self.engine_to_request[h][-1] for h in f["hashes"] if self.engine_to_request.get(h)]
                if found:
                    self._add(None, list(dict.fromkeys(found)), entry)

    def _add(self, engine_keys: list[int] | None, request_keys: list[int], entry: tuple) -> None:
        if engine_keys:
            n = max(len(engine_keys), len(request_keys))
            new: dict[int, list[int]] = {}
            for i in range(n):
                new.setdefault(engine_keys[i * len(engine_keys) // n], []).append(
                    request_keys[i * len(request_keys) // n])
            self.engine_to_request.update(new)
        for rk in request_keys:
            lru = self.data.setdefault(rk, OrderedDict())
            lru[entry] = None
            lru.move_to_end(entry)
            while len(lru) > self.pod_cache_size:
                lru.popitem(last=False)

    def _evict(self, engine_key: int, entry: tuple) -> None:
        rks = self.engine_to_request.get(engine_key)
        if rks is None:
            return
        for rk in rks:
            lru = self.data.get(rk)
            if lru is not None:
                lru.pop(entry, None)
                if not lru:
                    del self.data[rk]
        if all(rk not in self.data for rk in rks):
            del self.engine_to_request[engine_key]

    def clear(self, pod: str) -> None:
        """Every entry of ``pod``, all tiers (the engine-key mapping stays, as in llm-d)."""
        for rk in list(self.data):
            lru = self.data[rk]
            for e in [e for e in lru if e[0] == pod]:
                del lru[e]
            if not lru:
                del self.data[rk]

    # - score
    def tiers(self, model: str, token_ids: Sequence[int]) -> list[dict[str, set[str]]]:
        """Per request key of the prompt: ``{pod: tiers holding it}``."""
        out = []
        for rk in self.request_keys(model, token_ids):
            per: dict[str, set[str]] = {}
            for pod, tier, _g in self.data.get(rk, ()):
                per.setdefault(pod, set()).add(tier)
            out.append(per)
        return out

    def score(self, model: str, token_ids: Sequence[int], pods: Iterable[str] = ()) -> dict[str, float]:
        """``{pod: score}`` as llm-d's ``LongestPrefixScorer`` gives it (``pods`` limits
        the pods considered, as ``ScoreTokens``' ``podIdentifiers``)."""
        wanted = set(pods)
        keys = self.tiers(model, token_ids)
        if not keys:
            return {}

        def best(per: dict[str, set[str]]) -> dict[str, float]:
            return {p: max(self.weights.get(t, 1.0) for t in ts) for p, ts in per.items()
                    if not wanted or p in wanted}

        scores = best(keys[0])
        active = set(scores)
        for per in keys[1:]:
            if not active:
                break
            cur = best(per)
            for p in list(active):
                if p in cur:
                    scores[p] += cur[p]
                else:
                    active.discard(p)
        return scores


LlmdIndex.__doc__ = LlmdIndex.__doc__ % _LLMD


# -- Dynamo ------------------------------------------------------------------------------

_DYNAMO_PUB = "ai-dynamo/dynamo lib/llm/src/kv_router/publisher.rs@43855aecd4403a5fedd179746eb23aeceb011e85"
_DYNAMO_IDX = "ai-dynamo/dynamo lib/llm/src/kv_router/indexer.rs@322fb3afc36e8427a5df6b871a00ecb679404050"
#: ``XXH3_SEED`` of Dynamo's indexer.rs
DYNAMO_XXH3_SEED = 1337


class DynamoListenerPanic(RouterRuleError):
    """The event would panic Dynamo's ZMQ listener task (it stops reading that worker)."""


class _Node:
    __slots__ = ("children", "workers")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.workers: dict[tuple[str, int], int] = {}


def dynamo_local_hashes(token_ids: Sequence[int], kv_block_size: int) -> list[int]:
    """Dynamo's ``compute_block_hash_for_seq``: per full block, xxh3-64 with seed 1337 over
    the tokens as little-endian u32 bytes (not chained: the radix tree carries the prefix)."""
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - xxhash is in lmcache's requirements
        raise RouterRuleError("DynamoIndex needs the xxhash package (pip install xxhash)") from exc
    out = []
    for i in range(0, len(token_ids) - kv_block_size + 1, kv_block_size):
        data = struct.pack(f"<{kv_block_size}I", *token_ids[i:i + kv_block_size])
        out.append(xxhash.xxh3_64_intdigest(data, seed=DYNAMO_XXH3_SEED))
    return out


class DynamoIndex:
    """Dynamo's KV router as its code states it (``%s``; radix tree and scores from ``%s``).

    Listener (``start_zmq_listener``): one SUB per worker, subscribed to its configured
    topic (prefix match, ``""`` = all); events are the listener's worker's, whatever the
    topic. Not 3 frames, or a sequence frame not exactly 8 bytes: skipped. The payload must
    decode as ``KvEventBatch {ts: f64, events, data_parallel_rank: u32}``: a batch without an
    integer rank fails and is dropped whole, as is one with a bytes hash (hashes are i64 or
    u64), a token outside u32, or a non-string medium. Events may be maps (``type`` tag) or
    arrays (tag first); unknown keys and extra trailing elements are ignored.

    Conversion (``convert_event``, ``create_stored_blocks``):
    - ``BlockStored``: ``medium`` is read and IGNORED (a CPU or STORAGE block counts as a GPU
      one); ``lora_id`` is ignored; every block is taken as ``block_size`` tokens and the walk
      stops at the first block whose size differs from the worker's ``kv_block_size``, so an
      event of another block size stores nothing. Each kept block gets its local hash from
      its own tokens (:func:`dynamo_local_hashes`); ``token_ids`` shorter than the kept blocks
      need panic the listener (a slice out of range: :class:`DynamoListenerPanic`, and this
      worker's later messages are ignored).
    - ``BlockRemoved``: ``medium`` IGNORED: the worker loses the blocks whatever tier sent it.
    - ``AllBlocksCleared``: every block of the worker (all dp ranks).

    Radix tree (``RadixTree::apply_event``), per (worker, dp_rank): a store whose parent hash
    the worker does not hold is skipped whole; blocks hang under the parent by local hash.
    A removal stops at the first hash the worker does not hold (earlier ones are removed); a
    block left with no worker loses its children. Score (``find_matches``): walk the prompt's
    local hashes from the root; each matched block adds 1 to every worker on it; stop at the
    first miss. (Dynamo's scheduler then weighs overlap against load: not encoded here.)
    """

    def __init__(self, kv_block_size: int, *, topic: str = ""):
        self.kv_block_size = kv_block_size
        self.topic = topic.encode()
        self.root = _Node()
        self.lookup: dict[tuple[str, int], dict[int, _Node]] = {}
        self.dead: set[str] = set()
        self.dropped: list[str] = []

    def ingest(self, worker_id: str, msg: Sequence[bytes]) -> bool:
        """One ZMQ message read by ``worker_id``'s listener: ``True`` if applied."""
        if worker_id in self.dead:
            self.dropped.append(f"listener of {worker_id} panicked earlier")
            return False
        if msg and not bytes(msg[0]).startswith(self.topic):
            self.dropped.append(f"topic {bytes(msg[0])!r} not subscribed")
            return False
        if len(msg) != 3 or len(msg[1]) != 8:
            self.dropped.append("not 3 frames with an 8-byte sequence number")
            return False
        try:
            rank, events = self.decode(bytes(msg[2]))
        except RouterRuleError as exc:
            self.dropped.append(f"Failed to decode KVEventBatch msgpack: {exc}")
            return False
        for tag, f in events:
            try:
                self._apply(worker_id, rank, tag, f)
            except DynamoListenerPanic:
                self.dead.add(worker_id)
                raise
        return True

    @staticmethod
    def decode(payload: bytes) -> tuple[int, list[tuple]]:
        """``(dp_rank, [(tag, fields)])``; raises :class:`RouterRuleError` where rmp_serde
        fails the batch."""
        batch = _unpack(payload)
        if isinstance(batch, dict):
            batch = [batch.get("ts"), batch.get("events"),
                     batch.get("data_parallel_rank", batch.get("dp_rank"))]
        if not isinstance(batch, list) or len(batch) < 3:
            raise RouterRuleError("KvEventBatch needs ts, events, data_parallel_rank")
        ts, evs, rank = batch[:3]
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(evs, list):
            raise RouterRuleError("ts is not a number or events not an array")
        if not _is_int(rank) or not 0 <= rank < 1 << 32:
            raise RouterRuleError(f"data_parallel_rank is not a u32: {rank!r}")
        return rank, [DynamoIndex._event(ev) for ev in evs]

    @staticmethod
    def _event(ev: Any) -> tuple:
        names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                                 "lora_id", "medium"),
                 "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}
        if isinstance(ev, dict):
            tag = ev.get("type")
            f = {k: ev.get(k) for k in names.get(tag, ())}
        elif isinstance(ev, list) and ev and isinstance(ev[0], str):
            tag = ev[0]
            f = dict(zip(names.get(tag, ()), ev[1:]))
        else:
            raise RouterRuleError("a kv event must be a tagged map or sequence")
        if tag not in names:
            raise RouterRuleError(f"unknown variant {tag!r}")
        for k in names[tag]:
            f.setdefault(k, None)
        for k in ("block_hashes",) + (("token_ids", "block_size") if tag == "BlockStored" else ()):
            if tag != "AllBlocksCleared" and f[k] is None:
                raise RouterRuleError(f"missing field {k}")

        def h64(v: Any) -> int:
            if not _is_int(v) or not -(1 << 63) <= v <= _U64:
                raise RouterRuleError(f"block hash {v!r} is not an i64/u64")
            return v & _U64

        if tag == "AllBlocksCleared":
            return tag, f
        if not isinstance(f["block_hashes"], list):
            raise RouterRuleError("block_hashes is not an array")
        f["block_hashes"] = [h64(v) for v in f["block_hashes"]]
        if f["medium"] is not None and not isinstance(f["medium"], str):
            raise RouterRuleError("medium is not a string")
        if tag == "BlockStored":
            toks, bs = f["token_ids"], f["block_size"]
            if not isinstance(toks, list) or not all(_is_int(t) and 0 <= t < 1 << 32 for t in toks):
                raise RouterRuleError("token_ids are not u32")
            if not _is_int(bs) or bs < 0:
                raise RouterRuleError("block_size is not a usize")
            if f["lora_id"] is not None and not (_is_int(f["lora_id"]) and f["lora_id"] >= 0):
                raise RouterRuleError("lora_id is not a u64")
            f["parent_block_hash"] = None if f["parent_block_hash"] is None else h64(f["parent_block_hash"])
        return tag, f

    def _apply(self, worker_id: str, rank: int, tag: str, f: dict) -> None:
        worker = (worker_id, rank)
        look = self.lookup.setdefault(worker, {})
        if tag == "AllBlocksCleared":
            for w in [w for w in self.lookup if w[0] == worker_id]:
                for node in self.lookup[w].values():
                    node.workers.pop(w, None)
                    if not node.workers:
                        node.children.clear()
                self.lookup[w] = {}
            return
        if tag == "BlockRemoved":
            for h in f["block_hashes"]:
                node = look.get(h)
                if node is None:
                    self.dropped.append(f"BlockRemoved: block {h} not found; rest of the removal skipped")
                    return
                node.workers.pop(worker, None)
                if not node.workers:
                    node.children.clear()
                del look[h]
            return
        blocks = []
        toks, bs = f["token_ids"], f["block_size"]
        for i, h in enumerate(f["block_hashes"]):
            if bs != self.kv_block_size:
                self.dropped.append(f"Block not published. Block size must be {self.kv_block_size} tokens "
                                    f"to be published. Block size is: {bs}")
                break
            if len(toks) < (i + 1) * bs:
                raise DynamoListenerPanic(f"token_ids[{i * bs}..{(i + 1) * bs}] out of range for "
                                          f"{len(toks)} tokens: the listener task panics")
            blocks.append((h, dynamo_local_hashes(toks[i * bs:(i + 1) * bs], bs)[0]))
        parent = self.root
        if f["parent_block_hash"] is not None:
            found = look.get(f["parent_block_hash"])
            if found is None:
                self.dropped.append("Failed to find parent block; skipping store operation")
                return
            parent = found
        for ext, local in blocks:
            child = parent.children.get(local)
            if child is None:
                child = look.get(ext) or _Node()
                parent.children[local] = child
            child.workers[worker] = ext
            look[ext] = child
            parent = child

    def score(self, token_ids: Sequence[int]) -> dict[str, int]:
        """``{worker: matched prefix blocks}`` (``find_matches`` without early exit); a
        worker with a dp rank other than 0 is named ``worker#rank``."""
        scores: dict[str, int] = {}
        node = self.root
        for local in dynamo_local_hashes(token_ids, self.kv_block_size):
            node = node.children.get(local)
            if node is None:
                break
            for wid, rank in node.workers:
                key = wid if rank == 0 else f"{wid}#{rank}"
                scores[key] = scores.get(key, 0) + 1
        return scores


DynamoIndex.__doc__ = DynamoIndex.__doc__ % (_DYNAMO_PUB, _DYNAMO_IDX)


# -- live helpers ------------------------------------------------------------------------


class Message(NamedTuple):
    """One received message: topic, sequence number, raw payload."""

    topic: bytes
    seq: int
    payload: bytes

    def batch(self) -> Any:
        """The decoded ``[ts, events, dp_rank]``."""
        return _unpack(self.payload)


class EventSubscriber:
    """A ZMQ SUB socket on a KV-event publisher, for live tests: ``connect`` (or ``bind``)
    ``endpoint`` with ``topic`` as the subscription prefix; :meth:`collect` reads until a
    deadline. Sequence numbers that do not follow the previous one of the same topic are
    recorded in ``gaps`` as ``(topic, expected, got)``. Messages over ``max_bytes`` are
    refused by ZMQ (``MAXMSGSIZE``); ones without 3 frames are counted in ``malformed``."""

    def __init__(self, endpoint: str, topic: str | bytes = b"", *, bind: bool = False,
                 max_bytes: int = MAX_PAYLOAD):
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode() if isinstance(topic, str) else topic)
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT) if bind else endpoint
        self.last_seq: dict[bytes, int] = {}
        self.gaps: list[tuple[bytes, int, int]] = []
        self.malformed = 0

    def collect(self, deadline_s: float, until: Callable[[list[Message]], bool] | None = None,
                max_messages: int = 100_000) -> list[Message]:
        """Messages received within ``deadline_s`` seconds, returning early once ``until``
        (called on the list so far) is true or ``max_messages`` arrived."""
        out: list[Message] = []
        end = time.monotonic() + deadline_s
        while len(out) < max_messages and not (until and out and until(out)):
            left = end - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                break
            parts = self.sock.recv_multipart()
            if len(parts) != 3 or len(parts[1]) != 8:
                self.malformed += 1
                continue
            seq = int.from_bytes(parts[1], "big", signed=True)
            prev = self.last_seq.get(parts[0])
            if prev is not None and seq != prev + 1:
                self.gaps.append((parts[0], prev + 1, seq))
            self.last_seq[parts[0]] = seq
            out.append(Message(parts[0], seq, parts[2]))
        return out

    def close(self) -> None:
        self.sock.close(0)
        self._ctx.term()

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class PrefixRouter:
    """Route a prompt to the instance with the best score from ``scorer`` (e.g.
    ``functools.partial(llmd.score, model)`` or ``dynamo.score``); instances the scorer
    does not name score 0; ties (an all-zero score included) go round robin."""

    def __init__(self, instances: Sequence[str], scorer: Callable[[Sequence[int]], Mapping[str, float]]):
        if not instances:
            raise RouterRuleError("PrefixRouter needs at least one instance")
        self.instances = list(instances)
        self.scorer = scorer
        self._turn = 0

    def route(self, token_ids: Sequence[int]) -> str:
        scores = self.scorer(token_ids) or {}
        best = max(scores.get(i, 0) for i in self.instances)
        tied = [i for i in self.instances if scores.get(i, 0) == best]
        choice = tied[self._turn % len(tied)]
        self._turn += 1
        return choice
