from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import lmcache
from lmcache.config import KVSpec, load_config
from lmcache.errors import KVShapeError

L, H, D = 3, 2, 16


def kv_for(tokens, dtype=torch.float32):
    """Deterministic KV per token value: a prefix always has the same KV."""
    t = torch.as_tensor(list(tokens), dtype=torch.float64)
    base = torch.arange(L * 2 * H * D, dtype=torch.float64).reshape(L, 2, 1, H, D)
    return (torch.sin(base * 0.01 + t.reshape(1, 1, -1, 1, 1) * 0.37)).to(dtype)


def engine(tmp_path=None, cpu="4MiB", disk=None, **kw):
    tiers = [{"backend": "cpu", "capacity": cpu}]
    if disk:
        tiers.append({"backend": "disk", "path": str(tmp_path / "disk"), "capacity": disk})
    return lmcache.CacheEngine.from_config({"chunk_size": 16, "tiers": tiers, **kw})


def test_store_lookup_retrieve_exact():
    toks = list(range(100))
    kv = kv_for(toks)
    with engine() as e:
        assert e.lookup(toks) == 0
        assert e.retrieve(toks).num_tokens == 0
        r = e.store(toks, kv)
        assert (r.stored_tokens, r.skipped_tokens) == (100, 0)
        assert e.lookup(toks) == 100
        res = e.retrieve(toks)
        assert res.num_tokens == 100 and torch.equal(res.kv, kv)
        assert res.tiers == ["cpu"] * 7


def test_token_types_are_interchangeable():
    toks = list(range(40))
    kv = kv_for(toks)
    with engine() as e:
        e.store(np.array(toks), kv)
        assert e.lookup(torch.tensor(toks)) == 40
        assert torch.equal(e.retrieve(toks).kv, kv)


def test_only_new_chunks_are_stored_and_prefix_hits():
    a = list(range(64))
    b = a[:40] + [999] * 30
    with engine() as e:
        e.store(a, kv_for(a))
        r = e.store(b, kv_for(b))
        assert r.skipped_tokens == 32 and r.stored_tokens == 38  # chunks 0,1 shared
        # a prompt extending a cached one hits its cached prefix
        longer = a + [5, 6, 7]
        assert e.lookup(longer) == 64
        res = e.retrieve(longer)
        assert res.num_tokens == 64 and torch.equal(res.kv, kv_for(a))
        # diverging inside the third chunk: only two chunks hit
        c = a[:40] + [1] * 24
        assert e.lookup(c) == 32


def test_unfull_chunk_saving():
    toks = list(range(20))
    with engine() as e:
        e.store(toks, kv_for(toks))
        assert e.lookup(toks) == 20
        assert e.lookup(toks[:18]) == 16  # a different partial tail
    with engine(save_unfull_chunk=False) as e:
        r = e.store(toks, kv_for(toks))
        assert r.stored_tokens == 16 and e.lookup(toks) == 16


def test_retrieve_into_out():
    toks = list(range(50))
    kv = kv_for(toks)
    with engine() as e:
        e.store(toks, kv)
        out = torch.zeros(L, 2, 60, H, D)
        res = e.retrieve(toks, out=out)
        assert res.kv is out and torch.equal(out[:, :, :50], kv) and bool((out[:, :, 50:] == 0).all())
        with pytest.raises(KVShapeError):
            e.retrieve(toks, out=torch.zeros(L, 2, 10, H, D))


