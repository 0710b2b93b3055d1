"""The shapes of a vLLM instance's KV cache, as the vLLM connector's two sides see them:
:func:`kv_spec_of` (the engine's :class:`~lmcache.config.KVSpec` of one TP rank),
:func:`detect_layout` (the :mod:`lmcache.kernels` layout of one paged layer tensor),
:func:`_slots` (block ids to slot numbers), which kernels vLLM's CPU attention backend runs
(:func:`cpu_isa`, :func:`packed_cpu_kernels`) and whether shifted reuse can run under this
vLLM (:func:`shifted_freqs`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from lmcache.config import KVSpec
from lmcache.dtypes import dtype_name
from lmcache.kernels import KVLayout, get_layout, register_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

__all__ = ["NEOX_ROPE_MODELS", "VLLM_BHNC", "VLLM_CPU_VEC", "cpu_isa", "detect_layout", "kv_spec_of",
           "packed_cpu_kernels", "shifted_freqs", "tp_rank_of"]

#: extra-config keys read by this connector (everything else under ``lmcache.`` is lmcache config)
CONNECTOR_PREFIX = "lmcache.vllm."

#: model types whose vLLM implementation rotates keys by halves (``is_neox_style``), the
#: layout :func:`lmcache.kernels.rope.rerotate` works in
NEOX_ROPE_MODELS = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                              "gemma", "gemma2", "granite", "olmo2", "smollm3"})



#: vLLM >= 0.2x standardized per-layer view ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
#: (any physical order), unflattened by this connector to ``(B, H, N, 2, D)``.
VLLM_BHNC = register_layout(
    KVLayout(
        "vllm_bhn2d",
        block_axis=0, heads_axis=1, offset_axis=2, kv_axis=3, dim_axis=4,
        description="vLLM standardized [B, H, N, 2*D] per-layer view, last axis split into (K|V, D)",
    )
)  # fmt: skip

#: vLLM's CPU attention backend (vllm-cpu) allocates the same ``[B, H, N, 2*D]`` tensor but
#: reads it as ``[B, H, 2*N, D]``: per block and head, the keys, then the values. With its
#: ``vec`` kernels (x86 without AMX, head sizes of 32k) the N keys are stored transposed
#: (``[D, N]``) and the values as ``[N, D]``; no one strided view holds both, so each layer
#: becomes two views of this layout, keys and values, with their own strides, and the
#: connector hands the kernels ``2 * layers`` of them (the chunk buffer ``(2L, 1, T, H, D)``
#: is the engine's ``(L, 2, T, H, D)``).
VLLM_CPU_VEC = register_layout(
    KVLayout(
        "vllm_cpu_vec",
        block_axis=0, heads_axis=1, offset_axis=2, dim_axis=3,
        description="vLLM CPU attention (vec ISA): keys [B, H, D, N] and values [B, H, N, D] of one [B, H, N, 2*D] tensor, as two layers",
    )
)  # fmt: skip
#: The other CPU kernels (vec16, AMX, ...) pack blocks in ways not modelled here: their
#: blocks are copied as rows of the ``[B, H, N, 2*D]`` view (:data:`VLLM_BHNC`), which is
#: exact for a round trip in the same kind of engine but not per token: shifted reuse is
#: off there.


# --------------------------------------------------------------------------- shapes
def kv_spec_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, tp_rank: int = 0) -> tuple[KVSpec, bool, int]:
    """``(kv_spec, is_mla, block_size)`` of this vLLM instance's KV cache (one TP rank).

    MLA's one latent vector per token is stored as ``num_kv_heads=1`` with its two halves
    as "K" and "V" (``head_size = latent // 2``, layout ``mla``), so MLA entries use the
    engine's ``(layers, 2, tokens, heads, head_size)`` chunks and never mix with others.
    """
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    spec = None
    layers = 0
    if kv_cache_config is not None and getattr(kv_cache_config, "kv_cache_groups", None):
        for group in kv_cache_config.kv_cache_groups:
            if spec is None:
                spec = group.kv_cache_spec
            layers += len(group.layer_names)
        if len(kv_cache_config.kv_cache_groups) > 1:
            log.warning("lmcache: %d KV cache groups; only uniform full-attention models are supported",
                        len(kv_cache_config.kv_cache_groups))
    block_size = int(getattr(spec, "block_size", 0) or vllm_config.cache_config.block_size)
    is_mla = bool(getattr(mc, "use_mla", False)) or type(spec).__name__.startswith("MLA")
    if spec is not None and hasattr(spec, "num_kv_heads"):
        heads, head_size, dtype = int(spec.num_kv_heads), int(spec.head_size), spec.dtype
    else:
        heads, head_size = mc.get_num_kv_heads(pc), mc.get_head_size()
        dtype = mc.dtype
    if not layers:
        layers = mc.get_num_layers(pc)
    if is_mla:
        if head_size % 2:
            raise ValueError(f"lmcache: MLA latent size {head_size} is odd; it is stored as two halves")
        kv = KVSpec(layers, 1, head_size // 2, dtype_name(dtype), layout="mla", tp_rank=tp_rank, tp_size=tp_size)
    else:
        kv = KVSpec(layers, heads, head_size, dtype_name(dtype), tp_rank=tp_rank, tp_size=tp_size)
    return kv, is_mla, block_size


def detect_layout(t: torch.Tensor, *, num_kv_heads: int, head_size: int, is_mla: bool,
                  cpu_isa: str | None = None) -> tuple[KVLayout, torch.Tensor | list[torch.Tensor]]:
    """The kernels layout of one vLLM layer tensor and the view to hand the kernels.

    Recognised (per layer): MLA ``(B, N, latent)`` and vLLM 0.33's ``[B, 1, N, latent]``;
    FlashAttention ``(2, B, N, H, D)``; blocks-first ``(B, 2, N, H, D)``; FlashInfer HND
    ``(B, 2, H, N, D)``; and vLLM 0.33's standardized ``[B, H, N, 2*D]`` (any physical
    axis order: the kernels read strides), which vLLM's CPU attention backend (``cpu_isa``:
    the kernels it runs) reads as ``[B, H, 2*N, D]`` instead (:data:`VLLM_CPU_VEC`, whose
    view is a list: keys, values). Raises ``ValueError`` for anything else.
    """
    s = tuple(t.shape)
    if is_mla:
        if t.dim() == 3:
            return get_layout("mla"), t
        if t.dim() == 4 and s[1] == 1:
            return get_layout("mla"), t.squeeze(1)
    else:
        H, D = num_kv_heads, head_size
        if t.dim() == 5 and s[0] == 2 and s[3:] == (H, D):
            return get_layout("vllm_flash_attn"), t
        if t.dim() == 5 and s[1] == 2 and s[4] == D:
            if s[3] == H and (s[2] != H or t.stride(2) >= t.stride(3)):
                return get_layout("blocks_first"), t
            if s[2] == H:
                return get_layout("flashinfer_hnd"), t
        if t.dim() == 4 and s[1] == H and s[3] == 2 * D:
            if cpu_isa == "vec":  # contiguous there: the backend itself views it so
                B, N = s[0], s[2]
                halves = t.view(B, H, 2, N * D)
                return VLLM_CPU_VEC, [halves[:, :, 0].unflatten(-1, (D, N)).transpose(2, 3),
                                      halves[:, :, 1].unflatten(-1, (N, D))]
            return VLLM_BHNC, t.unflatten(-1, (2, D))
    raise ValueError(
        f"lmcache: unrecognised vLLM KV cache layer of shape {s} strides {tuple(t.stride())} "
        f"(num_kv_heads={num_kv_heads}, head_size={head_size}, mla={is_mla})"
    )


def _slots(block_ids: list[int], block_size: int, n: int) -> torch.Tensor:
    """Slot of each of the first ``n`` tokens of a request owning ``block_ids``."""
    need = -(-n // block_size)
    if need > len(block_ids):
        raise ValueError(f"{n} tokens need {need} blocks of {block_size}, the request has {len(block_ids)}")
    b = torch.tensor(block_ids[:need], dtype=torch.int64)
    return (b[:, None] * block_size + torch.arange(block_size, dtype=torch.int64)[None, :]).flatten()[:n]



def tp_rank_of(vllm_config: VllmConfig) -> int:
    """This process's tensor-parallel rank (from vLLM's process group, else its parallel config)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no process group (tests, single process)
        pc = vllm_config.parallel_config
        return int(getattr(pc, "rank", 0) or 0) % int(getattr(pc, "tensor_parallel_size", 1) or 1)


