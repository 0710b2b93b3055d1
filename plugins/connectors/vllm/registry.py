"""What one process shares between the connector's instances: the cache engines (the
workers of a process with the same config and KV spec share one, closed with the last)
and the worker sides by (vLLM instance, DP rank), which a scheduler in the same process
asks directly instead of over a socket or in-band."""

from __future__ import annotations

import threading
from typing import Any, Protocol

from lmcache.config import KVSpec
from lmcache.engine import CacheEngine


class LocalWorker(Protocol):
    """What a scheduler in the same process asks of a worker side (the connector's
    ``LocalWorker``, which imports this module, not the other way round)."""

    instance: str
    dp_rank: int
    tp_rank: int
    engine: Any
    _closed: bool

    def serve_lookup(self, tokens: list[int], pin: bool, shifted: bool = False,
                     extra: Any = None, request: str | None = None) -> tuple[int, list[int]]: ...

    def release_lookup(self, tokens: list[int], extra: Any = None, request: str | None = None) -> None: ...

__all__ = ["LocalWorker", "acquire_engine", "add_worker", "local_workers", "release_engine", "remove_worker"]

#: (config file, overrides, KV spec) -> [engine, users]
_ENGINES: dict[tuple, list] = {}
_ENGINES_LOCK = threading.Lock()


def acquire_engine(config_file: str | None, overrides: dict[str, Any], kv_spec: KVSpec) -> CacheEngine:
    """The process's engine for this config and KV spec, made on first use."""
    key = (config_file, tuple(sorted((k, repr(v)) for k, v in overrides.items())), kv_spec)
    with _ENGINES_LOCK:
        entry = _ENGINES.get(key)
        if entry is None or entry[0]._closed:
            engine = CacheEngine.from_config(config_file, kv_spec=kv_spec, **overrides)
            entry = _ENGINES[key] = [engine, 0]
        entry[1] += 1
        return entry[0]


def release_engine(engine: CacheEngine) -> None:
    """One user fewer; the last one closes the engine."""
    with _ENGINES_LOCK:
        for key, entry in list(_ENGINES.items()):
            if entry[0] is engine:
                entry[1] -= 1
                if entry[1] <= 0:
                    del _ENGINES[key]
                    engine.close()
                return


#: worker sides of this process by (vLLM instance, DP rank) -> {TP rank: worker}
_LOCAL_WORKERS: dict[tuple[str, int], dict[int, LocalWorker]] = {}
_LOCAL_LOCK = threading.Lock()


def add_worker(worker: LocalWorker) -> None:
    with _LOCAL_LOCK:
        _LOCAL_WORKERS.setdefault((worker.instance, worker.dp_rank), {})[worker.tp_rank] = worker


def remove_worker(worker: LocalWorker) -> None:
    with _LOCAL_LOCK:
        ws = _LOCAL_WORKERS.get((worker.instance, worker.dp_rank))
        if ws is not None and ws.get(worker.tp_rank) is worker:
            del ws[worker.tp_rank]


def local_workers(instance: str, dp_rank: int, tp_size: int) -> list[LocalWorker] | None:
    """The worker sides of ``(instance, dp_rank)``, by TP rank, if all of them live in this
    process (and are open), else ``None``: a scheduler in this process asks them directly."""
    with _LOCAL_LOCK:
        ws = _LOCAL_WORKERS.get((instance, dp_rank)) or {}
        live = {r: w for r, w in ws.items() if not w._closed}
    if len(live) == tp_size and all(r in live for r in range(tp_size)):
        return [live[r] for r in range(tp_size)]
    return None
