"""lmcache's KV events read by vLLM 0.33's own decoder (``vllm.distributed.kv_events``).

A real CacheEngine publishes on loopback; a ZMQ SUB socket receives the frames, and the
payloads are decoded with ``msgspec.msgpack.Decoder(type=KVEventBatch)``, as vLLM-based
routers do. The same decoded batch is then sent through vLLM's own ``ZmqEventPublisher``
to check that the frames (topic, sequence number, payload) have the same form. Block
hashes are compared with vLLM's own ``hash_block_tokens`` over ``init_none_hash``.

Run: LMCACHE_ENGINE_TESTS=1 .venv-vllm/bin/python -m pytest tests/engines/test_vllm_kv_events.py -q
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _kv_flood import flood  # noqa: E402
from _missing import missing  # noqa: E402

INSTALL = "bash requirements/setup-vllm.sh .venv-vllm .venv  (vllm==0.33.0 with --no-deps, see requirements/vllm.txt)"

try:
    import msgpack
    import msgspec
    import zmq
    from vllm.distributed.kv_events import (
        AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher,
    )
    from vllm.utils.hashing import sha256, sha256_cbor
    from vllm.v1.core import kv_cache_utils
except ImportError as exc:  # pragma: no cover
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

from lmcache.engine import CacheEngine  # noqa: E402
from lmcache.plugins.services.kv_events import request_replay  # noqa: E402

CHUNK = 4
BS = 2
HANG = 10.0  # seconds: a hang guard, not a timing assertion


@pytest.fixture(autouse=True)
def _need_vllm():
    if _IMPORT_ERROR is not None:
        missing(f"vllm's kv_events are not importable ({_IMPORT_ERROR}); install it with: {INSTALL}")


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def kv_for(n: int) -> torch.Tensor:
    return torch.randn(2, 2, n, 1, 4, generator=torch.Generator().manual_seed(n))


class Sub:
    """A SUB socket past ZMQ's slow-joiner window, keeping the raw frames."""

    def __init__(self, ctx, endpoint: str, probe, topic: bytes = b"kv@"):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.frames: list[list[bytes]] = []
        deadline = time.monotonic() + HANG
        while not self.frames:
            assert time.monotonic() < deadline, "nothing was published"
            probe()
            if self.sock.poll(100):
                self.frames.append(self.sock.recv_multipart())

    def until(self, pred, decoder) -> list:
        deadline = time.monotonic() + HANG
        while True:
            batches = [decoder.decode(f[2]) for f in self.frames]
            events = [e for b in batches for e in b.events]
            if pred(events):
                return events
            assert time.monotonic() < deadline, f"events never matched: {events}"
            if self.sock.poll(100):
                self.frames.append(self.sock.recv_multipart())


