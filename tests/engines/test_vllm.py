"""The vLLM v1 connector against the real vLLM classes (vllm==0.33.0, CPU only).

The scheduler role runs inside vLLM's own ``Scheduler`` (built from a real ``VllmConfig``
with a tiny hand-written Llama config, no download), which calls
``get_num_new_matched_tokens`` / ``update_state_after_alloc`` / ``build_connector_meta`` /
``request_finished`` itself. The worker role gets the ``SchedulerOutput``'s connector
metadata and is called in the model runner's order (bind, ``start_load_kv``, per layer
``wait_for_layer_load`` + ``save_kv_layer``, ``wait_for_save``,
``get_block_ids_with_load_errors``) on CPU tensors in vLLM's paged layouts. Forward passes
are simulated by writing random KV into the request's slots.

Run: LMCACHE_ENGINE_TESTS=1 .venv-vllm/bin/python -m pytest tests/engines/test_vllm.py -q
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _digests import count_digests, count_prompt_digests  # noqa: E402
from _missing import missing  # noqa: E402

INSTALL = "bash requirements/setup-vllm.sh .venv-vllm .venv  (vllm==0.33.0 with --no-deps, see requirements/vllm.txt)"

try:
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager
except ImportError as exc:  # pragma: no cover
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

BLOCK = 16
CHUNK = 64
NUM_BLOCKS = 64
HEADS, HEAD = 2, 16
LATENT = 24
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
_ids = itertools.count()


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    if _IMPORT_ERROR is not None:
        missing(f"vllm is not importable ({_IMPORT_ERROR}); install it with: {INSTALL}")
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": HEADS,
        "num_hidden_layers": len(LAYERS), "vocab_size": 1000, "max_position_embeddings": 2048,
        "torch_dtype": "float32", "head_dim": HEAD,
    }))  # fmt: skip
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return ModelConfig(model=str(d), skip_tokenizer_init=True, dtype="float32", max_model_len=2048)


def make_config(model_config, policy: str = "recompute", prefix_caching: bool = True, *, upstream: bool = False,
                role: str = "kv_both", kv_events=None, batched_tokens: int = 2048, **extra) -> VllmConfig:
    """A VllmConfig naming lmcache's connector; ``upstream``: as LMCache's users name it,
    ``kv_connector: LMCacheConnectorV1`` with no module path (vLLM's wrapper)."""
    extra.setdefault("lmcache.chunk_size", CHUNK)
    extra.setdefault("lmcache.namespace", f"t{next(_ids)}")  # a fresh cache engine per test
    names = ({"kv_connector": "LMCacheConnectorV1"} if upstream else
             {"kv_connector": "LMCacheConnector", "kv_connector_module_path": "lmcache.plugins.connectors.vllm"})
    vc = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=batched_tokens, max_num_seqs=8, max_model_len=2048, is_encoder_decoder=False,
            enable_chunked_prefill=True,
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            **names,
            kv_role=role,
            kv_load_failure_policy=policy,
            kv_connector_extra_config=extra,
        ),
        kv_events_config=kv_events,
    )
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    return vc


def kv_cache_config(mla: bool, dtype=torch.float32) -> KVCacheConfig:
    if mla:
        spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LATENT, dtype=dtype)
    else:
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=dtype)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


# ------------------------------------------------------------------ paged layouts
def alloc(layout: str, dtype=torch.float32) -> list[torch.Tensor]:
    """One zeroed tensor per layer in a vLLM layout."""
    out = []
    for _ in LAYERS:
        if layout == "flash_attn":  # vLLM <= 0.2x FlashAttention
            t = torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, HEAD, dtype=dtype)
        elif layout == "blocks_first":  # vLLM <= 0.2x FlashInfer
            t = torch.zeros(NUM_BLOCKS, 2, BLOCK, HEADS, HEAD, dtype=dtype)
        elif layout == "std_nhd":  # vLLM 0.33 standardized [B, H, N, 2D], physically NHD (LBNHC)
            t = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD, dtype=dtype).permute(0, 2, 1, 3)
        elif layout == "cpu_attn":  # vLLM's CPU backend (vec kernels): per block and head, keys [D, N], values [N, D]
            t = torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=dtype)
        elif layout == "mla":  # (B, N, latent)
            t = torch.zeros(NUM_BLOCKS, BLOCK, LATENT, dtype=dtype)
        elif layout == "std_mla":  # vLLM 0.33 [B, 1, N, latent]
            t = torch.zeros(NUM_BLOCKS, 1, BLOCK, LATENT, dtype=dtype)
        else:
            raise AssertionError(layout)
        out.append(t)
    return out


def token(t: torch.Tensor, layout: str, slot: int) -> torch.Tensor:
    """Every element of one token's KV, read directly (independent of the kernels)."""
    b, o = divmod(slot, BLOCK)
    return {
        "flash_attn": lambda: t[:, b, o],
        "blocks_first": lambda: t[b, :, o],
        "std_nhd": lambda: t[b, :, o],
        "cpu_attn": lambda: torch.cat([cpu_keys(t)[b, :, :, o], cpu_values(t)[b, :, o]], -1),
        "mla": lambda: t[b, o],
        "std_mla": lambda: t[b, 0, o],
    }[layout]()


def cpu_keys(t: torch.Tensor) -> torch.Tensor:
    """(B, H, D, N): where vLLM's CPU vec kernels put keys (tests/engines/test_vllm_live.py
    checks this against the real kernel)."""
    return t.view(NUM_BLOCKS, HEADS, 2, BLOCK * HEAD)[:, :, 0].view(NUM_BLOCKS, HEADS, HEAD, BLOCK)


def cpu_values(t: torch.Tensor) -> torch.Tensor:
    """(B, H, N, D): the values after the keys of each block and head."""
    return t.view(NUM_BLOCKS, HEADS, 2, BLOCK * HEAD)[:, :, 1].view(NUM_BLOCKS, HEADS, BLOCK, HEAD)


def slots_of(block_ids: list[int], n: int) -> list[int]:
    return [block_ids[i // BLOCK] * BLOCK + i % BLOCK for i in range(n)]


def forward(layers, layout, block_ids, start, end, gen) -> None:
    """Stand-in for the model: random KV for tokens [start, end) of the request."""
    for t in layers:
        for s in slots_of(block_ids, end)[start:]:
            v = token(t, layout, s)
            v.copy_(torch.randn(v.shape, generator=gen).to(v.dtype))


def same(a_layers, la, a_slots, b_layers, lb, b_slots) -> bool:
    return all(
        torch.equal(token(ta, la, sa), token(tb, lb, sb))
        for ta, tb in zip(a_layers, b_layers)
        for sa, sb in zip(a_slots, b_slots)
    )


def is_zero(layers, layout, slots) -> bool:
    return all(not token(t, layout, s).any() for t in layers for s in slots)


# ------------------------------------------------------------------ vLLM drivers
class Engine:
    """vLLM's real Scheduler plus worker-role connectors called like the model runner."""

    def __init__(self, vc, kcc):
        self.vc, self.kcc = vc, kcc
        self.sched = Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=BLOCK, log_stats=False)
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.workers = []
        self.blocks: dict[str, list[int]] = {}  # each request's blocks, as the model runner keeps them

    def worker(self, layers):
        """A worker-role connector, built as vLLM's factory builds it (vLLM's
        ``LMCacheConnectorV1`` wrapper for that name, else lmcache's class)."""
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        w = KVConnectorFactory.create_connector(self.vc, KVConnectorRole.WORKER, self.kcc)
        w.register_kv_caches(dict(zip(LAYERS, layers)))
        self.workers.append(w)
        return w

    def submit(self, req_id: str, prompt: list[int]) -> Request:
        r = Request(req_id, prompt, SamplingParams(max_tokens=4), None, block_hasher=self.hasher)
        self.sched.add_request(r)
        return r

    def step(self, worker, layers, layout, gen, *, layerwise=False, before_load=None):
        """One engine step: schedule, the worker connector around a simulated forward, then
        the scheduler's ``update_from_output``; returns (scheduler output, invalid blocks)."""
        out = self.sched.schedule()
        if before_load is not None:
            before_load(out)
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(None)
        for new in out.scheduled_new_reqs:  # the forward computes what was scheduled
            n = out.num_scheduled_tokens[new.req_id]
            self.blocks[new.req_id] = list(new.block_ids[0])
            forward(layers, layout, new.block_ids[0], new.num_computed_tokens, new.num_computed_tokens + n, gen)
        cached = out.scheduled_cached_reqs  # a chunked prefill's later steps (and decodes)
        for i, rid in enumerate(cached.req_ids):
            if cached.new_block_ids[i] is not None:
                self.blocks[rid] = (list(cached.new_block_ids[i][0]) if rid in cached.resumed_req_ids
                                    else self.blocks.get(rid, []) + list(cached.new_block_ids[i][0]))
            done = cached.num_computed_tokens[i]
            forward(layers, layout, self.blocks[rid], done, done + out.num_scheduled_tokens[rid], gen)
        for name, t in zip(LAYERS, layers):
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, t, None)
        worker.wait_for_save()
        invalid = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        # a step that ends inside a prompt (chunked prefill) samples nothing, as vLLM's runner
        # (schedule() has counted this step's tokens as computed already)
        sampled = [[42] if self.sched.requests[r].num_computed_tokens >= self.sched.requests[r].num_prompt_tokens
                   else [] for r in ids]
        self.last = self.sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(invalid_block_ids=set(invalid),
                                                  kv_cache_events=worker.get_kv_connector_kv_cache_events()),
        ))  # fmt: skip
        return out, invalid

    def finish(self, *req_ids):
        self.sched.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)

    def close(self):
        for w in self.workers:
            w.shutdown()
            _impl(w).shutdown()  # vLLM's LMCacheConnectorV1 wrapper does not forward shutdown()
        self.sched.shutdown()


