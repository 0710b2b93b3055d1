"""Re-rotating cached keys to a new position (lmcache.kernels.rope): the frequencies of each
RoPE variant agree with transformers' own, rotations compose, and on the real model a key
computed at one position, re-rotated, is the key computed at the other."""

from __future__ import annotations

import pytest
import torch

from lmcache.kernels.rope import inv_freq_of, max_positions, rerotate

VARIANTS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
}


def _config(scaling):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                       rope_theta=50000.0, rope_scaling=scaling)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_frequencies_of_each_variant_are_transformers_own(variant):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _config(VARIANTS[variant])
    ours = inv_freq_of(cfg)
    if variant == "default":
        want = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    else:
        want, _scale = ROPE_INIT_FUNCTIONS[variant](cfg, torch.device("cpu"))  # dynamic: at its original length
    assert ours.shape == (32,)
    torch.testing.assert_close(ours, want.to(torch.float64), rtol=1e-6, atol=0)


def test_dynamic_scaling_limits_the_positions_and_other_variants_are_refused():
    assert max_positions(_config(VARIANTS["dynamic"])) == 4096
    assert max_positions(_config(VARIANTS["llama3"])) is None
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        inv_freq_of(_config({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}))


def test_rotations_compose_keep_norms_and_leave_partial_dimensions():
    inv = inv_freq_of(_config(None))
    k = torch.randn(5, 2, 64)
    torch.testing.assert_close(rerotate(rerotate(k, 300, inv), -120, inv), rerotate(k, 180, inv), atol=2e-5, rtol=0)
    torch.testing.assert_close(rerotate(k, 0, inv), k)
    torch.testing.assert_close(rerotate(k, 977, inv).norm(dim=-1), k.norm(dim=-1), atol=1e-4, rtol=0)
    half = inv[:16]  # a rotary part of 32 of the 64 dimensions
    r = rerotate(k, 41, half)
    assert torch.equal(r[..., 32:], k[..., 32:]) and not torch.allclose(r[..., :32], k[..., :32])
    assert rerotate(k.to(torch.bfloat16), 5, inv).dtype == torch.bfloat16


def test_a_key_moved_on_the_real_model_is_the_key_computed_there(smollm2):
    """Layer 0's keys see no other token: the key of a token computed at position 10 and
    re-rotated by 1,990 is the key the model computes for it at position 2,000."""
    from transformers import DynamicCache

    model, tok = smollm2
    ids = torch.tensor([tok("Rotary embeddings compose, so a cached key can move.")["input_ids"]])

    def keys_at(start):
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=ids, cache=cache, use_cache=True,
                  position_ids=torch.arange(start, start + ids.shape[1]).unsqueeze(0))
        return cache.layers[0].keys[0].transpose(0, 1)  # (T, H, D)

    before, after = keys_at(10), keys_at(2000)
    moved = rerotate(before, 1990, inv_freq_of(model.config))
    assert (moved - after).abs().max() < 1e-3 * after.abs().max()
    assert (before - after).abs().max() > 0.1 * after.abs().max()  # the shift is not a no-op
