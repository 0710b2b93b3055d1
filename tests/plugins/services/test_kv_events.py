"""KV events: a real ZMQ SUB socket on loopback reading what a real CacheEngine publishes.

The payloads are decoded with plain msgpack here; tests/engines/test_vllm_kv_events.py
decodes them with vLLM's own msgspec types.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from lmcache.config import load_config
from lmcache.engine import CacheEngine
from lmcache.errors import ConfigError

from lmcache.plugins.services.kv_events import (
    KVEventPublisher, default_endpoint, default_topic, request_replay,
)
from lmcache.vllm_block_hash import BlockHasher

from _kv_flood import flood
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
BS = 2  # engine block size in most tests: two blocks per chunk
L, H, D = 2, 1, 4
HANG = 10.0  # seconds: a hang guard, not a timing assertion


def kv_for(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, n, H, D, generator=g)


def engine(tmp_path=None, *, cpu="1MiB", disk=None, **kv_events) -> CacheEngine:
    tiers = [{"backend": "cpu", "capacity": cpu}]
    if disk:
        tiers.append({"backend": "disk", "path": str(tmp_path / "disk"), "capacity": disk})
    ev = {"enabled": True, "endpoint": "tcp://127.0.0.1:0", "block_size": BS, **kv_events}
    return CacheEngine.from_config({"chunk_size": CHUNK, "tiers": tiers, "kv_events": ev})


def vh(toks, bs: int = BS, algo: str = "sha256") -> list[int]:
    """vLLM's int block hashes of ``toks`` (its ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` form)."""
    return [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in BlockHasher(algo).chain(toks, bs)]


class Reader:
    """A SUB socket that has seen at least one message (so no later one is lost to ZMQ's
    slow-joiner window) and keeps everything it received. It subscribes to ``kv@``, the
    prefix llm-d's subscriber filters on, unless told otherwise."""

    def __init__(self, ctx, pub: KVEventPublisher, *, subscribe: bytes = b"kv@"):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, subscribe)
        self.sub.connect(pub.endpoint)
        self.frames: list[list[bytes]] = []
        self.batches: list[list] = []
        deadline = time.monotonic() + HANG
        while not self.frames:  # empty batches probe until the subscription is live
            assert time.monotonic() < deadline, "no event arrived"
            pub.ping()
            if self.sub.poll(100):
                self._recv()

    def _recv(self) -> None:
        frames = self.sub.recv_multipart()
        self.frames.append(frames)
        self.batches.append(msgpack.unpackb(frames[2]))

    @property
    def events(self) -> list[dict]:
        return [ev for b in self.batches for ev in b[1]]

    @property
    def seqs(self) -> list[int]:
        return [int.from_bytes(f[1], "big") for f in self.frames]

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


FIELDS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
          "group_idx"]


def blocks(evs) -> list[tuple]:
    """``(hash, parent, token ids, block_size)`` per block of BlockStored events."""
    out = []
    for e in evs:
        bs = e["block_size"]
        for i, h in enumerate(e["block_hashes"]):
            parent = e["parent_block_hash"] if i == 0 else e["block_hashes"][i - 1]
            out.append((h, parent, e["token_ids"][i * bs : (i + 1) * bs], bs))
    return out


def chain(toks, bs: int = BS) -> list[tuple]:
    """What :func:`blocks` gives for vLLM's full blocks of ``toks``."""
    want = vh(toks, bs)
    return [(h, want[i - 1] if i else None, toks[i * bs : (i + 1) * bs], bs) for i, h in enumerate(want)]


def hashes(evs) -> list:
    return [h for e in evs for h in e["block_hashes"]]


def held(events) -> set[tuple]:
    """``(hash, medium)`` a consumer holds after applying ``events`` in order."""
    state: set[tuple] = set()
    for e in events:
        assert e["type"] != "AllBlocksCleared", "AllBlocksCleared clears the pod's GPU blocks too"
        for h in e.get("block_hashes", ()):
            (state.add if e["type"] == "BlockStored" else state.discard)((h, e["medium"]))
    return state


