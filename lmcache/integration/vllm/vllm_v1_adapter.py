"""The class behind vLLM's built-in ``LMCacheConnectorV1``, served by lmcache's vLLM connector.

Every LMCache deployment turns LMCache on with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'

vLLM's wrapper of that name (``vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py``)
imports :class:`LMCacheConnectorV1Impl` from here, builds it as ``cls(vllm_config, role,
parent)`` and forwards the connector calls to it. It is
:class:`lmcache.plugins.connectors.vllm.LMCacheConnector` (the same connector as
``kv_connector: LMCacheConnector`` with ``kv_connector_module_path:
lmcache.plugins.connectors.vllm``) with the differences of that calling convention:

- the wrapper reports every load as synchronous (it returns ``(n, False)`` for us), so loads
  from lower tiers are synchronous here (``vllm.async_loads`` is ``never``);
- ``update_state_after_alloc`` gets no blocks: a load's blocks are the scheduled request's;
- the wrapper does not forward ``shutdown``: the engine is closed (its queued writes
  flushed) when the process exits;
- the wrapper clears only its own connector metadata: the worker drops its copy after
  ``wait_for_save``, the last call of a step.

``kv_connector_extra_config`` takes upstream's keys: ``discard_partial_chunks`` (true: a
prompt's last partial chunk is not stored, ``save_unfull_chunk: false``), ``use_layerwise``
(``vllm.layerwise``), ``skip_last_n_tokens`` (``vllm.skip_last_n_tokens``: lookups leave out a
prompt's last n tokens; an explicit ``lmcache.vllm.skip_last_n_tokens`` wins), ``lmcache.<key>``
(any config key, in either vocabulary: :mod:`lmcache.upstream`); ``use_native`` never reaches
us (vLLM then loads its own copy); ``lmcache_rpc_port`` is accepted silently (the lookup
channel is named by vLLM's engine id) and ``lmcache.max_tokens_per_load`` has no effect (a hit
is loaded whole). ``LMCACHE_FORCE_SKIP_SAVE`` (any non-empty value) and
``kv_role: kv_consumer`` store nothing, as upstream.
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from typing import TYPE_CHECKING, Any

from lmcache.plugins.connectors.vllm import LMCacheConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# every impl not yet shut down, held weakly: an impl its owner dropped (and shut down) is
# not kept alive, with its engine's memory pool, until the process ends
_OPEN: weakref.WeakSet[LMCacheConnectorV1Impl] = weakref.WeakSet()


@atexit.register
def _shutdown_open() -> None:
    for impl in list(_OPEN):
        impl.shutdown()

#: upstream's own kv_connector_extra_config keys that change nothing here, and why
NO_EFFECT = {
    "lmcache.max_tokens_per_load": "a hit is loaded whole in one step",
}
#: upstream's keys accepted without a word: the lookup channel between vLLM's scheduler and
#: workers is named by vLLM's engine id (LMCache's PD configs set "producer1", "consumer1", ...)
_QUIET = ("use_native", "lmcache_rpc_port")
_TRUE = ("1", "true", "yes", "on")


def _flag(v: Any) -> bool:
    return v if isinstance(v, bool) else str(v).strip().lower() in _TRUE


class LMCacheConnectorV1Impl(LMCacheConnector):
    """lmcache's vLLM connector, built and called by vLLM's ``LMCacheConnectorV1`` wrapper
    (see the module doc)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, parent: KVConnectorBase_V1):
        self._parent = parent
        super().__init__(vllm_config, role, getattr(parent, "_kv_cache_config", None))
        if self.async_loads != "never":
            log.info("lmcache: loads are synchronous under LMCacheConnectorV1 (vLLM's wrapper reports "
                     "every load as synchronous); kv_connector LMCacheConnector loads lower tiers asynchronously")
        sched = self.connector_scheduler
        if sched is not None:
            sched.async_loads = "never"
            if os.environ.get("LMCACHE_FORCE_SKIP_SAVE"):
                sched.saves = False
        _OPEN.add(self)  # the wrapper does not forward shutdown(): closed at exit

    def _config_overrides(self, extra: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:  # type: ignore[override]
        """Upstream's extra-config keys first (see the module doc), then ours."""
        extra = dict(extra)
        for key in _QUIET:
            extra.pop(key, None)
        for key, why in NO_EFFECT.items():
            if key in extra:
                log.warning("lmcache: kv_connector_extra_config %s=%r has no effect: %s", key, extra.pop(key), why)
        discard = _flag(extra.pop("discard_partial_chunks", False))
        layerwise = extra.pop("use_layerwise", None)
        skip = extra.pop("skip_last_n_tokens", None)
        if skip not in (None, ""):  # vllm.skip_last_n_tokens, by our connector's own mapping
            if isinstance(skip, bool) or not str(skip).strip().isdigit():
                raise ValueError(f"lmcache: kv_connector_extra_config skip_last_n_tokens must be a whole number, "
                                 f"got {skip!r}")
            extra["skip_last_n_tokens"] = int(skip)
        config_file, overrides = super()._config_overrides(extra)
        if discard:
            overrides["save_unfull_chunk"] = False
        if layerwise is not None:
            overrides["vllm"] = {"layerwise": _flag(layerwise), **overrides.get("vllm", {})}
        return config_file, overrides

    # ------------------------------------------------------------------ scheduler role
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:  # type: ignore[override]
        """The wrapper adds ``False`` (a synchronous load) itself."""
        n, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return n

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:  # type: ignore[override]
        super().update_state_after_alloc(request, None, num_external_tokens)

    # ------------------------------------------------------------------ worker role
    def wait_for_save(self) -> None:
        try:
            super().wait_for_save()
        finally:
            self.clear_connector_metadata()

    def get_kv_events(self) -> list[Any]:
        """The tiers' stores for vLLM's own KV-event stream (plugins/connectors/vllm/events.py):
        the wrapper turns each into a ``BlockStored`` and has no way to carry a removal."""
        w = self.connector_worker
        return w._bridge.take(stores_only=True) if w is not None and w._bridge is not None else []


__all__ = ["LMCacheConnectorV1Impl"]