@pytest.mark.parametrize("top", ["cpu", "disk"])
def test_retrieve_into_a_sink_hands_over_each_chunk_once_from_the_pool(tmp_path, top):
    """``retrieve(into=sink)``: each chunk of the cached prefix reaches the sink exactly
    once, as pool memory (no copy made by the engine), in the engine layout; from a disk
    tier on its I/O threads as each file arrives. A chunk lost in the middle ends the
    result there; the sink's error reaches the caller; ``out`` and ``into`` together are
    refused. Every object read is handed back to the pool."""
    toks = list(range(100))  # 6 full chunks of 16 + 4 tokens
    kv = kv_for(toks)
    tiers = [{"backend": "disk", "path": str(tmp_path / "d"), "capacity": "8MiB"}] if top == "disk" else \
        [{"backend": "cpu", "capacity": "4MiB"}]
    with lmcache.CacheEngine.from_config({"chunk_size": 16, "tiers": tiers}) as e:
        e.store(toks, kv)
        e.flush()
        live = e.pool.live  # the cpu tier's own objects
        seen: dict[int, torch.Tensor] = {}
        pool = (e.pool._buf.data_ptr(), e.pool._buf.data_ptr() + e.pool.capacity)

        def sink(chunk, t):
            assert chunk.start not in seen, "a chunk handed over twice"
            assert pool[0] <= t.data_ptr() < pool[1] and t.is_contiguous()  # the pool's memory itself
            seen[chunk.start] = t.clone()

        res = e.retrieve(toks, into=sink)
        assert res.num_tokens == 100 and res.kv is None and len(res.tiers) == 7
        assert sorted(seen) == list(range(0, 100, 16))
        assert torch.equal(torch.cat([seen[k] for k in sorted(seen)], dim=2), kv)
        e.hierarchy.tiers[0].delete([e.chunk_keys(toks)[1][3]])  # chunk 3 lost
        seen.clear()
        assert e.retrieve(toks, into=sink).num_tokens == 48 and {0, 16, 32} <= set(seen)

        def broken(chunk, t):
            raise RuntimeError("sink failed")

        with pytest.raises(RuntimeError, match="sink failed"):
            e.retrieve(toks, into=broken)
        with pytest.raises(ValueError, match="out or into"):
            e.retrieve(toks, out=torch.zeros_like(kv), into=sink)
        assert e.pool.live == live - (top == "cpu")  # only the removed chunk is gone


