"""The rules two KV-aware routers apply to vLLM's KV events, as encoded in
tests/_routers.py, checked on handcrafted vLLM-format payloads.

Which rules and from which files:
- ``LlmdIndex``: llm-d/llm-d-kv-cache @7be76e1: ``pkg/kvevents/zmq_subscriber.go`` (3 frames,
  SUB prefix filter), ``pkg/kvevents/pool.go`` (default filter ``kv@``, medium lowercased,
  default ``gpu``, parent resolution, per-medium removal, pod-wide clear),
  ``pkg/kvevents/engineadapter/{vllm_adapter,common}.go`` (array-form events only, topic
  ``kv@<pod>@<model>``, hash forms), ``pkg/kvcache/kvblock/token_processor.go`` (request keys:
  FNV-1a 64 over canonical CBOR, llm-d's own block size), ``pkg/kvcache/kvblock/in_memory.go``
  (engine->request key ratio mapping, Evict, Clear), ``pkg/kvcache/kvblock_scorer.go`` +
  ``pkg/kvcache/backend.go`` (longest prefix, weights gpu 1.0 / cpu 0.8, others 1.0).
- ``DynamoIndex``: ai-dynamo/dynamo ``lib/llm/src/kv_router/publisher.rs`` @43855ae (map or
  array events, medium ignored, block size must equal kv_block_size, integer hashes and
  rank) and ``lib/llm/src/kv_router/indexer.rs`` @322fb3a (xxh3-64 seed 1337 local hashes,
  radix tree, removal per worker, overlap score).
These are our encodings of their code; their binaries were never run here.
"""

from __future__ import annotations

import functools
import struct

import pytest
import xxhash
import zmq

from tests import _routers as r

PROMPT = list(range(1000, 1064))  # 4 blocks of 16
OTHER = list(range(5000, 5064))
HASHES = [101, 102, 103, 104]
MODEL = "m"
HANG = 10.0  # seconds: a hang guard, not a timing assertion


def llmd_msg(pod: str, *events: dict, seq: int = 0, topic: str | None = None) -> list[bytes]:
    return r.frames(topic or f"kv@{pod}@{MODEL}", seq, r.encode_batch(events, array_like=True))


def stored(medium: str | None, hashes=HASHES, tokens=PROMPT, parent=None, block_size=16) -> dict:
    return r.block_stored(hashes, parent, tokens, block_size, medium)


# -- the payload form ---------------------------------------------------------------------


def test_events_follow_vllm_033_struct_order() -> None:
    """Map form as vLLM 0.33's msgspec writes it (``tag=True``, no ``array_like``): the tag,
    then the struct's fields in order; array form: every field, later ones nil."""
    batch = r.encode_batch([stored("CPU"), r.block_removed([1], "CPU"), r.all_blocks_cleared()], ts=1.5)
    ts, (bs, br, ac), rank = r._unpack(batch)
    assert (ts, rank) == (1.5, 0)
    assert list(bs) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                        "lora_id", "medium", "lora_name"]
    assert list(br) == ["type", "block_hashes", "medium"] and ac == {"type": "AllBlocksCleared"}
    arr = r.as_array(bs)
    assert arr[:8] == ["BlockStored", HASHES, None, PROMPT, 16, None, "CPU", None]
    assert len(arr) == 16 and arr[8:] == [None] * 8
    assert r.as_array(br) == ["BlockRemoved", [1], "CPU", None, None, None]
    assert r.frames("t", 5, b"p") == [b"t", b"\0" * 7 + b"\5", b"p"]


def test_llmd_hash_primitives_match_their_definitions() -> None:
    """CBOR canonical heads (RFC 8949 examples) and FNV-1a 64 test vectors."""
    cases = {0: "00", 23: "17", 24: "1818", 1000: "1903e8", 1000000: "1a000f4240",
             2**64 - 1: "1bffffffffffffffff", "a": "6161", None: "f6"}
    for v, hexed in cases.items():
        assert r.cbor_canonical(v).hex() == hexed
    assert r.cbor_canonical([1, [2, 3]]).hex() == "8201820203"
    assert r.fnv1a64(b"") == 0xCBF29CE484222325 and r.fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    ix = r.LlmdIndex(hash_seed="s")
    init = r.fnv1a64(r.cbor_canonical([r.fnv1a64(b"s"), None, MODEL]))
    first = r.fnv1a64(r.cbor_canonical([init, PROMPT[:16], None]))
    assert ix.request_keys(MODEL, PROMPT)[0] == first and len(ix.request_keys(MODEL, PROMPT[:40])) == 2


