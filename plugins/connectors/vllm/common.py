"""What the scheduler side and the worker side of the vLLM connector share: :class:`Side`,
the base of :class:`~.scheduler.ConnectorScheduler` and :class:`~.worker.ConnectorWorker`,
holds what both know of their vLLM instance (its name on the lookup channel, its ranks, the
KV cache's shape) and the options both read from the lmcache config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcache.config import Config

from ..prometheus import Metrics
from .layout import kv_spec_of, shifted_freqs

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def lookup_mode(vllm_config: VllmConfig, option: str) -> str:
    """``socket`` or ``inband``: how the scheduler asks the workers' tiers (``vllm.lookup``).
    ``auto`` is ``inband`` when the workers may run on another host (``nnodes > 1``, or the
    ``ray`` executor, which places them where it likes), else ``socket`` (docs/architecture.md,
    "Cache hits across hosts"). The scheduler and every worker decide alike from the same
    config."""
    if option != "auto":
        return option
    pc = vllm_config.parallel_config
    multi = int(getattr(pc, "nnodes", 1) or 1) > 1 or getattr(pc, "distributed_executor_backend", None) == "ray"
    return "inband" if multi else "socket"


class Side:
    """One role's half of the connector (one object per connector instance: the scheduler
    role builds only its scheduler side, a worker only its worker side)."""

    #: upstream LMCache's ``role`` label of this side's metrics
    role = ""

    def __init__(self, vllm_config: VllmConfig, kv_transfer_config: Any, kv_cache_config: KVCacheConfig | None,
                 tp_rank: int) -> None:
        self._vllm_config = vllm_config
        self._kv_transfer_config = kv_transfer_config
        pc = vllm_config.parallel_config
        self.tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        self.dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
        #: names this vLLM instance on the lookup channel (the same in the scheduler and its workers)
        self.instance = str(getattr(kv_transfer_config, "engine_id", None) or "default")
        self.tp_rank = tp_rank
        self.kv_spec, self.is_mla, self.block_size = kv_spec_of(vllm_config, kv_cache_config, tp_rank)
        self._closed = False
        # lmcache's tiers in vLLM's own KV-event stream (.events), when vLLM publishes one
        kec = getattr(vllm_config, "kv_events_config", None)
        self.kv_events = bool(kec is not None and getattr(kec, "enable_kv_cache_events", False))

    def _configure(self, config: Config) -> None:
        """Read the options both sides use from ``config`` (once the side has its config)."""
        self.config = config
        self.layerwise = config.vllm.layerwise
        self.chunk_size = config.chunk_size
        self.lookup_mode = lookup_mode(self._vllm_config, config.vllm.lookup)
        #: rotary frequencies when shifted reuse is on (docs/truncation.md, "vLLM"), else None
        self._inv_freq: torch.Tensor | None = None
        if config.approximate_reuse.enabled:
            self._inv_freq = shifted_freqs(self._vllm_config, layerwise=self.layerwise, is_mla=self.is_mla,
                                           block_size=self.block_size, head_size=self.kv_spec.head_size,
                                           warn=self.role == "scheduler")
        self.shifted = self._inv_freq is not None
        mc = self._vllm_config.model_config
        served = getattr(mc, "served_model_name", None)
        #: upstream LMCache's Prometheus metrics, in vLLM's /metrics (plugins/connectors/prometheus.py)
        self.metrics = Metrics(model_name=str(getattr(mc, "model", "")), worker_id=self.tp_rank, role=self.role,
                               served_model_name=str(served[0] if isinstance(served, (list, tuple)) and served else served or ""))


def usable_tokens(found: int, num_tokens: int, block_size: int, exact: int | None = None) -> int:
    """How many of a request's ``num_tokens`` a hit of ``found`` tokens lets vLLM skip.
    vLLM computes at least the last token: where that cap is what limits the hit, it is
    rounded down to a whole block (the block holding the last token is computed), and so
    is a hit that shifted reuse extends past its ``exact`` part. An exact hit that ends
    before the cap is taken to its last token, also inside a block: vLLM accepts a partial
    last block, and only layouts that load per token store a partial block, so a hit ends
    inside a block only where it can be loaded so. A PD decoder's prompt is the prompt plus
    the prefiller's first token: it computes that one token, not the rest of the prompt's
    last block."""
    cap = num_tokens - 1
    if found <= cap and (exact is None or found <= exact):
        return found
    return min(found, cap) // block_size * block_size
