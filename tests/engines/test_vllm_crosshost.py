"""In-band lookups of the vLLM connector (``lmcache.vllm.lookup: inband``), against vLLM's
real classes (vllm==0.33.0 API, CPU only): the scheduler puts its question in the connector
metadata, every worker answers in :meth:`build_connector_worker_meta`, vLLM's own
``KVOutputAggregator`` merges the ranks' answers into the output that reaches the
scheduler, and the hit is read on the next scheduling pass. Nothing here uses the Unix
socket, so the same path works with the workers on another host (see
test_vllm_crosshost_netns.py for two network namespaces).

Run: LMCACHE_ENGINE_TESTS=1 .venv-vllm/bin/python -m pytest tests/engines/test_vllm_crosshost.py -q
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_vllm import (  # noqa: E402
    Engine,
    alloc,
    forward,
    kv_cache_config,
    make_config,
    new_req,
    same,
    slots_of,
)

import test_vllm  # noqa: E402
from _digests import count_prompt_digests  # noqa: E402

model_config = test_vllm.model_config  # the fixture
LAYOUT = "blocks_first"
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


class InbandEngine(Engine):
    """:class:`test_vllm.Engine` whose step also carries the workers' metadata back, as
    vLLM's model runner and ``KVOutputAggregator`` do (``kv_connector_worker_meta``)."""

    def step(self, worker, layers, layout, gen, *, layerwise=False, before_load=None, ranks=None):
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.sched.schedule()
        if before_load is not None:
            before_load(out)
        outputs = []
        for w in ranks or [worker]:  # every rank runs the step; the first one computes here
            w.bind_connector_metadata(out.kv_connector_metadata)
            w.start_load_kv(None)
            if w is worker:
                for new in out.scheduled_new_reqs:
                    n = out.num_scheduled_tokens[new.req_id]
                    forward(layers, layout, new.block_ids[0], new.num_computed_tokens, new.num_computed_tokens + n, gen)
                for name, t in zip(LAYERS, layers):
                    w.wait_for_layer_load(name)
                    w.save_kv_layer(name, t, None)
            w.wait_for_save()
            ids = list(out.num_scheduled_tokens)
            outputs.append(ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[42] for _ in ids],
                kv_connector_output=KVConnectorOutput(invalid_block_ids=set(w.get_block_ids_with_load_errors()),
                                                      kv_connector_worker_meta=w.build_connector_worker_meta()),
            ))  # fmt: skip
            w.clear_connector_metadata()
        merged = KVOutputAggregator(expected_finished_count=len(outputs)).aggregate(outputs)
        self.last = self.sched.update_from_output(out, merged)
        return out, merged.kv_connector_output.invalid_block_ids


def _engine(model_config, **extra):
    return InbandEngine(make_config(model_config, **{"lmcache.vllm.lookup": "inband", **extra}), kv_cache_config(False))


def _stored(eng, seed: int):
    """Two workers' KV caches; request "a" over 200 tokens stored through the first:
    ``(gen, a_layers, b_layers, wa, wb, prompt, a_blocks)``."""
    gen = torch.Generator().manual_seed(seed)
    a_layers, b_layers = alloc(LAYOUT), alloc(LAYOUT)
    wa, wb = eng.worker(a_layers), eng.worker(b_layers)
    prompt = list(range(1, 201))
    return gen, a_layers, b_layers, wa, wb, prompt, _store(eng, wa, a_layers, gen, prompt)


def _store(eng, w, layers, gen, prompt):
    """Store ``prompt`` through ``w``: the first pass only asks (a miss), the second runs it."""
    eng.submit("a", prompt)
    out, _ = eng.step(w, layers, LAYOUT, gen)
    assert out.scheduled_new_reqs == [] and [a.token_ids for a in out.kv_connector_metadata.asks] == [prompt]
    out, _ = eng.step(w, layers, LAYOUT, gen)
    blocks = new_req(out, "a").block_ids[0]
    assert out.kv_connector_metadata.saves[0].token_ids == prompt
    eng.finish("a")
    eng.sched.reset_prefix_cache()  # vLLM forgets; lmcache remembers
    return blocks