@pytest.mark.parametrize("bs", [2, 3, 8])
def test_store_publishes_engine_blocks_per_medium(tmp_path, ctx, bs):
    """A chunk is announced as the engine blocks whose last token falls in it, with vLLM's
    hashes; the partial trailing block never is; cpu is ``CPU``, disk ``STORAGE``."""
    toks = list(range(100, 110))  # chunks of 4, 4 and a partial 2
    with engine(tmp_path, disk="8MiB", block_size=bs) as e:
        pub = e.kv_events
        assert pub.topic == f"kv@127.0.0.1:{pub.endpoint.rpartition(':')[2]}@default"
        r = Reader(ctx, pub)
        e.store(toks, kv_for(10))
        e.flush()
        want = chain(toks, bs)
        assert len(want) == 10 // bs
        evs = r.wait(lambda ev: all(len(hashes(stored(ev, m))) == len(want) for m in ("CPU", "STORAGE")))
        for medium in ("CPU", "STORAGE"):
            got = stored(evs, medium)
            # per block: its hash, its parent and its tokens, however runs were merged
            assert blocks(got) == want
            assert all(g["lora_id"] is None and g["lora_name"] is None and g["group_idx"] == 0 for g in got)
            assert all(list(g) == FIELDS for g in got)
        # storing again publishes nothing new for these chunks
        n = len(stored(evs))
        e.store(toks, kv_for(10))
        pub.ping()
        evs = r.wait(lambda ev: len(r.frames) > 1 and r.batches[-1][1] == [])
        assert len(stored(evs)) == n
        assert r.seqs == list(range(r.seqs[0], r.seqs[0] + len(r.seqs)))  # no gaps, in order
        assert all(f[0] == pub.topic.encode() and len(f) == 3 for f in r.frames)
        st = e.stats()["kv_events"]
        assert st["enabled"] and st["dropped_events"] == 0 and st["published_events"] >= len(r.events)
        assert (st["block_size"], st["hash_algo"]) == (bs, "sha256")


def test_parent_links_across_stores(ctx):
    toks = list(range(12))
    with engine() as e:
        r = Reader(ctx, e.kv_events)
        e.store(toks[:8], kv_for(8))
        e.store(toks, kv_for(12))  # extends the prefix by one chunk
        evs = r.wait(lambda ev: len(hashes(stored(ev))) == 6)
        assert blocks(stored(evs)) == chain(toks)


def test_sha256_cbor_and_key_extra_not_announced(ctx):
    from lmcache.keys import KeyExtra

    toks = list(range(8))
    with engine(hash_algo="sha256_cbor") as e:
        r = Reader(ctx, e.kv_events)
        e.store(list(range(50, 58)), kv_for(8), extra=KeyExtra(scope=b"salt"))  # its vLLM hash needs extra keys
        e.store(toks, kv_for(8))
        evs = r.wait(lambda ev: len(hashes(stored(ev))) == 4)
        assert hashes(stored(evs)) == vh(toks, algo="sha256_cbor") != vh(toks)
        assert e.stats()["kv_events"]["unannounced"] == 2


def test_evict_and_clear(tmp_path, ctx):
    """A medium's removal only when its last tier drops a block; media still holding it
    are announced again; a clear is per-block removals, never AllBlocksCleared."""
    toks = list(range(16))
    with engine(tmp_path, disk="8MiB") as e:
        r = Reader(ctx, e.kv_events)
        e.store(toks, kv_for(16))
        e.flush()
        want = vh(toks)
        r.wait(lambda ev: len(hashes(stored(ev))) == 16)
        n = len(r.events)
        e.admin.evict("cpu", all=True)
        evs = r.wait(lambda ev: len(hashes(removed(ev, "CPU"))) == 8 and len(hashes(stored(ev[n:], "STORAGE"))) == 8)
        assert sorted(hashes(removed(evs, "CPU"))) == sorted(want)
        assert not removed(evs, "STORAGE")
        assert held(evs) == {(h, "STORAGE") for h in want}
        n = len(evs)
        # a retrieve promotes the chunks back into the CPU tier: BlockStored again, with tokens
        assert e.retrieve(toks).num_tokens == 16
        evs = r.wait(lambda ev: len(hashes(stored(ev[n:], "CPU"))) == 8)
        assert blocks(stored(evs[n:], "CPU")) == chain(toks)
        n = len(evs)
        result = e.admin.clear(all=True)
        assert not result["skipped"]
        evs = r.wait(lambda ev: not held(ev))
        assert sorted(hashes(removed(evs[n:], "CPU")) + hashes(removed(evs[n:], "STORAGE"))) == sorted(want * 2)
        assert e.stats()["kv_events"]["held_chunks"] == 0


