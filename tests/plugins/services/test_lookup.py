"""The lookup service: a real engine answering on a real Unix socket, asked by a client in
another process (as vLLM's scheduler asks its workers) and in this one."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import torch

from lmcache.engine import CacheEngine
from lmcache.plugins.services.lookup_client import LookupClient

CHUNK = 4
L, H, D = 2, 1, 4
HANG = 10.0  # seconds: a hang guard, not a timing assertion


def kv_for(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(L, 2, n, H, D, generator=torch.Generator().manual_seed(seed))


def engine(sock: str, capacity: int | str = "1MiB", **extra) -> CacheEngine:
    return CacheEngine.from_config({"chunk_size": CHUNK, "tiers": [{"backend": "cpu", "capacity": capacity}],
                                    "lookup_socket": sock, **extra})


def ask(sock: str, *lookups: list[int]) -> list:
    """HELLO, then each lookup (pinned), from a separate Python process."""
    code = (
        "import json, sys\n"
        "from lmcache.plugins.services.lookup_client import LookupClient\n"
        "c = LookupClient([sys.argv[1]])\n"
        f"out = [c.hello(wait={HANG})[0]]\n"
        "for toks in json.loads(sys.argv[2]):\n"
        f"    r = c.result(c.submit(toks, pin=True), {HANG})[0]\n"
        "    out.append([r.hit, list(r.tiers)])\n"
        "c.close(); print(json.dumps(out))\n"
    )
    res = subprocess.run([sys.executable, "-c", code, sock, json.dumps(list(lookups))],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_a_scheduler_in_another_process_gets_hits_and_tiers(tmp_path):
    sock = str(tmp_path / "w0.sock")
    tokens = list(range(100, 112))
    with engine(sock) as e:
        e.store(tokens, kv_for(12))
        assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
        hello, hit, partial, miss = ask(sock, tokens + [7, 8], tokens[:6], [1, 2, 3, 4, 5])
        assert hello["chunk_size"] == CHUNK and hello["tiers"] == ["cpu"]
        assert hello["kv"] == e.kv_spec.signature and hello["tp_rank"] == 0
        assert hit == [12, [0, 0, 0]]
        assert partial == [4, [0]]
        assert miss == [0, []]
        info = e.stats()["lookup"]
        assert info["socket"] == sock and info["lookups"] == 3
    assert not os.path.exists(sock)  # the service closed with the engine and removed its socket


def test_a_channel_lookup_leases_until_released(tmp_path):
    sock = str(tmp_path / "w0.sock")
    a, b = list(range(12)), list(range(50, 62))
    with engine(sock, capacity=3 * L * 2 * CHUNK * H * D * 4) as e:  # room for three chunks
        e.store(a, kv_for(12))
        client = LookupClient([sock])
        try:
            assert client.result(client.submit(a, pin=True), HANG)[0].hit == 12
            e.store(b, kv_for(12, seed=1))  # every chunk of a is leased: b finds no room
            assert e.lookup(a) == 12 and e.lookup(b) == 0
            client.release(a)
            assert client.result(client.submit(b, pin=False), HANG)[0].hit == 0  # the release has landed
            e.store(b, kv_for(12, seed=1))
            assert e.lookup(b) == 12 and e.lookup(a) == 0
        finally:
            client.close()


def test_a_socket_that_cannot_be_bound_is_a_warning_not_a_failed_engine(tmp_path, caplog):
    sock = str(tmp_path / "no-such-dir" / "w0.sock")
    with caplog.at_level(logging.WARNING, logger="lmcache"), engine(sock) as e:
        e.store(list(range(8)), kv_for(8))
        assert e.services["lookup"].lookup(list(range(8)), False) == (8, [0, 0])  # in-process still answers
        assert e.stats()["lookup"] == {"socket": None}
    assert any("no lookup channel on" in r.getMessage() and sock in r.getMessage() for r in caplog.records)


def test_no_socket_configured_no_service(tmp_path):
    with CacheEngine.from_config({"chunk_size": CHUNK}) as e:
        assert "lookup" not in e.services and "lookup" not in e.stats()


def test_a_shifted_lookup_counts_what_shifted_reuse_covers_after_the_exact_prefix(tmp_path):
    """With approximate_reuse on, a lookup flagged shifted (vLLM's scheduler asks so) also
    counts the tokens that chunks computed at other positions cover without a gap after
    the exact prefix; the tier bytes (and the leases) stay those of the exact chunks."""
    sock = str(tmp_path / "w0.sock")
    a = list(range(100, 124))  # 6 chunks
    b = a[:4] + a[10:] + [7, 8]  # its first chunk exact, then 6 tokens cut: a[10:12] is a tail of a's third chunk
    with engine(sock, approximate_reuse=True) as e:
        e.store(a, kv_for(24))
        client = LookupClient([sock])
        try:
            plain = client.result(client.submit(b, pin=False), HANG)[0]
            shifted = client.result(client.submit(b, pin=True, shifted=True), HANG)[0]
            assert (plain.hit, list(plain.tiers)) == (4, [0])
            assert (shifted.hit, list(shifted.tiers)) == (18, [0]) and shifted.exact(CHUNK) == 4
            client.release(b[:4])
        finally:
            client.close()
        assert e.services["lookup"].lookup(b, False, True) == (18, [0])
        run = e.services["approximate_reuse"].cover(b, 4, len(b) - 1)
        assert [(m.start, m.length, m.old_start, m.offset) for m in run] == [(4, 2, 10, 2), (6, 4, 12, 0), (10, 4, 16, 0), (14, 4, 20, 0)]
    with engine(str(tmp_path / "w1.sock")) as e:  # without the feature the flag changes nothing
        e.store(a, kv_for(24))
        assert e.services["lookup"].lookup(b, False, True) == (4, [0])


def test_a_shifted_cover_from_the_start_takes_the_head_of_an_exact_first_chunk(tmp_path):
    """With no exact prefix (a system prompt shorter than a chunk), the covered run starts
    with the longest head of a first chunk that equals the prompt's start (KV of the same
    tokens at the same positions), then the tail of the chunk after the cut."""
    a = list(range(100, 164))  # 4 chunks of 16; its first 10 tokens stand for a system prompt
    b = a[:10] + a[20:] + [7]
    with engine(str(tmp_path / "w0.sock"), chunk_size=16, approximate_reuse=True) as e:
        e.store(a, kv_for(64))
        run = e.services["approximate_reuse"].cover(b, 0, len(b) - 1)
        assert [(m.start, m.length, m.old_start, m.offset) for m in run] == [
            (0, 10, 0, 0), (10, 12, 20, 4), (22, 16, 32, 0), (38, 16, 48, 0)]
        kv = e.services["approximate_reuse"].fetch(run)
        want = kv_for(64)
        assert torch.equal(kv[0], want[:, :, :10]) and torch.equal(kv[1], want[:, :, 20:32])
        assert e.services["lookup"].lookup(b, False, True) == (54, [])
        # a different token inside the system prompt: no head, the run cannot start at 0
        assert e.services["approximate_reuse"].cover([1] + b[1:], 0, len(b) - 1) == []
