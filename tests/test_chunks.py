"""The chunk gateway (lmcache.chunks): one shape check, observers told once per store,
corrupt entries dropped and counted, memory references released on every path; and the
callers that went through their own loops before (shifted reuse) now refused or dropped
what the gateway refuses."""

from __future__ import annotations

import pytest
import torch

import lmcache
from lmcache.backends.cpu import CPUBackend
from lmcache.chunks import ChunkGateway, PageLayout
from lmcache.config import load_config
from lmcache.errors import KVShapeError
from lmcache.hookspecs import hookimpl
from lmcache.plugin_manager import Registries, create_plugin_manager

C = 4  # tokens per chunk
SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float16"}
CFG = {"chunk_size": C, "tiers": [{"backend": "cpu", "capacity": "16MiB"}], "staging_size": "4MiB"}


def _engine(registries=None, **extra):
    cfg = load_config({**CFG, **extra})
    return lmcache.CacheEngine(cfg, kv_spec=lmcache.KVSpec(**SPEC), registries=registries)


def _kv(tokens: int, dtype=torch.float16, heads=2):
    return torch.arange(2 * 2 * tokens * heads * 8, dtype=torch.float32).reshape(2, 2, tokens, heads, 8).to(dtype)


def _only_entries_live(e) -> bool:
    """Every pool object alive is an entry of the CPU tier, held by that tier alone."""
    backend = e.hierarchy.tiers[0].backend
    alone = []
    for key, _ in e.hierarchy.tiers[0].keys():
        obj = backend.get_one(key)  # one more reference, for the look
        alone.append(obj.refcount == 2)
        obj.unref()
    return e.pool.live == len(alone) and all(alone)


@pytest.fixture
def engine():
    with _engine() as e:
        yield e


def test_a_store_of_the_wrong_dtype_or_shape_is_refused_whole_from_every_entry(engine):
    g = ChunkGateway.of(engine)
    chunks, keys = engine.chunk_keys(list(range(8)))
    for bad in (_kv(8, torch.float32), _kv(8, heads=3)):
        with pytest.raises(KVShapeError) as err:
            g.store(keys, bad, chunks=chunks, tokens=list(range(8)))
        msg = str(err.value)
        assert "\n" not in msg and "(2, 2, 4, 2, 8) float16" in msg  # names the engine's chunk ...
        assert f"{tuple(bad[:, :, :4].shape)} {str(bad.dtype)[6:]}" in msg  # ... and the one given
        pages = [bad[:, :, :4], bad[:, :, 4:]]
        with pytest.raises(KVShapeError, match="is not KV of"):
            g.store(keys, pages)
        obj = engine.hierarchy.allocate(tuple(bad[:, :, :4].shape), bad.dtype)
        with pytest.raises(KVShapeError, match="is not KV of"):
            g.put_one(keys[0], obj)
        with pytest.raises(KVShapeError, match="is not KV of"):
            g.allocate(tuple(bad[:, :, :4].shape), bad.dtype)
    assert engine.hierarchy.exists(keys) == [False, False]
    assert engine.pool.live == 0


def test_observers_are_told_once_per_store_given_tokens(engine):
    heard = []
    g = ChunkGateway(engine.hierarchy, lambda: engine.kv_spec, C, [lambda t, c, k: heard.append(list(k))])
    tokens = list(range(8))
    chunks, keys = engine.chunk_keys(tokens)
    res = g.store(keys, _kv(8), chunks=chunks, tokens=tokens)
    assert (res.stored_tokens, res.held, res.put_chunks) == (8, [True, True], 2)
    assert heard == [keys]
    res = g.store(keys, _kv(8), chunks=chunks, tokens=tokens)  # present: told, nothing put
    assert (res.skipped_tokens, res.held, res.put_chunks) == (8, [True, True], 0)
    g.store(keys, [_kv(4), _kv(4)])  # pages carry no tokens: not told
    assert heard == [keys, keys]
    assert _only_entries_live(engine)