def test_two_tiers_of_one_medium(tmp_path, ctx):
    """cpu and disk both ``CPU`` (kv_events.media): dropping the cpu copy removes nothing."""
    toks = list(range(8))
    with engine(tmp_path, disk="8MiB", media={"disk": "CPU"}) as e:
        r = Reader(ctx, e.kv_events)
        e.store(toks, kv_for(8))
        e.flush()
        r.wait(lambda ev: len(hashes(stored(ev))) == 4)
        e.admin.evict("cpu", all=True)
        e.kv_events.ping()
        k = len(r.frames)
        evs = r.wait(lambda ev: len(r.frames) > k)
        assert not removed(evs) and hashes(stored(evs)) == vh(toks)  # announced once, never removed
        e.admin.evict("disk", all=True)
        evs = r.wait(lambda ev: not held(ev))
        assert sorted(hashes(removed(evs, "CPU"))) == sorted(vh(toks)) and not removed(evs, "STORAGE")


def test_capacity_eviction_publishes_block_removed(ctx):
    chunk_bytes = L * 2 * CHUNK * H * D * 4
    with engine(cpu=2 * chunk_bytes) as e:
        r = Reader(ctx, e.kv_events)
        toks = list(range(16))
        e.store(toks, kv_for(16))  # 4 chunks into room for 2
        want = vh(toks)
        evs = r.wait(lambda ev: len(hashes(removed(ev))) >= 4 and len(hashes(stored(ev))) >= 8)
        assert set(hashes(removed(evs))) <= set(want)
        gone = len(hashes(removed(evs))) // (CHUNK // BS)
        assert e.stats()["tiers"]["cpu"]["entries"] == 4 - gone


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
            e.kv_events.ping()
        e.store(toks, kv_for(8))
        want = BlockHasher().chain(toks, BS)
        got: list = []
        while len(got) < 4:
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
        got = [seq for seq, _ in replay(ctx, pub, 0)]
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


def replay(ctx, pub: KVEventPublisher, start: int) -> list[tuple[int, list]]:
    """``(seq, events)`` the replay socket sends from ``start``."""
    got = request_replay(ctx, pub.replay_endpoint, start, HANG)
    assert all(topic == pub.topic.encode() for topic, _, _ in got)
    return [(seq, msgpack.unpackb(payload)[1]) for _, seq, payload in got]


def test_dropped_events_leave_a_sequence_gap_and_replay_serves_the_buffer(ctx):
    with engine(queue_size=8, replay_endpoint="tcp://127.0.0.1:0") as e:
        pub = e.kv_events
        r = Reader(ctx, pub)
        flood(e, 200)
        assert pub.stats()["dropped_events"] >= 200 - 8 - 1
        e.store(list(range(5000, 5004)), kv_for(4))  # after the drops
        r.wait(lambda ev: 5000 in [t for x in stored(ev) for t in x["token_ids"]])
        seqs = r.seqs
        gaps = [b for a, b in zip(seqs, seqs[1:]) if b != a + 1]
        assert gaps, f"no gap in {seqs}"
        assert pub.stats()["skipped_seqs"] >= 1
        # replay serves exactly what was published and is still buffered, gap included
        assert [(s, ev) for s, ev in replay(ctx, pub, seqs[0])] == list(zip(seqs, [b[1] for b in r.batches]))

def test_no_subscriber_never_blocks_and_drops_are_counted():
    with engine(hwm=1, queue_size=8) as e:
        toks = list(range(4 * 256))
        res = e.store(toks, kv_for(len(toks)))  # nobody listens: the PUB socket drops
        assert res.stored_tokens == len(toks)
        flood(e, 200)
        assert e.kv_events.stats()["dropped_events"] >= 200 - 8 - 1
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
        assert hashes(stored(evs)) == vh(list(range(4)))


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
        ({"block_size": 0}, "kv_events.block_size"),
        ({"hash_algo": "xxhash"}, "kv_events.hash_algo"),
        ({"host": "pod@x"}, "kv_events.host"),
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
    assert c.to_dict()["kv_events"]["endpoint"] is None
    assert (c.kv_events.block_size, c.kv_events.hash_algo) == (16, "sha256")  # vLLM's GPU and hash defaults
    assert load_config(c).kv_events == c.kv_events


