"""Hook specifications of lmcache: the whole plugin contract in one place.

Every hook is prefixed ``lmcache_``, typed and empty; its docstring is the contract.
Plugins implement hooks with ``@lmcache.hookimpl`` and are found through the entry-point
group ``lmcache``. Built-in plugins use these very hooks.
"""

from __future__ import annotations

from typing import Protocol

import pluggy


class Registry(Protocol):
    """What a registration hook gets: one plugin kind's names (the implementation is
    :class:`lmcache.plugin_manager.Registry`, which imports this module, not the other
    way round)."""

    def add(self, name: str, target: str | type, *, extra: str | None = None, requires: str | None = None,
            description: str = "") -> None:
        """Register ``target`` (``"module:Class"`` or a class) as ``name``; ``requires``
        (a pip requirement) or ``extra`` (a package extra) say how to install what an
        import of it misses."""


PROJECT = "lmcache"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def lmcache_register_backends(registry: Registry) -> None:
    """Register storage backends.

    Called once per plugin manager, when the backend registry is first needed, as
    ``hook(registry=...)``: the argument must be named ``registry``. Call
    ``registry.add(name, "package.module:Class", requires=None, extra=None, description="")``
    once per backend. The class is imported only when a tier uses it; if that import
    fails, the error suggests ``pip install '<requires>'`` (a pip requirement) or
    ``pip install '<your package>[<extra>]'``.
    A backend class is built as ``Class(context)`` with a
    :class:`lmcache.storage.BackendContext` and implements the contract of
    :class:`lmcache.storage.StorageBackend`. Names are unique across all plugins: a second
    plugin adding the same name is an error naming both plugins. Returns nothing.
    """


@hookspec
def lmcache_register_codecs(registry: Registry) -> None:
    """Register payload codecs.

    Called once per plugin manager. ``registry.add(name, "module:Class")``; the class is
    built as ``Class(**options)`` and implements :class:`lmcache.codecs.Codec`
    (``encode(data) -> bytes``, ``decode(data, nbytes) -> bytes``, and optionally
    ``encode_tensor(t)``/``decode_tensor(data, shape, dtype)`` for codecs that need the
    dtype and shape). The name is what a tier's ``codec:`` key and the payload header name;
    it may not contain ``+``, which joins the names of a chain (``int8+zstd``). Returns nothing.
    """


@hookspec
def lmcache_register_connectors(registry: Registry) -> None:
    """Register engine connectors (vLLM, SGLang, transformers, ...).

    Called once per plugin manager. ``registry.add(name, "module:Class", extra=...)``;
    the class adapts one inference engine to :class:`lmcache.CacheEngine`. Returns
    nothing.
    """


@hookspec
def lmcache_register_policies(registry: Registry) -> None:
    """Register eviction policies.

    Called once per plugin manager. ``registry.add(name, "module:Class")``; the class is
    built with the tier's ``policy_options`` as keyword arguments (plus ``capacity=``, the
    tier's bytes, if its ``__init__`` takes it) and implements
    :class:`lmcache.policies.EvictionPolicy`: it records accesses and proposes victims
    (each victim is evicted and followed by ``on_remove``), while the core accounts bytes
    and skips pinned entries. Returns nothing.
    """


@hookspec
def lmcache_register_layouts(registry: Registry) -> None:
    """Register KV memory layouts (how an engine lays out its paged KV cache).

    Called once per plugin manager. ``registry.add(name, "module:LAYOUT")`` where the
    target is a :class:`lmcache.kernels.KVLayout` instance whose ``name`` is ``name``;
    :func:`lmcache.kernels.get_layout` finds it by that name, and the gather/scatter
    kernels then move KV between that layout and chunk buffers. Names are unique across
    all plugins. Returns nothing.
    """


@hookspec
def lmcache_register_services(registry: Registry) -> None:
    """Register engine services (what an engine runs beside its tiers: an API, an endpoint,
    a publisher).

    Called once per plugin manager. ``registry.add(name, "module:Class")``; the class has
    ``enabled(config) -> bool`` (a static or class method: does this config ask for the
    service?) and is started by each engine whose config enables it as ``Class(view)``
    with a :class:`lmcache.services.EngineView`, in registration order; the object has
    ``info() -> dict | None`` (its part of ``CacheEngine.stats()``) and ``close()``, called
    in reverse start order (see :mod:`lmcache.services`). Returns nothing.
    """


@hookspec
def lmcache_register_channels(registry: Registry) -> None:
    """Register transfer channels (how prefill->decode moves a request's KV chunks between
    two instances' memory pools; config ``transfer_channel`` names one).

    Called once per plugin manager. ``registry.add(name, "module:Class", requires=...)``;
    the class implements :class:`lmcache.transfer.Channel` and is built as
    ``Class(endpoint)`` with the :class:`lmcache.transfer.ChannelEndpoint` that owns the
    pool, the receive buffer and the control connections; it only moves bytes (``write``,
    ``read`` and their serving halves, ``describe``, ``progress``). A package it imports
    lazily that is missing is one line naming ``requires``. Names are unique across all
    plugins. Returns nothing.
    """


@hookspec
def lmcache_register_bench_baselines(registry: Registry) -> None:
    """Register raw-client baselines for ``lmcache bench tiers --backend NAME``.

    Called once per plugin manager. ``registry.add(name, "module:function")`` where
    ``name`` is the backend's registered name and the function is
    ``baseline(options, items, batch) -> (put_seconds, get_seconds)``: with the store's own
    client, in the plainest fast way, store ``items`` (a sequence of ``(name, bytes)``)
    ``batch`` at a time, read them all back, delete them, and return the two wall times.
    ``options`` are the tier's backend keys. The benchmark reports the backend's own batch
    put/get against it; a backend without a baseline cannot be benchmarked that way. Not
    part of the backend contract: the engine never calls it. Names are unique across all
    plugins. Returns nothing.
    """


@hookspec
def lmcache_register_store_launchers(registry: Registry) -> None:
    """Register loopback store launchers: how to start a backend's own server on this
    machine, for tests (``lmcache.testing.stores.start(name)``, the ``lmcache_store``
    fixture of lmcache's pytest plugin) and for ``lmcache bench tiers --backend NAME``.

    Called once per plugin manager. ``registry.add(name, "module:function")`` where
    ``name`` is the backend's registered name (or a variant such as ``redis-cluster``) and
    the function is a context-manager factory ``function(**kwargs)`` that starts the
    server(s) on ``127.0.0.1`` (see :class:`lmcache.testing.stores.LocalServer`), yields a
    running :class:`lmcache.testing.stores.Store` whose ``options`` are the backend options
    that reach it, and stops everything on exit. A missing server binary raises
    :class:`lmcache.testing.stores.ServerUnavailable` with a message saying what to install.
    The target is imported only when that store is started. Not part of the backend
    contract: the engine never calls it. Names are unique across all plugins. Returns nothing.
    """
