"""The vLLM v1 connector: lmcache under vLLM's paged KV cache.

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "LMCacheConnector",
        "kv_connector_module_path": "lmcache.plugins.connectors.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.config_file": "lmcache.yaml", "lmcache.chunk_size": 256}}'

vLLM builds two instances: one in the scheduler (``KVConnectorRole.SCHEDULER``) and one per
worker (``KVConnectorRole.WORKER``). Both open a :class:`~lmcache.engine.CacheEngine` from the
same config: the YAML file named by ``lmcache.config_file`` (else ``LMCACHE_CONFIG_FILE``),
``LMCACHE_*`` environment variables, then every other ``lmcache.<key>`` of
``kv_connector_extra_config`` (``lmcache.vllm.*`` keys configure this connector instead).
Instances of one process with the same config and KV shape share one engine, so with one
GPU (scheduler and worker in the engine-core process) a CPU tier serves both; with several
worker processes the scheduler sees what workers stored only through a tier they share
(disk, fs, redis, lm, ...).

Scheduler role: :meth:`get_num_new_matched_tokens` looks the prompt up (pinning the hits),
returns the block-aligned hit beyond vLLM's own prefix cache and never the last prompt
token; :meth:`update_state_after_alloc` turns an admitted hit into a load spec;
:meth:`build_connector_meta` sends the load specs and the save specs (prompt chunks that
this step completes) to the workers. Loads are synchronous (``load_kv_async`` is not used).

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
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import torch

from lmcache.config import KVSpec
from lmcache.dtypes import dtype_name
from lmcache.engine import CacheEngine
from lmcache.kernels import KVLayout, get_layout, register_layout
from lmcache import kernels as K

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as exc:  # pragma: no cover - exercised only without vLLM
    raise ImportError(
        "lmcache.plugins.connectors.vllm needs vLLM (tested with vllm==0.33.0): pip install vllm"
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

#: extra-config keys read by this connector (everything else under ``lmcache.`` is lmcache config)
CONNECTOR_PREFIX = "lmcache.vllm."

#: vLLM >= 0.2x standardized per-layer view ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
#: (any physical order), unflattened by this connector to ``(B, H, N, 2, D)``.
VLLM_BHNC = register_layout(
    KVLayout(
        "vllm_bhn2d",
        block_axis=0, heads_axis=1, offset_axis=2, kv_axis=3, dim_axis=4,
        description="vLLM standardized [B, H, N, 2*D] per-layer view, last axis split into (K|V, D)",
    )
)  # fmt: skip


# --------------------------------------------------------------------------- metadata
@dataclass
class LoadSpec:
    """Load ``token_ids[skip:load_end]`` into the request's blocks.

    ``token_ids`` are the tokens the scheduler's lookup hit (ending on a chunk boundary or
    the prompt's end, so their chunk keys match what was stored); ``skip`` tokens are
    already in vLLM's prefix cache; ``load_end`` (block aligned, below the prompt length)
    is how far vLLM was promised KV.
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip: int
    load_end: int


@dataclass
class SaveSpec:
    """Store ``token_ids`` (a prompt prefix) from the request's blocks; ``skip`` tokens are
    known to be stored already."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip: int = 0


@dataclass
class LMCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _ReqState:
    prompt: list[int]
    block_ids: list[int] = field(default_factory=list)
    saved_end: int = 0


# --------------------------------------------------------------------------- shapes
def kv_spec_of(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None", tp_rank: int = 0) -> tuple[KVSpec, bool, int]:
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


def detect_layout(t: torch.Tensor, *, num_kv_heads: int, head_size: int, is_mla: bool) -> tuple[KVLayout, torch.Tensor]:
    """The kernels layout of one vLLM layer tensor and the view to hand the kernels.

    Recognised (per layer): MLA ``(B, N, latent)`` and vLLM 0.33's ``[B, 1, N, latent]``;
    FlashAttention ``(2, B, N, H, D)``; blocks-first ``(B, 2, N, H, D)``; FlashInfer HND
    ``(B, 2, H, N, D)``; and vLLM 0.33's standardized ``[B, H, N, 2*D]`` (any physical
    axis order: the kernels read strides). Raises ``ValueError`` for anything else.
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


def _truthy(v: Any) -> bool:
    return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------- the connector
