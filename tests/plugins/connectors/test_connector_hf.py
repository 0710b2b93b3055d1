"""End-to-end exactness with a real model: a cache hit must not change the output."""

from __future__ import annotations

import pytest
import torch

import lmcache
from lmcache.plugins.connectors.hf import TransformersConnector, kv_spec_of

CHUNK = 64
DOC = " ".join(f"Fact {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7} marbles." for i in range(40))


def make(smollm2, tmp_path, cpu="512MiB", disk=None, **cfg):
    model, tok = smollm2
    tiers = [{"backend": "cpu", "capacity": cpu}]
    if disk:
        tiers.append({"backend": "disk", "path": str(tmp_path / "kv"), "capacity": disk})
    eng = lmcache.CacheEngine.from_config({"chunk_size": CHUNK, "tiers": tiers, **cfg}, kv_spec=kv_spec_of(model))
    return TransformersConnector(model, tok, eng)


def reference(conn, prompt, **kw):
    return conn.generate(prompt, use_cache=False, store=False, **kw)


def assert_same(base, hit):
    assert hit.tokens == base.tokens, (hit.text, base.text)
    assert torch.allclose(hit.first_logits, base.first_logits, atol=1e-4, rtol=0), (
        (hit.first_logits - base.first_logits).abs().max()
    )


def test_whole_prompt_hit_is_exact(smollm2, tmp_path):
    conn = make(smollm2, tmp_path)
    prompt = DOC + "\nQuestion: how many marbles does box 12 hold?\nAnswer:"
    ids = conn.encode(prompt)
    assert len(ids) % CHUNK != 0  # the last chunk is partial
    base = reference(conn, ids, max_new_tokens=12)
    first = conn.generate(ids, max_new_tokens=12)
    assert first.cached_tokens == 0
    hit = conn.generate(ids, max_new_tokens=12)
    assert hit.cached_tokens == len(ids) - 1  # all but the last token, which is recomputed
    assert set(hit.tiers) == {"cpu"}
    assert_same(base, first)
    assert_same(base, hit)
    conn.close()


def test_partial_prefix_hit_and_divergence(smollm2, tmp_path):
    conn = make(smollm2, tmp_path)
    a = DOC + "\nQuestion: which box is green?"
    b = DOC + "\nQuestion: what colour is box 9?"
    ia, ib = conn.encode(a), conn.encode(b)
    common = next(i for i, (x, y) in enumerate(zip(ia, ib)) if x != y)
    conn.generate(ia, max_new_tokens=1)
    base = reference(conn, ib, max_new_tokens=10)
    hit = conn.generate(ib, max_new_tokens=10)
    assert hit.cached_tokens == common // CHUNK * CHUNK > 0
    assert_same(base, hit)
    # a longer prompt extending a stored one hits the stored one's chunks
    longer = ia + conn.encode(" Think step by step.")
    h2 = conn.generate(longer, max_new_tokens=6)
    assert h2.cached_tokens >= len(ia) // CHUNK * CHUNK
    assert_same(reference(conn, longer, max_new_tokens=6), h2)
    conn.close()


def test_disk_hit_in_a_fresh_engine_is_exact(smollm2, tmp_path):
    prompt = DOC + "\nSummarise the facts in one sentence."
    conn = make(smollm2, tmp_path, disk="1GiB")
    ids = conn.encode(prompt)
    base = reference(conn, ids, max_new_tokens=10)
    conn.generate(ids, max_new_tokens=1)
    conn.close()  # flushes the disk writes
    model, tok = smollm2
    eng = lmcache.CacheEngine.from_config(
        {"chunk_size": CHUNK, "tiers": [{"backend": "disk", "path": str(tmp_path / "kv"), "capacity": "1GiB"}]},
        kv_spec=kv_spec_of(model),
    )
    conn2 = TransformersConnector(model, tok, eng)
    hit = conn2.generate(ids, max_new_tokens=10)
    assert hit.cached_tokens == len(ids) - 1 and set(hit.tiers) == {"disk"}
    assert_same(base, hit)
    conn2.close()


def test_sampling_with_a_seed_is_reproducible_with_cache(smollm2, tmp_path):
    conn = make(smollm2, tmp_path)
    prompt = DOC + "\nWrite a short poem about marbles."
    kw = dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=50, top_p=0.95, seed=7)
    base = reference(conn, prompt, **kw)
    conn.generate(prompt, max_new_tokens=1)
    hit = conn.generate(prompt, **kw)
    assert hit.cached_tokens > 0 and hit.tokens == base.tokens
    conn.close()


def test_multi_turn_chat_reuses_the_previous_turn(smollm2, tmp_path):
    conn = make(smollm2, tmp_path)
    msgs = [{"role": "system", "content": "You answer from this text only. " + DOC}, {"role": "user", "content": "Which box holds 21 marbles?"}]
    t1 = conn.generate(msgs, max_new_tokens=16, store_output=True)
    msgs += [{"role": "assistant", "content": t1.text}, {"role": "user", "content": "And which holds 28?"}]
    t2 = conn.generate(msgs, max_new_tokens=16)
    assert t2.cached_tokens >= t1.prompt_tokens // CHUNK * CHUNK
    assert_same(reference(conn, msgs, max_new_tokens=16), t2)
    conn.close()


def test_batch_of_prompts_shares_prefix_work(smollm2, tmp_path):
    conn = make(smollm2, tmp_path)
    prompts = [DOC + f"\nQuestion {i}: how many marbles are in box {i}?" for i in (3, 5, 8)]
    outs = conn.generate_batch(prompts, max_new_tokens=4)
    assert outs[0].cached_tokens == 0
    assert all(o.cached_tokens > 0 for o in outs[1:])
    for p, o in zip(prompts, outs):
        assert o.tokens == reference(conn, p, max_new_tokens=4).tokens
    conn.close()


def test_mismatched_engine_shape_is_refused(smollm2):
    model, tok = smollm2
    eng = lmcache.CacheEngine.from_config({}, kv_spec=lmcache.KVSpec(num_layers=2, num_kv_heads=3, head_size=64, dtype="float32"))
    with pytest.raises(ValueError, match="set up for KV"):
        TransformersConnector(model, tok, eng)
    eng.close()


def test_layerwise_loading_is_exact(smollm2, tmp_path):
    model, tok = smollm2
    conn = make(smollm2, tmp_path)
    prompt = DOC + "\nQuestion: which boxes are blue?"
    base = reference(conn, prompt, max_new_tokens=8)
    conn.generate(prompt, max_new_tokens=1)
    lw = TransformersConnector(model, tok, conn.engine, layerwise=True)
    hit = lw.generate(prompt, max_new_tokens=8)
    assert hit.cached_tokens == len(conn.encode(prompt)) - 1
    assert_same(base, hit)
    conn.close()
