"""lmcache.testing.netns: hosts reach each other by address, a link taken down drops a
host off the network, and nothing is left behind."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from lmcache.testing.netns import Hosts, NetnsUnavailable, sweep

# a one-connection TCP server: prints READY, answers "hi <its address>" to one client
_SERVE = (
    "import socket,sys\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 7000)); s.listen()\n"
    "print('READY', flush=True)\n"
    "while True:\n"
    "    c,_=s.accept(); c.sendall(b'hi ' + c.getsockname()[0].encode()); c.close()\n"
)
_CONNECT = (
    "import socket,sys\n"
    "c=socket.create_connection((sys.argv[1], 7000), timeout=5); print(c.recv(64).decode())\n"
)


def _listen(host) -> subprocess.Popen:
    p = host.popen([sys.executable, "-c", _SERVE], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    assert p.stdout.readline().strip() == "READY"
    return p


def _ours(prefix: str) -> tuple[list[str], list[str]]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    return [n for n in ns.split() if n.startswith(prefix)], [line for line in links.splitlines() if prefix in line]


def test_hosts_reach_each_other_and_the_root_namespace(make_hosts):
    hosts = make_hosts(3, "reach")
    assert len({h.ip for h in hosts}) == 3 and len({h.name for h in hosts}) == 3
    servers = [_listen(h) for h in hosts]
    try:
        for a in hosts:
            for b in hosts:
                r = a.run([sys.executable, "-c", _CONNECT, b.ip], timeout=30)
                assert r.stdout.strip() == f"hi {b.ip}", (a, b, r.stderr[-300:])
            with socket.create_connection((a.ip, 7000), timeout=5) as c:  # from the root namespace
                assert c.recv(64) == f"hi {a.ip}".encode()
            r = a.run([sys.executable, "-c", _CONNECT, "127.0.0.1"], timeout=30)  # loopback is up inside
            assert r.stdout.strip() == "hi 127.0.0.1", r.stderr[-300:]
    finally:
        for p in servers:
            p.kill()
            p.wait()


def test_a_link_taken_down_makes_a_connect_time_out(make_hosts):
    hosts = make_hosts(2, "link")
    server = _listen(hosts[1])
    try:
        with socket.create_connection((hosts[1].ip, 7000), timeout=5) as c:  # up: answered
            assert c.recv(64)
        hosts[1].link_down()
        with pytest.raises(TimeoutError):
            socket.create_connection((hosts[1].ip, 7000), timeout=1.0)
        r = hosts[0].run([sys.executable, "-c", _CONNECT.replace("timeout=5", "timeout=1"), hosts[1].ip], timeout=30)
        assert r.returncode != 0 and "timed out" in r.stderr, r.stderr[-300:]
        hosts[1].link_up()
        deadline = time.monotonic() + 10  # a hang guard: the port needs a moment to forward again
        while True:
            try:
                with socket.create_connection((hosts[1].ip, 7000), timeout=1) as c:
                    assert c.recv(64) == f"hi {hosts[1].ip}".encode()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        server.kill()
        server.wait()


def test_close_leaves_no_namespace_link_or_process(make_hosts):
    make_hosts(1, "probe")  # skips (or fails under CI) where namespaces cannot be made
    hosts = Hosts(2, name="gone")
    prefix = hosts.prefix
    root_if = hosts._root_if
    sleeper = hosts[0].popen(["sleep", "600"])
    assert _ours(prefix)[0]
    hosts.close()
    assert _ours(prefix) == ([], [])
    assert root_if not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    assert sleeper.wait(timeout=10) == -9  # what ran inside was killed


def test_leftovers_of_a_killed_run_are_swept(make_hosts):
    make_hosts(1, "probe2")
    # a child makes hosts and is SIGKILLed: no close() runs
    child = subprocess.Popen(
        [sys.executable, "-c", "from lmcache.testing.netns import Hosts; import sys,time; h=Hosts(2, name='dead');"
         " print(h.prefix, flush=True); h[0].popen(['sleep','600']); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )
    prefix = child.stdout.readline().strip()
    assert prefix and len(_ours(prefix)[0]) == 3  # hub + 2 hosts
    child.kill()
    child.wait()
    assert len(_ours(prefix)[0]) == 3  # left behind
    assert any(n.startswith(prefix) for n in sweep())
    assert _ours(prefix) == ([], [])


def test_a_bad_name_is_refused_before_anything_is_made():
    with pytest.raises(ValueError, match="name"):
        Hosts(1, name="Bad Name!")
    assert issubclass(NetnsUnavailable, Exception)
