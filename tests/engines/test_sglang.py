"""lmcache as SGLang's HiCache storage backend, driven through SGLang's own classes.

Everything SGLang-side is real (sglang 0.5.23): the backend is built by SGLang's
``StorageBackendFactory`` from a ``HiCacheStorageConfig`` (the ``dynamic`` backend), and
pages move between lmcache and real host KV pools (``MHATokenToKVPoolHost``,
``MLATokenToKVPoolHost``) built on real device pools (``MHATokenToKVPool``,
``MLATokenToKVPool``) allocated on the CPU, with the calls SGLang's cache controller makes
(``managers/cache_controller.py``): ``batch_exists`` for the hit query, ``batch_set_v1`` /
``batch_get_v1`` (``interface_v1``) or ``batch_set`` of ``get_data_page`` tensors and
``batch_get`` into ``get_dummy_flat_data_page`` buffers followed by
``set_from_flat_data_page`` (the generic path).

Run with the SGLang venv (requirements/setup-sglang.sh):
    LMCACHE_ENGINE_TESTS=1 .venv-sglang/bin/python -m pytest tests/engines/test_sglang.py -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _missing import missing  # noqa: E402

from lmcache.backends.disk import DiskBackend  # noqa: E402
from lmcache.config import load_config  # noqa: E402
from lmcache.engine import CacheEngine  # noqa: E402
from lmcache.hookspecs import hookimpl  # noqa: E402
from lmcache.keys import CacheKey  # noqa: E402
from lmcache.plugin_manager import Registries, create_plugin_manager  # noqa: E402

INSTALL = "requirements/setup-sglang.sh .venv-sglang .venv (sglang==0.5.23 and its pins in requirements/sglang.txt)"

P = 4  # tokens per page
L = 3  # layers
H = 2  # kv heads (per rank)
D = 8  # head size
KV_LORA, ROPE = 16, 8  # MLA
DTYPE = torch.bfloat16
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
MODULE = "lmcache.plugins.connectors.sglang"
CLASS = "LMCacheHiCacheStorage"


@pytest.fixture(scope="module")
def sgl():
    try:
        from sglang.srt.mem_cache import hicache_storage
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
        from sglang.srt.mem_cache.storage import StorageBackendFactory
    except ImportError as exc:
        missing(f"sglang is not importable ({exc}); build its venv: {INSTALL}")

    class NS:
        pass

    ns = NS()
    ns.hs = hicache_storage
    ns.MHA, ns.MLA, ns.MHAHost, ns.MLAHost = MHATokenToKVPool, MLATokenToKVPool, MHATokenToKVPoolHost, MLATokenToKVPoolHost
    ns.Factory = StorageBackendFactory
    return ns


def host_pool(sgl, layout: str, mla: bool = False):
    """A real SGLang host pool (and its device pool) on the CPU."""
    if mla:
        dev = sgl.MLA(64, P, DTYPE, KV_LORA, ROPE, L, "cpu", False, start_layer=0, end_layer=L)
        return sgl.MLAHost(
            dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, P, layout, pin_memory=False,
            device_capacity_tokens=dev.size, start_layer=dev.start_layer, end_layer=dev.end_layer,
            target_layer_num=dev.layer_num, override_kv_cache_dim=dev.kv_cache_dim,
        )
    dev = sgl.MHA(64, P, DTYPE, H, D, L, "cpu", False, start_layer=0, end_layer=L)
    return sgl.MHAHost(
        dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, P, layout, pin_memory=False,
        device_capacity_tokens=dev.size, start_layer=dev.start_layer, end_layer=dev.end_layer,
    )


def storage_config(sgl, *, tp_rank=0, tp_size=1, mla=False, model="org/Model-7B", extra=None):
    return sgl.hs.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=False, model_name=model,
        extra_config=extra,
    )


def dynamic_extra(**more):
    extra = {"backend_name": "lmcache", "module_path": MODULE, "class_name": CLASS, "interface_v1": 1}
    extra.update(more)
    return extra


def attach(sgl, pool, cfg, engine=None):
    """What SGLang's cache controller does in attach_storage_backend."""
    if engine is None:
        backend = sgl.Factory.create_backend("dynamic", cfg, pool)
    else:  # the same class, handed a CacheEngine built here (for custom test backends)
        from lmcache.plugins.connectors.sglang import LMCacheHiCacheStorage

        backend = LMCacheHiCacheStorage(cfg, {}, engine=engine)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


@pytest.fixture
def engine():
    eng = CacheEngine.from_config({"tiers": [{"backend": "cpu", "capacity": "64MiB"}], "staging_size": "8MiB"})
    yield eng
    eng.close()


