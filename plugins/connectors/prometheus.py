"""LMCache's Prometheus metrics, under upstream LMCache's names, in the engine's own ``/metrics``.

Deployments of upstream LMCache chart ``lmcache:num_hit_tokens_total``,
``lmcache:local_cache_usage``, ``lmcache:retrieve_speed_sum`` and their kin, scraped from
``vllm serve``'s ``/metrics``, with ``PROMETHEUS_MULTIPROC_DIR`` set on the container (the
production stack's Helm chart sets ``/tmp``, llm-d ``/tmp/lmcache_prometheus``): then vLLM's
API server serves ``/metrics`` from that Prometheus multiprocess directory, where every
process of the server (the engine core with the scheduler, the workers) writes the metrics
it creates with ``prometheus_client``. So do these, created once per process, with
upstream's labels (``model_name``, ``worker_id``, ``role``,
``served_model_name``) and, for the gauges, upstream's multiprocess modes.

The connector reports what it did: :meth:`Metrics.lookup` (scheduler role: one lookup of
a prompt), :meth:`Metrics.retrieve` (worker role: one load into vLLM's blocks),
:meth:`Metrics.store` (worker role: one save), :meth:`Metrics.usage` (the tiers' bytes).
``num_hit_tokens`` counts the tokens a worker loaded into vLLM's blocks, so with one
worker it equals vLLM's own ``vllm:external_prefix_cache_hits``. lmcache's own names
(``lmcache_tier_*``) stay on the instance API. ``prometheus_client`` is vLLM's
dependency, imported only here; without it every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)

_TIME_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
_SPEED_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
_LOOKUP_BUCKETS = [0.00001 * 2**i for i in range(20)]

# name (without the lmcache: prefix) -> help text; counters gain _total when exposed
_COUNTERS = {
    "num_retrieve_requests": "Number of retrieve requests sent to lmcache",
    "num_store_requests": "Number of store requests sent to lmcache",
    "num_lookup_requests": "Number of lookup requests sent to lmcache",
    "num_requested_tokens": "Number of tokens requested from lmcache (retrieves)",
    "num_hit_tokens": "Number of tokens lmcache loaded into the engine",
    "num_stored_tokens": "Number of tokens stored in lmcache",
    "num_lookup_tokens": "Number of tokens in lookups",
    "num_lookup_hits": "Number of tokens hit in lookups",
    "num_vllm_hit_tokens": "Number of tokens in vLLM's own prefix cache at lookup",
    "num_prompt_tokens": "Number of prompt tokens looked up",
    "lookup_0_hit_requests": "Number of lookups that hit nothing",
}
# name -> (help, multiprocess mode)
_GAUGES = {
    "retrieve_hit_rate": ("Hit rate of retrieves: hit tokens / requested tokens", "livemostrecent"),
    "lookup_hit_rate": ("Hit rate of lookups: hit tokens / looked-up tokens", "livemostrecent"),
    "local_cache_usage": ("Bytes held by the CPU tiers", "sum"),
    "local_storage_usage": ("Bytes held by the local disk tiers", "sum"),
    "remote_cache_usage": ("Bytes counted in the remote tiers", "sum"),
}
_HISTOGRAMS = {
    "time_to_retrieve": ("Time to retrieve from lmcache (seconds)", _TIME_BUCKETS),
    "time_to_store": ("Time to store in lmcache (seconds)", _TIME_BUCKETS),
    "time_to_lookup": ("Time to look up in lmcache (seconds)", _LOOKUP_BUCKETS),
    "retrieve_speed": ("Retrieve speed of lmcache (tokens per second)", _SPEED_BUCKETS),
    "store_speed": ("Store speed of lmcache (tokens per second)", _SPEED_BUCKETS),
}
LABELS = ("model_name", "worker_id", "role", "served_model_name")
LOCAL_BACKENDS = {"cpu": "local_cache_usage", "disk": "local_storage_usage", "gds": "local_storage_usage"}

_FAMILIES: dict[str, Any] | None = None
_LOCK = threading.Lock()


def _families() -> dict[str, Any] | None:
    """The metric families of this process, created on first use (``None`` without
    prometheus_client). Created once: a second registration of a name would raise."""
    global _FAMILIES
    with _LOCK:
        if _FAMILIES is not None:
            return _FAMILIES or None
        try:
            import prometheus_client as pc
        except ImportError:
            _FAMILIES = {}
            return None
        fam: dict[str, Any] = {}
        try:
            if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # prometheus_client needs it to exist
                os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)
            for name, doc in _COUNTERS.items():
                fam[name] = pc.Counter(f"lmcache:{name}", doc, LABELS)
            for name, (doc, mode) in _GAUGES.items():
                fam[name] = pc.Gauge(f"lmcache:{name}", doc, LABELS, multiprocess_mode=mode)
            for name, (doc, buckets) in _HISTOGRAMS.items():
                fam[name] = pc.Histogram(f"lmcache:{name}", doc, LABELS, buckets=buckets)
        except (ValueError, OSError) as exc:  # names taken by another library; an unusable directory
            log.warning("lmcache: upstream-named Prometheus metrics are off in this process: %s", exc)
            fam = {}
        _FAMILIES = fam
        return fam or None


class Metrics:
    """One connector's view of the metrics, with its label values. Thread-safe: the
    worker's I/O thread reports loads too."""

    def __init__(self, *, model_name: str, worker_id: int | str, role: str, served_model_name: str = ""):
        fam = _families()
        labels = {"model_name": model_name, "worker_id": str(worker_id), "role": role,
                  "served_model_name": served_model_name}
        self._m = {name: f.labels(**labels) for name, f in fam.items()} if fam else {}
        self._lock = threading.Lock()
        self._requested = self._hit = self._looked_up = self._lookup_hits = 0
        if self._m:
            log.info("lmcache: Prometheus metrics in LMCache's names (lmcache:*), multiprocess dir %s",
                     os.environ.get("PROMETHEUS_MULTIPROC_DIR", "(none: this process's registry)"))

    @property
    def enabled(self) -> bool:
        return bool(self._m)

    def lookup(self, prompt_tokens: int, hit_tokens: int, engine_cached: int, seconds: float) -> None:
        """One lookup answered: the prompt's length, the tokens lmcache holds of it, those
        already in vLLM's own prefix cache, and how long the answer took."""
        if not self._m:
            return
        m = self._m
        m["num_lookup_requests"].inc()
        m["num_lookup_tokens"].inc(prompt_tokens)
        m["num_prompt_tokens"].inc(prompt_tokens)
        m["num_lookup_hits"].inc(hit_tokens)
        m["num_vllm_hit_tokens"].inc(engine_cached)
        if hit_tokens == 0:
            m["lookup_0_hit_requests"].inc()
        m["time_to_lookup"].observe(seconds)
        with self._lock:
            self._looked_up += prompt_tokens
            self._lookup_hits += hit_tokens
            rate = self._lookup_hits / self._looked_up if self._looked_up else 0.0
        m["lookup_hit_rate"].set(rate)

    def retrieve(self, requested: int, hit: int, seconds: float) -> None:
        """One load: tokens promised to vLLM, tokens actually loaded, its duration."""
        if not self._m:
            return
        m = self._m
        m["num_retrieve_requests"].inc()
        m["num_requested_tokens"].inc(requested)
        m["num_hit_tokens"].inc(hit)
        m["time_to_retrieve"].observe(seconds)
        if seconds > 0 and hit:
            m["retrieve_speed"].observe(hit / seconds)
        with self._lock:
            self._requested += requested
            self._hit += hit
            rate = self._hit / self._requested if self._requested else 0.0
        m["retrieve_hit_rate"].set(rate)

    def store(self, tokens: int, seconds: float) -> None:
        """One save: the tokens newly stored and its duration."""
        if not self._m:
            return
        m = self._m
        m["num_store_requests"].inc()
        m["num_stored_tokens"].inc(tokens)
        m["time_to_store"].observe(seconds)
        if seconds > 0 and tokens:
            m["store_speed"].observe(tokens / seconds)

    def usage(self, tiers: list[Any]) -> None:
        """Bytes used per kind of tier: CPU tiers are ``local_cache_usage``, disk and GDS
        ``local_storage_usage``, the rest ``remote_cache_usage``."""
        if not self._m:
            return
        total = dict.fromkeys(("local_cache_usage", "local_storage_usage", "remote_cache_usage"), 0)
        for t in tiers:
            total[LOCAL_BACKENDS.get(t.cfg.backend, "remote_cache_usage")] += t.used
        for name, v in total.items():
            self._m[name].set(v)


__all__ = ["LABELS", "Metrics"]
