"""``lmcache bench compare``: a small run through lmcache and through the real LMCache 0.5.6
in its own virtualenv (``make bench-compare``), checking the report's shape, that both
sides ran and that every byte and every lookup came back right (no timing assertions)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from _missing import missing

ROOT = Path(__file__).resolve().parents[2]
REF_VENV = ROOT / ".venv-lmcache-ref"
LMCACHE = Path(sys.executable).with_name("lmcache")


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(LMCACHE), "bench", "compare", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200"})


def test_bench_compare_quick_json(tmp_path):
    if not (REF_VENV / "bin" / "python").exists():
        missing(f"{REF_VENV.name} is absent: run `make bench-compare` to build the LMCache 0.5.6 reference venv")
    proc = _run("--quick", "--json", "--dir", str(tmp_path), "--passes", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)  # nothing but JSON on stdout
    assert data["benchmark"] == "compare"
    spec = data["spec"]
    assert spec["chunk_size"] == 256 and [s["name"] for s in spec["shapes"]] == ["llama3-8b", "smollm2"]

    # both sides ran, LMCache from its own venv (never this repository's package)
    ref = data["lmcache"]
    assert ref["side"] == "LMCache" and ref["lmcache_version"] == "0.5.6"
    assert ref["lmcache_path"].startswith(str(REF_VENV.resolve())) and not ref["lmcache_path"].startswith(str(ROOT / "lmcache"))
    for side in (data["ours"], ref):
        assert {(t["shape"], t["tier"]) for t in side["tiers"]} == {
            (s, t) for s in ("llama3-8b", "smollm2") for t in ("cpu", "disk")}
        for t in side["tiers"]:
            assert t["exact"] and t["complete"], t
            assert t["chunks"] == spec["chunks"] and t["stored_chunks"] == spec["chunks"]
            assert t["store_gbps"] > 0 and t["retrieve_gbps"] > 0 and len(t["store_seconds"]) == spec["store_rounds"]
        assert {(r["input"], r["tokens"]) for r in side["lookup"]} == {
            (i, n) for i in spec["lookup_inputs"] for n in spec["lookup_lengths"]}
        for r in side["lookup"]:
            assert r["exact"] and r["lookup"]["hit_tokens"] == r["tokens"] and r["chunks"] == r["tokens"] // 256
            assert r["hash"]["calls"] >= spec["lookup_min_calls"] and r["lookup"]["p99_ms"] >= r["lookup"]["p50_ms"] > 0
    # the same bytes per chunk on both sides
    theirs = {(t["shape"], t["tier"]): t for t in ref["tiers"]}
    for t in data["ours"]["tiers"]:
        assert t["chunk_bytes"] == theirs[(t["shape"], t["tier"])]["chunk_bytes"]
        assert t["bytes"] == theirs[(t["shape"], t["tier"])]["bytes"]

    # CPU over disk: SmolLM2 fp32, 16 chunks from one buffer, torch's default threads, both sides
    od = spec["cpu_over_disk"]
    assert (od["layers"], od["kv_heads"], od["head_size"], od["dtype"], od["chunks"]) == (30, 3, 64, "float32", 16)
    for side in (data["ours"], ref):
        t = side["cpu_over_disk"]
        assert t["exact"] and t["complete"] and t["threads"] == od["threads"], t
        assert t["stored_chunks"] == t["disk_chunks"] == 16 and t["bytes"] == od["bytes"] == 16 * 256 * 46080
        # two passes, the sides in turn (--passes 2): every round of both in each figure
        assert t["passes"] == 2
        assert len(t["store_seconds"]) == 2 * od["repeats"] and t["store_gbps"] > 0
        # persist (store+flush) per store round; a fresh disk-only engine's hit per round
        assert len(t["persist_seconds"]) == 2 * od["repeats"] and t["persist_gbps"] > 0
        assert all(p >= s for p, s in zip(t["persist_seconds"], t["store_seconds"]))
        assert len(t["hit_seconds"]) == 2 * od["hit_repeats"] and t["hit_gbps"] > 0
        assert t["hit_gbps"] == pytest.approx(t["bytes"] / statistics.median(t["hit_seconds"]) / 1e9)
        assert t["hit_exact"] and t["hit_tokens"] == 16 * 256
    assert ref["cpu_over_disk"]["backends"] == ["LocalCPUBackend", "LocalDiskBackend"]
    # the restart case (ours only: LMCache 0.5.6 does not reopen a directory): a new process
    # per round, its first retrieve over a CPU tier and the disk tier, every byte right
    ours = data["ours"]["cpu_over_disk"]
    assert len(ours["restart_seconds"]) == 2 * od["hit_repeats"] and ours["restart_gbps"] > 0
    assert ours["restart_gbps"] == pytest.approx(ours["bytes"] / statistics.median(ours["restart_seconds"]) / 1e9)
    assert "restart_seconds" not in ref["cpu_over_disk"]

    assert data["exact"] == {"ours": True, "lmcache": True} and data["complete"] == {"ours": True, "lmcache": True}
    assert data["physical"]["memcpy_gbps"] > 0 and set(data["physical"]["file_io"]) == {"llama3-8b", "smollm2"}
    assert data["physical"]["memcpy_over_disk_gbps"] > 0
    assert set(data["physical"]["over_disk"]) == {"memcpy", "write", "read", "scatter", "persist", "hit"}
    assert all(v > 0 for v in data["physical"]["over_disk"].values())
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 3 + 4 + 2 * len(spec["lookup_inputs"]) * len(spec["lookup_lengths"])
    for name, limit in (("cpu over disk smollm2 float32 store", "memcpy"),
                        ("cpu over disk smollm2 float32 persist (store+flush)", "memcpy + raw write"),
                        ("disk hit smollm2 float32, fresh engine, page cache", "page-cache read"),
                        ("disk hit smollm2 float32, fresh process (restart", "page-cache read")):
        assert [r["limit"].split(" (")[0] for r in rows if r["workload"].startswith(name)] == [limit], name
    for r in rows:
        assert r["ours"] > 0 and r["lmcache"] > 0 and r["ours_over_lmcache"] > 0 and r["exact"]
        assert r["limit"] and r["ours_vs_limit"] > 0 and r["lmcache_vs_limit"] > 0
    assert set(data["goals"]) >= {"lookup_at_least_5x", "tiers_at_least_lmcache", "losses"}


def test_bench_compare_without_ref_venv_says_how_to_build_it(tmp_path):
    proc = _run("--quick", "--ref-venv", str(tmp_path / "nowhere"), timeout=120)
    assert proc.returncode != 0 and proc.stdout == ""
    assert "make bench-compare" in proc.stderr and "Traceback" not in proc.stderr
