"""Loopback Redis and Valkey stores: standalone, a 3-master cluster, and sentinel.

Why real servers rather than an in-process fake: what the ``redis`` and ``valkey``
backends must get right is the network (pipelines split by slot, SCAN across cluster
masters, sentinel discovery, reconnecting after a crash), and only a real server shows
it. Every server binds ``127.0.0.1`` on a free port, keeps nothing on disk (``--save ''
--appendonly no``), and runs in a private temporary directory, so a killed and restarted
server comes back empty, exactly like a production cache without persistence. Cluster
nodes keep their ``nodes.conf`` in that directory, so a restarted cluster comes back with
the same slots (and no data).

Each function is a context manager yielding a :class:`~lmcache.testing.stores.Store` whose
``options`` are the backend options that reach the store (``url`` plus whatever keyword
arguments were given, e.g. ``prefix`` or ``timeout``) and whose ``servers`` are the
server processes (``store.kill()`` / ``store.restart()`` for fault tests).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from . import LocalServer, ServerUnavailable, Store, ensure_binary, free_port, port_open

SENTINEL_MASTER = "lmcache"
_BASE_ARGS = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--protected-mode", "no"]


def _binaries(flavour: str) -> tuple[str, str]:
    """(server, cli) executables of ``flavour`` ("redis" or "valkey"), installed if needed."""
    if flavour == "valkey":
        server = ensure_binary("valkey-server", apt_package="valkey-server", suite="bookworm-backports")
        cli = ensure_binary("valkey-cli", apt_package="valkey-tools", suite="bookworm-backports")
    else:
        server = ensure_binary("redis-server", apt_package="redis-server")
        cli = ensure_binary("redis-cli", apt_package="redis-tools")
    return server, cli


def _bus_port() -> int:
    """A port P with P and P + 10000 (the cluster bus) both free."""
    for _ in range(200):
        p = free_port()
        if p + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 10000))
            except OSError:
                continue
        return p
    raise ServerUnavailable("no free port pair (P, P+10000) for a cluster node")


def command(port: int, *args: str, timeout: float = 2.0) -> Any:
    """Send one command to a server on 127.0.0.1:``port`` and return the reply (bytes,
    int, list or an ``Exception`` for an error reply). A tiny RESP2 client, so that the
    launchers need no client library."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            b = a.encode()
            out.append(b"$%d\r\n%s\r\n" % (len(b), b))
        s.sendall(b"".join(out))
        f = s.makefile("rb")
        return _reply(f)


def _reply(f: Any) -> Any:
    line = f.readline()
    if not line:
        raise ConnectionError("connection closed")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest
    if kind == b"-":
        return Exception(rest.decode(errors="replace"))
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)
        return data[:-2]
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [_reply(f) for _ in range(n)]
    raise ConnectionError(f"unexpected reply {line!r}")


def _answers_ping(port: int) -> bool:
    try:
        return command(port, "PING", timeout=0.5) == b"PONG"
    except OSError:
        return False


def _server(binary: str, name: str, port: int, workdir: Path, extra: Sequence[str] = (), *, tls: bool = False) -> LocalServer:
    """One server on ``port``: plain TCP, or TLS only (then ready means the port accepts
    connections: a PING would need a TLS client)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ports = ["--port", "0", "--tls-port", str(port)] if tls else ["--port", str(port)]
    argv = [binary, *ports, *_BASE_ARGS, "--dir", str(workdir), *extra]
    ready = (lambda: port_open(port)) if tls else (lambda: _answers_ping(port))
    return LocalServer(name, argv, port, workdir=workdir, ready=ready)


@contextlib.contextmanager
def _standalone(flavour: str, tls: bool = False, **options: Any) -> Iterator[Store]:
    server_bin, _ = _binaries(flavour)
    root = Path(tempfile.mkdtemp(prefix=f"lmcache-{flavour}-"))
    try:
        port = free_port()
        extra: list[str] = []
        scheme = flavour
        if tls:
            cert, key = _self_signed(root)
            extra = ["--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                     "--tls-auth-clients", "no"]
            scheme += "s"
            options = {"ssl_ca_certs": str(cert), **options}
        srv = _server(server_bin, flavour, port, root / "data", extra, tls=tls)
        try:
            srv.start()
            yield Store(flavour, {"url": f"{scheme}://127.0.0.1:{port}/0", **options}, [srv])
        finally:
            srv.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _self_signed(root: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (made with the ``openssl`` command)."""
    openssl = ensure_binary("openssl", apt_package="openssl")
    cert, key = root / "cert.pem", root / "key.pem"
    p = subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        capture_output=True, text=True, timeout=60,
    )
    if p.returncode != 0:
        raise ServerUnavailable(f"openssl could not make a test certificate: {p.stderr.strip()[-500:]}")
    return cert, key