def vllm_hashes(toks, bs: int, algo: str = "sha256", fmt: str = "int") -> list:
    """vLLM's own block hashes of the full blocks of ``toks`` (int: as its
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` default publishes them)."""
    fn = {"sha256": sha256, "sha256_cbor": sha256_cbor}[algo]
    kv_cache_utils.init_none_hash(fn)
    out, parent = [], None
    for i in range(len(toks) // bs):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, toks[i * bs : (i + 1) * bs])
        out.append(parent)
    return out if fmt == "bytes" else [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in out]


def per_block(events) -> list[tuple]:
    out = []
    for e in events:
        for i, h in enumerate(e.block_hashes):
            parent = e.parent_block_hash if i == 0 else e.block_hashes[i - 1]
            out.append((h, parent, e.token_ids[i * e.block_size : (i + 1) * e.block_size], e.block_size, e.medium))
    return out


@pytest.mark.parametrize("fmt", ["int", "bytes"])
def test_vllm_decoder_reads_our_events(tmp_path, ctx, fmt):
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    cfg = {
        "chunk_size": CHUNK,
        "tiers": [{"backend": "cpu", "capacity": "1MiB"}, {"backend": "disk", "path": str(tmp_path), "capacity": "8MiB"}],
        "kv_events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0", "block_hash_format": fmt, "block_size": BS},
    }
    toks = list(range(50, 61))  # chunks of 4, 4 and 3: five full blocks of 2, the last token in none
    with CacheEngine.from_config(cfg) as e:
        sub = Sub(ctx, e.kv_events.endpoint, e.kv_events.ping)
        e.store(toks, kv_for(11))
        e.flush()
        want = vllm_hashes(toks, BS, fmt=fmt)

        def stored(evs, medium):
            return [x for x in evs if isinstance(x, BlockStored) and x.medium == medium]

        evs = sub.until(lambda ev: all(sum(len(x.block_hashes) for x in stored(ev, m)) == 5
                                       for m in ("CPU", "STORAGE")), decoder)
        for medium in ("CPU", "STORAGE"):
            assert per_block(stored(evs, medium)) == [
                (want[i], want[i - 1] if i else None, toks[2 * i : 2 * i + 2], BS, medium) for i in range(5)
            ]
            assert all(x.lora_id is None and x.lora_name is None and x.group_idx == 0 and x.extra_keys is None
                       for x in stored(evs, medium))
        n = len(evs)
        e.admin.clear(all=True)

        def gone(evs):
            return sorted(((h, x.medium) for x in evs if isinstance(x, BlockRemoved) for h in x.block_hashes), key=repr)

        everything = sorted([(h, m) for h in want for m in ("CPU", "STORAGE")], key=repr)
        evs = sub.until(lambda ev: gone(ev[n:]) == everything, decoder)  # a clear is per-block removals
        assert not any(isinstance(x, AllBlocksCleared) for x in evs)
        batches = [decoder.decode(f[2]) for f in sub.frames]
        assert all(b.data_parallel_rank == 0 and b.ts > 0 for b in batches)
        seqs = [int.from_bytes(f[1], "big") for f in sub.frames]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_block_hashes_are_vllms_own(ctx, algo):
    """Default block_size (16, vLLM's GPU default) over lmcache chunks of 32 (blocks
    straddle nothing) and of 24 (every other block straddles two chunks): the hashes,
    parents and token ids are those vLLM computes for the same tokens."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    toks = [(7919 * i) % 151_000 for i in range(100)]  # six full blocks of 16, four tokens over
    want = vllm_hashes(toks, 16, algo)
    for chunk in (32, 24):
        cfg = {"chunk_size": chunk, "kv_events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0", "hash_algo": algo}}
        with CacheEngine.from_config(cfg) as e:
            assert e.kv_events.stats()["block_size"] == 16
            sub = Sub(ctx, e.kv_events.endpoint, e.kv_events.ping)
            e.store(toks, kv_for(100))
            evs = sub.until(lambda ev: sum(len(x.block_hashes) for x in ev if isinstance(x, BlockStored)) == 6,
                            decoder)
        assert per_block([x for x in evs if isinstance(x, BlockStored)]) == [
            (want[i], want[i - 1] if i else None, toks[16 * i : 16 * i + 16], 16, "CPU") for i in range(6)
        ]


def test_a_dropped_batch_is_a_sequence_gap_and_replay_serves_the_buffer(ctx):
    """A full queue drops events: vLLM's decoder reads every frame, the sequence numbers
    show a gap, and vLLM's replay protocol returns the batches still buffered."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    cfg = {"chunk_size": CHUNK, "kv_events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0", "block_size": BS,
                                              "queue_size": 8, "replay_endpoint": "tcp://127.0.0.1:0"}}
    with CacheEngine.from_config(cfg) as e:
        pub = e.kv_events
        sub = Sub(ctx, pub.endpoint, pub.ping)
        flood(e, 200)  # through the real listener, its sender starved: the queue of 8 overflows
        e.store(list(range(5000, 5004)), kv_for(4))
        sub.until(lambda ev: any(5000 in x.token_ids for x in ev if isinstance(x, BlockStored)), decoder)
        seqs = [int.from_bytes(f[1], "big") for f in sub.frames]
        assert any(b != a + 1 for a, b in zip(seqs, seqs[1:])), f"no gap in {seqs}"
        replayed = [(seq, decoder.decode(payload))
                    for _, seq, payload in request_replay(ctx, pub.replay_endpoint, seqs[0], HANG)]
        assert [s for s, _ in replayed] == seqs
        assert [b.events for _, b in replayed] == [decoder.decode(f[2]).events for f in sub.frames]


