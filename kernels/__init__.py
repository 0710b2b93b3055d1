"""Data movement between an engine's paged KV memory and contiguous chunk buffers.

A chunk buffer is ``(num_layers, num_kv, num_tokens, heads, head_size)``; an engine's KV
memory is a list of per-layer tensors (or one stacked tensor) in one of the
:data:`LAYOUTS` (vLLM FlashAttention, blocks-first, FlashInfer NHD/HND, MLA, contiguous).
:func:`gather` / :func:`scatter` move every layer through a slot mapping,
:func:`gather_layer` / :func:`scatter_layer` one layer. The torch reference runs
everywhere; Triton kernels run on GPUs and are imported only when used. See
``docs/kernels.md``.
"""

from __future__ import annotations

from .layouts import (
    BLOCKS_FIRST,
    CONTIGUOUS,
    FLASHINFER_HND,
    FLASHINFER_NHD,
    LAYOUTS,
    MLA,
    VLLM_FLASH_ATTN,
    KVLayout,
    get_layout,
    register_layout,
)
from .ops import (
    SlotMappingError,
    chunk_shape,
    gather,
    gather_layer,
    num_slots,
    scatter,
    scatter_layer,
    select_backend,
    triton_available,
)

__all__ = [
    "KVLayout",
    "LAYOUTS",
    "register_layout",
    "get_layout",
    "VLLM_FLASH_ATTN",
    "BLOCKS_FIRST",
    "FLASHINFER_NHD",
    "FLASHINFER_HND",
    "MLA",
    "CONTIGUOUS",
    "SlotMappingError",
    "gather",
    "scatter",
    "gather_layer",
    "scatter_layer",
    "chunk_shape",
    "num_slots",
    "select_backend",
    "triton_available",
]
