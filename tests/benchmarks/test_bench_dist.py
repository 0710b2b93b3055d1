"""``lmcache bench controller`` (the controller's lookup) and ``lmcache bench p2p``, run small as a user runs them.

Each run starts real processes on loopback (a controller and engines, or a peer engine
with its raw TCP source), so these tests check that the benches start, measure both the
product path and its limit in the same run, report what the docs quote, verify the
fetched KV, and leave no process behind. The numbers themselves are not asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HANG = 180  # a guard against a hung child, not a timing assertion


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmcache.cli.main", "bench", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=HANG)


def test_controller_lookup_reports_both_latencies_and_every_instance():
    r = bench("controller", "--instances", "2", "--tokens", "1024", "--count", "50", "--no-index", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["instances"], d["tokens"], d["count"], d["chunk_size"]) == (2, 1024, 50, 256)
    assert d["held_tokens"] == [512, 1024]
    assert d["hit_tokens"] == {"bench-0": 512, "bench-1": 1024} and d["best"] == "bench-1" and d["complete"]
    for side in ("lookup_ms", "health_ms"):
        row = d[side]
        assert set(row) == {"p50", "p90", "p99", "max"}
        assert 0 < row["p50"] <= row["p90"] <= row["p99"] <= row["max"]
    assert d["ratio_p50"] == pytest.approx(d["lookup_ms"]["p50"] / d["health_ms"]["p50"], rel=0.02)
    assert d["machine"]["cpus"] >= 1


def test_p2p_reports_both_rates_and_is_exact():
    r = bench("p2p", "--chunks", "4", "--layers", "2", "--repeats", "2", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    chunk = 256 * 2 * 2 * 8 * 128 * 2  # tokens x (K, V) x layers x heads x head size x float16
    assert (d["chunks"], d["chunk_bytes"], d["bytes"], d["repeats"]) == (4, chunk, 4 * chunk, 2)
    assert d["exact"] is True and d["fetched_chunks"] == 4 * 2  # every chunk, every round
    # the raw source sends the same payloads: the KV and a small header per chunk
    assert d["bytes"] < d["raw_tcp_bytes"] < d["bytes"] + 4 * 4096
    assert d["p2p_fetch_gbps"] > 0 and d["raw_tcp_gbps"] > 0
    assert d["ratio"] == pytest.approx(d["p2p_fetch_gbps"] / d["raw_tcp_gbps"], rel=0.02)


def test_human_output_and_bad_options():
    r = bench("p2p", "--chunks", "2", "--layers", "1", "--repeats", "1")
    assert r.returncode == 0, r.stderr
    assert "p2p fetch" in r.stdout and "raw TCP" in r.stdout and "exact=True" in r.stdout
    r = bench("controller", "--tokens", "100", "--chunk-size", "256")
    assert r.returncode != 0 and r.stderr.startswith("lmcache: error:") and "--tokens" in r.stderr
    r = bench("p2p", "--dtype", "int3")
    assert r.returncode != 0 and "--dtype" in r.stderr and "Traceback" not in r.stderr


def test_registered_as_typer_commands():
    """The two functions work as commands of a typer app, as ``lmcache bench`` registers them."""
    import typer
    from typer.testing import CliRunner

    from lmcache.benchmarks import dist as bench_dist

    app = typer.Typer()
    app.command("controller")(bench_dist.lookup_cmd)
    app.command("p2p")(bench_dist.p2p_cmd)
    r = CliRunner().invoke(app, ["controller", "--help"])
    assert r.exit_code == 0 and "--instances" in r.output and "--count" in r.output
    r = CliRunner().invoke(app, ["p2p", "--help"])
    assert r.exit_code == 0 and "--chunks" in r.output and "--repeats" in r.output


def test_held_prefixes():
    from lmcache.benchmarks.dist import held_prefixes

    assert held_prefixes(3, 8192, 256) == [2560, 5376, 8192]
    assert held_prefixes(1, 1024, 256) == [1024]
    assert held_prefixes(4, 300, 256) == [256, 256, 256, 300]
