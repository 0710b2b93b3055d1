"""The servers: the processes an operator runs beside the engines, and the HTTP layer
they share.

- :mod:`lmcache.server.cache`: the cache server (``lmcache server``), the store behind
  the ``lm`` backend (:mod:`~lmcache.server.cache_store` the store it serves,
  :mod:`~lmcache.server.cache_slots` its connection slots);
- :mod:`lmcache.server.controller`: the controller (``lmcache controller serve``), a
  global index of which instance holds which chunks for KV-aware routers and a dispatcher
  of admin commands (:mod:`~lmcache.server.index` what its two indexes share,
  :mod:`~lmcache.server.index_memory` and :mod:`~lmcache.server.index_valkey` the
  indexes, :mod:`~lmcache.server.limits` the bounds on what a worker registers,
  :mod:`~lmcache.server.reach` which instances it may call and how);
- :mod:`lmcache.server.http`: the bounded JSON HTTP layer (connections, request time,
  the Host and Origin guard, HTTP statuses) under the controller and the instance API.

This room needs no engine: it imports from the core only the shared vocabulary (errors,
auth, keys, the wire frames, the operator page, the instance API's client) and never
torch. The engine reaches it through three faces only: the instance API serves over
:mod:`~lmcache.server.http`, the P2P endpoint embeds :class:`~lmcache.server.cache.CacheServer`,
and the controller worker reports the tier fields :mod:`~lmcache.server.limits` names
(``tests/test_layout.py`` holds both rules). The engine-side parts of the controller, its
worker and client, are engine services: :mod:`lmcache.plugins.services.controller` and
:mod:`lmcache.plugins.services.controller_client`.

Nothing here is imported by ``import lmcache``.
"""

from __future__ import annotations

__all__: list[str] = []
