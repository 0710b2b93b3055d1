"""The ``valkey`` backend: the :mod:`lmcache.backends.redis` backend driven by valkey-py.

Why a separate backend at all: Valkey speaks the same protocol and the redis backend
would work against it, but a deployment that standardised on Valkey wants its own
client package (``pip install 'lmcache[valkey]'``, no redis-py) and its own URL scheme.
Everything else (key layout, pipelines, SCAN listing, timeouts, reconnect, dropping
values of a foreign type) is the redis backend's code: only the client package is
swapped.

URLs: ``valkey://[user:password@]host[:port][/db]``, ``valkeys://`` for TLS,
``valkey+cluster://h1:p1,h2:p2``, ``valkey+sentinel://h:p/master[/db]``; the ``redis``
schemes are accepted too (same server protocol). Options: as for ``redis``.
"""

from __future__ import annotations

from lmcache.backends.redis import RedisBackend


class ValkeyBackend(RedisBackend):
    CLIENT = {
        "package": "valkey",
        "client": "Valkey",
        "cluster": "ValkeyCluster",
        "error": "ValkeyError",
        "cluster_error": "ValkeyClusterException",
    }
