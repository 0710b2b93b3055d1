"""Moving cached keys to another position: rotary embeddings re-applied by a position delta.

Rotary embeddings rotate each pair of a key's dimensions by ``position * inv_freq[j]``, and
rotations compose: the key a model computed for a token at position ``p`` becomes exactly
the key it would have had at ``p + delta`` (before attention mixes in other tokens) when
it is rotated once more by ``delta * inv_freq``. Values carry no position and stay as they
are. This is what lets KV computed further right in an earlier, longer context serve a
truncated prompt (:mod:`lmcache.plugins.services.shifted`).

``inv_freq`` depends on the model's RoPE variant; :func:`inv_freq_of` reads it from a
Hugging Face config (``rope_parameters`` or ``rope_scaling``, and ``rope_theta``):

- ``default``: ``theta ** (-2j / d)``;
- ``linear``: the default divided by ``factor`` (positions interpolated);
- ``dynamic`` (NTK): the default while the sequence fits ``max_position_embeddings``;
  past it the base grows with the length, so two positions rotate by the same frequencies
  only inside one length: shifted reuse refuses prompts longer than the original window;
- ``llama3``: low frequencies divided by ``factor``, high ones kept, a smooth blend between.

Any scaling of the rotation's magnitude (YaRN's ``attention_factor``) is already in the
cached key once; the delta rotation is a pure rotation and adds none.

The layout is Hugging Face's: the two halves of the head dimension are the pairs
(``rotate_half``), which is also how transformers loads GGUF Llama weights.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED = ("default", "linear", "dynamic", "llama3")


def _params(config: Any) -> dict[str, Any]:
    cfg = getattr(config, "get_text_config", lambda: config)()
    p = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    p.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    p["rope_type"] = p.get("rope_type") or p.get("type") or "default"
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    p["_dim"] = int(head * p.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))
    p["_max"] = getattr(cfg, "max_position_embeddings", None)
    return p


def inv_freq_of(config: Any) -> torch.Tensor:
    """The rotary frequencies (``head_dim / 2`` float64 values) of a Hugging Face model
    config; ``ValueError`` naming the variant when it is not one of :data:`SUPPORTED`."""
    p = _params(config)
    kind, theta, dim = p["rope_type"], float(p["rope_theta"]), p["_dim"]
    if kind not in SUPPORTED:
        raise ValueError(f"rope_type {kind!r} is not supported for shifted reuse (supported: {', '.join(SUPPORTED)})")
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if kind == "linear":
        inv = inv / float(p["factor"])
    elif kind == "llama3":
        factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old = float(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old / low, inv / factor, torch.where(wavelen < old / high, inv, blended))
    return inv


def max_positions(config: Any) -> int | None:
    """The last position before which the frequencies are fixed (``dynamic`` scaling
    changes them past ``max_position_embeddings``); ``None``: no such limit."""
    p = _params(config)
    return p["_max"] if p["rope_type"] == "dynamic" else None


def rerotate(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """``keys`` (``(..., D)``, rotated at some positions) as rotated at those positions plus
    ``delta`` (one shift for all of them: a chunk moves as a whole).

    Computed in float64 angles and float32 arithmetic, returned in ``keys``' dtype; the
    dimensions past ``2 * len(inv_freq)`` (partial rotary) are left as they are."""
    rot = 2 * inv_freq.numel()
    ang = float(delta) * inv_freq.to(torch.float64)  # (D/2,)
    cos = torch.cat([ang.cos(), ang.cos()], dim=-1).to(torch.float32)
    sin = torch.cat([ang.sin(), ang.sin()], dim=-1).to(torch.float32)
    k = keys[..., :rot].to(torch.float32)
    half = rot // 2
    rotated_half = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    out = k * cos + rotated_half * sin
    if rot == keys.shape[-1]:
        return out.to(keys.dtype)
    return torch.cat([out.to(keys.dtype), keys[..., rot:]], dim=-1)


__all__ = ["SUPPORTED", "inv_freq_of", "max_positions", "rerotate"]
