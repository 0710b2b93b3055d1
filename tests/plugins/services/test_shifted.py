"""Shifted reuse under truncation (approximate_reuse, lmcache.plugins.services.shifted) with
the real model: a prompt whose oldest tokens were cut reuses the chunks an earlier, longer
prompt computed, its first token agrees with a full recompute, what it builds on reused KV
never lands under exact keys, and exact prefix hits stay exactly what they were."""

from __future__ import annotations

import math

import pytest
import torch

import lmcache
from lmcache.config import load_config
from lmcache.errors import ConfigError
from lmcache.plugins.connectors.hf import _recompute_counts
from lmcache.plugins.services.shifted import content_hash, shifted_key

CHUNK = 32


def _engine(model, approx=True, recompute=0.15, **extra):
    from lmcache.plugins.connectors.hf import kv_spec_of

    cfg = {"chunk_size": CHUNK, "tiers": [{"backend": "cpu", "capacity": "512MiB"}],
           "approximate_reuse": {"enabled": approx, "recompute": recompute, **extra}}
    return lmcache.CacheEngine.from_config(cfg, kv_spec=kv_spec_of(model))


@pytest.fixture(scope="module")
def texts(smollm2):
    from lmcache.benchmarks.handbook import prose_ids

    model, tok = smollm2
    system = tok("You are a careful reader. Answer from the text.\n")["input_ids"]
    doc = prose_ids(tok, 700)
    long = system + doc[:640]  # the earlier prompt
    cut = system + doc[200:640] + tok("\nIn one sentence, the text says")["input_ids"]  # its oldest 200 cut
    return long, cut


def _connector(smollm2, engine):
    model, tok = smollm2
    return lmcache.connector("transformers")(model, tok, engine)


def test_a_truncated_prompt_reuses_shifted_chunks_and_agrees_with_a_full_recompute(smollm2, texts):
    long, cut = texts
    ref = _connector(smollm2, _engine(smollm2[0], approx=False)).prefill(cut, use_cache=False, store=False)
    with _engine(smollm2[0]) as e:
        conn = _connector(smollm2, e)
        conn.prefill(long)
        prefix_only = e.lookup(cut)
        matches = e.services["approximate_reuse"].find(cut, 4, len(cut) - 1)
        got = conn.prefill(cut)
        assert prefix_only == 0  # the exact prefix cache has nothing for it
        found = got.shifted_tokens + got.recomputed_tokens
        system = len(long) - 640  # the system prompt's tokens (the texts fixture), less than a chunk
        # the system prompt is no exact hit (it fills no chunk), but its KV is the head of
        # the long prompt's first chunk: loaded as it is, the rest shifted
        assert got.cached_tokens == system + got.shifted_tokens and found == sum(m.length for m in matches)
        # the partial chunk after the cut is a tail of the chunk the long prompt computed
        # before the first matched one; the system prompt before it is not
        tail, first = matches[0], matches[1]
        assert tail.offset > 0 and tail.start + tail.length == first.start and first.offset == 0
        assert tail.length == (-(system + 200)) % CHUNK and tail.start == system
        assert cut[tail.start : first.start] == long[tail.old_start : tail.old_start + tail.length]
        assert tail.old_start + tail.length == first.old_start
        other = list(cut)
        other[first.start - 1] += 1  # the token just before the chunk differs: no tail of it
        assert e.services["approximate_reuse"].find(other, 4, len(cut) - 1)[0] == first
        assert got.recomputed_tokens == math.ceil(0.15 * found)  # the earliest ones (select: leading)
        assert found >= 0.85 * len(cut)  # found in the cache
        # one prompt is no agreement rate (lmcache bench truncation measures that); its
        # next-token distribution is close to the full recompute's, and the same at the top
        p, q = torch.softmax(ref.logits, -1), torch.softmax(got.logits, -1)
        assert float((p - q).abs().sum()) / 2 < 0.3
        assert int(ref.logits.argmax()) in torch.topk(got.logits, 3).indices.tolist()
        stats = e.stats()["approximate_reuse"]
        assert stats["matched_chunks"] == 1 + len(matches) and stats["missing_chunks"] == 0  # 1: the head
        assert stats["stored_chunks"] > 0


