"""``health_probe.py HOST PORT``: the cache server's liveness probe, under the path and
arguments that LMCache's deployments use.

The vLLM production stack's Helm chart and operator run the cache server as
``/opt/venv/bin/lmcache_server 0.0.0.0 <port>``, probe it with
``/opt/venv/bin/python3 /workspace/LMCache/examples/kubernetes/health_probe.py 127.0.0.1 <port>``
(timeout 5 s, period 10 s, 3 failures) and hold the vLLM pods in an init container that
runs the same script against the cache-server Service until it succeeds. Our image puts
a script at that path that calls :func:`main`: it asks our server for HEALTH over
lmcache's framed protocol (:mod:`lmcache.wire`) and exits 0 only when the answer says
``ok`` within the timeout; anything else (refused, silent, stopped, another protocol, a
wrong token) is one line on stderr and exit 1. It imports no tensor library, so a probe
costs milliseconds, not the second that importing torch takes.

With ``lmcache_server ... --token`` the probe proves the token from
``$LMCACHE_SERVER_TOKEN`` (the variable the server takes it from), never sending it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Sequence

USAGE = "usage: health_probe.py HOST PORT [--timeout SECONDS]  (token: $LMCACHE_SERVER_TOKEN)"
#: the production stack's probe timeout (timeoutSeconds: 5)
DEFAULT_TIMEOUT = 5.0
#: the largest HEALTH answer read (a few hundred bytes in practice)
MAX_ANSWER = 64 << 10


class ProbeError(Exception):
    """Why the server is not healthy, in one line."""


def probe(host: str, port: int, timeout: float = DEFAULT_TIMEOUT, token: str | None = None) -> dict[str, Any]:
    """The server's HEALTH answer, within ``timeout`` seconds in all (connect, handshake,
    answer); :class:`ProbeError` otherwise."""
    from lmcache import wire as proto
    from lmcache.errors import LMCacheError
    from lmcache.wire_client import Connection

    deadline = time.monotonic() + timeout
    conn = None
    try:
        conn = Connection(host, port, timeout, token or None, MAX_ANSWER)
        conn.sock.settimeout(max(0.001, deadline - time.monotonic()))
        ((f, val),) = conn.request([(proto.HEALTH, b"", ())])
        if f.status != proto.OK:
            raise ProbeError(f"the server answered HEALTH with status {proto.STATUS_NAMES.get(f.status, f.status)}")
        answer = json.loads(bytes(val))
    except TimeoutError:
        raise ProbeError(f"no answer from {host}:{port} within {timeout:g}s") from None
    except (OSError, LMCacheError, ValueError) as exc:
        raise ProbeError(f"{host}:{port}: {exc}") from None
    finally:
        if conn is not None:
            conn.close()
    if not isinstance(answer, dict) or answer.get("status") != "ok":
        raise ProbeError(f"{host}:{port} is not healthy: {str(answer)[:200]}")
    return answer


def parse(argv: Sequence[str]) -> tuple[str, int, float]:
    args = list(argv)
    timeout = DEFAULT_TIMEOUT
    if "--timeout" in args:
        i = args.index("--timeout")
        try:
            timeout = float(args[i + 1])
        except (IndexError, ValueError):
            raise ValueError(f"--timeout takes a number of seconds; {USAGE}") from None
        if not timeout > 0:
            raise ValueError(f"--timeout must be positive; {USAGE}")
        del args[i : i + 2]
    if len(args) != 2:
        raise ValueError(f"expected HOST and PORT; {USAGE}")
    host, port = args
    if not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"PORT must be a number from 1 to 65535, not {port!r}; {USAGE}")
    return host, int(port), timeout


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 0 when the server at HOST PORT answers HEALTH ``ok`` in time; 1 when it
    does not; 2 for bad arguments."""
    argv = sys.argv[1:] if argv is None else argv
    if list(argv[:1]) in (["-h"], ["--help"]):
        sys.stdout.write(USAGE + "\n")
        return 0
    try:
        host, port, timeout = parse(argv)
    except ValueError as exc:
        sys.stderr.write(f"health_probe: error: {exc}\n")
        return 2
    try:
        answer = probe(host, port, timeout, os.environ.get("LMCACHE_SERVER_TOKEN"))
    except ProbeError as exc:
        sys.stderr.write(f"health_probe: unhealthy: {exc}\n")
        return 1
    sys.stdout.write(f"healthy: {host}:{port}, {answer.get('entries', '?')} entries, "
                     f"{answer.get('connections', '?')} connections\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
