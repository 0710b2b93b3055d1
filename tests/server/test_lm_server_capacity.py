"""``lmcache server`` counts every entry against its capacity, keys included, and says
loudly at start when it listens beyond loopback with no token (issue 29, item 6).

Real server processes on loopback; the frames go through real sockets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _procs import talk

from lmcache import wire as proto
from lmcache.server.cache import ENTRY_OVERHEAD, exposure_warning
from lmcache.testing.stores.lm import lm_store

CAPACITY = 1 << 20


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def health(port: int) -> dict:
    reply, _ = talk(port, proto.encode(proto.HEALTH, 1, b"", b""))
    ((_, _, value),) = list(proto.iter_frames(reply, 1 << 20))
    return json.loads(bytes(value))


def test_empty_value_puts_fill_the_capacity_and_are_evicted():
    n = 100_000
    with lm_store(capacity="1MiB") as s:
        port = s.servers[0].port
        pid = s.servers[0].proc.pid
        before = rss_kib(pid)
        keys = [f"empty:{i:032x}".encode() for i in range(n)]
        for start in range(0, n, 20_000):
            batch = b"".join(proto.encode(proto.PUT, i, keys[i], b"") for i in range(start, min(start + 20_000, n)))
            reply, _ = talk(port, batch, timeout=60)
            statuses = {f.status for f, _, _ in proto.iter_frames(reply, 1 << 20)}
            assert statuses == {proto.OK}
        h = health(port)
        grown = rss_kib(pid) - before
        per_entry = len(keys[0]) + ENTRY_OVERHEAD
        print(f"{n} empty PUTs: entries {h['entries']}, used {h['used_bytes']}, evictions {h['evictions']}, "
              f"RSS +{grown} KiB")
        assert 0 < h["used_bytes"] <= h["capacity_bytes"] == CAPACITY
        assert h["entries"] == h["used_bytes"] // per_entry <= CAPACITY // per_entry
        assert h["evictions"] == n - h["entries"] > 0
        # the newest keys stay (LRU), the oldest went
        reply, _ = talk(port, proto.encode(proto.EXISTS, 1, keys[-1], b"") + proto.encode(proto.EXISTS, 2, keys[0], b""))
        assert [f.status for f, _, _ in proto.iter_frames(reply, 1 << 20)] == [proto.OK, proto.NOT_FOUND]


def test_an_entry_whose_key_and_overhead_exceed_the_capacity_is_refused():
    with lm_store(capacity=f"{ENTRY_OVERHEAD + 8}B") as s:
        port = s.servers[0].port
        reply, _ = talk(port, proto.encode(proto.PUT, 1, b"k" * 9, b"") + proto.encode(proto.PUT, 2, b"k" * 8, b""))
        (f1, _, msg), (f2, _, _) = list(proto.iter_frames(reply, 1 << 20))
        assert f1.status == proto.ERROR and b"larger than the server's capacity" in bytes(msg)
        assert f2.status == proto.OK
        h = health(port)
        assert h["entries"] == 1 and h["used_bytes"] == h["capacity_bytes"] == ENTRY_OVERHEAD + 8


def start_server(host: str, *token: str) -> tuple[str, str]:
    """Start ``lmcache server`` on ``host`` (port 0), wait for LISTENING, stop it; its (stdout, stderr)."""
    argv = [sys.executable, "-m", "lmcache.cli.main", "server", "--host", host, "--port", "0", "--capacity", "1MiB"]
    if token:
        argv += ["--token", token[0]]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={k: v for k, v in os.environ.items() if k != "LMCACHE_SERVER_TOKEN"})
    try:
        first = p.stdout.readline()
        assert first.startswith("LISTENING"), first + p.stderr.read()
    finally:
        p.terminate()
        out, err = p.communicate(timeout=30)
    return first + out, err


def test_listening_beyond_loopback_without_a_token_warns_on_stderr():
    _, err = start_server("0.0.0.0")
    assert "WARNING: lmcache server listens on 0.0.0.0, beyond loopback, with NO TOKEN" in err
    assert "--token" in err
    for host, *token in (("127.0.0.1",), ("0.0.0.0", "s3cret")):
        _, err = start_server(host, *token)
        assert "WARNING" not in err, err


@pytest.mark.parametrize("host,warns", [("127.0.0.1", False), ("127.0.0.5", False), ("::1", False), ("[::1]", False),
                                        ("localhost", False), ("0.0.0.0", True), ("::", True), ("10.0.0.7", True),
                                        ("cache.example", True)])
def test_exposure_warning_is_for_hosts_beyond_loopback(host, warns):
    assert (exposure_warning(host, None) is not None) is warns
    assert exposure_warning(host, "tok") is None
