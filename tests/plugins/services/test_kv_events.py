"""KV events: a real ZMQ SUB socket on loopback reading what a real CacheEngine publishes.

The payloads are decoded with plain msgpack here; tests/engines/test_vllm_kv_events.py
decodes them with vLLM's own msgspec types.
"""

from __future__ import annotations

import logging
import sys
import time

import pytest
import torch

from lmcache.config import load_config
from lmcache.engine import CacheEngine
from lmcache.errors import ConfigError

from lmcache.plugins.services.kv_events import END_SEQ, KVEventPublisher

from _missing import missing

try:
    import msgpack
    import zmq
except ImportError as exc:  # make test installs lmcache[events]: absent, CI fails and elsewhere it skips
    msgpack = zmq = None
    _ABSENT = f"{exc.name} is not installed: pip install 'lmcache[events]'"
else:
    _ABSENT = None


@pytest.fixture(autouse=True)
def _needs_zmq_and_msgpack():
    if _ABSENT is not None:
        missing(_ABSENT)

CHUNK = 4
L, H, D = 2, 1, 4
HANG = 10.0  # seconds: a hang guard, not a timing assertion


def kv_for(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, n, H, D, generator=g)


def engine(tmp_path=None, *, cpu="1MiB", disk=None, **kv_events) -> CacheEngine:
    tiers = [{"backend": "cpu", "capacity": cpu}]
    if disk:
        tiers.append({"backend": "disk", "path": str(tmp_path / "disk"), "capacity": disk})
    ev = {"enabled": True, "endpoint": "tcp://127.0.0.1:0", **kv_events}
    return CacheEngine.from_config({"chunk_size": CHUNK, "tiers": tiers, "kv_events": ev})


def h64(hex_hash: str) -> int:
    return int.from_bytes(bytes.fromhex(hex_hash), "big") & ((1 << 64) - 1)


class Reader:
    """A SUB socket that has seen at least one message (so no later one is lost to ZMQ's
    slow-joiner window) and keeps everything it received."""

    def __init__(self, ctx, pub: KVEventPublisher, *, bind_first: str | None = None):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, pub.cfg.topic.encode())
        if bind_first is None:
            self.sub.connect(pub.endpoint)
        self.frames: list[list[bytes]] = []
        self.batches: list[list] = []
        deadline = time.monotonic() + HANG
        while not self.frames:  # AllBlocksCleared probes until the subscription is live
            assert time.monotonic() < deadline, "no event arrived"
            pub.cleared()
            if self.sub.poll(100):
                self._recv()

    def _recv(self) -> None:
        frames = self.sub.recv_multipart()
        self.frames.append(frames)
        self.batches.append(msgpack.unpackb(frames[2]))

    @property
    def events(self) -> list[dict]:
        return [ev for b in self.batches for ev in b[1]]

    def wait(self, pred) -> list[dict]:
        deadline = time.monotonic() + HANG
        while not pred(self.events):
            assert time.monotonic() < deadline, f"events never matched; got {self.events}"
            if self.sub.poll(100):
                self._recv()
        return self.events


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def stored(events, medium=None):
    return [e for e in events if e["type"] == "BlockStored" and (medium is None or e["medium"] == medium)]


def removed(events, medium=None):
    return [e for e in events if e["type"] == "BlockRemoved" and (medium is None or e["medium"] == medium)]


FIELDS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]


def blocks(evs) -> list[tuple]:
    """``(hash, parent, token ids, block_size)`` per block of BlockStored events."""
    out = []
    for e in evs:
        bs = e["block_size"]
        for i, h in enumerate(e["block_hashes"]):
            parent = e["parent_block_hash"] if i == 0 else e["block_hashes"][i - 1]
            out.append((h, parent, e["token_ids"][i * bs : (i + 1) * bs], bs))
    return out


def hashes(evs) -> list:
    return [h for e in evs for h in e["block_hashes"]]


def test_store_publishes_block_stored_per_tier(tmp_path, ctx):
    toks = list(range(100, 110))  # chunks of 4, 4 and a partial 2
    with engine(tmp_path, disk="8MiB") as e:
        r = Reader(ctx, e.kv_events)
        e.store(toks, kv_for(10))
        e.flush()
        want = [h64(h) for h in e.tokens.hashes(toks)]
        evs = r.wait(lambda ev: len(hashes(stored(ev, "disk"))) == 3 and len(hashes(stored(ev, "cpu"))) == 3)
        for medium in ("cpu", "disk"):
            got = stored(evs, medium)
            assert hashes(got) == want
            # per block: its hash, its parent (the previous chunk) and its tokens, however
            # the publisher merged runs of blocks into events
            assert blocks(got) == [
                (want[0], None, toks[0:4], 4), (want[1], want[0], toks[4:8], 4), (want[2], want[1], toks[8:], 2)
            ]
            assert all(g["lora_id"] is None and g["lora_name"] is None for g in got)
            assert all(list(g) == FIELDS for g in got)
        # storing again publishes nothing new for these chunks
        n = len(stored(evs))
        e.store(toks, kv_for(10))
        e.kv_events.cleared()
        evs = r.wait(lambda ev: ev[-1]["type"] == "AllBlocksCleared" and len(r.frames) > 1)
        assert len(stored(evs)) == n
        seqs = [int.from_bytes(f[1], "big") for f in r.frames]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gaps, in order
        assert all(f[0] == b"kv-events" and len(f) == 3 for f in r.frames)
        st = e.stats()["kv_events"]
        assert st["enabled"] and st["dropped_events"] == 0 and st["published_events"] >= len(r.events)