def test_a_system_prompt_shorter_than_a_chunk_is_loaded_exactly(smollm2, texts):
    """A prompt that shares only the system prompt (fewer tokens than a chunk, so no
    exact hit) with an earlier one loads its KV from the head of that prompt's first
    chunk: the same tokens at the same positions, so the logits are a full recompute's."""
    long, _ = texts
    system = len(long) - 640
    model, tok = smollm2
    other = long[:system] + tok("A new question about something else entirely. What is the boiling point"
                                " of water at sea level, why does it fall on a mountain, and how does a"
                                " pressure cooker use that? Answer in three short sentences, with one"
                                " number in each of them.")["input_ids"]
    assert len(other) > system + CHUNK + 8  # long enough to look for shifted chunks
    ref = _connector(smollm2, _engine(model, approx=False)).prefill(other, use_cache=False, store=False)
    with _engine(model) as e:
        conn = _connector(smollm2, e)
        conn.prefill(long)
        assert e.lookup(other) == 0
        got = conn.prefill(other)
        assert got.cached_tokens == system and got.shifted_tokens == 0 and got.recomputed_tokens == 0
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-3)
        assert e.stats()["approximate_reuse"]["matched_chunks"] == 1  # the head's chunk
        # what it stored is exact: a repeat is an exact prefix hit of the whole prompt
        assert e.lookup(other) == len(other)
        again = conn.prefill(other)
        torch.testing.assert_close(again.logits, ref.logits, rtol=1e-4, atol=1e-3)
        # a prompt too short to hold a shifted chunk after the system prompt loads it too
        short = long[:system] + tok(" Why is the sky blue?")["input_ids"]
        assert len(short) < system + CHUNK
        ref = _connector(smollm2, _engine(model, approx=False)).prefill(short, use_cache=False, store=False)
        got = conn.prefill(short)
        assert got.cached_tokens == system and got.shifted_tokens == 0
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 100000.0, "factor": 4.0, "original_max_position_embeddings": 2048},
    {"rope_type": "dynamic", "rope_theta": 100000.0, "factor": 2.0},  # with max_position_embeddings below the prompt
])
def test_reuse_stays_off_where_the_rotary_variant_does_not_allow_it(smollm2, texts, monkeypatch, caplog, rope):
    """A model whose rotary variant re-rotation does not support (YaRN), or a prompt past
    the positions where dynamic scaling changes the frequencies: no shifted reuse and no
    exact head (under dynamic scaling such a prompt's first positions carry other
    frequencies than an earlier prompt's); the prompt is computed as a whole, with one
    warning for the unsupported variant."""
    long, cut = texts
    model, tok = smollm2
    # only what the connector reads changes; the model's own rotary module keeps its frequencies
    monkeypatch.setattr(model.config, "rope_parameters", rope)
    if rope["rope_type"] == "dynamic":
        monkeypatch.setattr(model.config, "max_position_embeddings", len(cut) - 1)
    system = len(long) - 640
    short = long[:system] + tok(" Why is the sky blue?")["input_ids"]
    ref = _connector(smollm2, _engine(model, approx=False)).prefill(cut, use_cache=False, store=False)
    with _engine(model) as e, caplog.at_level("WARNING"):
        conn = _connector(smollm2, e)
        conn.prefill(long)
        got = conn.prefill(cut)
        assert (got.cached_tokens, got.shifted_tokens, got.recomputed_tokens) == (0, 0, 0)
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-3)
        if rope["rope_type"] == "yarn":  # nor the head of a short prompt
            assert conn.prefill(short).cached_tokens == 0
        assert e.stats()["approximate_reuse"]["matched_chunks"] == 0
    warned = [r for r in caplog.records if "approximate reuse is off for this model" in r.getMessage()]
    assert len(warned) == (1 if rope["rope_type"] == "yarn" else 0)