def test_frames_match_vllms_own_publisher(tmp_path, ctx):
    """Our frames and vLLM's ZmqEventPublisher's for the same batch: same topic frame,
    same 8-byte sequence number, same msgpack value."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    with CacheEngine.from_config(
        {"chunk_size": CHUNK, "kv_events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0", "block_size": BS}}
    ) as e:
        sub = Sub(ctx, e.kv_events.endpoint, e.kv_events.ping)
        e.store(list(range(8)), kv_for(8))
        sub.until(lambda ev: any(isinstance(x, BlockStored) for x in ev), decoder)
        topic = e.kv_events.topic
    ours = sub.frames
    assert topic.startswith("kv@127.0.0.1:") and topic.endswith("@default")  # llm-d's kv@<pod>@<model>

    # vLLM binds ipc:// and wildcard endpoints (and connects to tcp://host:port), so use ipc
    vllm = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"ipc://{tmp_path}/vllm.sock", topic=topic)
    try:
        theirs = Sub(ctx, f"ipc://{tmp_path}/vllm.sock",
                     lambda: vllm.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()])))
        for f in ours:
            vllm.publish(decoder.decode(f[2]))
        deadline = time.monotonic() + HANG
        first = int.from_bytes(theirs.frames[-1][1], "big") + 1
        got: dict[int, list[bytes]] = {}
        while len(got) < len(ours):
            assert time.monotonic() < deadline
            if theirs.sock.poll(100):
                fr = theirs.sock.recv_multipart()
                seq = int.from_bytes(fr[1], "big")
                if seq >= first:
                    got[seq - first] = fr
    finally:
        vllm.shutdown()
    for i, f in enumerate(ours):
        g = got[i]
        assert len(f) == len(g) == 3 and f[0] == g[0] == topic.encode() and len(f[1]) == len(g[1]) == 8
        assert msgpack.unpackb(f[2]) == msgpack.unpackb(g[2])


def test_replay_frames_match_vllms_own_publisher(tmp_path, ctx):
    """vLLM 0.33's replay protocol, answered by our publisher and by vLLM's own
    ``ZmqEventPublisher`` for the same batches: the same messages (``"", topic, seq,
    payload`` to a DEALER, then ``"", "", END_SEQ, ""``), and a REQ client, as vLLM's
    example subscriber uses, gets the same first reply from both."""
    cfg = {"chunk_size": CHUNK, "kv_events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0", "block_size": BS,
                                              "replay_endpoint": "tcp://127.0.0.1:0"}}
    with CacheEngine.from_config(cfg) as e:
        pub = e.kv_events
        for i in range(3):
            e.store(list(range(100 * i, 100 * i + 8)), kv_for(8))
        deadline = time.monotonic() + HANG
        while pub.stats()["published_events"] < 3:
            assert time.monotonic() < deadline, "our batches were never published"
            time.sleep(0.01)
        ours = request_replay(ctx, pub.replay_endpoint, 0, HANG)
        first_ours = _req_first(ctx, pub.replay_endpoint)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    replay_ep = f"ipc://{tmp_path}/vllm-replay.sock"
    vllm = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"ipc://{tmp_path}/vllm.sock",
                             replay_endpoint=replay_ep, topic=pub.topic)
    try:
        for _, _, payload in ours:
            vllm.publish(decoder.decode(payload))
        deadline = time.monotonic() + HANG
        while len(theirs := request_replay(ctx, replay_ep, 0, HANG)) < len(ours):
            assert time.monotonic() < deadline, f"vLLM's publisher buffered {len(theirs)} of {len(ours)} batches"
            time.sleep(0.05)
        first_theirs = _req_first(ctx, replay_ep)
    finally:
        vllm.shutdown()
    assert [(t, s) for t, s, _ in ours] == [(t, s) for t, s, _ in theirs] == [
        (pub.topic.encode(), s) for s in range(len(ours))]
    assert [msgpack.unpackb(p) for _, _, p in ours] == [msgpack.unpackb(p) for _, _, p in theirs]
    assert first_ours[:2] == first_theirs[:2] == [pub.topic.encode(), (0).to_bytes(8, "big")]
    assert msgpack.unpackb(first_ours[2]) == msgpack.unpackb(first_theirs[2])


def _req_first(ctx, endpoint: str) -> list[bytes]:
    """The first reply a REQ socket gets to a replay request from seq 0."""
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    try:
        req.connect(endpoint)
        req.send((0).to_bytes(8, "big"))
        assert req.poll(int(HANG * 1000)), f"no replay from {endpoint}"
        return req.recv_multipart()
    finally:
        req.close()
