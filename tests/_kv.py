"""Test KV derived from token ids alone, bit-identical in every process.

Why not ``torch.sin``: for float64 tensors torch computes it through MKL's vector math,
whose last bit can depend on the buffer's address, so two processes (or two calls in
one) sometimes disagree by one ulp and a cross-process "bit-exact" check fails for a
reason that is not the cache's. :func:`wave` uses only exactly rounded arithmetic.
"""

from __future__ import annotations

import torch


def wave(x: torch.Tensor) -> torch.Tensor:
    """A smooth periodic function of ``x`` with values in [-1, 1] (a parabola per period)."""
    f = x - torch.floor(x)
    return 8 * f * (1 - f) - 1
