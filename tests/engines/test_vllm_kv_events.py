"""lmcache's KV events read by vLLM 0.33's own decoder (``vllm.distributed.kv_events``).

A real CacheEngine publishes on loopback; a ZMQ SUB socket receives the frames, and the
payloads are decoded with ``msgspec.msgpack.Decoder(type=KVEventBatch)``, as vLLM-based
routers do. The same decoded batch is then sent through vLLM's own ``ZmqEventPublisher``
to check that the frames (topic, sequence number, payload) have the same form.

Run: LMCACHE_ENGINE_TESTS=1 .venv-vllm/bin/python -m pytest tests/engines/test_vllm_kv_events.py -q
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _missing import missing  # noqa: E402

INSTALL = "bash requirements/setup-vllm.sh .venv-vllm .venv  (vllm==0.33.0 with --no-deps, see requirements/vllm.txt)"

try:
    import msgpack
    import msgspec
    import zmq
    from vllm.distributed.kv_events import (
        AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher,
    )
except ImportError as exc:  # pragma: no cover
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

from lmcache.engine import CacheEngine  # noqa: E402

CHUNK = 4
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

    def __init__(self, ctx, endpoint: str, probe, topic: bytes = b"kv-events"):
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
        "kv_events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0", "block_hash_format": fmt},
    }
    toks = list(range(50, 60))
    with CacheEngine.from_config(cfg) as e:
        sub = Sub(ctx, e.kv_events.endpoint, e.kv_events.cleared)
        e.store(toks, kv_for(10))
        e.flush()
        raw = [bytes.fromhex(h) for h in e.tokens.hashes(toks)]
        want = raw if fmt == "bytes" else [int.from_bytes(b, "big") & ((1 << 64) - 1) for b in raw]

        def stored(evs, medium):
            return [x for x in evs if isinstance(x, BlockStored) and x.medium == medium]

        evs = sub.until(lambda ev: all(sum(len(x.block_hashes) for x in stored(ev, m)) == 3 for m in ("cpu", "disk")),
                        decoder)
        for medium in ("cpu", "disk"):
            assert per_block(stored(evs, medium)) == [
                (want[0], None, toks[0:4], 4, medium),
                (want[1], want[0], toks[4:8], 4, medium),
                (want[2], want[1], toks[8:10], 2, medium),
            ]
            assert all(x.lora_id is None and x.lora_name is None for x in stored(evs, medium))
        n = len(evs)
        e.admin.clear(all=True)
        evs = sub.until(lambda ev: any(isinstance(x, AllBlocksCleared) for x in ev[n:]), decoder)
        tail = evs[n:]
        end = next(i for i, x in enumerate(tail) if isinstance(x, AllBlocksCleared))
        gone = [(h, x.medium) for x in tail[:end] if isinstance(x, BlockRemoved) for h in x.block_hashes]
        assert sorted(gone, key=repr) == sorted([(h, m) for h in want for m in ("cpu", "disk")], key=repr)
        batches = [decoder.decode(f[2]) for f in sub.frames]
        assert all(b.data_parallel_rank == 0 and b.ts > 0 for b in batches)
        seqs = [int.from_bytes(f[1], "big") for f in sub.frames]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_frames_match_vllms_own_publisher(tmp_path, ctx):
    """Our frames and vLLM's ZmqEventPublisher's for the same batch: same topic frame,
    same 8-byte sequence number, same msgpack value."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    with CacheEngine.from_config(
        {"chunk_size": CHUNK, "kv_events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0"}}
    ) as e:
        sub = Sub(ctx, e.kv_events.endpoint, e.kv_events.cleared)
        e.store(list(range(8)), kv_for(8))
        sub.until(lambda ev: any(isinstance(x, BlockStored) for x in ev), decoder)
    ours = sub.frames

    # vLLM binds ipc:// and wildcard endpoints (and connects to tcp://host:port), so use ipc
    vllm = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"ipc://{tmp_path}/vllm.sock", topic="kv-events")
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
        assert len(f) == len(g) == 3 and f[0] == g[0] == b"kv-events" and len(f[1]) == len(g[1]) == 8
        assert msgpack.unpackb(f[2]) == msgpack.unpackb(g[2])