def packed_cpu_kernels(vllm_config: VllmConfig, block_size: int, head_size: int) -> bool:
    """Whether vLLM's CPU attention backend will run kernels other than ``vec`` here."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        dtype = getattr(vllm_config.model_config, "dtype", torch.float32)
        return _get_attn_isa(dtype, block_size, head_size,
                             getattr(vllm_config.cache_config, "cache_dtype", None)) != "vec"
    except Exception:
        return False


def cpu_isa(vllm_config: VllmConfig, names: list[str], dtype: torch.dtype, block_size: int, head_size: int) -> str | None:
    """The kernels of vLLM's CPU attention backend if these layers run it (its attention
    layers are in the compilation config's forward context, by layer name), else None."""
    ctx = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    for name in names:
        impl = getattr(ctx.get(name), "impl", None)
        if impl is None:
            continue
        if not type(impl).__name__.startswith("CPUAttention"):
            return None
        isa = getattr(ctx[name], "isa", None) or getattr(impl, "isa", None)
        if isa is None:
            try:
                from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

                cc = vllm_config.cache_config
                isa = _get_attn_isa(dtype, block_size, head_size, getattr(cc, "cache_dtype", None))
            except Exception:  # another vLLM: the packed fallback, never a wrong per-token read
                isa = "unknown"
        return str(isa)
    return None


def shifted_freqs(vllm_config: VllmConfig, *, layerwise: bool, is_mla: bool, block_size: int, head_size: int,
                  warn: bool) -> torch.Tensor | None:
    """The model's rotary frequencies if shifted reuse can run under this vLLM, else
    ``None`` (with one warning naming why when ``warn``: the scheduler side warns)."""
    from lmcache.kernels import rope

    hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    why = None
    if getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        why = ("vLLM's prefix cache is on: it would keep the approximate KV under the prompt's exact "
               "block hashes; run vLLM with --no-enable-prefix-caching (lmcache serves exact hits)")
    elif layerwise:
        why = f"{CONNECTOR_PREFIX}layerwise loads are exact-prefix only"
    elif is_mla:
        why = "MLA caches are not supported"
    elif packed_cpu_kernels(vllm_config, block_size, head_size):
        why = "vLLM's CPU attention kernels for this dtype and head size pack blocks in a layout lmcache does not read per token"
    elif hf is None or getattr(hf, "model_type", None) not in NEOX_ROPE_MODELS:
        why = f"model type {getattr(hf, 'model_type', None)!r} is not known to use half-split rotary keys"
    else:
        try:
            freqs = rope.inv_freq_of(hf)
        except (ValueError, KeyError, AttributeError) as exc:
            why = str(exc)
        else:
            if rope.max_positions(hf) is None:
                return freqs
            why = "dynamic rotary scaling changes its frequencies with the prompt's length"
    if warn:
        log.warning("lmcache: approximate_reuse is off under vLLM: %s", why)
    return None
