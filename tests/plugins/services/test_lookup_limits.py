"""The lookup channel's bounds (issue 29, items 8 and 9): a real engine on a real Unix
socket, peers in this process and in other processes. A frame over ``lookup_max_tokens``
costs nothing, a legal one no Python int per token; idle connections, from one process or
from many, never starve the scheduler's lookups; an idle or slow connection is closed."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
import tracemalloc

import pytest

from lmcache.plugins.services.lookup import HEADER, MAGIC, OP_LOOKUP, VERSION, LookupServer
from lmcache.plugins.services.lookup_client import LookupClient

from test_lookup import HANG, engine, kv_for

MIB = 1 << 20

# Holds idle connections to the socket argv[1]: argv[2] of them, from this one process
# ("one") or each from a forked child ("many"), opened one after another. Each sends a
# HELLO and prints "ok" if it was answered, "refused" if the server closed it instead;
# then all of them stay open, sending nothing, until stdin closes.
HOLDER = r"""
import os, socket, struct, sys
path, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
HELLO = struct.pack("<4sBBHIQ", b"LMKL", 1, 3, 0, 0, 1)
def hold():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(path)
    try:
        s.sendall(HELLO)
        ok = len(s.recv(4096)) > 0
    except OSError:
        ok = False
    return s, ok
held = []
for _ in range(n):
    if mode == "one":
        s, ok = hold()
        held.append(s)
        print("ok" if ok else "refused", flush=True)
        continue
    r, w = os.pipe()
    if os.fork() == 0:
        s, ok = hold()
        os.write(w, b"ok\n" if ok else b"refused\n")
        os.read(0, 1)  # until the test closes stdin
        os._exit(0)
    os.close(w)
    print(os.read(r, 16).decode().strip(), flush=True)
    os.close(r)
sys.stdin.read()
if mode == "many":
    for _ in range(n):
        os.wait()
