"""The controller: a global index of which instance holds which chunks, for KV-aware
routers, and a dispatcher of admin commands to instances.

- :mod:`lmcache.controller.service`: the HTTP service (``lmcache controller serve``);
- :mod:`lmcache.controller.worker`: the worker inside each cache engine that registers,
  heartbeats and reports admit/evict events (started when the config has
  ``controller: {url: ...}``);
- :mod:`lmcache.controller.client`: the HTTP client the CLI and the worker use.

Nothing here is imported by ``import lmcache``; the service needs no torch.
"""

from __future__ import annotations

__all__: list[str] = []