@pytest.mark.parametrize("top", ["cpu", "disk"])
def test_a_sink_may_leave_copies_running_and_retrieve_waits_for_them(tmp_path, top):
    """A sink returns the futures of copies it left running (the vLLM connector's block
    copies on its other threads): each chunk stays in memory until its copy ends, the
    retrieve returns after every one, and a failed copy is its error."""
    toks = list(range(100))
    kv = kv_for(toks)
    disk = {"backend": "disk", "path": str(tmp_path / "d"), "capacity": "8MiB"}
    with lmcache.CacheEngine.from_config({"chunk_size": 16, "tiers": [{"backend": "cpu", "capacity": "4MiB"}, disk]}) as e:
        e.store(toks, kv)
        e.flush()
    tiers = [disk] if top == "disk" else [{"backend": "cpu", "capacity": "4MiB"}]
    with lmcache.CacheEngine.from_config({"chunk_size": 16, "tiers": tiers}) as e, ThreadPoolExecutor(1) as ex:
        if top == "cpu":
            e.store(toks, kv)
        live = e.pool.live  # disk: nothing held; every chunk read lives only while it is read
        dst = torch.zeros_like(kv)
        held: list[int] = []

        def late_copy(chunk, t):
            time.sleep(0.005)  # the retrieve has handed over every chunk meanwhile
            held.append(e.pool.live)
            dst[:, :, chunk.start : chunk.end].copy_(t)

        futures: list = []

        def sink(chunk, t):
            futures.append(ex.submit(late_copy, chunk, t))
            return futures[-1:]

        assert e.retrieve(toks, into=sink).num_tokens == 100
        assert len(futures) == 7 and all(f.done() for f in futures)
        assert torch.equal(dst, kv)
        assert min(held) > live if top == "disk" else min(held) == live  # read chunks held through their copies
        assert e.pool.live == live  # and given back after

        def failing(chunk, t):
            raise RuntimeError(f"copy of chunk {chunk.start} failed")

        with pytest.raises(RuntimeError, match=r"copy of chunk \d+ failed"):
            e.retrieve(toks, into=lambda chunk, t: [ex.submit(failing, chunk, t)])
        assert e.pool.live == live


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int32, torch.float64])
@pytest.mark.parametrize("layerwise", [False, True])
def test_retrieve_into_an_out_of_another_dtype_is_refused(dtype, layerwise):
    """The outside review: a bfloat16 out came back off by 0.25, an int32 one truncated,
    with no word. Now the retrieve refuses before reading anything, naming both dtypes,
    out is untouched, and the entries are still there."""
    toks = list(range(32))
    kv = kv_for(toks)
    with engine() as e:
        e.store(toks, kv)
        out = torch.full((L, 2, 32, H, D), 7, dtype=dtype)
        with pytest.raises(KVShapeError, match=r"out is \w+ but this engine's KV is float32"):
            if layerwise:
                e.retrieve_layerwise(toks, out)
            else:
                e.retrieve(toks, out=out)
        assert bool((out == 7).all())
        assert e.lookup(toks) == 32 and torch.equal(e.retrieve(toks).kv, kv)


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_streamed_disk_read_into_an_inference_mode_tensor(tmp_path, caplog, layerwise):
    """The outside review: over a zstd disk tier after a restart, the transformers
    connector's retrieve into a tensor made under ``torch.inference_mode`` failed on the
    disk tier's I/O threads ("Inplace update to inference tensor outside InferenceMode"),
    logged a traceback per chunk and fell back. Now the copy works, with nothing logged."""
    toks = list(range(64))
    kv = kv_for(toks)
    cfg = {"chunk_size": 16, "kv_spec": {"num_layers": L, "num_kv_heads": H, "head_size": D, "dtype": "float32"},
           "tiers": [{"backend": "disk", "path": str(tmp_path / "kv"), "capacity": "16MiB", "codec": "zstd"}]}
    with lmcache.CacheEngine.from_config(cfg) as e:
        e.store(toks, kv)
        e.flush()
    caplog.set_level(logging.WARNING)
    with lmcache.CacheEngine.from_config(cfg) as e, torch.inference_mode():  # a restart: only the files
        out = torch.zeros(L, 2, 64, H, D)
        assert out.is_inference()
        if layerwise:
            h = e.retrieve_layerwise(toks, out)
            h.wait_all()
            n = h.num_tokens
        else:
            n = e.retrieve(toks, out=out).num_tokens
        assert n == 64 and torch.equal(out, kv)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32])
def test_a_disk_hit_is_copied_into_out_bit_for_bit_and_nowhere_else(tmp_path, dtype):
    """A file-like tier's chunks are copied into ``out`` on its I/O threads as numpy copies
    of their bits (``copy_off_main``): every dtype, numpy's or not, lands bit for bit, in
    the tokens it belongs to of a strided ``out``, and nothing around it is written."""
    toks = list(range(64))
    kv = torch.randint(-(2**15), 2**15 - 1, (L, 2, 64, H, D), dtype=torch.int32).view(torch.uint8)
    kv = kv.view(L, 2, 64, H, -1)[..., : D * dtype.itemsize].contiguous().view(dtype)
    cfg = {"chunk_size": 16, "kv_spec": {"num_layers": L, "num_kv_heads": H, "head_size": D,
                                         "dtype": str(dtype).removeprefix("torch.")},
           "tiers": [{"backend": "disk", "path": str(tmp_path / "kv"), "capacity": "16MiB"}]}
    with lmcache.CacheEngine.from_config(cfg) as e:
        e.store(toks, kv)
        e.flush()
    with lmcache.CacheEngine.from_config(cfg) as e:  # only the files: every chunk read on the I/O threads
        wide = torch.full((L, 2, 80, H, D + 3), 7, dtype=torch.uint8).view(torch.int8).to(torch.float32).to(dtype)
        before = wide.clone()
        out = wide[:, :, 8:, :, :D]  # strided in every dimension but the last
        assert e.retrieve(toks, out=out).num_tokens == 64
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
        assert torch.equal(out[:, :, :64].view(bits), kv.view(bits))
        mask = torch.ones(wide.shape, dtype=torch.bool)
        mask[:, :, 8:72, :, :D] = False
        assert torch.equal(wide.view(bits)[mask], before.view(bits)[mask])