"""


def raw(sock: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(HANG)  # a hang guard: a connection the server should close but keeps fails the test
    s.connect(sock)
    return s


def closed_by_server(s: socket.socket) -> bool:
    """Read until the server closes ``s`` (``True``); ``socket.timeout`` past ``HANG``."""
    while True:
        try:
            if not s.recv(65536):
                return True
        except ConnectionResetError:
            return True


def frame(count: int, body: bytes = b"") -> bytes:
    return HEADER.pack(MAGIC, VERSION, OP_LOOKUP, 0, count, 1) + body


def hit_of(client: LookupClient, tokens: list[int]) -> int:
    got = client.result(client.submit(tokens, pin=False), HANG)
    assert got is not None, "no answer within the hang guard"
    return got[0].hit


def test_a_lookup_over_lookup_max_tokens_is_refused_from_its_header_without_allocating_it(tmp_path, caplog):
    """Before: a frame of 1<<20 + 1 tokens (the new default bound; the old one was 1<<24) was
    read in full, its connection waiting for the body; after: refused from its 20-byte header
    with one log line, the connection closed, nothing allocated, and the engine serves on."""
    sock = str(tmp_path / "w0.sock")
    tokens = list(range(100, 112))
    over = (1 << 20) + 1
    msg = frame(over, bytes(4 * over))  # built before the measurement
    with caplog.at_level(logging.WARNING, logger="lmcache"), engine(sock) as e:
        e.store(tokens, kv_for(12))
        s = raw(sock)
        s.sendall(frame(over))  # the header alone: the server must not wait for the body
        assert closed_by_server(s)
        s.close()
        assert any(f"lookup of {over} tokens refused" in r.getMessage() for r in caplog.records)

        tracemalloc.start()
        try:
            s = raw(sock)
            try:
                s.sendall(msg)  # the body too: the server closes before taking it
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert closed_by_server(s)
            s.close()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < MIB, f"refusing a {len(msg) / MIB:.0f} MiB frame allocated {peak / MIB:.1f} MiB"

        client = LookupClient([sock])
        try:
            assert hit_of(client, tokens) == 12
        finally:
            client.close()


def test_lookup_max_tokens_bounds_the_frame(tmp_path):
    """A lookup of exactly ``lookup_max_tokens`` is answered, one more token is refused."""
    sock = str(tmp_path / "w0.sock")
    tokens = list(range(100, 116))
    with engine(sock, lookup_max_tokens=16) as e:
        e.store(tokens, kv_for(16))
        client = LookupClient([sock])
        try:
            assert hit_of(client, tokens) == 16
            assert hit_of(client, tokens + [1]) == 0  # refused: the connection closed, a miss
        finally:
            client.close()
        s = raw(sock)
        s.sendall(frame(17))
        assert closed_by_server(s)
        s.close()


def test_a_legal_lookup_is_decoded_without_a_python_int_per_token(tmp_path):
    """A lookup of 1<<20 tokens (4 MiB on the wire): before, the server copied it to bytes,
    an array and a list of Python ints (about 48 bytes per token); after, one buffer the
    engine hashes as an array (4 bytes per token, plus the 8 of the hash's int64 view)."""
    sock = str(tmp_path / "w0.sock")
    n = 1 << 20
    with engine(sock) as e:
        e.store(list(range(8)), kv_for(8))  # a kv spec: the lookup hashes its tokens
        msg = frame(n, bytes(range(256)) * (4 * n // 256))
        s = raw(sock)
        tracemalloc.start()
        try:
            s.sendall(msg)
            reply = s.recv(HEADER.size + 8)  # the reply's header and hit: the lookup is done
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            s.close()
        assert len(reply) >= HEADER.size
        assert peak < 16 * n, f"a lookup of {n} tokens allocated {peak / MIB:.1f} MiB"


@pytest.mark.parametrize("mode", ["one", "many"])
def test_idle_connections_never_starve_the_schedulers_lookup(tmp_path, mode):
    """20 idle connections, from one process or from 20: before, 16 of them took every slot
    and the scheduler's connection was closed at once (its lookups all misses); after, one
    process holds at most ``max_per_peer``, and with every slot taken a new connection
    closes the one idle the longest."""
    sock = str(tmp_path / "w0.sock")
    tokens = list(range(100, 112))
    n = 20
    with engine(sock) as e:
        e.store(tokens, kv_for(12))
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, sock, str(n), mode],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            answers = [holder.stdout.readline().strip() for _ in range(n)]
            assert len(answers) == n and all(a in ("ok", "refused") for a in answers), answers
            client = LookupClient([sock])
            try:
                assert hit_of(client, tokens) == 12
                assert hit_of(client, tokens[:8]) == 8
            finally:
                client.close()
            info = e.stats()["lookup"]
            if mode == "many":  # each new one took the place of the oldest idle one
                assert answers == ["ok"] * n and info["evicted"] >= n - LookupServer.max_connections
            else:
                assert answers.count("ok") == LookupServer.max_per_peer and info["refused"] >= 1
        finally:
            holder.stdin.close()
            holder.wait(timeout=60)


def test_an_idle_or_slow_connection_is_closed_and_the_scheduler_reconnects_quietly(tmp_path, monkeypatch, caplog):
    """Before: a connection that sent nothing, or half a frame, held its slot and thread for
    ever; after: closed after ``idle_timeout`` / ``frame_timeout``. The scheduler's own
    connection, closed the same way while it had nothing to ask, costs no miss and no
    warning: the next lookup reconnects at once."""
    monkeypatch.setattr(LookupServer, "idle_timeout", 1.0, raising=False)
    monkeypatch.setattr(LookupServer, "frame_timeout", 1.0, raising=False)
    sock = str(tmp_path / "w0.sock")
    tokens = list(range(100, 112))
    with caplog.at_level(logging.WARNING, logger="lmcache"), engine(sock) as e:
        e.store(tokens, kv_for(12))
        idle, slow = raw(sock), raw(sock)
        slow.sendall(frame(100, b"\1" * 10))  # 10 bytes of a 400-byte body, then nothing
        for s in (idle, slow):
            assert closed_by_server(s)
            s.close()

        client = LookupClient([sock])
        try:
            assert hit_of(client, tokens) == 12
            guard = time.monotonic() + HANG
            while client.ranks[0].sock is not None:  # the server closed it idle; the client saw it
                assert time.monotonic() < guard, "the scheduler's idle connection was never closed"
                time.sleep(0.02)
            assert hit_of(client, tokens) == 12
        finally:
            client.close()
        assert e.stats()["lookup"]["idle_closed"] >= 2
    assert not [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