# -- llm-d ----------------------------------------------------------------------------------


def test_llmd_topic_filter_drops_non_kv_topics() -> None:
    ix = r.LlmdIndex()
    assert not ix.ingest(llmd_msg("a", stored("GPU"), topic="kv-events"))
    assert "does not match filter" in ix.dropped[-1] and ix.score(MODEL, PROMPT) == {}
    assert ix.ingest(llmd_msg("a", stored("GPU")))
    assert ix.score(MODEL, PROMPT) == {"a": 4.0}
    # not three @-parts: the whole topic is the pod, the model is "" (keys differ from "m")
    assert ix.ingest(llmd_msg("x", stored("GPU"), topic="kv@b"))
    assert ix.score("", PROMPT) == {"kv@b": 4.0}


def test_llmd_drops_map_form_events_whole_batch() -> None:
    """llm-d decodes events positionally (upstream vLLM's array_like=True): vLLM 0.33's map
    form fails the whole message."""
    ix = r.LlmdIndex()
    payload = r.encode_batch([stored("GPU")])  # map form
    assert not ix.ingest(r.frames(f"kv@a@{MODEL}", 0, payload))
    assert "not an array" in ix.dropped[-1] and ix.score(MODEL, PROMPT) == {}
    assert ix.ingest(r.frames(f"kv@a@{MODEL}", 1, r.encode_batch([stored("GPU")], array_like=True)))


def test_llmd_tier_weights() -> None:
    """CPU hit = 0.8 of a GPU hit; STORAGE (lowercased ``storage``) has no default weight and
    counts 1.0 like GPU, unless configured."""
    ix = r.LlmdIndex()
    ix.ingest(llmd_msg("g", stored("GPU")))
    ix.ingest(llmd_msg("c", stored("CPU")))
    ix.ingest(llmd_msg("s", stored("STORAGE")))
    ix.ingest(llmd_msg("n", stored(None)))  # no medium: gpu
    scores = ix.score(MODEL, PROMPT)
    assert scores["c"] == pytest.approx(0.8 * scores["g"]) and scores["g"] == 4.0
    assert scores["s"] == 4.0 and scores["n"] == 4.0
    tuned = r.LlmdIndex(weights={"gpu": 1.0, "cpu": 0.8, "storage": 0.5})
    tuned.ingest(llmd_msg("s", stored("STORAGE")))
    assert tuned.score(MODEL, PROMPT) == {"s": 2.0}
    assert {t for per in ix.tiers(MODEL, PROMPT) for ts in per.values() for t in ts} == {"gpu", "cpu", "storage"}


def test_llmd_removal_is_per_medium() -> None:
    """BlockRemoved(CPU) drops only the (pod, cpu) entry; STORAGE still holds the blocks."""
    ix = r.LlmdIndex(weights={"gpu": 1.0, "cpu": 0.8, "storage": 0.5})
    ix.ingest(llmd_msg("a", stored("CPU"), stored("STORAGE")))
    assert ix.score(MODEL, PROMPT) == {"a": pytest.approx(3.2)}
    ix.ingest(llmd_msg("a", r.block_removed(HASHES, "CPU"), seq=1))
    assert ix.score(MODEL, PROMPT) == {"a": 2.0}
    ix.ingest(llmd_msg("a", r.block_removed(HASHES, "STORAGE"), seq=2))
    assert ix.score(MODEL, PROMPT) == {} and ix.engine_to_request == {}
    # a repeated BlockStored after a removal restores the medium
    ix.ingest(llmd_msg("a", stored("STORAGE"), seq=3))
    assert ix.score(MODEL, PROMPT) == {"a": 2.0}


def test_llmd_clear_is_pod_wide() -> None:
    ix = r.LlmdIndex()
    ix.ingest(llmd_msg("a", stored("GPU"), stored("CPU")))
    ix.ingest(llmd_msg("b", stored("CPU")))
    ix.ingest(llmd_msg("a", r.all_blocks_cleared(), seq=1))
    assert ix.score(MODEL, PROMPT) == {"b": pytest.approx(3.2)}