class LMCacheConnector(KVConnectorBase_V1):
    """lmcache as a vLLM v1 KV connector (see the module doc)."""

    def __init__(self, vllm_config: "VllmConfig", role: "KVConnectorRole", kv_cache_config: "KVCacheConfig | None" = None):
        try:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        except TypeError:  # vLLM < 0.11: (vllm_config, role)
            super().__init__(vllm_config=vllm_config, role=role)  # type: ignore[call-arg]
        extra = dict(getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {})
        config_file = extra.pop("lmcache.config_file", None)
        own = {k[len(CONNECTOR_PREFIX):]: v for k, v in extra.items() if k.startswith(CONNECTOR_PREFIX)}
        overrides = {
            k[len("lmcache."):]: v for k, v in extra.items()
            if k.startswith("lmcache.") and not k.startswith(CONNECTOR_PREFIX)
        }  # fmt: skip
        self.layerwise = _truthy(own.pop("layerwise", False))
        if own:
            raise ValueError(f"lmcache: unknown kv_connector_extra_config keys {sorted(CONNECTOR_PREFIX + k for k in own)}")
        tp_rank = 0 if role == KVConnectorRole.SCHEDULER else self._tp_rank(vllm_config)
        self.kv_spec, self.is_mla, self.block_size = kv_spec_of(vllm_config, kv_cache_config, tp_rank)
        self.engine = _acquire_engine(config_file, overrides, self.kv_spec)
        self.chunk_size = self.engine.config.chunk_size
        # scheduler state
        self._reqs: dict[str, _ReqState] = {}
        self._pending_lookups: dict[str, tuple[list[int], int]] = {}  # req -> (hit tokens, local computed)
        self._loads: dict[str, LoadSpec] = {}
        # worker state
        self._layers: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._layout: KVLayout | None = None
        self._failed: set[int] = set()
        self._layer_loads: list[tuple[LoadSpec, Any, torch.Tensor, torch.Tensor]] = []
        self._layer_saves: list[tuple[SaveSpec, torch.Tensor, torch.Tensor, int]] = []
        self._closed = False

    @staticmethod
    def _tp_rank(vllm_config: "VllmConfig") -> int:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        except Exception:  # no process group (tests, single process)
            pc = vllm_config.parallel_config
            return int(getattr(pc, "rank", 0) or 0) % int(getattr(pc, "tensor_parallel_size", 1) or 1)

    # ================================================================ scheduler role
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        prompt = list(request.prompt_token_ids or [])
        self._drop_pending(request.request_id)
        hit = self.engine.lookup(prompt, pin=True)
        # vLLM computes at least the last token; hits are whole blocks
        usable = min(hit, request.num_tokens - 1) // self.block_size * self.block_size
        if usable <= num_computed_tokens:
            if hit:
                self.engine.release(prompt[:hit])
            return 0, False
        self._pending_lookups[request.request_id] = (prompt[:hit], num_computed_tokens)
        return usable - num_computed_tokens, False

    def _drop_pending(self, req_id: str) -> None:
        p = self._pending_lookups.pop(req_id, None)
        if p is not None:
            self.engine.release(p[0])

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        req_id = request.request_id
        st = self._reqs.get(req_id)
        if st is None:
            st = self._reqs[req_id] = _ReqState(list(request.prompt_token_ids or []))
        if num_external_tokens <= 0:
            self._drop_pending(req_id)
            return
        pending = self._pending_lookups.pop(req_id, None)
        if pending is None:
            log.warning("lmcache: %s: %d external tokens without a lookup; not loading", req_id, num_external_tokens)
            return
        tokens, local = pending
        block_ids = list(blocks.get_block_ids()[0])
        self._loads[req_id] = LoadSpec(req_id, tokens, block_ids, local, local + num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> LMCacheConnectorMetadata:
        meta = LMCacheConnectorMetadata()
        scheduled: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                st = self._reqs[new.req_id] = _ReqState(list(new.prompt_token_ids or []))
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
                meta.loads.append(load)
            end = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            n = len(st.prompt)
            save_end = n if end >= n else end // self.chunk_size * self.chunk_size
            if save_end > st.saved_end:
                meta.saves.append(SaveSpec(req_id, st.prompt[:save_end], list(st.block_ids), st.saved_end))
                st.saved_end = save_end
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None  # saves are synchronous: vLLM may free the blocks now

    def _forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._drop_pending(req_id)

    def take_events(self) -> Iterable[Any]:
        """No KV cache events: lmcache's own controller publishes admissions/evictions."""
        return ()

    # ================================================================ worker role
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        views: list[torch.Tensor] = []
        layout: KVLayout | None = None
        heads = 1 if self.is_mla else self.kv_spec.num_kv_heads
        head = self.kv_spec.head_size * (2 if self.is_mla else 1)
        for i, (name, t) in enumerate(kv_caches.items()):
            lay, view = detect_layout(t, num_kv_heads=heads, head_size=head, is_mla=self.is_mla)
            if layout is not None and lay != layout:
                raise ValueError(f"lmcache: layer {name} is {lay.name} but earlier layers are {layout.name}")
            layout = lay
            views.append(view)
            self._layer_index[name] = i
        if len(views) != self.kv_spec.num_layers:
            raise ValueError(f"lmcache: {len(views)} KV cache layers registered, expected {self.kv_spec.num_layers}")
        self._layers, self._layout = views, layout
        log.info("lmcache: %d layers in layout %s, kv %s", len(views), layout.name if layout else None, self.kv_spec.signature)

    def _meta(self) -> LMCacheConnectorMetadata | None:
        m = self._connector_metadata
        return m if isinstance(m, LMCacheConnectorMetadata) else None

    def _buffer(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernels chunk buffer, the engine's (L, 2, T, H, D) view of it) on the host."""
        assert self._layout is not None
        shape = self._layout.chunk_shape(self._layers[0], len(self._layers), num_tokens)
        buf = torch.empty(shape, dtype=self._layers[0].dtype)
        if self.is_mla:
            L, _, T, _, latent = shape
            view = buf.view(L, T, 2, latent // 2).permute(0, 2, 1, 3).unsqueeze(3)
        else:
            view = buf
        return buf, view

    def _device(self) -> torch.device:
        return self._layers[0].device

    def _fail(self, spec: LoadSpec, good: int) -> None:
        """Report the blocks of tokens ``[max(good, skip), load_end)`` as failed."""
        first = max(good, spec.skip) // self.block_size
        last = -(-spec.load_end // self.block_size)
        bad = spec.block_ids[first:last]
        if bad:
            log.warning("lmcache: %s: loaded %d of %d tokens; %d blocks will be recomputed",
                        spec.req_id, max(good, spec.skip), spec.load_end, len(bad))
            self._failed.update(bad)

    def _load_slots(self, spec: LoadSpec, got: int) -> torch.Tensor:
        """Slots of the lookup's tokens: tokens past ``min(got, load_end)`` are padding."""
        n = len(spec.token_ids)
        valid = min(got, spec.load_end)
        slots = torch.full((n,), -1, dtype=torch.int64)
        slots[:valid] = _slots(spec.block_ids, self.block_size, valid)
        return slots

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._meta()
        self._layer_loads = []
        if meta is None or not meta.loads:
            return
        if not self._layers:
            for spec in meta.loads:
                self._fail(spec, 0)
            return
        for spec in meta.loads:
            try:
                buf, view = self._buffer(len(spec.token_ids))
                if self.layerwise:
                    handle = self.engine.retrieve_layerwise(spec.token_ids, view)
                    got = handle.num_tokens
                    slots = self._load_slots(spec, got)
                    self._layer_loads.append((spec, handle, buf, slots))
                else:
                    got = self.engine.retrieve(spec.token_ids, out=view).num_tokens
                    if min(got, spec.load_end) > spec.skip:
                        slots = self._load_slots(spec, got)
                        K.scatter(buf.to(self._device()), self._layout, slots, self._layers, spec.skip)
                if got < spec.load_end:
                    self._fail(spec, got)
            except Exception:
                log.exception("lmcache: loading %s failed; vLLM will recompute it", spec.req_id)
                self._fail(spec, 0)

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
                    K.scatter_layer(buf[i].to(self._device()), self._layout, slots, self._layers[i], spec.skip)
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
            K.gather_layer(self._layers[i], self._layout, slots, dev_buf[i], skip)
        if i == len(self._layers) - 1:
            saves, self._layer_saves = self._layer_saves, []
            for spec, dev_buf, slots, skip in saves:
                self._finish_save(spec, dev_buf, skip)

    def _prepare_save(self, spec: SaveSpec) -> tuple[SaveSpec, torch.Tensor, torch.Tensor, int] | None:
        """Pin what is cached already and set up the gather of the rest (``None``: nothing to do)."""
        skip = self.engine.lookup(spec.token_ids, pin=True)
        if skip >= len(spec.token_ids):
            self.engine.release(spec.token_ids)
            return None
        slots = _slots(spec.block_ids, self.block_size, len(spec.token_ids))
        assert self._layout is not None
        shape = self._layout.chunk_shape(self._layers[0], len(self._layers), len(spec.token_ids))
        dev_buf = torch.empty(shape, dtype=self._layers[0].dtype, device=self._device())
        return spec, dev_buf, slots, skip

    def _finish_save(self, spec: SaveSpec, dev_buf: torch.Tensor, skip: int) -> None:
        try:
            buf, view = self._buffer(len(spec.token_ids))
            buf[:, :, skip:].copy_(dev_buf[:, :, skip:])
            # chunks before ``skip`` stay pinned (leased) until after the store, so the
            # store skips them and never reads their unfilled rows
            self.engine.store(spec.token_ids, view)
        except Exception:
            log.exception("lmcache: storing %s failed", spec.req_id)
        finally:
            self.engine.release(spec.token_ids)

    def wait_for_save(self) -> None:
        meta = self._meta()
        if meta is None or not meta.saves or not self._layers:
            return
        if self.layerwise:
            if self._layer_saves:  # not every layer called save_kv_layer: store nothing partial
                for spec, *_ in self._layer_saves:
                    self.engine.release(spec.token_ids)
                self._layer_saves = []
            return
        for spec in meta.saves:
            prepared = self._prepare_save(spec)
            if prepared is None:
                continue
            _, dev_buf, slots, skip = prepared
            try:
                K.gather(self._layers, self._layout, slots, dev_buf, skip)
            except Exception:
                log.exception("lmcache: gathering %s failed", spec.req_id)
                self.engine.release(spec.token_ids)
                continue
            self._finish_save(spec, dev_buf, skip)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # loads and saves finish within the step

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    # ================================================================ lifecycle
    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            _release_engine(self.engine)
