"""Triton kernels for gather/scatter between paged KV memory and chunk buffers.

Imported lazily by :mod:`lmcache.kernels.ops` (never at ``import lmcache.kernels``), and
only when the tensors are on a GPU and ``triton`` imports, or when a caller forces
``backend="triton"`` (on CPU tensors that needs ``TRITON_INTERPRET=1``).

One launch moves every layer: the grid is ``(tokens after skip, layers, num_kv)`` and each
program copies one token's ``heads x head_size`` elements of one layer's K or V. Layers
are reached through a table of their base addresses, so a list of separately allocated
per-layer tensors (vLLM) costs one launch, as does a stacked tensor. All offsets are
computed from the strides of the :meth:`KVLayout.canonical` view in 64-bit, so
non-contiguous views and caches larger than 2**31 elements work. The kernel copies raw
bits (tensors are reinterpreted as integers of the same width), so it is bit-exact for
every dtype, fp8 included. Negative slots (padding) are masked out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import nullcontext
from typing import Sequence

import torch
import triton
import triton.language as tl

from .layouts import KVLayout

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TL_BITS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
_MAX_TILE = 4096  # elements per program iteration


@triton.jit
def _kv_copy_kernel(
    layer_ptrs,  # int64[num_layers]: base address of each layer's paged tensor
    chunk_ptr,  # chunk buffer (L, num_kv, T, H, D), reinterpreted as integers
    slot_ptr,  # int64[T]
    skip,
    block_size,
    p_kv, p_blk, p_off, p_h, p_d,  # paged strides (elements), canonical order
    c_layer, c_kv, c_tok, c_h, c_d,  # chunk strides (elements)
    num_heads,
    head_size,
    ELEM: tl.constexpr,  # integer type of the element width
    GATHER: tl.constexpr,
    ALIGNED: tl.constexpr,  # every layer's base address is 16-byte aligned
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    tok = (tl.program_id(0) + skip).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    kv = tl.program_id(2).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    blk = slot // block_size
    off = slot % block_size
    base = tl.load(layer_ptrs + layer).to(tl.pointer_type(ELEM))
    if ALIGNED:
        base = tl.multiple_of(base, 16)  # lets the compiler vectorize the paged side
    paged = base + kv * p_kv + blk * p_blk + off * p_off
    chunk = chunk_ptr + layer * c_layer + kv * c_kv + tok * c_tok
    heads_here = tl.where(valid, num_heads, 0)  # a padding token moves nothing
    hs = tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    for h0 in range(0, num_heads, BLOCK_H):
        h = (h0 + hs).to(tl.int64)
        for d0 in range(0, head_size, BLOCK_D):
            d = (d0 + ds).to(tl.int64)
            mask = (h[:, None] < heads_here) & (d[None, :] < head_size)
            p = paged + h[:, None] * p_h + d[None, :] * p_d
            c = chunk + h[:, None] * c_h + d[None, :] * c_d
            if GATHER:
                tl.store(c, tl.load(p, mask=mask), mask=mask)
            else:
                tl.store(p, tl.load(c, mask=mask), mask=mask)


class _PtrTables:
    """Device tensors of layer base addresses, cached (engines reuse the same KV tensors)."""

    def __init__(self, size: int = 64):
        self._size = size
        self._cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, layers: Sequence[torch.Tensor]) -> torch.Tensor:
        device = layers[0].device
        ptrs = tuple(t.data_ptr() for t in layers)
        key = (str(device), ptrs)
        with self._lock:
            table = self._cache.get(key)
            if table is not None:
                self._cache.move_to_end(key)
                return table
        table = torch.tensor(ptrs, dtype=torch.int64).to(device)
        with self._lock:
            self._cache[key] = table
            if len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return table


_tables = _PtrTables()


def _tiles(num_heads: int, head_size: int) -> tuple[int, int]:
    block_d = min(triton.next_power_of_2(head_size), 1024)
    block_h = max(1, min(triton.next_power_of_2(num_heads), _MAX_TILE // block_d))
    return block_h, block_d


def _launch(
    layout: KVLayout, layers: Sequence[torch.Tensor], slots: torch.Tensor, chunk: torch.Tensor, skip: int, gather: bool
) -> None:
    num_layers, num_kv, num_tokens, num_heads, head_size = chunk.shape
    if num_tokens - skip <= 0:
        return
    elem = chunk.element_size()
    if elem not in _BITS:
        raise ValueError(f"the triton kernels move elements of 1, 2, 4 or 8 bytes, not {elem} ({chunk.dtype})")
    canons = [layout.canonical(t) for t in layers]
    block_size = canons[0].shape[2]
    bits = chunk.view(_BITS[elem])  # same strides, integer elements: a bit-exact copy
    slots = slots.contiguous()
    block_h, block_d = _tiles(num_heads, head_size)
    # one launch for all layers when they share strides (the normal case), else one each
    groups = (
        [list(range(num_layers))]
        if all(c.stride() == canons[0].stride() for c in canons)
        else [[i] for i in range(num_layers)]
    )
    with torch.cuda.device(chunk.device) if chunk.device.type == "cuda" else nullcontext():
        for group in groups:
            table = _tables.get([layers[i] for i in group])
            aligned = all(layers[i].data_ptr() % 16 == 0 for i in group)
            sub = bits[group[0] : group[-1] + 1]
            grid = (num_tokens - skip, len(group), num_kv)
            _kv_copy_kernel[grid](
                table, sub, slots, skip, block_size,
                *canons[group[0]].stride(),
                *sub.stride(),
                num_heads, head_size,
                ELEM=_TL_BITS[elem], GATHER=gather, ALIGNED=aligned, BLOCK_H=block_h, BLOCK_D=block_d,
            )  # fmt: skip


def gather(
    layout: KVLayout, layers: Sequence[torch.Tensor], slots: torch.Tensor, chunk: torch.Tensor, skip: int
) -> None:
    _launch(layout, layers, slots, chunk, skip, gather=True)


def scatter(
    layout: KVLayout, layers: Sequence[torch.Tensor], slots: torch.Tensor, chunk: torch.Tensor, skip: int
) -> None:
    _launch(layout, layers, slots, chunk, skip, gather=False)


def compile_for(
    arch: int = 90, *, gather: bool = True, elem_bytes: int = 2, block_h: int = 8, block_d: int = 128
) -> triton.compiler.CompiledKernel:
    """Compile the kernel ahead of time for CUDA ``sm_<arch>`` (no GPU needed).

    A check for machines without a GPU that the kernel lowers to PTX and a cubin, with
    the specializations a real launch gets (unit head-dim strides, 16-byte divisible
    pointers and strides). Returns the compiled kernel; ``.asm["ptx"]`` holds the PTX.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _kv_copy_kernel
    names = list(fn.arg_names)
    constexprs = {
        "ELEM": _TL_BITS[elem_bytes],
        "GATHER": gather,
        "ALIGNED": True,
        "BLOCK_H": block_h,
        "BLOCK_D": block_d,
        "p_d": 1,
        "c_d": 1,
    }
    pointers = {"layer_ptrs": "*i64", "chunk_ptr": f"*i{8 * elem_bytes}", "slot_ptr": "*i64"}
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i64") for n in names}
    divisible = [n for n in names if n not in constexprs and n not in ("skip", "block_size", "num_heads")]
    src = ASTSource(
        fn,
        signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible},
    )
    return triton.compile(src, target=GPUTarget("cuda", arch, 32))