def test_kv_built_on_reused_chunks_never_lands_under_exact_keys(smollm2, texts):
    long, cut = texts
    with _engine(smollm2[0], select="leading") as e:
        conn = _connector(smollm2, e)
        conn.prefill(long)
        conn.prefill(cut)
        svc = e.services["approximate_reuse"]
        matches = svc.find(cut, 4, len(cut) - 1)
        redo = _recompute_counts([m.length for m in matches], 0.15, "leading")
        exact = next(m.start + r for m, r in zip(matches, redo) if r < m.length)  # the first token reused as is
        assert e.lookup(cut) == exact // CHUNK * CHUNK  # only the chunks before the first reused token
        keys = e.chunk_keys(cut)[1]
        tier = e.hierarchy.tiers[0]
        assert all(tier.size_of(shifted_key(k)) is not None for k in keys[exact // CHUNK:-1])  # stored, apart
        assert not set(map(shifted_key, keys)) & set(keys)
        # the same prompt again: its exact part is an exact hit, the rest shifted reuse at delta 0
        again = conn.prefill(cut, store=False)
        assert again.cached_tokens - again.shifted_tokens == exact // CHUNK * CHUNK


def test_exact_prefix_hits_are_unchanged_with_the_feature_on(smollm2, texts):
    long, _ = texts
    out = {}
    for approx in (False, True):
        with _engine(smollm2[0], approx=approx) as e:
            conn = _connector(smollm2, e)
            conn.prefill(long[:400])
            hit = conn.prefill(long[:400] + long[400:420], store=False)  # an exact prefix and a short new tail
            full = conn.prefill(long[:400], store=False)  # the whole prompt cached
            out[approx] = (hit.cached_tokens, hit.shifted_tokens, hit.logits, full.cached_tokens, full.logits)
    assert out[True][0] == out[False][0] == 384 and out[True][1] == 0
    assert torch.equal(out[True][2], out[False][2]) and torch.equal(out[True][4], out[False][4])


def test_a_chunk_gone_before_its_load_is_computed_instead(smollm2, texts):
    long, cut = texts
    with _engine(smollm2[0]) as e:
        conn = _connector(smollm2, e)
        conn.prefill(long)
        svc = e.services["approximate_reuse"]
        gone = svc.find(cut, 4, len(cut) - 1)[2:5]
        e.hierarchy.tiers[0].delete([m.key for m in gone])
        got = conn.prefill(cut, store=False)
        assert e.stats()["approximate_reuse"]["missing_chunks"] == 3
        left = sum(m.length for m in svc.find(cut, 4, len(cut) - 1)) - 3 * CHUNK
        assert got.shifted_tokens == left - math.ceil(0.15 * left)
        assert torch.isfinite(got.logits).all() and got.cache.get_seq_length() == len(cut)


def test_deviation_picks_closer_tokens_than_position_rules(smollm2, texts):
    """On this cut, recomputing the tokens whose layer-1 KV deviates most brings the next
    token's distribution closer to the full recompute's than the position rules do."""
    long, cut = texts
    ref = torch.softmax(_connector(smollm2, _engine(smollm2[0], approx=False)).prefill(cut, use_cache=False, store=False).logits, -1)
    tv = {}
    for select in ("deviation", "leading", "chunk_starts"):
        with _engine(smollm2[0], select=select) as e:  # leading is the default: cheaper, not closer here
            conn = _connector(smollm2, e)
            conn.prefill(long)
            got = conn.prefill(cut, store=False)
            tv[select] = float((torch.softmax(got.logits, -1) - ref).abs().sum()) / 2
    assert tv["deviation"] < min(tv["leading"], tv["chunk_starts"]), tv


@pytest.mark.parametrize("select", ["leading", "deviation"])
def test_run_by_run_and_one_masked_pass_compute_the_same(smollm2, texts, monkeypatch, select):
    """The two ways of computing the same tokens on the same reused KV: run by run in
    position order (a few runs: leading) and one forward pass with a mask by position
    (many runs: deviation). Each is forced on the other's case; logits and cache agree."""
    from lmcache.plugins.connectors import hf

    long, cut = texts
    got = {}
    for runs in (0, 10**6):  # every prompt by mask; every prompt run by run
        monkeypatch.setattr(hf, "_MAX_COMPUTE_RUNS", runs)
        with _engine(smollm2[0], select=select) as e:
            conn = _connector(smollm2, e)
            conn.prefill(long)
            got[runs] = conn.prefill(cut, store=False)
    a, b = got[0], got[10**6]
    assert a.shifted_tokens == b.shifted_tokens > 0 and a.recomputed_tokens == b.recomputed_tokens > 0
    assert torch.allclose(a.logits, b.logits, atol=1e-3), (a.logits - b.logits).abs().max()
    assert int(a.logits.argmax()) == int(b.logits.argmax())
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert la.keys.shape == lb.keys.shape and torch.allclose(la.keys, lb.keys, atol=1e-3)
        assert torch.allclose(la.values, lb.values, atol=1e-3)


def test_recomputing_everything_is_a_full_recompute(smollm2, texts):
    long, cut = texts
    ref = _connector(smollm2, _engine(smollm2[0], approx=False)).prefill(cut, use_cache=False, store=False)
    for select in ("leading", "deviation"):
        with _engine(smollm2[0], recompute=1.0, select=select) as e:
            conn = _connector(smollm2, e)
            conn.prefill(long)
            got = conn.prefill(cut, store=False)
            assert got.shifted_tokens == 0 and got.recomputed_tokens > 0.85 * len(cut)
            assert torch.allclose(got.logits, ref.logits, atol=1e-3), (got.logits - ref.logits).abs().max()


def test_chunk_starts_recomputes_the_same_share_of_every_chunk(smollm2, texts):
    long, cut = texts
    with _engine(smollm2[0], select="chunk_starts") as e:
        conn = _connector(smollm2, e)
        conn.prefill(long)
        lengths = [m.length for m in e.services["approximate_reuse"].find(cut, 4, len(cut) - 1)]
        got = conn.prefill(cut, store=False)
        assert got.shifted_tokens + got.recomputed_tokens == sum(lengths) and lengths.count(CHUNK) > 5
        # ceil(0.15 * 32) = 5 of each whole chunk, the same share of the tail after the cut
        assert got.recomputed_tokens == sum(math.ceil(round(0.15 * n, 6)) for n in lengths)
    assert _recompute_counts([32, 32, 32], 0.5, "leading") == [32, 16, 0]
    assert _recompute_counts([32, 32, 32], 0.0, "leading") == [0, 0, 0] == _recompute_counts([32] * 3, 0, "chunk_starts")
    assert _recompute_counts([32, 20], 1.0, "chunk_starts") == [32, 20]


def test_without_the_feature_the_content_index_is_not_there(smollm2, texts):
    long, cut = texts
    with _engine(smollm2[0], approx=False) as e:
        conn = _connector(smollm2, e)
        conn.prefill(long)
        assert "approximate_reuse" not in e.services
        assert conn.prefill(cut, store=False).cached_tokens == 0


def test_the_content_index_is_bounded_and_prefers_exact_chunks(smollm2, texts):
    long, _ = texts
    with _engine(smollm2[0], index_entries=8) as e:
        conn = _connector(smollm2, e)
        conn.prefill(long)
        svc = e.services["approximate_reuse"]
        assert svc.info()["index_entries"] == 8  # the newest 8 of the 20 full chunks
        assert content_hash(long[-CHUNK - 4:-4]) != content_hash(long[-CHUNK:])


def test_the_config_section_is_checked():
    assert load_config({"approximate_reuse": True}).approximate_reuse.recompute == 0.15
    for bad, key in (({"recompute": 1.5}, "approximate_reuse.recompute"), ({"recompute": True}, "approximate_reuse.recompute"),
                     ({"sink_tokens": -1}, "approximate_reuse.sink_tokens"), ({"nope": 1}, "approximate_reuse.nope"),
                     ({"select": "random"}, "approximate_reuse.select")):
        with pytest.raises(ConfigError) as ei:
            load_config({"approximate_reuse": bad})
        assert ei.value.key == key
