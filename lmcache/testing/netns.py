"""Hosts on one machine: Linux network namespaces joined by one bridge, for tests that need
several machines (controller replicas, Valkey with Sentinels, engines on other hosts).

Why namespaces and not loopback ports: a host of its own has its own address, its own
ports (every Valkey listens on 6379, every controller on 9000, as on real machines) and a
link that can be taken down, so "this machine dropped off the network" is a real fault and
not a killed process.

Layout of ``Hosts(n, name="t")``: a hub namespace holding a bridge; host ``i`` is a
namespace whose ``eth0`` is one end of a veth pair, the other end a port of the bridge;
one more veth pair joins the root namespace to the bridge, so the test process (in the
root namespace) reaches every host by its address. The hosts share a /24 of 10.201.0.0/16
that no route of the root namespace uses yet (host ``i`` is ``.i+1``, the root side
``.254``). Loopback is up in every namespace.

Cleanup: everything lives in namespaces named ``lmcache-<name>-<pid>-<seq>-...`` (the
root's veth end dies with the hub's), so deleting them removes every link. ``close()``
(the ``with`` block's end, and ``atexit``) SIGKILLs what still runs in them and deletes
them, also after a failed test; a run killed with SIGKILL leaves them behind, and the next
:class:`Hosts` of any process removes those whose pid is gone (:func:`sweep`).

Root only (``ip netns`` needs ``CAP_SYS_ADMIN``); otherwise :class:`NetnsUnavailable`.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Any, Sequence

from ..errors import LMCacheError

__all__ = ["Host", "Hosts", "NetnsUnavailable", "sweep"]

PREFIX = "lmcache-"
_NAME_RE = re.compile(r"^lmcache-[a-z0-9]{1,12}-(\d+)-\d+-(?:hub|h\d+)$")
_LOCK = "/run/lmcache-netns.lock"  # held while a /24 is chosen and taken
_seq = itertools.count()
#: each ``ip`` call is bounded (a hang guard)
IP_TIMEOUT = 10.0


class NetnsUnavailable(LMCacheError):
    """Network namespaces cannot be made here (not root, no ``ip``, or the kernel said no);
    the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` did not finish within {IP_TIMEOUT:g}s") from None
    if check and r.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {(r.stderr or r.stdout).strip()[:300]}")
    return r


def _namespaces() -> list[str]:
    r = _ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    """SIGKILL every process in namespace ``ns`` and wait for them to go (bounded)."""
    r = _ip("netns", "pids", ns, check=False)
    pids = [int(p) for p in r.stdout.split() if p.isdigit() and int(p) != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + IP_TIMEOUT  # until each is gone or a zombie (its parent reaps it)
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _running(p)]
        if pids:
            time.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _delete(ns: str) -> None:
    _kill_inside(ns)
    _ip("netns", "del", ns, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> list[str]:
    """Delete the namespaces left by :class:`Hosts` of processes that are gone (a run killed
    with SIGKILL), with whatever still runs in them; returns their names."""
    gone = []
    for ns in _namespaces():
        m = _NAME_RE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _delete(ns)
            gone.append(ns)
    return gone


def _free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A 10.201.X.0/24 that no address or route of the root namespace overlaps."""
    r = _ip("-4", "route", "show", "table", "all", check=False)
    used = set()
    for line in r.stdout.splitlines():
        head = line.split()[0] if line.split() else ""
        if head.startswith("local"):
            head = line.split()[1]
        with contextlib.suppress(ValueError):
            used.add(ipaddress.ip_network(head, strict=False))
    for i in range(254):
        net = ipaddress.ip_network(f"10.201.{(seed + i) % 254 + 1}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise NetnsUnavailable("no free 10.201.X.0/24 left in the root namespace")


class Host:
    """One host: a network namespace with ``eth0`` on the hosts' bridge."""

    def __init__(self, name: str, ip: str, port: str, hub: str):
        self.name = name  #: the namespace's name
        self.ip = ip  #: its address, reachable from the other hosts and the root namespace
        self._port = port  # the bridge port of its link (in the hub namespace)
        self._hub = hub

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this host."""
        return ["ip", "netns", "exec", self.name, *[str(a) for a in argv]]

    def popen(self, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` in this host (``ip netns exec`` execs it: the Popen's pid is the
        program's own)."""
        return subprocess.Popen(self.argv(argv), **popen_kwargs)

    def run(self, argv: Sequence[str], timeout: float = 30.0, **run_kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` in this host to its end (``subprocess.run``, bounded by ``timeout``)."""
        run_kwargs.setdefault("capture_output", True)
        run_kwargs.setdefault("text", True)
        return subprocess.run(self.argv(argv), timeout=timeout, **run_kwargs)

    def link_down(self) -> None:
        """Cut this host off the network: its bridge port goes down (its ``eth0`` loses the
        carrier). Packets to and from it are dropped; a connect to it times out."""
        _ip("-n", self._hub, "link", "set", self._port, "down")

    def link_up(self) -> None:
        """Put this host back on the network."""
        _ip("-n", self._hub, "link", "set", self._port, "up")

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.ip!r})"


class Hosts:
    """``n`` hosts on one bridge (see the module's doc); a context manager, and a sequence
    of :class:`Host`. Raises :class:`NetnsUnavailable` saying why when namespaces cannot
    be made."""

    def __init__(self, n: int, name: str = "t"):
        if not 1 <= n <= 250:
            raise ValueError(f"Hosts: n must be 1..250, not {n}")
        if not re.fullmatch(r"[a-z0-9]{1,12}", name):
            raise ValueError(f"Hosts: name must be 1-12 lowercase letters or digits, not {name!r}")
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (ip netns); run the multi-host tests as root")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("the `ip` command (iproute2) is not installed: apt-get install -y iproute2")
        sweep()
        seq = next(_seq)
        self.prefix = f"{PREFIX}{name}-{os.getpid()}-{seq}"
        self.hub = f"{self.prefix}-hub"
        self.hosts: list[Host] = []
        self._closed = False
        # the root end's name must be unique in the root namespace (at most 15 characters)
        self._root_if = f"lmr{os.getpid() % 10**7}x{seq % 1000}"
        atexit.register(self.close)
        try:
            self._build(n, seq)
        except BaseException:
            self.close()
            raise

    def _build(self, n: int, seq: int) -> None:
        hub = self.hub
        _ip("netns", "add", hub)
        _ip("-n", hub, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        names = [f"{self.prefix}-h{i}" for i in range(n)]
        for i, ns in enumerate(names):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", hub, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", hub, "link", "set", f"p{i}", "master", "br0", "up")
        with open(_LOCK, "a") as lock:  # one chooser at a time: two runs never take one /24
            fcntl.flock(lock, fcntl.LOCK_EX)
            net = _free_subnet(os.getpid() + seq)
            _ip("-n", hub, "link", "add", "up0", "type", "veth", "peer", "name", self._root_if)
            _ip("-n", hub, "link", "set", "up0", "master", "br0", "up")
            _ip("-n", hub, "link", "set", self._root_if, "netns", "1")
            _ip("addr", "add", f"{net[254]}/24", "dev", self._root_if)
            _ip("link", "set", self._root_if, "up")
        for i, ns in enumerate(names):
            addr = str(net[i + 1])
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            self.hosts.append(Host(ns, addr, f"p{i}", hub))
        self.subnet = net

    def __len__(self) -> int:
        return len(self.hosts)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __iter__(self):
        return iter(self.hosts)

    def close(self) -> None:
        """Kill what runs in the hosts and delete every namespace (and so every link).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        for ns in _namespaces():
            if ns.startswith(self.prefix + "-"):
                _delete(ns)
        with contextlib.suppress(NetnsUnavailable):  # moved to the root ns by _build: dies with the hub, but be sure
            _ip("link", "del", self._root_if, check=False)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