def test_parent_links_across_stores(ctx):
    toks = list(range(12))
    with engine() as e:
        r = Reader(ctx, e.kv_events)
        e.store(toks[:8], kv_for(8))
        e.store(toks, kv_for(12))  # extends the prefix by one chunk
        want = [h64(h) for h in e.tokens.hashes(toks)]
        evs = r.wait(lambda ev: len(hashes(stored(ev))) == 3)
        assert blocks(stored(evs))[2] == (want[2], want[1], toks[8:], CHUNK)


def test_evict_and_clear(tmp_path, ctx):
    toks = list(range(16))
    with engine(tmp_path, disk="8MiB") as e:
        r = Reader(ctx, e.kv_events)
        e.store(toks, kv_for(16))
        e.flush()
        want = [h64(h) for h in e.tokens.hashes(toks)]
        r.wait(lambda ev: len(hashes(stored(ev))) == 8)
        e.admin.evict("cpu", all=True)
        evs = r.wait(lambda ev: len(hashes(removed(ev, "cpu"))) == 4)
        assert sorted(hashes(removed(evs, "cpu"))) == sorted(want)
        assert not removed(evs, "disk")
        n = len(evs)
        # a retrieve promotes the chunks back into the CPU tier: BlockStored again, with tokens
        assert e.retrieve(toks).num_tokens == 16
        evs = r.wait(lambda ev: len(hashes(stored(ev[n:], "cpu"))) == 4)
        back = stored(evs[n:], "cpu")
        assert hashes(back) == want and [t for b in back for t in b["token_ids"]] == toks
        n = len(evs)
        result = e.admin.clear(all=True)
        assert not result["skipped"]
        evs = r.wait(lambda ev: any(x["type"] == "AllBlocksCleared" for x in ev[n:]))
        tail = evs[n:]
        cleared_at = next(i for i, x in enumerate(tail) if x["type"] == "AllBlocksCleared")
        assert sorted(hashes(removed(tail[:cleared_at]))) == sorted(want * 2)  # cpu and disk


def test_capacity_eviction_publishes_block_removed(ctx):
    chunk_bytes = L * 2 * CHUNK * H * D * 4
    with engine(cpu=2 * chunk_bytes) as e:
        r = Reader(ctx, e.kv_events)
        toks = list(range(16))
        e.store(toks, kv_for(16))  # 4 chunks into room for 2
        want = [h64(h) for h in e.tokens.hashes(toks)]
        evs = r.wait(lambda ev: len(hashes(removed(ev))) >= 2 and len(hashes(stored(ev))) >= 4)
        assert set(hashes(removed(evs))) <= set(want)
        assert e.stats()["tiers"]["cpu"]["entries"] == 4 - len(hashes(removed(evs)))