def test_inband_hit_is_read_one_step_later_and_loaded_exactly(model_config):
    eng = _engine(model_config)
    try:
        gen, a_layers, b_layers, wa, wb, prompt, a_blocks = _stored(eng, 11)
        assert "lookup" not in wa.engine.services and wa.connector_worker._lookup.server is None  # no socket
        whole = count_prompt_digests(wb.engine)
        eng.submit("b", prompt + list(range(500, 520)))
        out, _ = eng.step(wb, b_layers, LAYOUT, gen)  # the question goes out; "b" waits one step
        assert out.scheduled_new_reqs == [] and len(out.kv_connector_metadata.asks) == 1
        out, invalid = eng.step(wb, b_layers, LAYOUT, gen)
        b = new_req(out, "b")
        assert b.num_computed_tokens == 192 and invalid == set()
        assert out.kv_connector_metadata.loads[0].seq == out.kv_connector_metadata.loads[0].seq is not None
        assert same(a_layers, LAYOUT, slots_of(a_blocks, 192), b_layers, LAYOUT, slots_of(b.block_ids[0], 192))
        assert eng.sched.connector.connector_scheduler.stats["hit_tokens"] == 192
        assert wb.connector_worker._asked == {}  # the load consumed the lookup's pins
        # the question names the request: its load and save find the prompt by the id (issue 46)
        assert whole[0] == 0
    finally:
        eng.close()


def test_inband_chunk_evicted_between_lookup_and_load_is_recomputed(model_config):
    eng = _engine(model_config)
    try:
        gen, a_layers, b_layers, wa, wb, prompt, _ = _stored(eng, 12)
        eng.submit("b", prompt + [3] * 20)
        eng.step(wb, b_layers, LAYOUT, gen)

        def evict(out):  # answered 192 tokens; then chunk [64, 128) vanished before the load
            assert new_req(out, "b").num_computed_tokens == 192
            _, keys = wb.engine.chunk_keys(prompt[:192])
            for tier in wb.engine.hierarchy.tiers:
                tier.delete([keys[1]])

        out, invalid = eng.step(wb, b_layers, LAYOUT, gen, before_load=evict)
        b = new_req(out, "b")
        assert invalid == set(b.block_ids[0][4:12])  # tokens 64..191 are recomputed by vLLM
        out, invalid = eng.step(wb, b_layers, LAYOUT, gen)
        i = out.scheduled_cached_reqs.req_ids.index("b")
        assert out.scheduled_cached_reqs.num_computed_tokens[i] == 64 and invalid == set()
    finally:
        eng.close()


def test_a_prefix_counts_only_where_every_rank_answered_it(model_config):
    """Two ranks answer through vLLM's aggregator: the hit is the shortest; a rank that does
    not answer makes it a miss (never a hit one rank cannot load)."""
    from lmcache.plugins.connectors.vllm.metadata import LMCacheWorkerMetadata

    eng = _engine(model_config)
    try:
        gen, a_layers, b_layers, wa, wb, prompt, _ = _stored(eng, 13)
        sched = eng.sched.connector.connector_scheduler
        sched._ranks = 2  # as with tensor parallel 2: both workers answer
        real = wb.connector_worker.answer_lookups

        def short(meta):  # the second rank holds only the first chunk
            got = real(meta)
            if got is not None:
                got = LMCacheWorkerMetadata({s: [type(r[0])(min(r[0].hit, 64), r[0].tiers[:1])] for s, r in got.answers.items()})
            return got

        wb.connector_worker.answer_lookups = short
        eng.submit("b", prompt + [5] * 20)
        eng.step(wa, a_layers, LAYOUT, gen, ranks=[wa, wb])
        out, _ = eng.step(wa, a_layers, LAYOUT, gen, ranks=[wa, wb])
        assert new_req(out, "b").num_computed_tokens == 64
        eng.finish("b")
        eng.sched.reset_prefix_cache()
        eng.submit("c", prompt + [6] * 20)
        eng.step(wa, a_layers, LAYOUT, gen)  # one rank answers only
        out, _ = eng.step(wa, a_layers, LAYOUT, gen)
        assert new_req(out, "c").num_computed_tokens == 0
    finally:
        eng.close()


@pytest.mark.parametrize("mode,expect", [("socket", "socket"), ("inband", "inband"), ("auto", "socket")])
def test_lookup_mode_is_selectable_and_auto_is_socket_on_one_node(model_config, mode, expect):
    from lmcache.plugins.connectors.vllm.common import lookup_mode

    vc = make_config(model_config, **{"lmcache.vllm.lookup": mode})
    assert lookup_mode(vc, mode) == expect
    vc.parallel_config.nnodes = 2
    assert lookup_mode(vc, mode) == ("socket" if mode == "socket" else "inband")