def _impl(conn):
    """lmcache's connector: the object itself, or the impl behind vLLM's LMCacheConnectorV1 wrapper."""
    return getattr(conn, "_lmcache_engine", conn)


def new_req(out, req_id):
    return next(r for r in out.scheduled_new_reqs if r.req_id == req_id)


LAYOUTS = {"flash_attn": False, "blocks_first": False, "std_nhd": False, "mla": True, "std_mla": True}


# ------------------------------------------------------------------ tests
def test_factory_loads_the_connector_in_both_roles(model_config):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from lmcache.plugins.connectors.vllm import LMCacheConnector

    vc, kcc = make_config(model_config, policy="fail"), kv_cache_config(False)
    conns = [KVConnectorFactory.create_connector(vc, role, kcc) for role in KVConnectorRole]
    try:
        assert all(type(c) is LMCacheConnector for c in conns)
        sched, worker = (c for c in conns if c.role == KVConnectorRole.SCHEDULER), (c for c in conns if c.role != KVConnectorRole.SCHEDULER)
        sched, worker = next(sched), next(worker)
        assert sched.engine is None  # the scheduler opens no tiers: it asks the workers
        assert worker.engine is not None and worker.engine.config.chunk_size == CHUNK == sched.chunk_size
        # a recompute policy was set so that a failed load never fails a request
        assert vc.kv_transfer_config.kv_load_failure_policy == "recompute"
        assert conns[0].kv_spec.signature == "float32-L2-H2-D16-lt2hd-tp0of1"
    finally:
        for c in conns:
            c.shutdown()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("layerwise", [False, True], ids=["bulk", "layerwise"])
@pytest.mark.parametrize("upstream", [False, True], ids=["LMCacheConnector", "LMCacheConnectorV1"])
def test_store_then_load_into_other_blocks(model_config, layout, layerwise, upstream):
    """Store a prompt from one worker's blocks, load it into another's. With
    ``LMCacheConnectorV1`` every call goes through vLLM's wrapper: its scheduler side passes
    no blocks to update_state_after_alloc and takes a bare count from
    get_num_new_matched_tokens; LMCache's ``use_layerwise`` key selects layer-wise."""
    mla = LAYOUTS[layout]
    dtype = torch.bfloat16 if mla else torch.float32
    opts = {"use_layerwise": layerwise} if upstream else {"lmcache.vllm.layerwise": layerwise}
    eng = Engine(make_config(model_config, upstream=upstream, **opts), kv_cache_config(mla, dtype))
    gen = torch.Generator().manual_seed(1)
    try:
        a_layers, b_layers = alloc(layout, dtype), alloc(layout, dtype)
        wa, wb = eng.worker(a_layers), eng.worker(b_layers)
        prompt = list(range(1, 201))
        eng.submit("a", prompt)
        out, invalid = eng.step(wa, a_layers, layout, gen, layerwise=layerwise)
        a_blocks = new_req(out, "a").block_ids[0]
        assert invalid == set() and out.kv_connector_metadata.saves[0].token_ids == prompt
        assert _impl(wa).engine.lookup(prompt) == 200  # 3 full chunks + the unfull tail
        eng.finish("a")
        eng.sched.reset_prefix_cache()  # vLLM forgets; lmcache remembers
        eng.submit("filler", [7] * 40)  # takes blocks so "b" lands elsewhere
        eng.step(wb, b_layers, layout, gen)
        eng.submit("b", prompt + list(range(500, 520)))
        out, invalid = eng.step(wb, b_layers, layout, gen, layerwise=layerwise)
        b = new_req(out, "b")
        assert b.num_computed_tokens == 192  # chunks [0,192) hit; b's 4th chunk differs from a's tail
        assert out.num_scheduled_tokens["b"] == 220 - 192
        assert invalid == set()
        assert b.block_ids[0][:12] != a_blocks[:12]
        assert same(a_layers, layout, slots_of(a_blocks, 192), b_layers, layout, slots_of(b.block_ids[0], 192))
        # "b" then stored its own full prompt; the chunks it shares with "a" were skipped
        assert _impl(wb).engine.lookup(prompt + list(range(500, 520))) == 220
        assert _impl(wb)._connector_metadata is None  # dropped after the step: no stale load next step
    finally:
        eng.close()


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "over-the-cap"])
def test_staging_memory_is_kept_between_requests(model_config, monkeypatch, keep):
    """A worker moves loads and saves through host staging memory kept between requests
    (fresh memory costs page faults on every request: 52 ms against 9 ms for a 3k-token
    prompt of SmolLM2). A later, shorter load through the same memory is exact all the
    same; past STAGING_KEEP_BYTES each request allocates its own."""
    from lmcache.plugins.connectors.vllm import worker as conn

    if not keep:
        monkeypatch.setattr(conn, "STAGING_KEEP_BYTES", 0)
    layout = "mla"  # loads scatter from the pool directly but for MLA (its kernels' latent order)
    eng = Engine(make_config(model_config), kv_cache_config(True))
    gen = torch.Generator().manual_seed(3)
    try:
        a_layers, b_layers = alloc(layout), alloc(layout)
        wa, wb = eng.worker(a_layers), eng.worker(b_layers)
        long, short = list(range(1, 4 * CHUNK + 9)), list(range(1000, 1000 + CHUNK + 9))
        stored = {}
        for rid, prompt in (("long", long), ("short", short)):
            eng.submit(rid, prompt)
            out, _ = eng.step(wa, a_layers, layout, gen)
            stored[rid] = new_req(out, rid).block_ids[0]
            eng.finish(rid)
        assert list(wa.connector_worker._staging) == (["gather"] if keep else [])  # the saves' gather, on the host
        eng.sched.reset_prefix_cache()  # vLLM forgets; lmcache remembers
        buffers = []
        for rid, prompt, hit in (("b-long", long, 4 * CHUNK), ("b-short", short, CHUNK)):
            eng.submit(rid, prompt + [5, 6, 7])
            out, invalid = eng.step(wb, b_layers, layout, gen)
            got = new_req(out, rid)
            assert got.num_computed_tokens == hit and invalid == set()
            src = stored["long" if rid == "b-long" else "short"]
            assert same(a_layers, layout, slots_of(src, hit), b_layers, layout, slots_of(got.block_ids[0], hit))
            buffers.append(wb.connector_worker._staging.get("load"))
            eng.finish(rid)
        if keep:  # one buffer, sized by the first load, served the second
            assert buffers[0] is not None and buffers[1] is buffers[0]
        else:
            assert buffers == [None, None]
    finally:
        eng.close()


