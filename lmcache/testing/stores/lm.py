"""A loopback ``lmcache server`` for the ``lm`` backend's tests and ``lmcache bench``.

The server runs as its own process (``lmcache server``), as in production, so
fault tests can kill it and a restart comes back empty (the server keeps nothing on
disk). It binds ``127.0.0.1`` on a free port.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

from . import LocalServer, Store, free_port


@contextlib.contextmanager
def lm_store(
    *,
    capacity: str = "1GiB",
    policy: str = "lru",
    token: str | None = None,
    max_value_size: str = "1GiB",
    max_connections: int = 256,
    **options: Any,
) -> Iterator[Store]:
    """A running server; the store's ``options`` are ``{"url": "lm://127.0.0.1:P"}``
    plus ``token`` (when set) and any other keyword arguments (backend options such as
    ``timeout`` or ``prefix``)."""
    port = free_port()
    argv = [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", str(port),
            "--capacity", capacity, "--policy", policy, "--max-value-size", max_value_size,
            "--max-connections", str(max_connections)]
    env = {"LMCACHE_SERVER_TOKEN": token} if token else {}
    server = LocalServer("lmcache-server", argv, port, env=env)
    opts: dict[str, Any] = {"url": f"lm://127.0.0.1:{port}", **options}
    if token:
        opts.setdefault("token", token)
    with server:
        server.start()
        yield Store("lm", opts, [server])
