"""The services an engine runs beside its tiers: one small protocol, started in order and
closed in reverse.

A service is what the engine starts when its config asks for it: the instance API, the
peer-to-peer endpoint, the controller worker, the KV-event publisher. Each is declared
once, in :data:`SERVICES`, as a :class:`ServiceSpec`: a name, whether the config enables
it, and how to start it on an engine. A started service has ``info()`` (its part of
:meth:`lmcache.CacheEngine.stats`, or ``None`` for none) and ``close()``.

The engine keeps them in an :class:`contextlib.ExitStack`: a service that fails to start
closes every one started before it, in reverse, and :meth:`~lmcache.CacheEngine.close`
unwinds the same stack. Services that act on the data path do so through the engine's
hook lists, not through fields the engine tests for: ``engine.miss_fillers`` (a peer
fetch before a lookup gives up), ``engine.store_observers`` (a chunk key's token ids for
KV events) and the hierarchy's listeners (:meth:`StorageHierarchy.add_listener`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .config import Config
    from .engine import CacheEngine


@runtime_checkable
class Service(Protocol):
    def info(self) -> dict[str, Any] | None:
        """This service's counters for ``CacheEngine.stats()[name]`` (``None``: none)."""

    def close(self) -> None:
        """Stop serving and release what it holds; called once, in reverse start order."""


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    enabled: Callable[[Config], bool]
    start: Callable[[CacheEngine], Service]


def _api(engine: CacheEngine) -> Service:
    from .api import ApiServer

    return ApiServer(engine.admin, engine.config.api)


def _p2p(engine: CacheEngine) -> Service:
    from .p2p import P2P

    p2p = P2P(engine, engine.config.p2p)
    if p2p.fetching:
        engine.miss_fillers.append(p2p.fill)
    return p2p


def _controller(engine: CacheEngine) -> Service:
    from .controller.worker import ControllerWorker

    return ControllerWorker(engine, engine.config.controller)


class _KVEvents:
    """The KV-event publisher (:mod:`lmcache.events`) as a service: it hears the tiers'
    admits and evictions and the token ids of each stored chunk, and closes after the
    hierarchy's queued writes are done (their admits are events too)."""

    def __init__(self, engine: CacheEngine):
        from .events import KVEventPublisher

        cfg = engine.config
        self.publisher = KVEventPublisher(cfg.kv_events, namespace=cfg.namespace, model=cfg.model)
        self._hierarchy = engine.hierarchy
        if self.publisher.enabled:
            engine.hierarchy.add_listener(self.publisher.on_tier_event)
            engine.store_observers.append(self.publisher.remember)

    def info(self) -> dict[str, Any]:
        return self.publisher.stats()

    def close(self) -> None:
        self._hierarchy.flush()
        self.publisher.close()


#: the built-in services, in start order (the P2P endpoint before the controller worker,
#: which registers its address; closing runs backwards)
SERVICES: list[ServiceSpec] = [
    ServiceSpec("api", lambda c: c.api.enabled, _api),
    ServiceSpec("p2p", lambda c: c.p2p.enabled, _p2p),
    ServiceSpec("controller", lambda c: bool(c.controller.url), _controller),
    ServiceSpec("kv_events", lambda c: c.kv_events.enabled, _KVEvents),
]