def test_llmd_keys_come_from_tokens_in_its_own_block_size() -> None:
    """The event's block_size is not used: one engine hash for 128 tokens (vLLM's CPU
    backend) maps to 8 request keys of 16, and its removal drops all 8."""
    prompt = list(range(128))
    ix = r.LlmdIndex()
    ix.ingest(llmd_msg("a", stored("CPU", hashes=[7], tokens=prompt, block_size=128)))
    assert ix.score(MODEL, prompt) == {"a": pytest.approx(8 * 0.8)}
    assert len(ix.engine_to_request[7]) == 8
    ix.ingest(llmd_msg("a", r.block_removed([7], "CPU"), seq=1))
    assert ix.score(MODEL, prompt) == {}
    wide = r.LlmdIndex(block_size_tokens=32)
    wide.ingest(llmd_msg("a", stored("GPU", hashes=[1, 2, 3, 4], tokens=prompt, block_size=32)))
    assert wide.score(MODEL, prompt) == {"a": 4.0}


def test_llmd_parent_must_be_known() -> None:
    ix = r.LlmdIndex()
    ix.ingest(llmd_msg("a", stored("GPU", hashes=[9], tokens=PROMPT[32:48], parent=999)))
    assert "parent 999 not found" in ix.dropped[-1]
    ix.ingest(llmd_msg("a", stored("GPU", hashes=[1, 2], tokens=PROMPT[:32]), seq=1))
    ix.ingest(llmd_msg("a", stored("CPU", hashes=[3, 4], tokens=PROMPT[32:], parent=2), seq=2))
    assert ix.score(MODEL, PROMPT) == {"a": pytest.approx(2 + 2 * 0.8)}


def test_llmd_empty_tokens_add_a_tier_to_known_blocks() -> None:
    """``token_ids: []`` (vLLM's offload placeholders, lmcache's unknown-token chunks) adds the
    tier to the request keys the engine hashes already map to; unknown hashes: nothing."""
    ix = r.LlmdIndex()
    ix.ingest(llmd_msg("a", stored("GPU")))
    ix.ingest(llmd_msg("a", stored("CPU", tokens=[], block_size=0), seq=1))
    ix.ingest(llmd_msg("a", r.block_removed(HASHES, "GPU"), seq=2))
    assert ix.score(MODEL, PROMPT) == {"a": pytest.approx(3.2)}
    ix.ingest(llmd_msg("b", stored("CPU", hashes=[555], tokens=[], block_size=0)))
    assert "b" not in ix.score(MODEL, PROMPT)


# -- Dynamo ---------------------------------------------------------------------------------


def dyn_msg(*events: dict, seq: int = 0, **kw) -> list[bytes]:
    return r.frames("", seq, r.encode_batch(events, **kw))


def test_dynamo_local_hash_is_xxh3_seed_1337_of_le_u32() -> None:
    blocks = r.dynamo_local_hashes(PROMPT[:40], 16)
    assert len(blocks) == 2
    assert blocks[0] == xxhash.xxh3_64_intdigest(struct.pack("<16I", *PROMPT[:16]), seed=1337)


def test_dynamo_drops_blocks_of_another_block_size() -> None:
    ix = r.DynamoIndex(16)
    assert ix.ingest("w", dyn_msg(stored("GPU", hashes=[1, 2], tokens=PROMPT, block_size=32)))
    assert ix.score(PROMPT) == {} and "Block size must be 16" in ix.dropped[-1]
    assert ix.ingest("w", dyn_msg(stored("GPU"), seq=1))
    assert ix.score(PROMPT) == {"w": 4}


def test_dynamo_ignores_medium() -> None:
    """A CPU/STORAGE block counts as a GPU one; a removal of any medium drops the block from
    the worker (STORAGE still holding it or not), and a repeated BlockStored (what lmcache
    sends for the media still holding it) restores it."""
    ix = r.DynamoIndex(16)
    ix.ingest("g", dyn_msg(stored("GPU")))
    ix.ingest("s", dyn_msg(stored("CPU"), stored("STORAGE")))
    assert ix.score(PROMPT) == {"g": 4, "s": 4}
    ix.ingest("s", dyn_msg(r.block_removed(HASHES, "CPU"), seq=1))
    assert ix.score(PROMPT) == {"g": 4}
    ix.ingest("s", dyn_msg(stored("STORAGE"), seq=2))
    assert ix.score(PROMPT) == {"g": 4, "s": 4}


