"""lmcache's tiers in vLLM's own KV-event stream (issue 36; plugins/connectors/vllm/events.py).

vLLM 0.33's real ``Scheduler`` runs with ``kv_events_config.enable_kv_cache_events``; the
worker connector's ``get_kv_connector_kv_cache_events`` goes back in the
``KVConnectorOutput`` as vLLM's model runner sends it, and what the scheduler publishes
(its own block pool's ``GPU`` events and lmcache's) is read from its publisher. The same
prompt's blocks must carry the same hashes in both.

Run: LMCACHE_ENGINE_TESTS=1 .venv-vllm/bin/python -m pytest tests/engines/test_vllm_tier_events.py -q
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_vllm import (  # noqa: E402
    BLOCK, Engine, _impl, alloc, kv_cache_config, make_config, model_config, new_req,
)

_ = model_config  # the module-scoped fixture of test_vllm.py (it names what is missing without vLLM)

LAYOUT = "std_nhd"


class Published:
    """Stands where vLLM's ZMQ publisher stands (``Scheduler.kv_event_publisher``): every
    ``KVEventBatch`` the scheduler publishes, as it publishes it."""

    def __init__(self) -> None:
        self.batches: list = []

    def publish(self, batch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass

    def take(self, medium: str | None = None, kind: str | None = None) -> list:
        out = [e for b in self.batches for e in b.events
               if (medium is None or getattr(e, "medium", None) == medium) and (kind is None or type(e).__name__ == kind)]
        return out

    def clear(self) -> None:
        self.batches = []


def _hashes(events) -> list:
    return [h for e in events for h in e.block_hashes]


def _engine(model_config, tmp_path, *, upstream: bool = False, disk: bool = False, **extra):
    """vLLM's scheduler and one worker connector with KV events on: ``(engine, published,
    worker, its KV layers)``."""
    from vllm.config import KVEventsConfig

    tiers = [{"backend": "cpu", "capacity": "64MiB"}]
    if disk:
        tiers.append({"backend": "disk", "path": str(tmp_path / "disk"), "capacity": "256MiB"})
    extra = {"lmcache.tiers": tiers, "lmcache.staging_size": "16MiB", "lmcache.memory_pool_prefault": False, **extra}
    vc = make_config(model_config, upstream=upstream,
                     kv_events=KVEventsConfig(enable_kv_cache_events=True, publisher="null"), **extra)
    eng = Engine(vc, kv_cache_config(False))
    pub = eng.sched.kv_event_publisher = Published()
    layers = alloc(LAYOUT)
    return eng, pub, eng.worker(layers), layers


def _run(eng: Engine, w, layers, rid: str, prompt: list[int], seed: int = 0, **extras):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    r = Request(rid, prompt, SamplingParams(max_tokens=4), None, block_hasher=eng.hasher, **extras)
    eng.sched.add_request(r)
    out, invalid = eng.step(w, layers, LAYOUT, torch.Generator().manual_seed(seed))
    assert invalid == set()
    eng.finish(rid)
    return new_req(out, rid).num_computed_tokens


@pytest.mark.parametrize("upstream", [False, True], ids=["LMCacheConnector", "LMCacheConnectorV1"])
def test_tier_stores_carry_vllms_own_block_hashes(model_config, tmp_path, upstream):
    """One 200-token prompt (12 full blocks of 16, chunks of 64): vLLM publishes its GPU
    blocks; lmcache's CPU tier store of the same prompt is the same 12 blocks, with the
    same hashes, parents, token ids and block size, in vLLM's stream. Before: lmcache's
    connector sent nothing into vLLM's stream (take_events returned ())."""
    eng, pub, w, layers = _engine(model_config, tmp_path, upstream=upstream)
    try:
        prompt = list(range(1, 201))
        _run(eng, w, layers, "a", prompt)
        gpu, cpu = pub.take("GPU", "BlockStored"), pub.take("CPU", "BlockStored")
        assert len(_hashes(gpu)) == 200 // BLOCK == 12
        assert _hashes(cpu) == _hashes(gpu)  # the same blocks, the same hashes
        assert [t for e in cpu for t in e.token_ids] == prompt[:192]
        assert all(e.block_size == BLOCK for e in cpu)
        assert cpu[0].parent_block_hash is None  # chained as vLLM chains them
        assert all(isinstance(h, int) for h in _hashes(cpu))  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
        if not upstream:
            assert all(e.group_idx == 0 for e in cpu)
        print("captured pair:", {"GPU": gpu[0], "CPU": cpu[0]})
    finally:
        eng.close()