def test_an_engine_without_kv_spec_takes_it_from_the_tiers_or_says_to_set_it(tmp_path):
    """The outside review: ``lookup`` on an engine with no ``kv_spec`` yet (a fresh process
    over a persisted or shared tier) returned 0 silently. It now takes the spec from the
    tier's entries when they have one shape, and says to set ``kv_spec`` when several."""
    toks = list(range(64))
    disk = {"backend": "disk", "path": str(tmp_path / "kv"), "capacity": "16MiB"}
    with lmcache.CacheEngine.from_config({"chunk_size": 16, "tiers": [disk]}) as e:
        e.store(toks, kv_for(toks))
        e.flush()
    with lmcache.CacheEngine.from_config({"chunk_size": 16, "tiers": [disk]}) as e:  # no kv_spec
        assert e.kv_spec is None
        assert e.lookup(toks) == 64
        assert e.kv_spec is not None and e.kv_spec.num_layers == L
        assert torch.equal(e.retrieve(toks).kv, kv_for(toks))
        other = list(range(500, 532))
        e2 = lmcache.CacheEngine.from_config(
            {"chunk_size": 16, "tiers": [disk], "kv_spec": {"num_layers": 1, "num_kv_heads": 1, "head_size": 8,
                                                             "dtype": "float32"}})
        e2.store(other, torch.zeros(1, 2, 32, 1, 8))
        e2.close()
    with lmcache.CacheEngine.from_config({"chunk_size": 16, "tiers": [disk]}) as e:  # two shapes now
        with pytest.raises(KVShapeError, match="set kv_spec"):
            e.lookup(toks)
    with lmcache.CacheEngine.from_config({"chunk_size": 16, "tiers": [{"backend": "cpu", "capacity": "1MiB"}]}) as e:
        assert e.lookup(toks) == 0  # nothing stored anywhere: a plain miss


def test_shape_errors():
    toks = list(range(20))
    with engine() as e:
        with pytest.raises(KVShapeError, match="shape"):
            e.store(toks, torch.zeros(3, 20, 2, 16))
        with pytest.raises(KVShapeError, match="tokens"):
            e.store(toks, kv_for(range(19)))
        e.store(toks, kv_for(toks))
        with pytest.raises(KVShapeError, match="kv_spec"):
            e.store(toks, kv_for(toks, dtype=torch.float16))


def test_kv_spec_from_config_allows_lookup_before_any_store(tmp_path):
    toks = list(range(48))
    spec = {"num_layers": L, "num_kv_heads": H, "head_size": D, "dtype": "float32"}
    with engine(tmp_path, disk="8MiB", kv_spec=spec) as e:
        e.store(toks, kv_for(toks))
    with lmcache.CacheEngine.from_config(
        {"chunk_size": 16, "tiers": [{"backend": "disk", "path": str(tmp_path / "disk"), "capacity": "8MiB"}]},
        kv_spec=KVSpec(**spec),
    ) as e2:
        assert e2.locate(toks) == (48, ["disk"] * 3)
        assert torch.equal(e2.retrieve(toks).kv, kv_for(toks))


def test_namespaces_models_and_shapes_are_isolated(tmp_path):
    toks = list(range(32))
    disk = {"backend": "disk", "path": str(tmp_path / "shared"), "capacity": "8MiB"}
    spec = KVSpec(L, H, D, "float32")
    with lmcache.CacheEngine.from_config({"chunk_size": 16, "namespace": "alice", "tiers": [disk]}, kv_spec=spec) as e:
        e.store(toks, kv_for(toks))
    for cfg, s in [
        ({"namespace": "bob"}, spec),
        ({"namespace": "alice", "model": "other-model"}, spec),
        ({"namespace": "alice"}, KVSpec(L, H, D, "float16")),
        ({"namespace": "alice"}, KVSpec(L, H, D, "float32", tp_rank=1, tp_size=2)),
    ]:
        with lmcache.CacheEngine.from_config({"chunk_size": 16, "tiers": [disk], **cfg}, kv_spec=s) as other:
            assert other.lookup(toks) == 0, cfg
    with lmcache.CacheEngine.from_config({"chunk_size": 16, "namespace": "alice", "tiers": [disk]}, kv_spec=spec) as same:
        assert same.lookup(toks) == 32