class ClusterStore(Store):
    """A cluster's :class:`Store`: ``restart()`` returns once every node says
    ``cluster_state:ok`` again (the nodes keep their slots in ``nodes.conf``)."""

    def restart(self) -> None:
        super().restart()
        wait_cluster_ok(self.extra["ports"])


def cluster_ok(ports: list[int]) -> bool:
    """True when every node says ``cluster_state:ok``."""
    for p in ports:
        try:
            info = command(p, "CLUSTER", "INFO", timeout=0.5)
        except OSError:
            return False
        if not isinstance(info, bytes) or b"cluster_state:ok" not in info:
            return False
    return True


def wait_cluster_ok(ports: list[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cluster_ok(ports):
            return
        time.sleep(0.05)
    raise ServerUnavailable(f"the cluster on ports {ports} did not reach cluster_state:ok within {timeout:.0f}s")


@contextlib.contextmanager
def _cluster(flavour: str, masters: int = 3, **options: Any) -> Iterator[Store]:
    server_bin, cli = _binaries(flavour)
    root = Path(tempfile.mkdtemp(prefix=f"lmcache-{flavour}-cluster-"))
    servers: list[LocalServer] = []
    try:
        ports: list[int] = []
        for i in range(masters):
            port = _bus_port()
            while port in ports or port - 10000 in ports or port + 10000 in ports:
                port = _bus_port()
            ports.append(port)
            srv = _server(server_bin, f"{flavour}-node{i}", port, root / f"node{i}",
                          ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                           "--cluster-node-timeout", "2000"])
            servers.append(srv)
            srv.start()
        p = subprocess.run(
            [cli, "--cluster", "create", *[f"127.0.0.1:{port}" for port in ports], "--cluster-replicas", "0",
             "--cluster-yes"],
            capture_output=True, text=True, timeout=60,
        )
        if p.returncode != 0:
            raise ServerUnavailable(f"{Path(cli).name} --cluster create failed: {(p.stdout + p.stderr).strip()[-800:]}")
        wait_cluster_ok(ports)
        url = f"{flavour}+cluster://" + ",".join(f"127.0.0.1:{port}" for port in ports)
        yield ClusterStore(flavour, {"url": url, **options}, servers, extra={"ports": ports})
    finally:
        for srv in servers:
            srv.close()
        shutil.rmtree(root, ignore_errors=True)


def redis_store(**options: Any) -> contextlib.AbstractContextManager[Store]:
    """A standalone redis-server. ``tls=True`` serves TLS only (``rediss://``, with a
    fresh self-signed certificate passed as ``ssl_ca_certs``)."""
    return _standalone("redis", **options)


def valkey_store(**options: Any) -> contextlib.AbstractContextManager[Store]:
    """A standalone valkey-server (installed from bookworm-backports when missing)."""
    return _standalone("valkey", **options)


def redis_cluster_store(**options: Any) -> contextlib.AbstractContextManager[Store]:
    """A Redis Cluster of three masters and no replicas."""
    return _cluster("redis", **options)


def valkey_cluster_store(**options: Any) -> contextlib.AbstractContextManager[Store]:
    """A Valkey cluster of three masters and no replicas."""
    return _cluster("valkey", **options)


@contextlib.contextmanager
def redis_sentinel_store(**options: Any) -> Iterator[Store]:
    """One redis-server master and one sentinel watching it (quorum 1) under the name
    :data:`SENTINEL_MASTER`; the URL names the sentinel, which tells the client where
    the master is."""
    server_bin, _ = _binaries("redis")
    root = Path(tempfile.mkdtemp(prefix="lmcache-redis-sentinel-"))
    servers: list[LocalServer] = []
    try:
        mport, sport = free_port(), free_port()
        while sport == mport:
            sport = free_port()
        master = _server(server_bin, "redis-master", mport, root / "master")
        servers.append(master)
        master.start()
        sdir = root / "sentinel"
        sdir.mkdir()
        conf = sdir / "sentinel.conf"
        conf.write_text(
            f"port {sport}\nbind 127.0.0.1\nprotected-mode no\ndir {sdir}\n"
            f"sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {mport} 1\n"
            f"sentinel down-after-milliseconds {SENTINEL_MASTER} 5000\n"
        )

        def sentinel_ready() -> bool:
            try:
                reply = command(sport, "SENTINEL", "get-master-addr-by-name", SENTINEL_MASTER, timeout=0.5)
            except OSError:
                return False
            return isinstance(reply, list) and reply[1:] == [str(mport).encode()]

        sentinel = LocalServer("redis-sentinel", [server_bin, str(conf), "--sentinel"], sport, workdir=sdir,
                               ready=sentinel_ready)
        servers.append(sentinel)
        sentinel.start()
        url = f"redis+sentinel://127.0.0.1:{sport}/{SENTINEL_MASTER}/0"
        yield Store("redis", {"url": url, **options}, servers, extra={"master_port": mport})
    finally:
        for srv in reversed(servers):
            srv.close()
        shutil.rmtree(root, ignore_errors=True)