@pytest.mark.parametrize("layout", [k for k, mla in LAYOUTS.items() if not mla])
def test_a_load_scatters_from_the_pool_without_staging(model_config, layout):
    """Issue 31: a load copies each chunk once, from the engine's memory pool into the paged
    blocks (before: pool -> staging buffer -> blocks). No host staging buffer is made for
    loads, and the loaded KV equals what was stored, behind a prefix vLLM holds itself."""
    eng = Engine(make_config(model_config), kv_cache_config(False))
    gen = torch.Generator().manual_seed(5)
    try:
        a_layers, b_layers = alloc(layout), alloc(layout)
        wa, wb = eng.worker(a_layers), eng.worker(b_layers)
        prompt = list(range(1, 4 * CHUNK + 9))
        eng.submit("a", prompt)
        out, _ = eng.step(wa, a_layers, layout, gen)
        src = new_req(out, "a").block_ids[0]
        eng.finish("a")
        eng.sched.reset_prefix_cache()
        eng.submit("b", prompt + [5, 6, 7])
        out, invalid = eng.step(wb, b_layers, layout, gen)
        got = new_req(out, "b")
        assert got.num_computed_tokens == 4 * CHUNK and invalid == set()
        assert same(a_layers, layout, slots_of(src, 4 * CHUNK), b_layers, layout, slots_of(got.block_ids[0], 4 * CHUNK))
        assert "load" not in _impl(wb).connector_worker._staging
    finally:
        eng.close()


@pytest.mark.parametrize("layout", [k for k, mla in LAYOUTS.items() if not mla])
def test_one_request_hashes_its_prompt_once_and_saves_without_staging(model_config, layout):
    """Issue 31: in the worker's process each request's chunk keys are computed once (the
    scheduler's lookup; the load's retrieve and release and the save's store find them),
    and a save gathers each chunk not cached yet from the paged blocks straight into the
    cache's memory (no staging buffer, no lookup before it). Digest calls, 5-chunk prompt:
    a miss then its save 15 before, 5 after; a hit, its load and its save 27 before, 5 after,
    1 since a prompt that extends a remembered one reuses its full chunks' keys."""
    eng = Engine(make_config(model_config), kv_cache_config(False))
    gen = torch.Generator().manual_seed(6)
    try:
        a_layers, b_layers = alloc(layout), alloc(layout)
        wa, wb = eng.worker(a_layers), eng.worker(b_layers)
        engine = _impl(wa).engine
        assert _impl(wb).engine is engine  # one engine per process and config
        calls, whole = count_digests(engine), count_prompt_digests(engine)
        prompt = list(range(1, 4 * CHUNK + 9))  # 5 chunks, the last one partial
        eng.submit("a", prompt)
        out, _ = eng.step(wa, a_layers, layout, gen)
        src = new_req(out, "a").block_ids[0]
        assert out.kv_connector_metadata.saves[0].token_ids == prompt
        assert calls[0] == 5
        eng.finish("a")
        eng.sched.reset_prefix_cache()
        calls[0] = 0
        eng.submit("b", prompt + [5, 6, 7])
        out, invalid = eng.step(wb, b_layers, layout, gen)
        got = new_req(out, "b")
        assert got.num_computed_tokens == 4 * CHUNK and invalid == set()
        # the lookup's, of the one chunk past a's 4 full ones (b's prompt extends a's, whose
        # keys the process has); the load, its release and the save found them
        assert calls[0] == 1
        # the lookup, loads, saves and their releases name the request: its prompt is found
        # by that name, never by a digest of the whole prompt (issue 46)
        assert whole[0] == 0
        assert same(a_layers, layout, slots_of(src, 4 * CHUNK), b_layers, layout, slots_of(got.block_ids[0], 4 * CHUNK))
        staging = {**_impl(wa).connector_worker._staging, **_impl(wb).connector_worker._staging}
        assert not {"gather", "save", "load"} & set(staging)
        # what the saves stored is the blocks' KV: b's whole prompt reads back as its blocks hold it
        res = engine.retrieve(prompt + [5, 6, 7])
        assert res.num_tokens == len(prompt) + 3
        for i, slot in enumerate(slots_of(got.block_ids[0], res.num_tokens)):
            for layer, t in enumerate(b_layers):
                v = token(t, layout, slot)
                want = v.reshape(HEADS, 2, HEAD).transpose(0, 1) if layout == "std_nhd" else v
                assert torch.equal(res.kv[layer, :, i], want), (i, layer)
    finally:
        eng.close()



def test_a_chunked_prefill_hashes_each_chunk_once(model_config):
    """A prompt of 10 chunks prefilled 100 tokens a step (vLLM's chunked prefill, 7 steps):
    each step saves the prompt so far (lookup, store, release of a growing prefix) and the
    worker's process hashes each full chunk once, plus the partial last chunk of each step
    that ends inside one: 10 here (40 before, when every step hashed its prefix from the
    first token). Then the whole prompt reads back as the blocks hold it."""
    layout = "std_nhd"
    eng = Engine(make_config(model_config, batched_tokens=100), kv_cache_config(False))
    gen = torch.Generator().manual_seed(9)
    try:
        layers = alloc(layout)
        w = eng.worker(layers)
        engine = _impl(w).engine
        calls, whole = count_digests(engine), count_prompt_digests(engine)
        prompt = list(range(7, 7 + 10 * CHUNK - 20))  # 620 tokens: 9 full chunks and a partial one
        eng.submit("c", prompt)
        ends = []
        for _ in range(8):  # 7 prefill steps of at most 100 tokens, then a decode
            out, _ = eng.step(w, layers, layout, gen)
            ends += [len(s.token_ids) for s in out.kv_connector_metadata.saves]
        assert len(ends) >= 5 and ends[-1] == len(prompt), ends
        partial = sum(1 for e in ends if e % CHUNK)  # each step's own partial last chunk
        assert calls[0] == len(prompt) // CHUNK + partial, (calls[0], ends)
        assert whole[0] == 0  # every call names the request: no digest of the whole prompt
        res = engine.retrieve(list(prompt))
        assert res.num_tokens == len(prompt)
        for i, slot in enumerate(slots_of(eng.blocks["c"], len(prompt))):
            for layer, t in enumerate(layers):
                v = token(t, layout, slot)
                assert torch.equal(res.kv[layer, :, i], v.reshape(HEADS, 2, HEAD).transpose(0, 1)), (i, layer)
    finally:
        eng.close()

def test_vllm_prefix_cache_hit_is_skipped(model_config):
    layout = "std_nhd"
    eng = Engine(make_config(model_config), kv_cache_config(False))
    gen = torch.Generator().manual_seed(2)
    try:
        a_layers = alloc(layout)
        w = eng.worker(a_layers)
        prompt = list(range(1, 201))
        eng.submit("a", prompt)
        out, _ = eng.step(w, a_layers, layout, gen)
        a_blocks = new_req(out, "a").block_ids[0]
        a_kv = [t.clone() for t in a_layers]
        eng.finish("a")
        eng.sched.reset_prefix_cache()
        eng.submit("c", prompt[:48] + [999] * 20)  # vLLM now caches blocks 0..2 of the prompt
        out, _ = eng.step(w, a_layers, layout, gen)
        c_blocks = new_req(out, "c").block_ids[0]
        eng.finish("c")
        before = [t.clone() for t in a_layers]
        eng.submit("b", prompt + [5] * 10)
        out, invalid = eng.step(w, a_layers, layout, gen)
        b = new_req(out, "b")
        load = out.kv_connector_metadata.loads[0]
        assert b.num_computed_tokens == 192 and load.skip == 48 and load.load_end == 192
        assert b.block_ids[0][:3] == c_blocks[:3]  # vLLM's own cached blocks
        assert invalid == set()
        # the connector left vLLM's cached tokens alone and loaded 48..192
        assert same(before, layout, slots_of(c_blocks, 48), a_layers, layout, slots_of(b.block_ids[0], 48))
        b_slots = slots_of(b.block_ids[0], 192)
        assert same(a_kv, layout, slots_of(a_blocks, 192)[48:], a_layers, layout, b_slots[48:])
    finally:
        eng.close()