def fill(pool, n: int, seed: int) -> torch.Tensor:
    """Allocate ``n`` pages of the host pool and write random KV into them."""
    idx = pool.alloc(n * P)
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        page = pool.get_data_page(int(idx[i * P]), flat=False)
        page.copy_(torch.randn(page.shape, generator=g).to(DTYPE))
    return idx


def pages(pool, idx: torch.Tensor) -> list[torch.Tensor]:
    return [pool.get_data_page(int(idx[i * P]), flat=True).clone() for i in range(idx.numel() // P)]


def token_major(pool, mla: bool) -> torch.Tensor:
    """The pool's whole buffer as (token slot, layer, k/v, head, dim), read straight from
    ``kv_buffer`` by the dims of SGLang's ``init_kv_buffer`` (pool_host/mha.py and
    pool_host/mla.py), independently of the connector's page handling."""
    kv, lay = pool.kv_buffer, pool.layout
    if mla:  # layer_first (L, T, 1, D); page_first (T, L, 1, D); direct (pages, L, P, 1, D)
        if lay == "layer_first":
            v = kv.permute(1, 0, 2, 3)
        elif lay == "page_first":
            v = kv
        else:
            v = kv.permute(0, 2, 1, 3, 4).reshape(-1, L, 1, KV_LORA + ROPE)
        return v.unsqueeze(2)  # (T, L, 1, 1, D)
    if lay == "layer_first":  # (2, L, T, H, D)
        return kv.permute(2, 1, 0, 3, 4)
    if lay == "page_first":  # (2, T, L, H, D)
        return kv.permute(1, 2, 0, 3, 4)
    if lay == "page_first_direct":  # (2, pages, L, P, H, D)
        return kv.permute(1, 3, 2, 0, 4, 5).reshape(-1, L, 2, H, D)
    assert lay == "page_head"  # (2, pages, H, P, L, D)
    return kv.permute(1, 3, 4, 0, 2, 5).reshape(-1, L, 2, H, D)


def canonical(pool, idx: torch.Tensor, mla: bool) -> list[torch.Tensor]:
    """Each page's KV as (tokens, layers, k/v, heads, dim), whatever the pool's layout."""
    tm = token_major(pool, mla)
    return [tm[int(idx[i * P]) : int(idx[i * P]) + P].clone() for i in range(idx.numel() // P)]


def page_keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:060x}" for i in range(n)]  # SGLang page hashes are hex strings


# ----------------------------------------------------------------------------- the factory
def test_dynamic_factory_builds_backend_from_extra_config(sgl, tmp_path):
    from lmcache.plugins.connectors.sglang import LMCacheHiCacheStorage

    pool = host_pool(sgl, "page_first")
    cfg_file = tmp_path / "lmcache.yaml"
    cfg_file.write_text("tiers:\n  - {backend: cpu, capacity: 32MiB}\nnamespace: team-a\n")
    extra = dynamic_extra(lmcache_config_file=str(cfg_file), **{"lmcache.staging_size": "4MiB"})
    backend = attach(sgl, pool, storage_config(sgl, extra=extra))
    try:
        assert isinstance(backend, LMCacheHiCacheStorage)
        assert isinstance(backend, sgl.hs.HiCacheStorage)
        cfg = backend.engine.config
        assert cfg.namespace == "team-a" and cfg.staging_size == 4 << 20
        key = CacheKey.parse(backend.key_of("ab" * 32))
        assert key.namespace == "team-a" and key.model == "org/Model-7B"
        assert key.signature == "bfloat16-L3-H2-D8-lt2hd-tp0of1-pg4"
        idx = fill(pool, 2, seed=1)
        keys = page_keys("f", 2)
        assert backend.batch_set_v1(keys, idx) == [True, True]
        assert backend.batch_exists(keys) == 2
    finally:
        backend.close()


# ----------------------------------------------------------------------------- zero-copy path
@pytest.mark.parametrize(
    "layout,mla", [(lay, False) for lay in MHA_LAYOUTS] + [(lay, True) for lay in MLA_LAYOUTS]
)
def test_v1_roundtrip_through_real_host_pool(sgl, engine, layout, mla):
    pool = host_pool(sgl, layout, mla)
    backend = attach(sgl, pool, storage_config(sgl, mla=mla, extra=dynamic_extra()), engine)
    n = 5
    src = fill(pool, n, seed=2)
    want = pages(pool, src)
    keys = page_keys("a", n)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, src) == [True] * n
    assert backend.batch_exists(keys) == n
    assert all(backend.exists(k) for k in keys)
    dst = pool.alloc(n * P)  # another region of the pool, zeroed
    for i in range(n):
        pool.get_data_page(int(dst[i * P]), flat=False).zero_()
    assert backend.batch_get_v1(keys, dst) == [True] * n
    got = pages(pool, dst)
    for w, g in zip(want, got):
        assert torch.equal(w.view(torch.int16), g.view(torch.int16))  # bytes equal
    stats = engine.stats()["tiers"]["cpu"]
    assert stats["entries"] == n
    # stored in lmcache's chunk layout (layers, k/v, tokens, heads, dim) whatever the pool's
    obj, tier = engine.hierarchy.find_one(backend.key_of(keys[1]))
    try:
        assert torch.equal(obj.tensor, canonical(pool, src, mla)[1].permute(1, 2, 0, 3, 4))
    finally:
        obj.unref()


@pytest.mark.parametrize("mla", [False, True])
def test_pages_move_between_host_layouts(sgl, engine, mla):
    """A page stored from a pool of one layout loads into pools of every other layout,
    token for token (checked against the pools' raw buffers, not the connector's views)."""
    layouts = MLA_LAYOUTS if mla else MHA_LAYOUTS
    pools = [host_pool(sgl, lay, mla) for lay in layouts]
    backends = [attach(sgl, p, storage_config(sgl, mla=mla, extra=dynamic_extra()), engine) for p in pools]
    assert len({b.signature for b in backends}) == 1
    for j, (src_pool, src_backend) in enumerate(zip(pools, backends)):
        keys = page_keys(f"b{j}", 3)
        src = fill(src_pool, 3, seed=3 + j)
        assert all(src_backend.batch_set_v1(keys, src))
        want = canonical(src_pool, src, mla)
        for pool, backend in zip(pools, backends):
            dst = pool.alloc(3 * P)
            assert backend.batch_get_v1(keys, dst) == [True] * 3
            assert all(torch.equal(w, g) for w, g in zip(want, canonical(pool, dst, mla))), (src_pool.layout, pool.layout)
            pool.free(dst)


# ----------------------------------------------------------------------------- generic path
@pytest.mark.parametrize("layout,mla", [("layer_first", False), ("page_first_direct", False), ("page_first", True)])
def test_generic_tensor_path(sgl, engine, layout, mla):
    """cache_controller's _generic_page_set / _generic_page_get call sequence."""
    pool = host_pool(sgl, layout, mla)
    backend = attach(sgl, pool, storage_config(sgl, mla=mla, extra={**dynamic_extra(), "interface_v1": 0}), engine)
    n = 4
    src = fill(pool, n, seed=4)
    keys = page_keys("c", n)
    data = [pool.get_data_page(src[i * P]) for i in range(n)]  # flat, host page order
    assert backend.batch_set(keys, data) is True
    assert backend.batch_exists(keys) == n
    dummy = [pool.get_dummy_flat_data_page() for _ in keys]
    page_data = backend.batch_get(keys, dummy)
    dst = pool.alloc(n * P)
    for i in range(n):
        assert page_data[i] is not None
        pool.set_from_flat_data_page(dst[i * P], page_data[i])
    assert all(torch.equal(w, g) for w, g in zip(pages(pool, src), pages(pool, dst)))
    # single-key forms; a get without a target allocates one
    one = backend.get(keys[0])
    assert one is not None and torch.equal(one, pages(pool, src)[0])
    assert backend.get("missing-page") is None
    assert backend.set("d" * 64, pool.get_data_page(src[0])) is True and backend.exists("d" * 64)
    # both paths share entries: a page written by set_v1 is read by get and vice versa
    keys2 = page_keys("e", 2)
    assert all(backend.batch_set_v1(keys2, src[: 2 * P]))
    got = backend.batch_get(keys2, [pool.get_dummy_flat_data_page() for _ in keys2])
    assert all(torch.equal(g, w) for g, w in zip(got, pages(pool, src)[:2]))
    # a page of the wrong size is refused, never stored
    assert backend.batch_set(["bad"], [torch.zeros(7, dtype=DTYPE)]) is False
    assert not backend.exists("bad")


# ----------------------------------------------------------------------------- semantics
def test_batch_exists_counts_leading_pages(sgl, engine):
    pool = host_pool(sgl, "page_first")
    backend = attach(sgl, pool, storage_config(sgl, extra=dynamic_extra()), engine)
    keys = page_keys("p", 4)
    src = fill(pool, 4, seed=5)
    assert backend.batch_set_v1([keys[0], keys[2], keys[3]], torch.cat([src[:P], src[2 * P :]])) == [True] * 3
    assert backend.batch_exists(keys) == 1  # keys[1] is missing: the prefix stops there
    assert backend.batch_exists(keys[2:]) == 2
    assert backend.batch_exists([]) == 0
    # a batch_get_v1 over a gap: per-key flags, SGLang counts the leading successes
    dst = pool.alloc(4 * P)
    assert backend.batch_get_v1(keys, dst) == [True, False, True, True]
    # wrong number of host indices: all failed, nothing raised
    assert backend.batch_get_v1(keys, dst[:5]) == [False] * 4


def test_tp_ranks_and_models_never_collide(sgl, engine):
    keys = page_keys("t", 2)
    pools, backends, srcs = [], [], []
    for rank in (0, 1):
        pool = host_pool(sgl, "page_first")
        backend = attach(sgl, pool, storage_config(sgl, tp_rank=rank, tp_size=2, extra=dynamic_extra()), engine)
        pools.append(pool)
        backends.append(backend)
        srcs.append(fill(pool, 2, seed=10 + rank))
    assert "tp0of2" in backends[0].signature and "tp1of2" in backends[1].signature
    assert backends[0].key_of(keys[0]) != backends[1].key_of(keys[0])
    assert all(backends[0].batch_set_v1(keys, srcs[0]))
    assert backends[1].batch_exists(keys) == 0  # rank 0's pages are not rank 1's heads
    assert all(backends[1].batch_set_v1(keys, srcs[1]))
    for pool, backend, src in zip(pools, backends, srcs):
        dst = pool.alloc(2 * P)
        assert all(backend.batch_get_v1(keys, dst))
        assert all(torch.equal(w, g) for w, g in zip(pages(pool, src), pages(pool, dst)))
    # another model never sees them
    other = attach(sgl, host_pool(sgl, "page_first"),
                   storage_config(sgl, tp_rank=0, tp_size=2, model="org/Other", extra=dynamic_extra()), engine)
    assert other.batch_exists(keys) == 0


def test_mla_pages_are_shared_by_tp_ranks_and_written_once(sgl, engine):
    keys = page_keys("m", 3)
    p0, p1 = host_pool(sgl, "page_first", mla=True), host_pool(sgl, "layer_first", mla=True)
    r0 = attach(sgl, p0, storage_config(sgl, tp_rank=0, tp_size=2, mla=True, extra=dynamic_extra()), engine)
    r1 = attach(sgl, p1, storage_config(sgl, tp_rank=1, tp_size=2, mla=True, extra=dynamic_extra()), engine)
    assert r0.key_of(keys[0]) == r1.key_of(keys[0])
    assert "-mla-" in r0.signature
    src1 = fill(p1, 3, seed=20)
    assert r1.batch_set_v1(keys, src1) == [True] * 3  # not the storage writer: a no-op
    assert r0.batch_exists(keys) == 0
    src0 = fill(p0, 3, seed=21)
    assert all(r0.batch_set_v1(keys, src0))
    dst = p1.alloc(3 * P)
    assert r1.batch_get_v1(keys, dst) == [True] * 3  # rank 1 reads rank 0's pages
    assert all(torch.equal(w, g) for w, g in zip(canonical(p0, src0, True), canonical(p1, dst, True)))
    # an MHA model's page of the same hash is another entry
    mha = attach(sgl, host_pool(sgl, "page_first"), storage_config(sgl, extra=dynamic_extra()), engine)
    assert mha.batch_exists(keys) == 0


# ----------------------------------------------------------------------------- failures
def test_corrupt_entry_is_a_miss_not_garbage(sgl, tmp_path):
    disk = tmp_path / "disk"
    eng = CacheEngine.from_config({"tiers": [{"backend": "disk", "path": str(disk), "capacity": "64MiB"}],
                                   "staging_size": "8MiB"})
    try:
        pool = host_pool(sgl, "page_first")
        backend = attach(sgl, pool, storage_config(sgl, extra=dynamic_extra()), eng)
        keys = page_keys("x", 2)
        src = fill(pool, 2, seed=30)
        assert all(backend.batch_set_v1(keys, src))
        eng.flush()
        files = list(disk.rglob("*.lmc"))  # the entries (not the directory's .lmcache-* claim, ledger, locks)
        assert len(files) == 2
        for f in files:  # flip bytes in the middle of each payload
            b = bytearray(f.read_bytes())
            mid = len(b) // 2
            b[mid : mid + 8] = bytes(x ^ 0xFF for x in b[mid : mid + 8])
            f.write_bytes(bytes(b))
        dst = pool.alloc(2 * P)
        sentinel = [pool.get_data_page(int(dst[i * P]), flat=False).fill_(7.0) for i in range(2)]
        assert backend.batch_get_v1(keys, dst) == [False, False]
        for i in range(2):  # the host pages are untouched
            assert torch.all(pool.get_data_page(int(dst[i * P]), flat=False) == 7.0)
        assert backend.get(keys[0], pool.get_dummy_flat_data_page()) is None
        assert backend.batch_exists(keys) == 0  # removed as corrupt
        del sentinel
    finally:
        eng.close()


def test_entry_of_another_shape_is_dropped(sgl, engine):
    pool = host_pool(sgl, "layer_first")
    backend = attach(sgl, pool, storage_config(sgl, extra=dynamic_extra()), engine)
    key = "y" * 64
    obj = engine.hierarchy.allocate((L, 2, P + 1, H, D), DTYPE)  # not this pool's page shape
    obj.tensor.fill_(1.0)
    engine.hierarchy.put_one(backend.key_of(key), obj)
    obj.unref()
    assert backend.exists(key)
    dst = pool.alloc(P)
    pool.get_data_page(int(dst[0]), flat=False).fill_(3.0)
    assert backend.batch_get_v1([key], dst) == [False]
    assert torch.all(pool.get_data_page(int(dst[0]), flat=False) == 3.0)
    assert not backend.exists(key)
    assert engine.hierarchy.tiers[0].stats.corrupt == 1  # counted, like the engine's own check
    assert engine.pool.live == 0  # nothing held after the drop


class FlakyDisk(DiskBackend):
    """A disk store whose device can be 'unplugged': every read, write and listing then
    raises OSError (the object view a tier opens reads and writes through ``_load`` and
    ``_commit``)."""

    OPTIONS = {**DiskBackend.OPTIONS}
    unplugged = False

    def _check(self):
        if FlakyDisk.unplugged:
            raise OSError(5, "Input/output error (device unplugged)")

    def exists(self, keys):
        self._check()
        return super().exists(keys)

    def _load(self, path, key):
        self._check()
        return super()._load(path, key)

    def _commit(self, key, total, codec, fill):
        self._check()
        return super()._commit(key, total, codec, fill)

    def keys(self):
        self._check()
        return super().keys()


class _FlakyPlugin:
    @hookimpl
    def lmcache_register_backends(self, registry):
        registry.add("flaky-disk", FlakyDisk)


def test_down_tier_gives_misses_not_exceptions(sgl, tmp_path):
    pm = create_plugin_manager(autoload=False)
    pm.register(_FlakyPlugin(), name="tests")
    cfg = load_config({"tiers": [{"backend": "flaky-disk", "path": str(tmp_path / "d"), "capacity": "64MiB"}],
                       "staging_size": "8MiB"})
    eng = CacheEngine(cfg, registries=Registries(pm))
    try:
        pool = host_pool(sgl, "page_first")
        backend = attach(sgl, pool, storage_config(sgl, extra=dynamic_extra()), eng)
        keys = page_keys("z", 3)
        src = fill(pool, 3, seed=40)
        assert all(backend.batch_set_v1(keys, src))
        FlakyDisk.unplugged = True
        dst = pool.alloc(3 * P)
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, dst) == [False] * 3
        assert backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys]) == [None] * 3
        assert backend.exists(keys[0]) is False
        more = page_keys("w", 2)
        assert backend.batch_set_v1(more, src[: 2 * P]) == [False, False]  # reported, so SGLang stops
        assert backend.batch_set(more, [pool.get_data_page(src[0]), pool.get_data_page(src[P])]) is False
    finally:
        FlakyDisk.unplugged = False
        eng.close()


def test_clear_removes_only_this_pools_pages(sgl, engine):
    a = attach(sgl, host_pool(sgl, "page_first"), storage_config(sgl, extra=dynamic_extra()), engine)
    other_pool = host_pool(sgl, "page_first")
    b = attach(sgl, other_pool, storage_config(sgl, model="org/Other", extra=dynamic_extra()), engine)
    keys = page_keys("k", 2)
    assert all(a.batch_set_v1(keys, fill(a.mem_pool_host, 2, seed=50)))
    assert all(b.batch_set_v1(keys, fill(other_pool, 2, seed=51)))
    assert a.clear() is True
    assert a.batch_exists(keys) == 0 and b.batch_exists(keys) == 2


def test_unregistered_backend_refuses_transfers(sgl, engine):
    from lmcache.plugins.connectors.sglang import LMCacheHiCacheStorage

    backend = LMCacheHiCacheStorage(storage_config(sgl, extra=dynamic_extra()), {}, engine=engine)
    with pytest.raises(RuntimeError, match="register_mem_pool_host"):
        backend.batch_exists(["a"])
