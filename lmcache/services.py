"""The services an engine runs beside its tiers: a plugin type, one small protocol, started
in order and closed in reverse.

A service is what the engine starts when its config asks for it: the instance API, the
peer-to-peer endpoint, the controller worker, the KV-event publisher, the lookup channel
of another process's scheduler (the built-ins, in
:mod:`lmcache.plugins.services`). Services are plugins like backends and codecs: a plugin
registers each through ``lmcache_register_services(registry)`` as a class with
``enabled(config) -> bool``; the engine starts the enabled ones in registration order as
``Class(view)``, where ``view`` is an :class:`EngineView`, the narrow part of the engine a
service may use. A started service has ``info()`` (its part of
:meth:`lmcache.CacheEngine.stats`, or ``None`` for none) and ``close()``.

The engine keeps them in an :class:`contextlib.ExitStack`: a service that fails to start
closes every one started before it, in reverse, and :meth:`~lmcache.CacheEngine.close`
unwinds the same stack. Services that act on the data path do so through hook lists, not
through fields the engine tests for: miss fillers (a peer fetch before a lookup gives up),
store observers (a chunk key's token ids for KV events) and the hierarchy's listeners.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .chunks import ChunkGateway
    from .config import Config, KVSpec
    from .hierarchy import StorageHierarchy
    from .keys import Chunk, KeyExtra


@runtime_checkable
class Service(Protocol):
    def info(self) -> dict[str, Any] | None:
        """This service's counters for ``CacheEngine.stats()[name]`` (``None``: none)."""

    def close(self) -> None:
        """Stop serving and release what it holds; called once, in reverse start order."""


class EngineView:
    """What a service sees of its engine: the config, the hierarchy, the clock, the
    instance id, the KV spec (it may arrive with the first store), the admin operations,
    lookups with leases, the other services, the hook lists of the data path, and
    :attr:`chunks`, the one way chunks go into and out of the tiers. Not the
    engine itself: a service cannot store, retrieve or close it, so the engine's
    invariants stay its own."""

    __slots__ = ("_chunks", "_engine", "clock", "config", "hierarchy", "instance_id")

    def __init__(self, engine: Any):  # the lmcache.CacheEngine it views (which imports this module)
        self._engine = engine
        self.config: Config = engine.config
        self.hierarchy: StorageHierarchy = engine.hierarchy
        self.clock: Callable[[], float] = engine.clock
        self.instance_id: str = engine.instance_id
        self._chunks: ChunkGateway | None = None

    @property
    def chunks(self) -> ChunkGateway:
        """:class:`lmcache.chunks.ChunkGateway` on this engine: chunks in and out of its
        tiers with its one shape check, its store observers and the references released."""
        if self._chunks is None:
            from .chunks import ChunkGateway

            self._chunks = ChunkGateway.of(self._engine)
        return self._chunks

    @property
    def kv_spec(self) -> KVSpec | None:
        return self._engine.kv_spec

    @property
    def admin(self) -> Any:
        """:class:`lmcache.admin.Admin` on this engine (what the instance API serves)."""
        return self._engine.admin

    def service(self, name: str) -> Any | None:
        """A service started before this one, by its registered name, or ``None``."""
        return self._engine.services.get(name)

    def chunk_keys(self, tokens: Any, extra: KeyExtra | None = None) -> tuple[list[Chunk], list[str]]:
        return self._engine.chunk_keys(tokens, extra)

    def prompt(self, tokens: Any, extra: KeyExtra | None = None, request: str | None = None) -> Any:
        """:meth:`lmcache.CacheEngine.prompt`: the tokens with their chunk keys (found by
        ``request`` where given)."""
        return self._engine.prompt(tokens, extra, request)

    def locate(self, tokens: Any, *, pin: bool = False, extra: KeyExtra | None = None) -> tuple[int, list[str]]:
        """:meth:`lmcache.CacheEngine.locate`: the cached prefix and each chunk's tier."""
        return self._engine.locate(tokens, pin=pin, extra=extra)

    def release(self, tokens: Any, *, extra: KeyExtra | None = None) -> None:
        """:meth:`lmcache.CacheEngine.release`: drop the leases a pinned locate took."""
        self._engine.release(tokens, extra=extra)

    def add_miss_filler(self, filler: Callable[[list[Chunk], list[str], int], int]) -> None:
        """``filler(chunks, keys, have) -> fetched`` is asked when a lookup or retrieve
        misses after ``have`` chunks: it may bring the missing chunks into the tiers."""
        self._engine.miss_fillers.append(filler)

    def add_store_observer(self, observer: Callable[[Any, list[Chunk], list[str]], None]) -> None:
        """``observer(tokens, chunks, keys)`` is told before chunks are stored or promoted
        (never of chunks keyed with a :class:`~lmcache.keys.KeyExtra`)."""
        self._engine.store_observers.append(observer)


def start_services(engine: Any, registry: Any, stack: Any) -> None:
    """Start the enabled services of ``registry`` into ``engine.services``, in
    registration order, each closed by ``stack`` (so in reverse). ``engine``: the
    :class:`lmcache.CacheEngine` starting them."""
    view = EngineView(engine)
    for entry in registry.in_order():
        cls = registry.load(entry.name)
        if cls.enabled(engine.config):
            svc = cls(view)
            stack.callback(svc.close)
            engine.services[entry.name] = svc  # visible to the services started after it


__all__ = ["EngineView", "Service", "start_services"]