def test_bytes_hashes_and_connect_mode(ctx):
    """``bind: false`` connects to a router's SUB socket; ``bytes`` hashes are the digests."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    toks = list(range(8))
    with engine(endpoint=f"tcp://127.0.0.1:{port}", bind=False, block_hash_format="bytes", topic="t1") as e:
        deadline = time.monotonic() + HANG
        while not sub.poll(100):
            assert time.monotonic() < deadline
            e.kv_events.cleared()
        e.store(toks, kv_for(8))
        want = [bytes.fromhex(h) for h in e.tokens.hashes(toks)]
        got: list = []
        while len(got) < 2:
            assert time.monotonic() < deadline + HANG
            if sub.poll(100):
                topic, _, payload = sub.recv_multipart()
                assert topic == b"t1"
                got += hashes(stored(msgpack.unpackb(payload)[1]))
        assert got == want


def test_replay(ctx):
    with engine(replay_endpoint="tcp://127.0.0.1:0", buffer_steps=3) as e:
        pub = e.kv_events
        for i in range(5):
            e.store(list(range(i * 100, i * 100 + 4)), kv_for(4))
            deadline = time.monotonic() + HANG
            while pub.stats()["published_batches"] < i + 1:  # one batch per store, by waiting
                assert time.monotonic() < deadline
                time.sleep(0.01)
        # a DEALER, since one request is answered by several messages
        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(pub.replay_endpoint)
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while True:
            assert req.poll(HANG * 1000)
            empty, topic, seq, payload = req.recv_multipart()
            if seq == END_SEQ:
                assert topic == payload == b""
                break
            got.append(int.from_bytes(seq, "big"))
            assert topic == b"kv-events" and stored(msgpack.unpackb(payload)[1])
        assert got == [2, 3, 4]  # only the last buffer_steps batches
        # a malformed request is ignored, not fatal
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(pub.replay_endpoint)
        bad.send_multipart([b"", b"xx"])
        e.store(list(range(900, 904)), kv_for(4))
        deadline = time.monotonic() + HANG
        while pub.stats()["published_batches"] < 6:
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_no_subscriber_never_blocks_and_drops_are_counted():
    with engine(hwm=1, queue_size=8) as e:
        toks = list(range(4 * 256))
        res = e.store(toks, kv_for(len(toks)))  # nobody listens: the PUB socket drops
        assert res.stored_tokens == len(toks)
        pub = e.kv_events
        # a stalled sender: the listener runs with no chance for the sending thread to
        # drain (a huge GIL switch interval), so the bounded queue overflows
        old = sys.getswitchinterval()
        sys.setswitchinterval(30)
        try:
            for i in range(200):
                pub.on_tier_event("evict", "cpu", f"lmc1:default:default:sig:{i:032x}")
        finally:
            sys.setswitchinterval(old)
        st = pub.stats()
        assert st["dropped_events"] >= 200 - 8 - 1
        assert e.retrieve(toks).num_tokens == len(toks)


def test_bind_failure_disables_once_and_engine_works(ctx, caplog):
    with engine() as first:
        with caplog.at_level(logging.WARNING, logger="lmcache.plugins.services.kv_events"):
            with engine(endpoint=first.kv_events.endpoint) as e:
                assert not e.kv_events.enabled and "cannot bind" in e.kv_events.error
                toks = list(range(8))
                e.store(toks, kv_for(8))
                assert e.retrieve(toks).num_tokens == 8
                e.admin.clear(all=True)
                assert e.stats()["kv_events"]["enabled"] is False
        warnings = [r for r in caplog.records if r.name == "lmcache.plugins.services.kv_events"]
        assert len(warnings) == 1 and "kv events disabled" in warnings[0].getMessage()


def test_other_namespaces_are_not_published(ctx):
    with engine() as e:
        r = Reader(ctx, e.kv_events)
        e.kv_events.on_tier_event("admit", "cpu", "lmc1:other:default:sig:" + "0" * 32)
        e.store(list(range(4)), kv_for(4))
        evs = r.wait(lambda ev: len(stored(ev)) == 1)
        assert hashes(stored(evs)) == [h64(e.tokens.hashes(list(range(4)))[0])]


def test_disabled_by_default():
    with CacheEngine.from_config({"chunk_size": CHUNK}) as e:
        assert e.kv_events is None and "kv_events" not in e.stats()


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"endpoint": "http://127.0.0.1:1"}, "kv_events.endpoint"),
        ({"endpoint": "tcp://127.0.0.1"}, "kv_events.endpoint"),
        ({"queue_size": 0}, "kv_events.queue_size"),
        ({"block_hash_format": "hex"}, "kv_events.block_hash_format"),
        ({"enabled": "yes"}, "kv_events.enabled"),
        ({"port": 1}, "kv_events.port"),
        ("on", "kv_events"),
    ],
)
def test_config_errors_name_the_key(raw, key):
    with pytest.raises(ConfigError) as exc:
        load_config({"kv_events": raw})
    assert exc.value.key == key


def test_config_shortcuts_and_env():
    assert load_config({"kv_events": True}).kv_events.enabled
    c = load_config(environ={"LMCACHE_KV_EVENTS": "{enabled: true, topic: x, replay_endpoint: 'tcp://127.0.0.1:0'}"})
    assert c.kv_events.topic == "x" and c.kv_events.replay_endpoint == "tcp://127.0.0.1:0"
    assert c.to_dict()["kv_events"]["endpoint"] == "tcp://127.0.0.1:5557"
    assert load_config(c).kv_events == c.kv_events


def test_controller_worker_and_kv_events_both_get_tier_events(ctx):
    """The publisher is chained after the controller worker's listener, not instead of it."""
    from lmcache.controller.client import ControllerClient
    from lmcache.controller.service import ControllerServer

    with ControllerServer(port=0, instance_timeout=5) as ctl:
        cfg = {
            "chunk_size": CHUNK, "tiers": [{"backend": "cpu", "capacity": "1MiB"}],
            "controller": {"url": ctl.url, "heartbeat_interval": 0.1},
            "kv_events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0"},
        }
        toks = list(range(8))
        with CacheEngine.from_config(cfg) as e:
            r = Reader(ctx, e.kv_events)
            e.store(toks, kv_for(8))
            r.wait(lambda ev: len(hashes(stored(ev))) == 2)
            client = ControllerClient(ctl.url)
            deadline = time.monotonic() + HANG
            while [x["hit_tokens"] for x in client.lookup(toks)["results"]] != [8]:
                assert time.monotonic() < deadline, "the controller never saw the store"
                time.sleep(0.05)
