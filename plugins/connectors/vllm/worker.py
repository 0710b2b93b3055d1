"""The worker side of the vLLM connector (:class:`ConnectorWorker`): it holds the process's
engine (:mod:`.registry`), whose ``lookup`` service answers the scheduler.

:meth:`ConnectorWorker.register_kv_caches` detects the layout of vLLM's per-layer tensors
from their shapes (:mod:`.layout`); every load (:meth:`ConnectorWorker.load`) retrieves into
one of the sinks of :mod:`.load_sinks` (each chunk from the engine's memory pool into the
paged blocks with :mod:`lmcache.kernels` through slot mappings built from block ids; MLA,
vLLM's CPU layout and shifted reuse through a staging buffer; layer by layer); every save takes its
KV through one of the sources of :mod:`.save_sources` (straight from the paged blocks into
the pool, or through a staging buffer, at once or layer by layer). A load that
returns fewer tokens than promised reports the affected blocks through
:meth:`ConnectorWorker.get_block_ids_with_load_errors`, so vLLM recomputes them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from lmcache import kernels as K
from lmcache.config import load_config
from lmcache.engine import CacheEngine
from lmcache.keys import KeyExtra
from lmcache.kernels import KVLayout
from lmcache.services import EngineView

from ...services.lookup import LookupChannel, LookupReply, socket_path
from .blocks import BlockEntries, block_entries_layout, packed_rows, savable
from .common import Side, lookup_mode
from .events import EventBridge, LMCacheTierEvents
from .layout import VLLM_BHNC, VLLM_CPU_VEC, _slots, cpu_isa, detect_layout, tp_rank_of
from . import load_sinks, save_sources
from .load_sinks import LoadSink
from .metadata import LMCacheConnectorMetadata, LMCacheWorkerMetadata, LoadSpec, SaveSpec
from .pd import PDWorker, receiver_port
from .registry import acquire_engine, add_worker, release_engine, remove_worker
from .save_sources import SaveSource

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

__all__ = ["STAGING_KEEP_BYTES", "ConnectorWorker"]

#: the largest staging buffer a worker keeps between requests (one per use, see
#: ``ConnectorWorker._buffer``); a larger load or save allocates its own each time
STAGING_KEEP_BYTES = 1 << 30

class ConnectorWorker(Side):
    """The worker role's half of :class:`~lmcache.plugins.connectors.vllm.LMCacheConnector`
    (see the module doc): the engine, loads, saves, staging buffers, finished loads."""

    role = "worker"

    def __init__(self, vllm_config: VllmConfig, kv_transfer_config: Any, kv_cache_config: KVCacheConfig | None,
                 config_file: str | None, overrides: dict[str, Any]) -> None:
        super().__init__(vllm_config, kv_transfer_config, kv_cache_config, tp_rank_of(vllm_config))
        # the engine's lookup service answers the scheduler on this rank's socket, or
        # in-band (vllm.lookup), in this connector's worker metadata: then no socket
        cfg = load_config(config_file, **overrides)
        mode = lookup_mode(vllm_config, cfg.vllm.lookup)
        # vLLM's CPU backend: entries hold its blocks whole, keyed apart (.blocks)
        tag = block_entries_layout(vllm_config, self.block_size, self.kv_spec.head_size, cfg, self.is_mla)
        if tag is not None:
            self.kv_spec = dataclasses.replace(self.kv_spec, layout=tag)
        self._block_entries: BlockEntries | None = None
        sock = socket_path(self.instance, self.dp_rank, self.tp_rank) if mode == "socket" else None
        # a lookup frame is bounded by the longest prompt this model takes (docs/engines.md)
        max_len = int(getattr(vllm_config.model_config, "max_model_len", 0) or 0)
        bound = {"lookup_max_tokens": max_len} if max_len > 0 else {}
        pd_port = receiver_port(cfg, self.tp_rank)  # a PD receiver's rank listens where LMCache's keys say
        if pd_port:
            overrides = {**overrides, "transfer": {**overrides.get("transfer", {}), **pd_port}}
        self.engine: CacheEngine = acquire_engine(config_file, {**bound, **overrides, "lookup_socket": sock}, self.kv_spec)
        self._configure(self.engine.config)
        self._pd = PDWorker(self.engine, cfg, self.tp_rank, self.instance, self.dp_rank) if cfg.pd.role != "off" else None
        self._lookup = self.engine.services.get("lookup") or LookupChannel(EngineView(self.engine))
        #: in-band lookups answered with pins: seq -> (when, tokens, exact, extra)
        self._asked: dict[int, tuple[float, list[int], int, KeyExtra | None, str | None]] = {}
        self._shifted_from: dict[str, int] = {}  # request -> first position not loaded exactly
        self._layers: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._layout: KVLayout | None = None
        self._split = False
        self._failed: set[int] = set()
        self._layer_loads: list[tuple[LoadSpec, Any, torch.Tensor, torch.Tensor]] = []
        self._layer_saves: list[SaveSource] = []  # this step's layerwise saves, between layer 0 and the last
        self._async_lock = threading.Lock()
        self._async_done: set[str] = set()
        self._io: ThreadPoolExecutor | None = None
        #: host staging memory kept between requests, one buffer per user (_buffer)
        self._staging: dict[str, torch.Tensor] = {}
        self._bridge = EventBridge(self.engine) if self.kv_events else None
        add_worker(self)  # a scheduler in this process asks it directly

    # ================================================================ lookup channel
    def serve_lookup(self, tokens: list[int], pin: bool, shifted: bool = False,
                      extra: KeyExtra | None = None, request: str | None = None) -> tuple[int, list[int]]:
        """The scheduler's lookup of ``tokens`` (request ``request``'s: the engine keeps the
        request's prompt by that name, so its loads and saves find its keys)."""
        assert self.engine is not None
        return self._lookup.lookup(tokens, pin, shifted, extra, request)

    def release_lookup(self, tokens: list[int], extra: KeyExtra | None = None, request: str | None = None) -> None:
        """Drop the leases a pinned :meth:`serve_lookup` of ``tokens`` took."""
        assert self.engine is not None
        self._lookup.release(tokens, extra, request)

    def answer_lookups(self, meta: LMCacheConnectorMetadata | None) -> LMCacheWorkerMetadata | None:
        """In-band lookups (``vllm.lookup: inband``): drop the pins of the lookups the
        scheduler released, and answer this step's questions (pinning the hits) in the
        worker metadata vLLM brings back to the scheduler. A question that fails is a miss;
        pins nobody released expire after ``lookup_pin_timeout`` (so are forgotten here)."""
        now = time.monotonic()
        for seq, rec in list(self._asked.items()):
            if now - rec[0] > self.config.lookup_pin_timeout:
                del self._asked[seq]
        if meta is None:
            return None
        for seq in meta.releases:
            rec = self._asked.pop(seq, None)
            if rec is not None and rec[2]:
                try:
                    self.release_lookup(rec[1][: rec[2]], rec[3], rec[4])
                except Exception:
                    log.exception("lmcache: releasing lookup %d failed (its pins expire on their own)", seq)
        answers: dict[int, list[LookupReply]] = {}
        for ask in meta.asks:
            try:
                n, tiers = self.serve_lookup(ask.token_ids, True, ask.shifted, ask.extra, ask.request)
            except Exception:
                log.exception("lmcache: in-band lookup failed; a miss")
                n, tiers = 0, []
            reply = LookupReply(n, bytes(tiers))
            answers[ask.seq] = [reply]
            if reply.exact(self.chunk_size):
                self._asked[ask.seq] = (now, ask.token_ids, reply.exact(self.chunk_size), ask.extra, ask.request)
        return LMCacheWorkerMetadata(answers) if answers else None

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

    # ================================================================ KV caches, loads, saves
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        views: list[torch.Tensor] = []
        layout: KVLayout | None = None
        heads = 1 if self.is_mla else self.kv_spec.num_kv_heads
        head = self.kv_spec.head_size * (2 if self.is_mla else 1)
        isa = (cpu_isa(self._vllm_config, list(kv_caches), next(iter(kv_caches.values())).dtype, self.block_size,
                       self.kv_spec.head_size) if kv_caches else None)
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
        if self.kv_spec.layout.startswith("vllmcpu_"):  # entries of whole blocks (.blocks), keyed apart
            try:
                if packed_rows(self.kv_spec.layout):  # packed kernels' rows: the kernels the tag names
                    if layout is not VLLM_BHNC or not self.kv_spec.layout.startswith(f"vllmcpu_{isa}_"):
                        raise ValueError(f"lmcache: entries {self.kv_spec.layout} need vLLM's CPU kernels they name, "
                                         f"these layers are {layout.name if layout else None} run by {isa!r}")
                elif layout is not VLLM_CPU_VEC:
                    raise ValueError(f"lmcache: whole-block entries need vLLM's CPU vec layout, these layers are "
                                     f"{layout.name if layout else None}")
                else:
                    self._block_entries = BlockEntries(list(kv_caches.values()), views, self.block_size)
            except ValueError as exc:  # never per-token entries under the whole-block signature
                log.error("%s; lmcache loads and saves nothing (vLLM computes every prompt)", exc)
                return
        self._layers, self._layout = views, layout
        log.info("lmcache: %d layers in layout %s, kv %s", len(views), layout.name if layout else None, self.kv_spec.signature)

    def _buffer(self, num_tokens: int, role: str | None = None, device: torch.device | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernels chunk buffer, the engine's (L, 2, T, H, D) view of it), on the host
        unless ``device`` is given.

        With ``role``, host memory is kept for the next call of the same role (up to
        :data:`STAGING_KEEP_BYTES`): each role has one user at a time ("load": the loads
        of a step, one after another; "io": the I/O thread's; "gather" and "save": the
        saves of a step, one after another). Fresh host memory is paid in page faults on
        every request (figures: docs/benchmarks.md#measurements-behind-the-code). Layerwise loads and saves hold several
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

    def load(self, spec: LoadSpec, role: str | None = "load") -> int:
        """Load one request into its paged blocks; the number of tokens loaded. Every load
        goes one way (:mod:`.load_sinks`): the PD pull where the request has one, the
        engine's retrieve into the sink :meth:`_sink` picks (the lookup's pins, taken for
        the scheduler, end with it), then the sink's finish into the blocks."""
        assert self.engine is not None
        if spec.pull is not None and self._pd is not None:  # PD, vLLM's flow: the prefiller's offer first
            self._pd.pull(spec)
        sink = self._sink(spec, role)
        keys = spec.keyed(self.engine)
        try:
            got = sink.fetch(keys)
        finally:
            self.engine.release(keys, extra=spec.extra)
        return sink.finish(got)

    def _sink(self, spec: LoadSpec, role: str | None) -> LoadSink:
        """Where this load's chunks go: layer by layer (``use_layerwise``, not on the I/O
        thread), whole blocks, each chunk straight into the paged blocks, or one staging
        buffer (MLA, vLLM's CPU attention layout, shifted reuse: :meth:`_per_chunk`)."""
        if self.layerwise and not spec.is_async:
            return load_sinks.Layerwise(self, spec)
        if self._block_entries is not None:
            return load_sinks.Blocks(self, spec)
        if self._per_chunk() and not spec.shifted:
            return load_sinks.Direct(self, spec)
        return load_sinks.Staged(self, spec, role)

    def _per_chunk(self) -> bool:
        """Whether loads and saves move each chunk straight between the pool and the paged
        blocks (one kernel call per chunk and layer). Not for MLA (its kernels read the
        latent halves in another order than the engine stores them), nor for vLLM's CPU
        attention layout (:data:`VLLM_CPU_VEC`, keys and values as two kernel layers): there
        each call costs more than the copy it saves, so a whole request goes through one
        kept host buffer and one bulk gather or scatter (docs/benchmarks.md, "vLLM")."""
        return not (self.is_mla or self._split)

    def _load_async(self, spec: LoadSpec) -> None:
        """One asynchronous load, on the I/O thread: failures are filed before the request
        is reported finished, so vLLM sees them no later than the finish."""
        bad: list[int] = []
        t0 = time.perf_counter()
        got = 0
        try:
            got = self.load(spec, "io")
            if got < spec.load_end:
                bad = self._bad_blocks(spec, got)
        except Exception:
            log.exception("lmcache: loading %s failed; vLLM will recompute it", spec.req_id)
            bad = self._bad_blocks(spec, 0)
        self._loaded(spec, got, t0)
        with self._async_lock:
            self._failed.update(bad)
            self._async_done.add(spec.req_id)

    def start_load_kv(self, meta: LMCacheConnectorMetadata | None) -> None:
        """Start this step's loads (``meta``: the step's connector metadata, if ours)."""
        self._layer_loads = []
        if self._bridge is not None and meta is not None:  # before the stores and loads: their tier events
            for spec in meta.loads:
                self._bridge.note(spec.exact_ids, spec.extra, spec.blocks, spec.req_id)
            for spec in meta.saves:
                self._bridge.note(spec.token_ids, spec.extra, spec.blocks, spec.req_id)
        if meta is None or not meta.loads:
            return
        for spec in meta.loads:  # an in-band lookup's pins: the load drops them
            if spec.seq is not None:
                self._asked.pop(spec.seq, None)
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
                got = self.load(spec)
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

    def save_kv_layer(self, layer_name: str, meta: LMCacheConnectorMetadata | None) -> None:
        """Layerwise: gather layer ``layer_name`` of this step's saves; store after the last."""
        if not self.layerwise:
            return
        i = self._layer_index.get(layer_name)
        if meta is None or not meta.saves or i is None or not self._layers:
            return
        if i == 0:
            self._layer_saves = [src for src in (save_sources.Layerwise(self, s) for s in self._savable(meta)) if src.begin()]
        for src in self._layer_saves:
            src.layer(i)
        if i == self.kv_spec.num_layers - 1:
            saves, self._layer_saves = self._layer_saves, []
            for src in saves:
                src.finish()

    def _savable(self, meta: LMCacheConnectorMetadata) -> list[SaveSpec]:
        return [s for s in (savable(s, self.kv_spec.layout, self.block_size) for s in meta.saves) if s is not None]

    def shifted_from(self, req_id: str) -> int | None:
        """Where a shifted load of ``req_id`` stopped loading exact KV (``None``: none did)."""
        with self._async_lock:
            return self._shifted_from.get(req_id)

    def save_source(self, spec: SaveSpec) -> SaveSource:
        """How a bulk save of ``spec`` takes its KV (:mod:`.save_sources`): straight from the
        paged blocks where a chunk is gathered per token or stored as whole blocks, else
        through the staging buffer (also every save of a request built on shifted reuse)."""
        if (self._per_chunk() or self._block_entries is not None) and self.shifted_from(spec.req_id) is None:
            return save_sources.Direct(self, spec)
        return save_sources.Staged(self, spec)

    def wait_for_save(self, meta: LMCacheConnectorMetadata | None) -> None:
        """Bulk: gather and store this step's saves (layerwise: drop a partial layer walk);
        then PD's offers and pushes of the prompts stored (.pd)."""
        try:
            self._save_all(meta)
        finally:
            if meta is not None and meta.pd and self._pd is not None:
                self._pd.send(meta.pd)

    def _save_all(self, meta: LMCacheConnectorMetadata | None) -> None:
        if meta is None or not meta.saves or not self._layers:
            return
        assert self.engine is not None
        if self.layerwise:
            saves, self._layer_saves = self._layer_saves, []
            for src in saves:  # not every layer called save_kv_layer: store nothing partial
                src.abort()
            return
        for spec in self._savable(meta):  # one after another: they share the "gather" buffer
            src = self.save_source(spec)
            if src.begin():
                src.finish()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Saves finish within the step; asynchronous loads are reported once done."""
        with self._async_lock:
            done, self._async_done = self._async_done, set()
            for req_id in finished_req_ids:
                self._shifted_from.pop(req_id, None)
        if self.engine is not None:
            for req_id in finished_req_ids:
                self.engine.forget(req_id)
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
        if self._io is not None:
            self._io.shutdown(wait=True)
        if self._pd is not None:
            self._pd.close()
        if self._block_entries is not None:
            self._block_entries.close()
        remove_worker(self)
        if self._bridge is not None:
            self._bridge.close()
        release_engine(self.engine)