def test_dynamo_decode_rules() -> None:
    ix = r.DynamoIndex(16)
    assert ix.ingest("w", dyn_msg(stored("GPU"), array_like=True))  # arrays decode too
    for bad in (dyn_msg(stored("GPU"), data_parallel_rank=None),  # rank missing
                dyn_msg(stored("GPU", hashes=[b"\1" * 16] * 4)),  # bytes hashes
                [b"", b"\0" * 4, r.encode_batch([stored("GPU")])]):  # short sequence frame
        assert not ix.ingest("v", bad)
    assert ix.score(PROMPT) == {"w": 4}
    sub = r.DynamoIndex(16, topic="kv@")
    assert not sub.ingest("w", r.frames("other", 0, r.encode_batch([stored("GPU")])))


def test_dynamo_parent_and_removal_rules() -> None:
    ix = r.DynamoIndex(16)
    ix.ingest("w", dyn_msg(stored("GPU", hashes=[3, 4], tokens=PROMPT[32:], parent=2)))
    assert ix.score(PROMPT) == {} and "parent" in ix.dropped[-1]
    ix.ingest("w", dyn_msg(stored("GPU", hashes=[1, 2], tokens=PROMPT[:32]), seq=1))
    ix.ingest("w", dyn_msg(stored("GPU", hashes=[3, 4], tokens=PROMPT[32:], parent=2), seq=2))
    assert ix.score(PROMPT) == {"w": 4}
    ix.ingest("w", dyn_msg(r.block_removed([4, 999, 3]), seq=3))  # stops at 999: 3 stays
    assert ix.score(PROMPT) == {"w": 3} and "999 not found" in ix.dropped[-1]
    ix.ingest("w", dyn_msg(r.all_blocks_cleared(), seq=4))
    assert ix.score(PROMPT) == {}


def test_dynamo_short_token_ids_panic_the_listener() -> None:
    ix = r.DynamoIndex(16)
    assert ix.ingest("w", dyn_msg(stored("CPU", tokens=[], block_size=0)))  # lmcache's placeholder: dropped
    with pytest.raises(r.DynamoListenerPanic, match="out of range"):
        ix.ingest("w", dyn_msg(stored("CPU", tokens=[], block_size=16)))
    assert not ix.ingest("w", dyn_msg(stored("GPU"), seq=1))
    assert ix.score(PROMPT) == {}


# -- routing ----------------------------------------------------------------------------------


def test_router_prefers_the_pod_that_announced_the_prompt() -> None:
    llmd, dyn = r.LlmdIndex(), r.DynamoIndex(16)
    llmd.ingest(llmd_msg("b", stored("CPU")))
    dyn.ingest("b", dyn_msg(stored("STORAGE")))
    for scorer in (functools.partial(llmd.score, MODEL), dyn.score):
        router = r.PrefixRouter(["a", "b", "c"], scorer)
        assert [router.route(PROMPT) for _ in range(3)] == ["b", "b", "b"]
        assert [router.route(OTHER) for _ in range(3)] == ["a", "b", "c"]  # ties: round robin


# -- live subscriber ----------------------------------------------------------------------------


def test_event_subscriber_filters_and_reports_gaps() -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        with r.EventSubscriber(f"tcp://127.0.0.1:{port}", "kv@") as sub:
            probe = b"kv@probe@m"
            for i in range(int(HANG / 0.05)):  # until the subscription reached the publisher
                pub.send_multipart(r.frames(probe, i, r.encode_batch([])))
                if sub.collect(0.05):
                    break
            else:
                pytest.fail("subscriber never received the probe")
            payload = r.encode_batch([stored("CPU")], array_like=True)
            for topic, seq in ((b"other", 0), (b"kv@a@m", 0), (b"kv@a@m", 1), (b"kv@a@m", 3)):
                pub.send_multipart(r.frames(topic, seq, payload))
            got = [m for m in sub.collect(HANG, until=lambda ms: sum(m.topic == b"kv@a@m" for m in ms) == 3)
                   if m.topic == b"kv@a@m"]
            assert [m.seq for m in got] == [0, 1, 3]
            assert [g for g in sub.gaps if g[0] == b"kv@a@m"] == [(b"kv@a@m", 2, 3)]
            assert b"other" not in sub.last_seq
            ix = r.LlmdIndex()
            assert all(ix.ingest(r.frames(*m)) for m in got)
            assert ix.score(MODEL, PROMPT) == {"a": pytest.approx(3.2)}
    finally:
        pub.close(0)
        ctx.term()