def test_lookup_pin_protects_until_release():
    a, b = list(range(32)), list(range(100, 132))
    chunk_bytes = L * 2 * 16 * H * D * 4
    with engine(cpu=2 * chunk_bytes) as e:
        e.store(a, kv_for(a))
        assert e.lookup(a, pin=True) == 32
        e.store(b, kv_for(b))  # no room: a is leased
        assert e.lookup(a) == 32 and e.lookup(b) == 0
        assert torch.equal(e.retrieve(a).kv, kv_for(a))  # a retrieve ends no lease
        e.store(b, kv_for(b))
        assert e.lookup(a) == 32 and e.lookup(b) == 0
        e.release(a)
        e.store(b, kv_for(b))
        assert e.lookup(b) == 32 and e.lookup(a) == 0


def test_another_callers_retrieve_never_ends_a_lease():
    """The outside review: caller A's ``lookup(pin=True)`` lease was released by caller
    B's retrieve of the same tokens, so A's retrieve got less than promised (240 of ~11k
    pinned lookups under stress; the vLLM connector relies on these leases). Leases are
    counted per caller: B's lookup, retrieve and release leave A's lease standing."""
    a, b = list(range(32)), list(range(100, 132))
    chunk_bytes = L * 2 * 16 * H * D * 4
    with engine(cpu=2 * chunk_bytes) as e:
        e.store(a, kv_for(a))
        assert e.lookup(a, pin=True) == 32  # A
        assert e.retrieve(a).num_tokens == 32  # B, without a lookup
        assert e.lookup(a, pin=True) == 32  # B again, with one
        assert e.retrieve(a).num_tokens == 32
        e.release(a)  # B is done
        e.store(b, kv_for(b))  # would evict a if A's lease had gone
        assert e.lookup(a) == 32 and e.lookup(b) == 0
        r = e.retrieve(a)  # A gets what it was promised
        assert r.num_tokens == 32 and torch.equal(r.kv, kv_for(a))
        e.release(a)
        e.store(b, kv_for(b))
        assert e.lookup(b) == 32 and e.lookup(a) == 0


def test_a_release_never_ends_a_lease_taken_in_another_tier(tmp_path):
    """Found under stress: A's lookup leased a chunk in the disk tier, B's lookup (after a
    promotion) found it in the cpu tier, and B's release dropped one lease in every tier,
    A's included; the disk tier then evicted what A was promised. A lease now covers the
    key in every tier, and a release drops exactly one of each."""
    a = list(range(32))
    chunk_bytes = L * 2 * 16 * H * D * 4
    with engine(tmp_path, cpu="4MiB", disk=2 * chunk_bytes + 4096) as e:  # room for a or b
        cpu, disk = e.hierarchy.tiers
        e.store(a, kv_for(a))
        e.flush()
        cpu.delete(e.chunk_keys(a)[1])
        assert e.locate(a, pin=True) == (32, ["disk", "disk"])  # A
        assert e.retrieve(a).tiers == ["disk", "disk"]  # (promoted into cpu)
        assert e.locate(a, pin=True) == (32, ["cpu", "cpu"])  # B
        e.release(a)  # B is done
        cpu.delete(e.chunk_keys(a)[1])
        b = list(range(500, 532))
        e.store(b, kv_for(b))
        e.flush()  # the disk tier wants room: a is still A's
        r = e.retrieve(a)
        assert r.num_tokens == 32 and torch.equal(r.kv, kv_for(a)), r.tiers
        e.release(a)