def _store_then_reload(eng: Engine, layout: str, prompt: list[int], tail: list[int], seed: int, layerwise: bool = False):
    """Request "a" stores ``prompt`` from one worker's blocks; vLLM forgets it; request "b"
    (``prompt + tail``) is scheduled on another worker: (b, b's step output, its invalid
    blocks, a check that b's first ``n`` tokens hold a's KV)."""
    gen = torch.Generator().manual_seed(seed)
    a_layers, b_layers = alloc(layout), alloc(layout)
    wa, wb = eng.worker(a_layers), eng.worker(b_layers)
    eng.submit("a", prompt)
    out, _ = eng.step(wa, a_layers, layout, gen, layerwise=layerwise)
    a_blocks = new_req(out, "a").block_ids[0]
    eng.finish("a")
    eng.sched.reset_prefix_cache()
    eng.submit("b", prompt + tail)
    out, invalid = eng.step(wb, b_layers, layout, gen, layerwise=layerwise)
    b = new_req(out, "b")

    def same_kv(n: int) -> bool:
        return same(a_layers, layout, slots_of(a_blocks, n), b_layers, layout, slots_of(b.block_ids[0], n))

    return b, out, invalid, same_kv


@pytest.mark.parametrize("unfull", [True, False])
def test_unfull_chunk(model_config, unfull):
    eng = Engine(make_config(model_config, **{"lmcache.save_unfull_chunk": unfull}), kv_cache_config(False))
    try:
        prompt = list(range(1, 251))  # 3 full chunks + 58 tokens
        # the same prompt again: all but its last token may be loaded
        b, _, invalid, same_kv = _store_then_reload(eng, "flash_attn", prompt, [], seed=3)
        assert eng.sched.connector.stats["hit_tokens"] == b.num_computed_tokens
        want = 240 if unfull else 192  # the last token's block is computed; no unfull chunk: whole chunks
        assert b.num_computed_tokens == want and invalid == set() and same_kv(want)
    finally:
        eng.close()


@pytest.mark.parametrize("layout", ["flash_attn", "std_nhd"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["bulk", "layerwise"])
def test_a_hit_ending_inside_a_block_loads_to_its_last_token(model_config, layout, layerwise):
    """A PD decoder's request (LMCache's decoder config: ``skip_last_n_tokens: 1``,
    ``discard_partial_chunks: false``): the stored prompt plus one token (the prefiller's
    first). The hit (250 tokens: 3 full chunks and an unfull one) ends before the last
    token, inside vLLM's 16th block: it is loaded to its last token, and vLLM computes one
    token, not the 10 that rounding down to a whole block would leave it."""
    eng = Engine(make_config(model_config, upstream=True, skip_last_n_tokens=1, discard_partial_chunks=False,
                             use_layerwise=layerwise), kv_cache_config(False))
    try:
        b, out, invalid, same_kv = _store_then_reload(eng, layout, list(range(1, 251)), [77], seed=5,
                                                      layerwise=layerwise)
        assert b.num_computed_tokens == 250 and out.num_scheduled_tokens["b"] == 1 and invalid == set()
        assert out.kv_connector_metadata.loads[0].load_end == 250 and same_kv(250)
    finally:
        eng.close()


@pytest.mark.parametrize("layerwise", [False, True], ids=["bulk", "layerwise"])
def test_failed_load_reports_blocks(model_config, layerwise):
    layout = "blocks_first"
    eng = Engine(make_config(model_config, **{"lmcache.vllm.layerwise": layerwise}), kv_cache_config(False))
    gen = torch.Generator().manual_seed(4)
    try:
        a_layers, b_layers = alloc(layout), alloc(layout)
        wa, wb = eng.worker(a_layers), eng.worker(b_layers)
        prompt = list(range(1, 201))
        eng.submit("a", prompt)
        out, _ = eng.step(wa, a_layers, layout, gen)
        a_blocks = new_req(out, "a").block_ids[0]
        eng.finish("a")
        eng.sched.reset_prefix_cache()
        eng.submit("b", prompt + [3] * 20)

        def evict(out):  # the scheduler promised 192 tokens, then chunk [64, 128) vanished
            assert new_req(out, "b").num_computed_tokens == 192
            _, keys = wb.engine.chunk_keys(prompt[:192])
            for tier in wb.engine.hierarchy.tiers:
                tier.delete([keys[1]])

        out, invalid = eng.step(wb, b_layers, layout, gen, layerwise=layerwise, before_load=evict)
        b = new_req(out, "b")
        assert invalid == set(b.block_ids[0][4:12])  # tokens 64..191 must be recomputed
        assert same(a_layers, layout, slots_of(a_blocks, 64), b_layers, layout, slots_of(b.block_ids[0], 64))
        # vLLM took the report: "b" goes back to token 64 and recomputes the rest
        assert eng.last == {} or all(o.finish_reason is None for o in eng.last[0].outputs)
        out, invalid = eng.step(wb, b_layers, layout, gen)
        i = out.scheduled_cached_reqs.req_ids.index("b")
        assert out.scheduled_cached_reqs.num_computed_tokens[i] == 64 and invalid == set()
        assert out.num_scheduled_tokens["b"] == 220 - 64
        assert wb.get_block_ids_with_load_errors() == set()  # reported once
    finally:
        eng.close()


@pytest.mark.parametrize("ours", ["recompute", "fail"])
def test_tier_error_reports_every_promised_block(model_config, monkeypatch, ours):
    """A tier that errors: every promised block is reported. vLLM's own default policy is
    ``kv_load_failure_policy="fail"``; the connector turns it into ``recompute`` (the
    request goes on, recomputing), unless ``lmcache.vllm.load_failure_policy: fail``, when
    the request ends with an error. Never with garbage."""
    layout = "std_nhd"
    vc = make_config(model_config, policy="fail", **{"lmcache.vllm.load_failure_policy": ours})
    eng = Engine(vc, kv_cache_config(False))
    gen = torch.Generator().manual_seed(5)
    try:
        a_layers, b_layers = alloc(layout), alloc(layout)
        wa, wb = eng.worker(a_layers), eng.worker(b_layers)
        prompt = list(range(1, 201))
        eng.submit("a", prompt)
        eng.step(wa, a_layers, layout, gen)
        eng.finish("a")
        eng.sched.reset_prefix_cache()
        eng.submit("b", prompt + [3] * 20)

        def broken(*a, **k):
            raise OSError("tier down")

        monkeypatch.setattr(wb.engine, "retrieve", broken)
        out, invalid = eng.step(wb, b_layers, layout, gen)
        b = new_req(out, "b")
        assert b.num_computed_tokens == 192
        assert invalid == set(b.block_ids[0][:12])
        assert is_zero(b_layers, layout, slots_of(b.block_ids[0], 192))
        outputs = eng.last[0].outputs if eng.last else []
        errors = [o for o in outputs if o.request_id == "b" and o.finish_reason == FinishReason.ERROR]
        if ours == "fail":
            assert errors
        else:
            assert not errors
            monkeypatch.undo()
            out, invalid = eng.step(wb, b_layers, layout, gen)  # b is recomputed from its first token
            assert not invalid
            scheduled = {**{r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs},
                         **dict(zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens))}
            assert scheduled.get("b") == 0
    finally:
        eng.close()


def test_unknown_connector_key_is_refused(model_config):
    from lmcache.plugins.connectors.vllm import LMCacheConnector

    with pytest.raises(ValueError, match=r"'vllm\.bogus': unknown key"):
        LMCacheConnector(make_config(model_config, **{"lmcache.vllm.bogus": 1}), KVConnectorRole.WORKER, kv_cache_config(False))


# ------------------------------------------------------------------ shifted reuse (approximate_reuse)
def _shifted_prompts():
    a = list(range(1, 321))  # 5 chunks of 64; its first 8 tokens stand for a system prompt
    b = a[:8] + a[48:] + list(range(900, 920))  # 40 tokens after the system prompt cut, a new turn
    old = list(range(8)) + [p + 40 for p in range(8, 280)]  # b's position p was a's old[p]
    return a, b, old


