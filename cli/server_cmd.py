"""``lmcache server``: run a cache server (the ``lm://`` backend's store, and the P2P
transfer endpoint) until SIGTERM or SIGINT.

It prints ``LISTENING host:port`` on stdout once it accepts connections (with
``--port 0``, the port it picked), so scripts and tests start it and read one line.
"""

from __future__ import annotations

from typing import Annotated

import typer

from lmcache.server import cache as lmserver
from lmcache import wire

from ._util import CLIError, size_option


def server_cmd(
    host: Annotated[str, typer.Option("--host", help="Address to bind (loopback unless you mean it).")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="TCP port; 0 picks a free one (printed).")
    ] = wire.DEFAULT_PORT,
    capacity: Annotated[str, typer.Option("--capacity", help="Bytes the server stores before it evicts.")] = "4GiB",
    policy: Annotated[str, typer.Option("--policy", help="Eviction policy (lru, lfu, fifo, or a plugin's).")] = "lru",
    token: Annotated[
        str | None,
        typer.Option("--token", envvar="LMCACHE_SERVER_TOKEN", show_envvar=False, show_default=False,
                     help="Clients must prove they know this token before anything else (a mutual HMAC handshake; "
                          "default: $LMCACHE_SERVER_TOKEN; none: no check)."),
    ] = None,
    max_value_size: Annotated[
        str, typer.Option("--max-value-size", help="Largest value (and frame) accepted; larger ones close the connection.")
    ] = "1GiB",
    max_connections: Annotated[
        int, typer.Option("--max-connections", min=1,
                          help="Connections served at once; one more closes the one idle the longest.")
    ] = lmserver.DEFAULT_MAX_CONNECTIONS,
    auth_timeout: Annotated[
        float, typer.Option("--auth-timeout", min=0.001,
                            help="Seconds a new connection has to authenticate (without --token: to send a whole frame).")
    ] = lmserver.DEFAULT_AUTH_TIMEOUT,
    max_unauthenticated: Annotated[
        int, typer.Option("--max-unauthenticated", min=1,
                          help="Connections not yet authenticated at once; one more closes the oldest stuck one "
                               "(from the address with the most).")
    ] = lmserver.DEFAULT_MAX_UNAUTHENTICATED,
) -> None:
    """Run an lmcache cache server (framed binary protocol over TCP) until SIGTERM/SIGINT."""
    cap = size_option(capacity, "--capacity", auto=False)
    maxv = size_option(max_value_size, "--max-value-size", auto=False)
    assert cap is not None and maxv is not None
    from lmcache.plugin_manager import get_registries

    if policy not in get_registries().policies:
        known = ", ".join(get_registries().policies.names())
        raise CLIError(f"unknown eviction policy {policy!r}; known: {known}")
    try:
        lmserver.run(host, port, capacity=cap, policy=policy, token=token or None, max_value_size=maxv,
                     max_connections=max_connections, announce=lambda s: print(s, flush=True),
                     auth_timeout=auth_timeout, max_unauthenticated=max_unauthenticated)
    except OSError as exc:
        raise CLIError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