def test_lookup_pin_without_retrieve_expires():
    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    clock = Clock()
    chunk_bytes = L * 2 * 16 * H * D * 4
    cfg = load_config({"chunk_size": 16, "lookup_pin_timeout": 10, "tiers": [{"backend": "cpu", "capacity": 2 * chunk_bytes}]})
    a, b = list(range(32)), list(range(100, 132))
    with lmcache.CacheEngine(cfg, clock=clock) as e:
        e.store(a, kv_for(a))
        e.lookup(a, pin=True)
        clock.t = 11.0
        e.store(b, kv_for(b))
        assert e.lookup(b) == 32


def test_write_through_disk_then_new_engine_and_promotion(tmp_path):
    toks = list(range(160))
    kv = kv_for(toks)
    chunk_bytes = L * 2 * 16 * H * D * 4
    with engine(tmp_path, cpu=3 * chunk_bytes, disk="16MiB") as e:
        e.store(toks, kv)
        e.flush()
        n, tiers = e.locate(toks)
        assert n == 160 and tiers.count("disk") == 7 and tiers.count("cpu") == 3
        res = e.retrieve(toks)
        assert torch.equal(res.kv, kv)
        st = e.stats()
        # the retrieve keeps its own chunks 7-9 in the CPU tier while it runs: promoting
        # chunks 0-6 may not push them out, so they are read from the CPU tier
        assert st["tiers"]["disk"]["hits"] == 7 and st["tiers"]["cpu"]["hits"] == 3
        assert res.tiers == ["disk"] * 7 + ["cpu"] * 3
        assert st["tiers"]["cpu"]["used_bytes"] <= 3 * chunk_bytes


def test_write_back(tmp_path):
    toks = list(range(160))
    kv = kv_for(toks)
    chunk_bytes = L * 2 * 16 * H * D * 4
    with engine(tmp_path, cpu=3 * chunk_bytes, disk="16MiB", write_policy="write-back") as e:
        e.store(toks, kv)
        e.flush()
        st = e.stats()["tiers"]
        assert st["cpu"]["entries"] == 3 and st["disk"]["entries"] == 7
        assert torch.equal(e.retrieve(toks).kv, kv)


def test_close_flushes_and_rejects_use(tmp_path):
    toks = list(range(64))
    e = engine(tmp_path, disk="8MiB")
    e.store(toks, kv_for(toks))
    e.close()
    e.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        e.lookup(toks)
    assert len(list((tmp_path / "disk").rglob("*.lmc"))) == 4
    assert e.pool.used == 0


def test_bfloat16_roundtrip_is_bit_exact(tmp_path):
    toks = list(range(70))
    kv = torch.randn(L, 2, 70, H, D).to(torch.bfloat16)
    with engine(tmp_path, disk="8MiB") as e:
        e.store(toks, kv)
        e.flush()
    with lmcache.CacheEngine.from_config(
        {"chunk_size": 16, "tiers": [{"backend": "disk", "path": str(tmp_path / "disk"), "capacity": "8MiB", "codec": "zstd"}]},
        kv_spec=KVSpec(L, H, D, "bfloat16"),
    ) as e2:
        assert torch.equal(e2.retrieve(toks).kv, kv)


def test_pool_exhaustion_skips_store_instead_of_growing():
    toks = list(range(64))
    chunk_bytes = L * 2 * 16 * H * D * 4
    with engine(cpu=chunk_bytes, staging_size=0, memory_pool_size=2 * chunk_bytes) as e:
        cpu = e.hierarchy.tiers[0]
        e.store(toks, kv_for(toks))
        assert e.pool.used <= e.pool.capacity
        assert cpu.used <= cpu.capacity
        assert e.lookup(toks) in (0, 16)


def test_store_from_per_layer_views_matches_tensor_store():
    toks = list(range(40))
    kv = kv_for(toks)
    # per-layer (T, H, D) views of an (L, 2, H, T, D) buffer: strided, as engines hold them
    buf = kv.permute(0, 1, 3, 2, 4).contiguous()
    layers = [(buf[i, 0].transpose(0, 1), buf[i, 1].transpose(0, 1)) for i in range(L)]
    with engine() as e:
        e.store(toks, layers)
        assert torch.equal(e.retrieve(toks).kv, kv)
        with pytest.raises(KVShapeError, match="layer 1"):
            e.store(list(range(500, 540)), [layers[0], (layers[1][0][:5], layers[1][1])])