def _shifted_engine(model_config, seed: int):
    """vLLM's scheduler with approximate_reuse on (and vLLM's prefix cache off), a generator."""
    vc = make_config(model_config, prefix_caching=False, **{"lmcache.approximate_reuse": True})
    return Engine(vc, kv_cache_config(False)), torch.Generator().manual_seed(seed)


def test_shifted_reuse_loads_a_truncated_prompt_rerotated(model_config):
    """A prompt whose 40 tokens after the system prompt were cut: vLLM loads the system
    prompt's KV (the head of a's first chunk, exact), the tail of that chunk after the cut
    and a's next four chunks, keys re-rotated by -40, values as they were; what vLLM then
    computes on them is stored under shifted keys, never the exact ones."""
    from lmcache.kernels import rope
    from lmcache.plugins.services.shifted import shifted_key

    layout = "std_nhd"
    vc = make_config(model_config, prefix_caching=False, **{"lmcache.approximate_reuse": True})
    eng = Engine(vc, kv_cache_config(False))
    gen = torch.Generator().manual_seed(7)
    try:
        a_layers, b_layers = alloc(layout), alloc(layout)
        wa = eng.worker(a_layers)
        a, b, old = _shifted_prompts()
        eng.submit("a", a)
        out, _ = eng.step(wa, a_layers, layout, gen)
        a_slots = slots_of(new_req(out, "a").block_ids[0], 320)
        eng.finish("a")
        wb = eng.worker(b_layers)
        eng.submit("b", b)
        out, invalid = eng.step(wb, b_layers, layout, gen)
        req = new_req(out, "b")
        assert eng.sched.connector.shifted and wb.engine.lookup(b) == 0  # no exact prefix
        load = out.kv_connector_metadata.loads[0]
        assert (load.exact, load.shifted, load.load_end) == (0, True, 272)  # 280 covered, block aligned
        assert req.num_computed_tokens == 272 and invalid == set()
        inv = rope.inv_freq_of(model_config.hf_config)
        b_slots = slots_of(req.block_ids[0], 272)
        for ta, tb in zip(a_layers, b_layers):
            for p in range(272):
                src, dst = token(ta, layout, a_slots[old[p]]), token(tb, layout, b_slots[p])  # (H, 2D)
                k_src, v_src = src[:, :HEAD], src[:, HEAD:]
                want_k = rope.rerotate(k_src, p - old[p], inv)
                assert torch.allclose(dst[:, :HEAD], want_k, atol=1e-5), p
                assert torch.equal(dst[:, HEAD:], v_src), p
        stats = wb.engine.stats()["approximate_reuse"]
        assert stats["matched_chunks"] == 6 and stats["missing_chunks"] == 0  # head, tail, 4 chunks
        assert eng.sched.connector.stats["shifted_hit_tokens"] == 272
        # b's KV was built on shifted reuse: stored apart, under shifted keys only
        keys = wb.engine.chunk_keys(b)[1]
        tier = wb.engine.hierarchy.tiers[0]
        assert all(tier.size_of(k) is None for k in keys)
        assert all(tier.size_of(shifted_key(k)) is not None for k in keys[:-1])
    finally:
        eng.close()


def test_shifted_reuse_after_an_exact_prefix_stores_both_apart(model_config):
    """A system prompt of a whole chunk is an exact hit; the shifted run follows it. What
    the request stores: its first chunk under the exact key, the rest under shifted keys."""
    from lmcache.plugins.services.shifted import shifted_key

    layout = "std_nhd"
    eng, gen = _shifted_engine(model_config, 10)
    try:
        layers = alloc(layout)
        w = eng.worker(layers)
        a = list(range(1, 321))
        b = a[:64] + a[104:] + list(range(900, 920))  # 40 tokens after the first chunk cut
        eng.submit("a", a)
        eng.step(w, layers, layout, gen)
        eng.finish("a")
        eng.submit("b", b)
        out, invalid = eng.step(w, layers, layout, gen)
        load = out.kv_connector_metadata.loads[0]
        assert (load.exact, load.shifted) == (64, True) and invalid == set()
        assert load.load_end == (64 + 24 + 3 * 64) // BLOCK * BLOCK  # the tail of a's chunk 1, then chunks 2-4
        keys = w.engine.chunk_keys(b)[1]
        tier = w.engine.hierarchy.tiers[0]
        assert w.engine.lookup(b) == 64  # only the exact chunk under an exact key
        assert all(tier.size_of(k) is None for k in keys[1:])
        assert all(tier.size_of(shifted_key(k)) is not None for k in keys[1:-1])
    finally:
        eng.close()