def test_a_corrupt_entry_from_a_tier_is_dropped_counted_and_ends_the_prefix(engine):
    g = ChunkGateway.of(engine)
    chunks, keys = engine.chunk_keys(list(range(12)))
    g.store(keys, _kv(12), chunks=chunks)
    bad = engine.hierarchy.allocate((2, 2, C, 2, 8), torch.float32)  # the right shape, another dtype
    tier = engine.hierarchy.tiers[0]
    tier.delete([keys[1]])
    assert tier.put_one(keys[1], bad)
    bad.unref()
    got = g.find(keys, sizes=[c.num_tokens for c in chunks])
    assert [t.name for _, t in got] == ["cpu"]  # the prefix ends at the dropped entry
    for obj, _ in got:
        obj.unref()
    assert tier.stats.corrupt == 1 and engine.hierarchy.exists(keys) == [True, False, True]
    with g.found(keys, prefix=False) as hits:
        assert [h is not None for h in hits] == [True, False, True]
        assert torch.equal(hits[2][0].tensor, _kv(12)[:, :, 8:12])
    assert _only_entries_live(engine)


def test_a_fixed_page_layout_refuses_other_token_counts(engine):
    g = ChunkGateway.of(engine).with_layout(PageLayout((2, 1, C, 1, 16), "float16"))
    keys = [k.replace(k[-32:], f"{i:032x}") for i, k in enumerate(engine.chunk_keys(list(range(8)))[1])]
    assert g.store(keys[:1], [torch.ones(2, 1, C, 1, 16, dtype=torch.float16)]).held == [True]
    obj = engine.hierarchy.allocate((2, 1, C + 1, 1, 16), torch.float16)
    engine.hierarchy.put_one(keys[1], obj)
    obj.unref()
    with g.found(keys[:2], prefix=False) as hits:
        assert [h is not None for h in hits] == [True, False]
    assert engine.hierarchy.tiers[0].stats.corrupt == 1 and _only_entries_live(engine)


class _Refusing(CPUBackend):
    """A CPU backend whose writes raise before the tier can catch them (reserve_size)."""

    def reserve_size(self, key, obj):
        raise RuntimeError("reserve_size failed")


class _Plugin:
    @hookimpl
    def lmcache_register_backends(self, registry):
        registry.add("refusing-cpu", _Refusing)


def test_memory_goes_back_to_the_pool_when_a_put_raises():
    pm = create_plugin_manager()
    pm.register(_Plugin(), name="tests-chunks")
    with _engine(Registries(pm), tiers=[{"backend": "refusing-cpu", "capacity": "16MiB"}]) as e:
        g = ChunkGateway.of(e)
        chunks, keys = e.chunk_keys(list(range(8)))
        with pytest.raises(RuntimeError, match="reserve_size"):
            g.store(keys, _kv(8), chunks=chunks)
        assert e.pool.live == 0
        with pytest.raises(RuntimeError, match="reserve_size"):
            g.put_one(keys[0], g.allocate((2, 2, C, 2, 8), torch.float16))
        assert e.pool.live == 0


# ------------------------------------------------------------ shifted reuse through the gateway
def _shifted_engine():
    return _engine(approximate_reuse={"enabled": True})


def test_shifted_store_refuses_kv_of_another_dtype():
    """Before: store_shifted copied float32 KV into float16 chunks (a silent conversion)."""
    with _shifted_engine() as e:
        svc = e.services["approximate_reuse"]
        with pytest.raises(KVShapeError, match="float32"):
            svc.store_shifted(list(range(8)), _kv(8, torch.float32), 0)
        assert svc.stored_chunks == 0 and list(e.hierarchy.tiers[0].keys()) == [] and e.pool.live == 0
        assert svc.store_shifted(list(range(8)), _kv(8), 0) == 8


def test_shifted_fetch_drops_an_entry_of_another_dtype():
    """Before: fetch checked the shape only and handed float32 KV to a float16 engine."""
    from lmcache.plugins.services.shifted import Match

    with _shifted_engine() as e:
        svc = e.services["approximate_reuse"]
        key = e.chunk_keys(list(range(C)))[1][0]
        bad = e.hierarchy.allocate((2, 2, C, 2, 8), torch.float32)
        e.hierarchy.put_one(key, bad)
        bad.unref()
        assert svc.fetch([Match(0, C, key, 0)]) == [None]
        assert e.hierarchy.tiers[0].stats.corrupt == 1 and e.hierarchy.exists([key]) == [False]
        assert svc.missing_chunks == 1 and e.pool.live == 0
