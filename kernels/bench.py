"""Micro-benchmark of gather/scatter against a plain copy of the same bytes.

``measure(layout, num_tokens)`` builds a paged KV cache in ``layout``, a slot mapping that
places the tokens in randomly chosen blocks (as an engine's block allocator would), and
times :func:`gather`, :func:`scatter` and ``dst.copy_(src)`` of a contiguous buffer of the
same size. Rates are bytes moved per second (each byte counted once, as for memcpy).
Meant for ``lmcache bench`` and for comparing backends; it does not touch the CLI.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from .layouts import KVLayout, get_layout
from .ops import gather, scatter, select_backend

__all__ = ["measure", "make_paged"]


def make_paged(
    layout: str | KVLayout,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
) -> list[torch.Tensor]:
    """``num_layers`` zeroed per-layer tensors in ``layout`` (unpaged layouts hold
    ``num_blocks * block_size`` token slots)."""
    lay = get_layout(layout)
    sizes = {
        "kv_axis": 2,
        "block_axis": num_blocks,
        "offset_axis": block_size if lay.paged else num_blocks * block_size,
        "heads_axis": num_heads,
        "dim_axis": head_size,
    }
    shape = [0] * lay.ndim
    for role, n in sizes.items():
        axis = getattr(lay, role)
        if axis is not None:
            shape[axis] = n
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def _time(fn: Callable[[], Any], device: torch.device, repeat: int, warmup: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(
    layout: str | KVLayout,
    num_tokens: int = 256,
    *,
    num_layers: int = 32,
    num_heads: int = 8,
    head_size: int = 128,
    block_size: int = 16,
    num_blocks: int | None = None,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
    backend: str | None = None,
    repeat: int = 5,
    warmup: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """Time gather, scatter and a memcpy of the same bytes; return rates in GB/s (1e9 B/s).

    The result also names the layout, backend, bytes per call and best seconds per call.
    """
    lay = get_layout(layout)
    dev = torch.device(device)
    blocks_needed = -(-num_tokens // block_size)
    num_blocks = num_blocks or max(2 * blocks_needed, 1)
    if num_blocks < blocks_needed:
        raise ValueError(f"num_blocks={num_blocks} cannot hold {num_tokens} tokens of block_size {block_size}")
    layers = make_paged(
        lay, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
        num_heads=num_heads, head_size=head_size, dtype=dtype, device=dev,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    for t in layers:
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    if lay.paged:
        blocks = torch.randperm(num_blocks, generator=gen)[:blocks_needed]
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:num_tokens]
    else:
        slots = torch.arange(num_tokens)
    slots = slots.to(dev)
    chunk = torch.empty(lay.chunk_shape(layers[0], num_layers, num_tokens), dtype=dtype, device=dev)
    nbytes = chunk.numel() * chunk.element_size()
    src = torch.empty_like(chunk).copy_(chunk)
    dst = torch.empty_like(chunk)
    kw = {"backend": backend, "check_slots": False}
    t_gather = _time(lambda: gather(layers, lay, slots, chunk, **kw), dev, repeat, warmup)
    t_scatter = _time(lambda: scatter(chunk, lay, slots, layers, **kw), dev, repeat, warmup)
    t_copy = _time(lambda: dst.copy_(src), dev, repeat, warmup)
    return {
        "layout": lay.name,
        "backend": select_backend(dev, backend),
        "device": str(dev),
        "dtype": str(dtype).replace("torch.", ""),
        "num_tokens": num_tokens,
        "num_layers": num_layers,
        "bytes": nbytes,
        "gather_s": t_gather,
        "scatter_s": t_scatter,
        "memcpy_s": t_copy,
        "gather_gbps": nbytes / t_gather / 1e9,
        "scatter_gbps": nbytes / t_scatter / 1e9,
        "memcpy_gbps": nbytes / t_copy / 1e9,
    }