def test_shifted_reuse_chunk_gone_before_the_load_is_recomputed(model_config):
    layout = "std_nhd"
    eng, gen = _shifted_engine(model_config, 8)
    try:
        layers = alloc(layout)
        w = eng.worker(layers)
        a, b, _ = _shifted_prompts()
        eng.submit("a", a)
        eng.step(w, layers, layout, gen)
        eng.finish("a")
        eng.submit("b", b)
        a_keys = w.engine.chunk_keys(a)[1]
        # a's third chunk goes between the scheduler's lookup and the worker's load
        out, invalid = eng.step(w, layers, layout, gen, before_load=lambda out: w.engine.hierarchy.tiers[0].delete([a_keys[2]]))
        load = out.kv_connector_metadata.loads[0]
        assert load.shifted and load.load_end == 272
        # covered: head, tail and chunk 1 (b's tokens up to 88); blocks from 80 on are recomputed
        req = new_req(out, "b")
        assert invalid == set(req.block_ids[0][88 // BLOCK : 272 // BLOCK])
        assert w.engine.stats()["approximate_reuse"]["missing_chunks"] == 1
    finally:
        eng.close()


def test_each_role_builds_only_its_side(model_config):
    """The entry class delegates by role (as vLLM's offloading connector): the scheduler
    role builds a scheduler side and no worker state (no engine, no staging, no layers),
    a worker builds a worker side and no scheduler state (no lookups, no request state)."""
    from lmcache.plugins.connectors.vllm import ConnectorScheduler, ConnectorWorker, LMCacheConnector

    vc = make_config(model_config)
    s = LMCacheConnector(vc, KVConnectorRole.SCHEDULER, kv_cache_config(False))
    w = LMCacheConnector(vc, KVConnectorRole.WORKER, kv_cache_config(False))
    try:
        assert type(s.connector_scheduler) is ConnectorScheduler and s.connector_worker is None and s.engine is None
        assert type(w.connector_worker) is ConnectorWorker and w.connector_scheduler is None and w.engine is not None
        for name in ("engine", "_staging", "_layers", "_io", "_bridge", "_failed", "_block_entries"):
            assert not hasattr(s.connector_scheduler, name), name
        for name in ("_reqs", "_lookups", "_loads", "_client", "_tier_events", "stats"):
            assert not hasattr(w.connector_worker, name), name
        # a call of the other role does nothing and answers empty
        assert s.get_finished({"x"}) == (None, None) and s.get_block_ids_with_load_errors() == set()
        assert tuple(w.take_events()) == () and w.request_finished(Request("x", [1, 2, 3], SamplingParams(max_tokens=4), None), []) == (False, None)
    finally:
        s.shutdown()
        w.shutdown()


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_an_unknown_lmcache_vllm_key_is_refused_naming_it(model_config, role):
    """``lmcache.vllm.*`` is the ``vllm`` config section: an unknown key or a bad value is
    a one-line ConfigError naming the key, in either role."""
    from lmcache.errors import ConfigError
    from lmcache.plugins.connectors.vllm import LMCacheConnector

    for extra, key in (({"lmcache.vllm.layerwize": True}, "vllm.layerwize"),
                       ({"lmcache.vllm.async_loads": "sometimes"}, "vllm.async_loads")):
        with pytest.raises(ConfigError) as err:
            LMCacheConnector(make_config(model_config, **extra), getattr(KVConnectorRole, role), kv_cache_config(False))
        assert err.value.key == key and key in str(err.value) and "\n" not in str(err.value)


def test_shifted_reuse_is_off_while_vllms_prefix_cache_is_on(model_config, caplog):
    from lmcache.plugins.connectors.vllm import LMCacheConnector

    vc = make_config(model_config, **{"lmcache.approximate_reuse": True})
    with caplog.at_level("WARNING"):
        c = LMCacheConnector(vc, KVConnectorRole.SCHEDULER, kv_cache_config(False))
    try:
        assert not c.shifted
        assert "--no-enable-prefix-caching" in caplog.text
    finally:
        c.shutdown()


def _run_cpu_kernels(vc, isa: str) -> None:
    """Every attention layer of ``vc`` runs vLLM's CPU backend with kernels ``isa`` (what
    the connector looks at: the compilation config's forward context, by layer name)."""
    import types

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    vc.compilation_config.static_forward_context.update(
        {n: types.SimpleNamespace(impl=object.__new__(CPUAttentionBackendImpl), isa=isa) for n in LAYERS})


def _cpu_backend(model_config, monkeypatch, tag: str, isa: str) -> tuple[Engine, object]:
    """An engine whose worker keys its entries ``tag`` (blocks.block_entries_layout, forced:
    this vLLM is not the CPU build) on vLLM's CPU backend running kernels ``isa``; and its config."""
    from lmcache.plugins.connectors.vllm import worker as worker_mod

    monkeypatch.setattr(worker_mod, "block_entries_layout", lambda *a, **kw: tag)
    vc = make_config(model_config)
    _run_cpu_kernels(vc, isa)
    return Engine(vc, kv_cache_config(False)), vc


def _forget_then_load_192(eng: Engine, prompt: list[int], layout: str, gen) -> tuple[object, list[torch.Tensor]]:
    """Request "a" ends and vLLM forgets it; request "b" (``prompt`` and 10 more tokens)
    runs on a new cache of ``layout``: its request, after 192 tokens came from lmcache."""
    eng.finish("a")
    eng.sched.reset_prefix_cache()
    b_layers = alloc(layout)
    wb = eng.worker(b_layers)
    eng.submit("b", prompt + [7] * 10)
    out, invalid = eng.step(wb, b_layers, layout, gen)
    req = new_req(out, "b")
    assert req.num_computed_tokens == 192 and invalid == set()
    return req, b_layers


@pytest.mark.parametrize("layerwise", [False, True], ids=["bulk", "layerwise"])
def test_cpu_attention_layout_is_read_as_the_backend_reads_it(model_config, layerwise):
    """vLLM's CPU attention backend allocates [B, H, N, 2D] like the standardized layout but
    its vec kernels keep, per block and head, the keys transposed ([D, N]) and then the
    values ([N, D]). What lmcache stores from it must be each token's own key and value,
    so that it can move to other positions (shifted reuse) or to another engine."""
    import types

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    layout = "cpu_attn"
    vc = make_config(model_config, **{"lmcache.vllm.layerwise": layerwise})
    # the attention layers the model runner registers, by name (what the connector looks at)
    vc.compilation_config.static_forward_context.update(
        {n: types.SimpleNamespace(impl=object.__new__(CPUAttentionBackendImpl), isa="vec") for n in LAYERS})
    eng = Engine(vc, kv_cache_config(False))
    gen = torch.Generator().manual_seed(9)
    try:
        layers = alloc(layout)
        w = eng.worker(layers)
        assert w.connector_worker._layout.name == "vllm_cpu_vec" and len(w.connector_worker._layers) == 2 * len(LAYERS)
        prompt = list(range(1, 201))
        eng.submit("a", prompt)
        out, _ = eng.step(w, layers, layout, gen)
        slots = slots_of(new_req(out, "a").block_ids[0], 200)
        kv = w.engine.retrieve(prompt).kv  # (L, 2, T, H, D)
        for i, t in enumerate(layers):
            for p in (0, 1, 15, 16, 17, 100, 199):
                b, o = divmod(slots[p], BLOCK)
                assert torch.equal(kv[i, 0, p], cpu_keys(t)[b, :, :, o]), p
                assert torch.equal(kv[i, 1, p], cpu_values(t)[b, :, o]), p
        # and a load into other blocks puts every token back where the backend reads it
        req, b_layers = _forget_then_load_192(eng, prompt, layout, gen)
        assert same(layers, layout, slots[:192], b_layers, layout, slots_of(req.block_ids[0], 192))
    finally:
        eng.close()


def test_cpu_attention_blocks_are_stored_whole_and_put_back_where_the_backend_reads_them(model_config, monkeypatch):
    """On vLLM's CPU platform with the vec kernels and chunks of whole blocks (decided by
    blocks.block_entries_layout, forced here: this vLLM is not the CPU build), an entry
    holds each block as the kernels keep it, under a signature of its own, and a load
    into other blocks of another cache gives every token back as the backend reads it;
    the prompt's partial last block (200 = 12 blocks of 16 + 8) goes per token."""
    tag = f"vllmcpu_vec_b{BLOCK}"
    layout = "cpu_attn"
    eng, _ = _cpu_backend(model_config, monkeypatch, tag, "vec")
    gen = torch.Generator().manual_seed(11)
    try:
        layers = alloc(layout)
        w = eng.worker(layers)
        cw = w.connector_worker
        assert cw.kv_spec.layout == tag and tag in cw.engine.kv_spec.signature and cw._block_entries is not None
        prompt = list(range(1, 201))
        eng.submit("a", prompt)
        out, _ = eng.step(w, layers, layout, gen)
        blocks = new_req(out, "a").block_ids[0]
        slots = slots_of(blocks, 200)
        kv = w.engine.retrieve(prompt).kv  # (L, 2, T, H, D) elements, each chunk's blocks whole
        per_block = layers[0][0].numel()
        for c in range(0, 200 - CHUNK + 1, CHUNK):  # whole chunk c, layer i: its blocks as the backend keeps them
            for i, t in enumerate(layers):
                region = kv[i, :, c : c + CHUNK].reshape(-1)  # the entry's bytes of this layer, in order
                for j in range(CHUNK // BLOCK):
                    assert torch.equal(region[j * per_block : (j + 1) * per_block],
                                       t[blocks[c // BLOCK + j]].reshape(-1)), (c, i, j)
        for i, t in enumerate(layers):  # the unfull last chunk (one partial block) per token
            for p in range(192, 200):
                b, o = divmod(slots[p], BLOCK)
                assert torch.equal(kv[i, 0, p], cpu_keys(t)[b, :, :, o]) and torch.equal(kv[i, 1, p], cpu_values(t)[b, :, o])
        req, b_layers = _forget_then_load_192(eng, prompt, layout, gen)
        assert same(layers, layout, slots[:192], b_layers, layout, slots_of(req.block_ids[0], 192))
    finally:
        eng.close()


def test_packed_cpu_kernels_store_whole_blocks_under_their_own_signature(model_config, monkeypatch):
    """vLLM's CPU kernels other than vec (vec16, AMX) pack a block in an order of their own:
    the first rows of a partial block do not hold its tokens, and no other engine reads the
    rows as KV. So (blocks.block_entries_layout, forced here: this vLLM is not the CPU build)
    their entries are keyed vllmcpu_<isa>_rows_b<N>, never lt2hd, hold whole blocks only
    (200 tokens = 12 blocks of 16 + 8: 192 stored), and a load into other blocks of another
    cache gives each block back byte for byte. Kernels other than the ones the signature
    names load and save nothing."""
    from lmcache.plugins.connectors.vllm.layout import VLLM_BHNC

    tag = f"vllmcpu_vec16_rows_b{BLOCK}"
    eng, vc = _cpu_backend(model_config, monkeypatch, tag, "vec16")
    layout, gen = "cpu_attn", torch.Generator().manual_seed(12)  # [B, H, N, 2D], as every CPU kernel has it
    try:
        w = eng.worker(layers := alloc(layout))
        signature = w.connector_worker.engine.kv_spec.signature
        assert w.connector_worker.kv_spec.layout == tag and tag in signature and "lt2hd" not in signature
        assert w.connector_worker._layout is VLLM_BHNC and w.connector_worker._block_entries is None
        prompt = list(range(1, 201))
        eng.submit("a", prompt)
        out, _ = eng.step(w, layers, layout, gen)
        blocks = new_req(out, "a").block_ids[0]
        assert w.engine.lookup(prompt) == 192  # the partial last block is not stored
        req, b_layers = _forget_then_load_192(eng, prompt, layout, gen)
        for t, tb in zip(layers, b_layers):
            for j in range(12):
                assert torch.equal(tb[req.block_ids[0][j]], t[blocks[j]]), j
        # the same signature with the vec kernels underneath: an error, nothing loaded or saved
        eng.finish("b")
        _run_cpu_kernels(vc, "vec")
        c_layers = alloc(layout)
        wc = eng.worker(c_layers)
        assert not wc.connector_worker._layers
    finally:
        eng.close()


# ------------------------------------------------------------------ vLLM's LMCacheConnectorV1 (LMCache's users)
def test_lmcacheconnectorv1_by_name_runs_lmcache_in_both_roles(model_config):
    """``kv_connector: LMCacheConnectorV1`` with no module path, as every LMCache deployment
    writes it: vLLM's wrapper imports lmcache.integration.vllm.vllm_v1_adapter in both roles,
    and its impl is lmcache's connector; upstream's extra-config keys are taken."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl

    vc = make_config(model_config, policy="fail", upstream=True, discard_partial_chunks=False,
                     lmcache_rpc_port="producer1", use_layerwise=True)
    conns = [KVConnectorFactory.create_connector(vc, role, kv_cache_config(False)) for role in KVConnectorRole]
    try:
        assert all(type(c) is LMCacheConnectorV1 and type(_impl(c)) is LMCacheConnectorV1Impl for c in conns)
        sched, worker = (_impl(c) for c in sorted(conns, key=lambda c: c.role != KVConnectorRole.SCHEDULER))
        assert sched.engine is None and worker.engine is not None
        assert worker.layerwise and sched.layerwise  # use_layerwise -> vllm.layerwise
        assert sched.async_loads == "never"  # the wrapper reports every load as synchronous
        assert vc.kv_transfer_config.kv_load_failure_policy == "recompute"
    finally:
        for c in conns:
            _impl(c).shutdown()
    # the impls are closed at exit (the wrapper does not forward shutdown), but not kept alive
    # for it: each one dropped frees its engine's memory pool (before: 1.3 GB per impl, held
    # until the process ended; 22.9 GB at the end of this file)
    import gc
    import weakref

    refs = [weakref.ref(_impl(c)) for c in conns]
    del conns, c, sched, worker
    gc.collect()
    assert [r() for r in refs] == [None, None]


def _store_one(model_config, monkeypatch=None, *, role="kv_both", **extra):
    """One 200-token prompt through the V1 wrapper; the worker's lookup of it afterwards."""
    eng = Engine(make_config(model_config, upstream=True, role=role, **extra), kv_cache_config(False))
    try:
        layers = alloc("std_nhd")
        w = eng.worker(layers)
        prompt = list(range(1, 201))
        eng.submit("a", prompt)
        eng.step(w, layers, "std_nhd", torch.Generator().manual_seed(2))
        return _impl(w).engine.lookup(prompt)
    finally:
        eng.close()


def _store_then_ask(eng: Engine, prompt: list[int], tail: list[int], seed: int):
    """Request "a" stores ``prompt``; vLLM forgets it; request "b" (``prompt + tail``) is
    scheduled: the scheduler output of b's step."""
    layers = alloc("std_nhd")
    w = eng.worker(layers)
    gen = torch.Generator().manual_seed(seed)
    eng.submit("a", prompt)
    eng.step(w, layers, "std_nhd", gen)
    eng.finish("a")
    eng.sched.reset_prefix_cache()
    eng.submit("b", prompt + tail)
    return eng.step(w, layers, "std_nhd", gen)[0]


def test_lmcacheconnectorv1_discard_partial_chunks_and_skip_save(model_config, monkeypatch):
    """discard_partial_chunks: true stores the full chunks only; kv_role kv_consumer and
    LMCACHE_FORCE_SKIP_SAVE store nothing, as with LMCache."""
    assert _store_one(model_config) == 200
    assert _store_one(model_config, discard_partial_chunks=True) == 192
    assert _store_one(model_config, role="kv_consumer") == 0
    monkeypatch.setenv("LMCACHE_FORCE_SKIP_SAVE", "1")
    assert _store_one(model_config) == 0


def test_lmcacheconnectorv1_skip_last_n_tokens_and_a_bad_value(model_config):
    """skip_last_n_tokens leaves a prompt's last n tokens out of its lookup; a value that is
    not a whole number is refused naming the key."""
    eng = Engine(make_config(model_config, upstream=True, skip_last_n_tokens=80), kv_cache_config(False))
    try:
        out = _store_then_ask(eng, list(range(1, 301)), [9, 9], seed=4)
        assert new_req(out, "b").num_computed_tokens == 192  # (302 - 80) tokens looked up: 3 whole chunks
    finally:
        eng.close()
    with pytest.raises(ValueError, match="skip_last_n_tokens"):
        Engine(make_config(model_config, upstream=True, skip_last_n_tokens="lots"), kv_cache_config(False))


def _submit_params(eng: Engine, req_id: str, prompt: list[int], params: dict | None) -> Request:
    """A request whose sampling params carry ``kv_transfer_params``, as vLLM's API server
    builds them from a completion request's ``kv_transfer_params`` field."""
    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params} if params is not None else None)
    r = Request(req_id, prompt, sp, None, block_hasher=eng.hasher)
    eng.sched.add_request(r)
    return r


@pytest.mark.parametrize("upstream", [True, False], ids=["LMCacheConnectorV1", "LMCacheConnector"])
def test_kv_transfer_params_skip_save_and_tags(model_config, upstream, caplog):
    """LMCache's per-request ``kv_transfer_params``: ``lmcache.skip_save: true`` stores
    nothing of the request but still loads its hit; ``lmcache.tag.<name>`` keys the KV
    under its tags (hit only by the same tags, in any order); another ``lmcache.*`` entry
    is warned about once and changes nothing."""
    from lmcache.plugins.connectors.vllm.extra import request_extra

    eng = Engine(make_config(model_config, upstream=upstream), kv_cache_config(False))
    try:
        layers = alloc("std_nhd")
        w = eng.worker(layers)
        engine = _impl(w).engine
        gen = torch.Generator().manual_seed(11)
        prompt = list(range(1, 201))

        def run(req_id, toks, params):
            _submit_params(eng, req_id, toks, params)
            out = eng.step(w, layers, "std_nhd", gen)[0]
            eng.finish(req_id)
            eng.sched.reset_prefix_cache()
            return new_req(out, req_id).num_computed_tokens

        with caplog.at_level("WARNING"):
            assert run("a", prompt, {"lmcache.skip_save": True, "lmcache.max_offload_tokens": 64,
                                     "do_remote_prefill": False}) == 0
            assert run("a2", prompt, {"lmcache.skip_save": "true", "lmcache.max_offload_tokens": 64}) == 0
        assert engine.lookup(prompt) == 0  # nothing stored
        assert sum("lmcache.max_offload_tokens has no effect" in r.getMessage() for r in caplog.records) == 1
        assert not any("do_remote_prefill" in r.getMessage() for r in caplog.records)  # not ours: silent
        assert run("b", prompt, {"lmcache.skip_save": False}) == 0
        assert engine.lookup(prompt) == 200  # stored
        # skip_save still loads: the hit, and nothing of the new tail is stored
        longer = prompt + list(range(500, 600))
        before = engine.lookup(longer)
        assert run("c", longer, {"lmcache.skip_save": True}) == 192
        assert engine.lookup(longer) == before < len(longer)

        other = list(range(1000, 1200))
        tags = {"lmcache.tag.user": "alice", "lmcache.tag.app": 7}
        assert run("d", other, tags) == 0
        assert engine.lookup(other) == 0  # not under the plain keys
        tagged = Request("probe", other, SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": {
            "lmcache.tag.app": "7", "lmcache.tag.user": "alice"}}), None, block_hasher=eng.hasher)
        assert engine.lookup(other, extra=request_extra(tagged)) == 200
        assert run("e", other + [5, 5], {"lmcache.tag.app": 7, "lmcache.tag.user": "alice"}) == 192
        assert run("f", other + [5, 5], {"lmcache.tag.user": "bob", "lmcache.tag.app": 7}) == 0
        assert run("g", other + [5, 5], None) == 0
    finally:
        eng.close()


def test_upstream_metrics_count_what_was_loaded(model_config):
    """lmcache:* metrics in LMCache's names and labels (in the process's registry here;
    vLLM serves them from its multiprocess directory): the hit tokens are exactly the
    tokens the scheduler admitted as external hits."""
    import prometheus_client

    eng = Engine(make_config(model_config, upstream=True), kv_cache_config(False))
    labels = {"model_name": model_config.model, "worker_id": "0", "role": "worker", "served_model_name": model_config.model}

    def value(name: str, role: str = "worker") -> float:
        return prometheus_client.REGISTRY.get_sample_value(f"lmcache:{name}", {**labels, "role": role}) or 0.0

    before = {n: value(n) for n in ("num_hit_tokens_total", "num_retrieve_requests_total", "num_stored_tokens_total")}
    lookups = value("num_lookup_requests_total", "scheduler")
    try:
        out = _store_then_ask(eng, list(range(1, 201)), [3, 3], seed=5)
        hit = new_req(out, "b").num_computed_tokens
        assert hit == 192
        assert value("num_hit_tokens_total") - before["num_hit_tokens_total"] == hit
        assert value("num_retrieve_requests_total") - before["num_retrieve_requests_total"] == 1
        assert value("num_stored_tokens_total") - before["num_stored_tokens_total"] == 200 + 10  # a, then b's new tail
        assert value("num_lookup_requests_total", "scheduler") - lookups == 2
        assert value("retrieve_hit_rate") == 1.0
        assert value("local_cache_usage") > 0
        assert value("time_to_retrieve_count") >= 1
    finally:
        eng.close()


# ------------------------------------------------------------------ request isolation (issue 29, item 13)
def _isolation_engine(model_config, seed: int):
    eng = Engine(make_config(model_config), kv_cache_config(False))
    layers = alloc("std_nhd")
    return eng, eng.worker(layers), layers, torch.Generator().manual_seed(seed)


def _asked(eng, w, layers, gen, rid: str, prompt: list[int], **extras) -> int:
    """Request ``rid`` with vLLM's per-request extras (``cache_salt``, ``lora_request``,
    ``mm_features``) through one step, then forgotten by vLLM's prefix cache: the tokens it
    got from lmcache. It stores its own prompt, under its own extras."""
    r = Request(rid, prompt, SamplingParams(max_tokens=4), None, block_hasher=eng.hasher, **extras)
    eng.sched.add_request(r)
    out, invalid = eng.step(w, layers, "std_nhd", gen)
    assert invalid == set()
    eng.finish(rid)
    eng.sched.reset_prefix_cache()
    return new_req(out, rid).num_computed_tokens


def _image(identifier: str, offset: int, length: int):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def _old_keys(engine, tokens: list[int]) -> list[str]:
    """The chunk keys lmcache made before request extras existed, written out here:
    xxh3-128 chained from 16 zero bytes over each chunk's little-endian int64 tokens."""
    import numpy as np
    import xxhash

    from lmcache.keys import key_prefix

    prefix = key_prefix(engine.config.namespace, engine.config.model, engine.kv_spec.signature)
    prev, out = b"\0" * 16, []
    for s in range(0, len(tokens), CHUNK):
        prev = xxhash.xxh3_128_digest(prev + np.asarray(tokens[s : s + CHUNK], dtype="<i8").tobytes())
        out.append(prefix + prev.hex())
    return out


def test_cache_salt_keeps_requests_apart_and_no_salt_keeps_the_old_keys(model_config):
    """vLLM's cache_salt keeps one tenant's prefix cache from serving another's; lmcache
    too. Before: every request below after the first hit 192 tokens, whatever its salt.
    After: only the same salt hits; a request with no salt stores exactly the keys of
    before (existing caches and the controller's index stay valid), a salted one none of them."""
    eng, w, layers, gen = _isolation_engine(model_config, 11)
    prompt, tail = list(range(1, 201)), [5] * 20
    try:
        assert _asked(eng, w, layers, gen, "a", prompt, cache_salt="tenant-1") == 0
        assert not any(w.engine.hierarchy.exists(_old_keys(w.engine, prompt)))  # salted: no plain key
        assert _asked(eng, w, layers, gen, "b", prompt + tail, cache_salt="tenant-2") == 0
        assert _asked(eng, w, layers, gen, "c", prompt + tail) == 0  # no salt: no hit of a salted entry
        assert all(w.engine.hierarchy.exists(_old_keys(w.engine, prompt + tail)))  # ... and the old keys
        assert _asked(eng, w, layers, gen, "d", prompt + tail, cache_salt="tenant-1") == 192
        assert _asked(eng, w, layers, gen, "e", prompt + tail, cache_salt="tenant-2") == 208
        assert _asked(eng, w, layers, gen, "f", prompt + tail) == 208
    finally:
        eng.close()


def test_lora_adapters_never_share_kv(model_config):
    """Two LoRA adapters over one prompt have different KV. Before: the second adapter (and
    the base model) loaded the first one's KV, 192 tokens; after: only the same adapter
    (name, id and path) hits."""
    from vllm.lora.request import LoRARequest

    eng, w, layers, gen = _isolation_engine(model_config, 12)
    prompt, tail = list(range(1, 201)), [6] * 20
    try:
        assert _asked(eng, w, layers, gen, "a", prompt, lora_request=LoRARequest("sql", 1, "/adapters/sql")) == 0
        for rid, other in (("b", LoRARequest("chat", 2, "/adapters/chat")), ("c", LoRARequest("sql", 3, "/adapters/sql")),
                           ("d", LoRARequest("sql", 1, "/adapters/sql-v2")), ("e", None)):
            assert _asked(eng, w, layers, gen, rid, prompt + tail, lora_request=other) == 0, rid
        assert _asked(eng, w, layers, gen, "f", prompt + tail, lora_request=LoRARequest("sql", 1, "/adapters/sql")) == 192
    finally:
        eng.close()


def test_images_behind_the_same_placeholders_never_share_kv(model_config):
    """Two images behind the same placeholder tokens [70, 100) give different KV from
    there on. Before: the second image loaded the first one's KV, 192 tokens; after: only
    chunk [0, 64), before the image, is shared (as vLLM shares the blocks before it); the
    same image at the same place hits in full, the same image elsewhere does not."""
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    eng, w, layers, gen = _isolation_engine(model_config, 13)
    # the tiny model has no encoder: give vLLM's scheduler an encoder budget, so that it
    # schedules past the placeholders (the simulated forward ignores the encoder inputs)
    eng.sched.max_num_encoder_input_tokens = 4096
    eng.sched.encoder_cache_manager = EncoderCacheManager(cache_size=4096)
    prompt, tail = list(range(1, 201)), [7] * 20
    try:
        assert _asked(eng, w, layers, gen, "a", prompt, mm_features=[_image("cat", 70, 30)]) == 0
        assert _asked(eng, w, layers, gen, "b", prompt + tail, mm_features=[_image("dog", 70, 30)]) == 64
        assert _asked(eng, w, layers, gen, "c", prompt + tail, mm_features=[_image("cat", 72, 30)]) == 64
        assert _asked(eng, w, layers, gen, "d", prompt + tail, mm_features=[_image("cat", 70, 30)]) == 192
    finally:
        eng.close()


def test_a_request_with_prompt_embeds_is_neither_looked_up_nor_stored(model_config):
    """Prompt embeddings sit behind sentinel token ids: their KV is not named by the
    tokens, so such a request is left to vLLM. Before: the second request loaded the
    first one's KV (192 tokens); after: nothing is stored or loaded for either."""
    eng, w, layers, gen = _isolation_engine(model_config, 14)
    prompt = list(range(1, 201))
    try:
        embeds = torch.zeros(len(prompt), 64)
        assert _asked(eng, w, layers, gen, "a", prompt, prompt_embeds=embeds) == 0
        assert w.engine.lookup(prompt) == 0
        assert _asked(eng, w, layers, gen, "b", prompt + [8] * 20, prompt_embeds=torch.ones(len(prompt) + 20, 64)) == 0
    finally:
        eng.close()