def test_a_block_leaves_a_medium_only_when_its_last_tier_drops_it(model_config, tmp_path):
    """CPU + disk tiers: both announce the prompt (CPU and STORAGE). The CPU tier's clear is
    per-block removals on CPU (never AllBlocksCleared), and STORAGE is announced again
    (the disk tier still holds it), never removed."""
    eng, pub, w, layers = _engine(model_config, tmp_path, disk=True)
    try:
        prompt = list(range(1, 201))
        _run(eng, w, layers, "a", prompt)
        engine = _impl(w).engine
        engine.flush()  # the disk tier's queued writes
        _run(eng, w, layers, "tick", [7] * 8)  # one more step publishes the disk tier's admits
        gpu = _hashes(pub.take("GPU", "BlockStored"))
        assert _hashes(pub.take("STORAGE", "BlockStored")) == gpu
        pub.clear()
        engine.admin.clear("cpu")
        _run(eng, w, layers, "tick2", [8] * 8)
        assert not pub.take(kind="AllBlocksCleared")  # a tier clear is per-block removals
        assert sorted(_hashes(pub.take("CPU", "BlockRemoved"))) == sorted(gpu)
        assert sorted(_hashes(pub.take("STORAGE", "BlockStored"))) == sorted(gpu)  # still on disk
        assert not pub.take("STORAGE", "BlockRemoved")
    finally:
        eng.close()


def test_a_restart_announces_what_the_disk_tier_still_holds(model_config, tmp_path):
    """A new engine over the same disk directory (a restarted vLLM): its first request
    over the prompt hits the disk tier and announces those blocks on STORAGE, then on CPU
    once promoted; the hashes are those vLLM gives the prompt."""
    # the same cache across the two engines; a disk hit loads in the step (not asynchronously)
    ns = {"lmcache.namespace": "restarted", "lmcache.vllm.async_loads": "never"}
    eng, pub, w, layers = _engine(model_config, tmp_path, disk=True, **ns)
    prompt = list(range(1, 201))
    try:
        _run(eng, w, layers, "a", prompt)
        _impl(w).engine.flush()
        gpu = _hashes(pub.take("GPU", "BlockStored"))
    finally:
        eng.close()
    eng, pub, w, layers = _engine(model_config, tmp_path, disk=True, **ns)
    try:
        assert _run(eng, w, layers, "b", prompt + [5] * 20) == 192  # loaded from the disk tier
        _run(eng, w, layers, "tick", [7] * 8)
        assert _hashes(pub.take("STORAGE", "BlockStored"))[:12] == gpu
        assert _hashes(pub.take("CPU", "BlockStored"))[:12] == gpu
    finally:
        eng.close()


def test_salted_and_lora_requests_carry_vllms_extra_keys(model_config, tmp_path):
    """A salted request's blocks hash differently (vLLM and lmcache alike); the event has
    vLLM's extra keys (the salt in the first block) and the same hashes as vLLM's GPU event."""
    eng, pub, w, layers = _engine(model_config, tmp_path)
    try:
        prompt = list(range(1, 201))
        _run(eng, w, layers, "a", prompt, cache_salt="tenant-1")
        gpu, cpu = pub.take("GPU", "BlockStored"), pub.take("CPU", "BlockStored")
        assert _hashes(cpu) == _hashes(gpu) and len(_hashes(cpu)) == 12
        assert [k for e in cpu for k in e.extra_keys] == [k for e in gpu for k in e.extra_keys]
        assert cpu[0].extra_keys[0] == ("tenant-1",)
    finally:
        eng.close()


def test_no_events_without_vllms_kv_events(model_config, tmp_path):
    """Without --kv-events-config nothing is built or sent (no bridge, no block hashes in
    the connector metadata)."""
    eng = Engine(make_config(model_config, **{"lmcache.memory_pool_prefault": False}), kv_cache_config(False))
    try:
        layers = alloc(LAYOUT)
        w = eng.worker(layers)
        assert _impl(w).connector_worker._bridge is None
        out, _ = eng.step(w, layers, LAYOUT, torch.Generator().manual_seed(0))
        assert w.get_kv_connector_kv_cache_events() is None
    finally:
        eng.close()
