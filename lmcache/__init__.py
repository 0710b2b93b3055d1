"""lmcache: a KV-cache layer for LLM inference.

The public API is imported lazily so that ``import lmcache`` stays cheap (the CLI and
plugin discovery do not need torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    BackendError,
    ConfigError,
    CorruptPayloadError,
    KVShapeError,
    LMCacheError,
    MemoryPoolError,
    MissingDependencyError,
    PluginError,
)
from .hookspecs import hookimpl

__version__ = "0.1.0"

_LAZY = {
    "CacheEngine": "lmcache.engine",
    "RetrieveResult": "lmcache.engine",
    "StoreResult": "lmcache.engine",
    "Config": "lmcache.config",
    "KVSpec": "lmcache.config",
    "TierConfig": "lmcache.config",
    "load_config": "lmcache.config",
    "CacheKey": "lmcache.keys",
    "TokenProcessor": "lmcache.keys",
    "MemoryPool": "lmcache.memory",
    "MemoryObj": "lmcache.memory",
    "StorageBackend": "lmcache.storage",
    "BytesBackend": "lmcache.storage",
    "BackendContext": "lmcache.storage",
    "Store": "lmcache.storage",
    "Encoded": "lmcache.encoded",
    "open_objects": "lmcache.encoded",
}

__all__ = [
    "BackendError",
    "ConfigError",
    "CorruptPayloadError",
    "KVShapeError",
    "LMCacheError",
    "MemoryPoolError",
    "MissingDependencyError",
    "PluginError",
    "connector",
    "hookimpl",
    *_LAZY,
]


def connector(name: str) -> Any:
    """The connector class registered as ``name`` (``"transformers"``, ``"vllm"``,
    ``"sglang"`` or a plugin's), through the plugin registries: a disabled one is refused,
    a missing extra names its ``pip install``."""
    from .plugin_manager import get_registries

    return get_registries().connectors.load(name)


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'lmcache' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # pragma: no cover
    from .config import Config, KVSpec, TierConfig, load_config
    from .engine import CacheEngine, RetrieveResult, StoreResult
    from .keys import CacheKey, TokenProcessor
    from .memory import MemoryObj, MemoryPool
    from .encoded import Encoded, open_objects
    from .storage import BackendContext, BytesBackend, StorageBackend, Store