def test_defaults_a_router_finds(monkeypatch):
    """Port 5558 (vLLM's publisher has 5557), bound on ``host``, else ``$POD_IP``, else
    loopback; topic ``kv@<host>:<port>@<model>`` (llm-d's form)."""
    monkeypatch.delenv("POD_IP", raising=False)
    cfg = load_config({"kv_events": True}).kv_events
    assert default_endpoint(cfg) == "tcp://127.0.0.1:5558"
    assert default_topic(cfg, "tcp://127.0.0.1:5558", "m/x") == "kv@127.0.0.1:5558@m/x"
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert default_endpoint(cfg) == "tcp://10.1.2.3:5558"
    assert default_topic(cfg, "tcp://10.1.2.3:5558", "m") == "kv@10.1.2.3:5558@m"
    assert default_topic(cfg, "tcp://*:6000", "m") == "kv@10.1.2.3:6000@m"  # a wildcard bind names the pod
    named = load_config({"kv_events": {"host": "fd00::1"}}).kv_events
    assert default_endpoint(named) == "tcp://[fd00::1]:5558"
    assert default_topic(named, "tcp://[fd00::1]:5558", "m") == "kv@fd00::1:5558@m"


def test_controller_worker_and_kv_events_both_get_tier_events(ctx):
    """The publisher is chained after the controller worker's listener, not instead of it."""
    from lmcache.plugins.services.controller_client import ControllerClient
    from lmcache.server.controller import ControllerServer

    with ControllerServer(port=0, instance_timeout=5) as ctl:
        cfg = {
            "chunk_size": CHUNK, "tiers": [{"backend": "cpu", "capacity": "1MiB"}],
            "controller": {"url": ctl.url, "heartbeat_interval": 0.1},
            "kv_events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0", "block_size": BS},
        }
        toks = list(range(8))
        with CacheEngine.from_config(cfg) as e:
            r = Reader(ctx, e.kv_events)
            e.store(toks, kv_for(8))
            r.wait(lambda ev: len(hashes(stored(ev))) == 4)
            client = ControllerClient(ctl.url)
            deadline = time.monotonic() + HANG
            while [x["hit_tokens"] for x in client.lookup(toks)["results"]] != [8]:
                assert time.monotonic() < deadline, "the controller never saw the store"
                time.sleep(0.05)


def n_hashes(events, tag: str) -> int:
    """Block hashes in events of ``tag``, map or array form."""
    return sum(len(x[1]) if isinstance(x, list) else len(x["block_hashes"])
               for x in events if (x[0] if isinstance(x, list) else x["type"]) == tag)


@pytest.mark.parametrize("form", ["map", "array"])
def test_router_rules_ingest_the_stream(ctx, form):
    """What llm-d and Dynamo make of the stream, by their rules as tests/_routers.py
    encodes them (llm-d-kv-cache pool.go/vllm_adapter.go/in_memory.go: the ``kv@`` filter,
    ``kv@<pod>@<model>`` topic, array-form events only, per-medium removals, cpu weight 0.8;
    Dynamo publisher.rs: blocks of its kv_block_size only, medium ignored)."""
    from tests._routers import DynamoIndex, LlmdIndex

    toks = list(range(1000, 1040))  # two full blocks of 16, eight tokens over
    with engine(block_size=16, event_form=form) as e:
        r = Reader(ctx, e.kv_events)
        e.store(toks, kv_for(40))
        r.wait(lambda ev: n_hashes(ev, "BlockStored") == 2)
        pod = e.kv_events.topic.split("@")[1]
        llmd, dyn = LlmdIndex(), DynamoIndex(16)
        for f in r.frames:
            llmd.ingest(f)
            dyn.ingest("w", f)
        if form == "map":  # llm-d drops map-form messages whole; Dynamo reads both
            assert llmd.score("default", toks) == {} and any("not an array" in d for d in llmd.dropped)
        else:
            assert llmd.score("default", toks) == {pod: pytest.approx(2 * 0.8)}
        assert dyn.score(toks) == {"w": 2}
        n = len(r.frames)
        e.admin.clear(all=True)
        r.wait(lambda ev: n_hashes(ev, "BlockRemoved") == 2)
        for f in r.frames[n:]:
            llmd.ingest(f)
            dyn.ingest("w", f)
        assert llmd.score("default", toks) == {} and dyn.score(toks) == {}