def test_a_store_that_finds_chunks_cached_counts_as_a_use():
    """The shared system prompt must not be the first thing LRU evicts."""
    chunk_bytes = L * 2 * 16 * H * D * 4
    system = list(range(16))
    with engine(cpu=3 * chunk_bytes) as e:
        e.store(system, kv_for(system))
        for i in range(1, 5):
            toks = system + list(range(1000 * i, 1000 * i + 16))
            e.store(toks, kv_for(toks))
        assert e.lookup(system) == 16


def test_retrieve_layerwise_fills_layers_in_order_and_releases():
    toks = list(range(70))
    kv = kv_for(toks)
    with engine() as e:
        e.store(toks, kv)
        out = torch.zeros(L, 2, 70, H, D)
        h = e.retrieve_layerwise(toks, out)
        assert h.num_tokens == 70 and h.tiers == ["cpu"] * 5
        for layer in range(L):
            h.wait(layer)
            assert torch.equal(out[layer], kv[layer])
        h.wait_all()
        assert all(t._pins == {} for t in e.hierarchy.tiers)  # nothing stays pinned
        miss = e.retrieve_layerwise(list(range(900, 930)), torch.zeros(L, 2, 30, H, D))
        assert miss.num_tokens == 0
        miss.wait_all()
        with pytest.raises(KVShapeError):
            e.retrieve_layerwise(toks, torch.zeros(L, 2, 10, H, D))
        assert e.lookup(toks) == 70


def test_release_drops_lookup_leases():
    a, b = list(range(32)), list(range(100, 132))
    chunk_bytes = L * 2 * 16 * H * D * 4
    with engine(cpu=2 * chunk_bytes) as e:
        e.store(a, kv_for(a))
        assert e.lookup(a, pin=True) == 32
        e.release(a)
        e.store(b, kv_for(b))  # a is no longer leased: it makes room
        assert e.lookup(b) == 32 and e.lookup(a) == 0


def test_disk_top_tier_pipelines_stores_and_retrieves(tmp_path):
    """A disk tier on top: a store writes chunks on the engine's I/O threads while it
    copies the next ones (a pool of 2 chunks is enough for 8: it waits for writes in
    flight instead of dropping chunks); a retrieve into ``out`` copies each chunk as its
    file is read; a missing file in the middle ends the prefix there, exactly."""
    import lmcache

    spec = {"num_layers": 2, "num_kv_heads": 2, "head_size": 64, "dtype": "float16"}
    chunk_bytes = 64 * 2 * 2 * 2 * 64 * 2
    e = lmcache.CacheEngine.from_config({
        "chunk_size": 64, "memory_pool_size": 2 * chunk_bytes, "staging_size": 0,
        "tiers": [{"backend": "disk", "capacity": "16MiB", "path": str(tmp_path / "kv")}]}, kv_spec=spec)
    try:
        toks = list(range(1000, 1512))  # 8 chunks
        kv = torch.randn(2, 2, 512, 2, 64).half()
        r = e.store(toks, kv)
        assert (r.stored_tokens, r.dropped_tokens) == (512, 0)
        assert e.pool.used == 0
        out = torch.zeros_like(kv)
        got = e.retrieve(toks, out=out)
        assert got.num_tokens == 512 and got.kv is out and torch.equal(out, kv)
        keys = e.chunk_keys(toks)[1]
        disk = e.hierarchy.tiers[0].backend.raw
        disk._path(keys[5]).unlink()  # a file lost under the tier
        out.zero_()
        got = e.retrieve(toks, out=out)
        assert got.num_tokens == 5 * 64 and torch.equal(out[:, :, :320], kv[:, :, :320])
        assert e.pool.used == 0 and e.pool.live == 0
    finally:
        e.close()
