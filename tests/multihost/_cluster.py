"""The controller HA cluster of the multi-host suite, each part in a host of its own
(:mod:`lmcache.testing.netns`): a Valkey primary and its replica, three Sentinels, three
controller replicas serving one ``valkey+sentinel://`` index, and three small engines
whose ``controller.url`` names all three replicas.

Hosts: 0 primary + sentinel, 1 replica + sentinel, 2 sentinel, 3-5 controllers c0-c2,
6 a controller started late, 7-9 engines e0-e2. Every process runs as users run it
(``valkey-server``, ``valkey-server CONF --sentinel``, ``lmcache controller serve``, a
:class:`~lmcache.CacheEngine` with a cpu tier); its output goes to a log in the work
directory. Timeouts are small so that faults play out in seconds: the lease
(``--instance-timeout``) 2 s, heartbeats every 0.5 s, Sentinel's down-after 1 s."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from lmcache.testing import procs
from lmcache.testing.netns import Host, Hosts

VALKEY_PORT = 6379
SENTINEL_PORT = 26379
CTL_PORT = 9000
MASTER = "lmcache"
INSTANCE_TIMEOUT = 2.0
HEARTBEAT = 0.5
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000
CHUNK = 16
MODEL = "multihost/synthetic"
KV = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}
PROMPT = [(i * 7919 + 13) % 30000 for i in range(128)]
#: the tokens of PROMPT each engine stores at the start
HELD = {"e0": 32, "e1": 64, "e2": 128}
HANG = 60.0  # seconds a process may take to start or a condition to hold: a hang guard, not a budget
_ENGINE = Path(__file__).with_name("_engine.py")


class Cluster:
    """The running cluster. ``held`` is what each live engine holds now (tests that
    change an engine update it); :meth:`hits` is what a lookup of PROMPT answers."""

    def __init__(self, hosts: Hosts, workdir: Path, valkey: str, cli: str):
        self.hosts = hosts
        self.dir = workdir
        self.valkey, self.cli = valkey, cli
        self.token = secrets.token_hex(16)
        self.procs: dict[str, subprocess.Popen] = {}
        self.held = dict(HELD)
        self.sentinels = [f"{hosts[i].ip}:{SENTINEL_PORT}" for i in range(3)]
        self.index = f"valkey+sentinel://{','.join(self.sentinels)}/{MASTER}"
        self.ctl_hosts = {f"c{i}": hosts[3 + i] for i in range(3)} | {"c3": hosts[6]}
        self.eng_hosts = {f"e{i}": hosts[7 + i] for i in range(3)}
        self.urls = [self.url(f"c{i}") for i in range(3)]

    # ------------------------------------------------------------ processes
    def _start(self, name: str, host: Host, argv: list[str], **kw: Any) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "ab")
        try:
            p = host.popen(argv, stderr=log, stdout=kw.pop("stdout", log), **kw)
        finally:
            log.close()
        self.procs[name] = p
        return p

    def log_tail(self, name: str, lines: int = 8) -> str:
        try:
            return " | ".join((self.dir / f"{name}.log").read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self, name: str) -> None:
        """SIGKILL ``name`` (a crash) and reap it."""
        p = self.procs.pop(name)
        p.kill()
        p.wait(timeout=10)

    def stop_all(self) -> None:
        for name in list(self.procs)[::-1]:
            procs.stop(self.procs.pop(name), grace=5)

    def valkey_cli(self, ip: str, port: int, *args: str) -> str:
        r = subprocess.run([self.cli, "-h", ip, "-p", str(port), *args], capture_output=True, text=True, timeout=5)
        return r.stdout.strip()

    def wait(self, fn: Callable[[], Any], what: str, timeout: float = HANG) -> Any:
        """``fn()`` once it is true; an error naming ``what`` and the last value otherwise."""
        end = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < end:
            try:
                last = fn()
            except Exception as exc:  # a process still starting
                last = exc
            if last and not isinstance(last, Exception):
                return last
            time.sleep(0.05)
        raise AssertionError(f"not reached within {timeout:g}s: {what} (last: {str(last)[:300]})")

    # ------------------------------------------------------------ valkey and sentinels
    def start_valkey(self) -> None:
        primary = self.hosts[0].ip
        for i, role in enumerate(("valkey-primary", "valkey-replica")):
            d = self.dir / role
            d.mkdir()
            argv = [self.valkey, "--port", str(VALKEY_PORT), "--bind", "0.0.0.0", "--save", "", "--appendonly", "no",
                    "--protected-mode", "no", "--dir", str(d)]
            if i:
                argv += ["--replicaof", primary, str(VALKEY_PORT)]
            self._start(role, self.hosts[i], argv, stdin=subprocess.DEVNULL)
        self.wait(lambda: self.valkey_cli(primary, VALKEY_PORT, "PING") == "PONG", "the Valkey primary answers")
        self.wait(lambda: "master_link_status:up" in self.valkey_cli(self.hosts[1].ip, VALKEY_PORT, "INFO", "replication"),
                  "the replica is in sync")
        for i in range(3):
            d = self.dir / f"sentinel-{i}"
            d.mkdir()
            conf = d / "sentinel.conf"
            conf.write_text(
                f"port {SENTINEL_PORT}\nbind 0.0.0.0\nprotected-mode no\ndir {d}\n"
                f"sentinel monitor {MASTER} {primary} {VALKEY_PORT} 2\n"
                f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {MASTER} 1\n"
            )
            self._start(f"sentinel-{i}", self.hosts[i], [self.valkey, str(conf), "--sentinel"], stdin=subprocess.DEVNULL)
        for i in range(3):
            ip = self.hosts[i].ip
            self.wait(lambda: self._sentinel_sees(ip), f"sentinel {i} sees the primary, its replica and 2 other sentinels")

    def _sentinel_sees(self, ip: str) -> bool:
        out = self.valkey_cli(ip, SENTINEL_PORT, "SENTINEL", "master", MASTER).splitlines()
        info = dict(zip(out[::2], out[1::2]))
        return info.get("ip") == self.hosts[0].ip and info.get("num-slaves") == "1" and info.get("num-other-sentinels") == "2"

    def primary(self) -> str:
        """The primary's address as Sentinel 2 (on a host that keeps running) tells it."""
        out = self.valkey_cli(self.hosts[2].ip, SENTINEL_PORT, "SENTINEL", "get-master-addr-by-name", MASTER).splitlines()
        return out[0] if out else ""

    # ------------------------------------------------------------ controllers
    def url(self, name: str) -> str:
        return f"http://{self.ctl_hosts[name].ip}:{CTL_PORT}"

    def start_controller(self, name: str) -> str:
        """``lmcache controller serve`` on its host; returns once it printed its URL."""
        host = self.ctl_hosts[name]
        lmcache = str(Path(sys.executable).with_name("lmcache"))
        argv = [lmcache, "controller", "serve", "--host", host.ip, "--port", str(CTL_PORT), "--index", self.index,
                "--instance-timeout", str(INSTANCE_TIMEOUT)]
        env = {**os.environ, "LMCACHE_CONTROLLER_TOKEN": self.token}
        p = self._start(name, host, argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, text=True)
        try:
            line = procs.readline(p, HANG)
        except Exception:
            raise AssertionError(f"controller {name} did not start: {self.log_tail(name)}") from None
        assert line == self.url(name), (line, self.log_tail(name))
        return line

    def client(self, *names: str, timeout: float = 1.0):
        from lmcache.plugins.services.controller_client import ControllerClient

        urls = [self.url(n) for n in names] if names else self.urls
        return ControllerClient(urls, self.token, timeout=timeout)

    # ------------------------------------------------------------ engines
    def engine_config(self, name: str) -> dict[str, Any]:
        return {"chunk_size": CHUNK, "model": MODEL, "kv_spec": KV, "tiers": [{"backend": "cpu", "capacity": "64MiB"}],
                "staging_size": "16MiB",
                "controller": {"url": ",".join(self.urls), "token": self.token, "instance_id": name,
                               "heartbeat_interval": HEARTBEAT, "timeout": 1.0}}

    def spawn_engine(self, name: str, tokens: int, wait: bool = False) -> str:
        """Start an engine storing the first ``tokens`` of PROMPT (with ``wait``, it opens
        the engine when :meth:`go` tells it); returns its key in :attr:`procs` (``NAME``,
        or ``NAME-restarted`` while the first one runs). :meth:`ready` waits for it."""
        spec = self.dir / f"{name}.json"
        spec.write_text(json.dumps({"config": self.engine_config(name), "tokens": PROMPT[:tokens], "wait": wait}))
        key = f"{name}-restarted" if name in self.procs else name
        self._start(key, self.eng_hosts[name], [sys.executable, str(_ENGINE), str(spec)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return key

    def ready(self, key: str, wait: bool = False) -> None:
        """Wait until engine ``key`` printed LOADED, and READY unless told to wait for :meth:`go`."""
        self._expect(key, "LOADED")
        if not wait:
            self._expect(key, "READY")

    def go(self, key: str) -> None:
        p = self.procs[key]
        p.stdin.write("go\n")
        p.stdin.flush()
        self._expect(key, "READY")

    def _expect(self, key: str, word: str) -> None:
        try:
            line = procs.readline(self.procs[key], HANG)
        except Exception:
            raise AssertionError(f"engine {key} did not print {word}: {self.log_tail(key)}") from None
        assert line.split()[:1] == [word], (line, self.log_tail(key))

    # ------------------------------------------------------------ lookups
    def hits(self, client: Any) -> dict[str, int]:
        """instance id -> hit tokens of a lookup of PROMPT, for this cluster's engines."""
        return {r["instance_id"]: r["hit_tokens"] for r in client.lookup(PROMPT, model=MODEL)["results"]}


def start(hosts: Hosts, workdir: Path, valkey: str, cli: str) -> Cluster:
    """Start the whole cluster (see the module's doc) and wait until every controller
    replica answers a lookup with every engine's hits."""
    c = Cluster(hosts, workdir, valkey, cli)
    c.start_valkey()
    for i in range(3):
        c.start_controller(f"c{i}")
    for key in [c.spawn_engine(name, n) for name, n in HELD.items()]:  # side by side: each imports torch
        c.ready(key)
    for i in range(3):
        with c.client(f"c{i}") as cl:
            c.wait(lambda: c.hits(cl) == c.held, f"controller c{i} answers every engine's hits")
    return c
