"""``lmcache bench controller``'s index part, run tiny as a user runs it: the lookup rows per
chunk count (memory, and valkey with its raw pipelined reads when the valkey index is
in this lmcache), the memory per million entries, and the failover gaps. The numbers
are not asserted; the fields and the invariants of a correct run are (0 failed lookups
across a SIGKILLed controller replica)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HANG = 300  # a guard against a hung child, not a timing assertion


def test_bench_controller_index_part_reports_every_field():
    r = subprocess.run([sys.executable, "-m", "lmcache.cli.main", "bench", "controller", "--instances", "2",
                        "--tokens", "512", "--count", "10", "--chunks", "2,8", "--entries", "400", "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=HANG)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)["index"]
    assert d["chunks"] == [2, 8]
    valkey = d["valkey"] == "available"
    assert valkey or d["valkey"].startswith("valkey index not available: "), d["valkey"]
    kinds = ["memory", "valkey"] if valkey else ["memory"]
    assert [(x["index"], x["chunks"]) for x in d["lookups"]] == [(k, c) for k in kinds for c in (2, 8)]
    for row in d["lookups"]:
        for side in ("direct_ms", "http_ms"):
            assert set(row[side]) == {"p50", "p99"} and 0 < row[side]["p50"] <= row[side]["p99"]
        assert row["direct_per_s"] > 0 and row["http_per_s"] > 0
        if row["index"] == "valkey":  # next to the raw pipelined reads of the same keys
            assert row["raw_pipeline_ms"]["p50"] > 0 and row["ratio_direct_to_raw_p50"] > 0
        else:
            assert "raw_pipeline_ms" not in row
    assert [m["index"] for m in d["memory"]] == kinds
    for m in d["memory"]:
        assert m["entries"] == 400 and m["bytes_per_entry"] > 0 and m["gib_for_10m"] >= 0
    names = [(f["what"], f["index"]) for f in d["failover"]]
    assert names[0] == ("controller replica SIGKILLed", "memory")
    if valkey:
        assert names[1:] == [("controller replica SIGKILLed", "valkey"),
                             ("valkey primary SIGKILLed (Sentinel)", "valkey+sentinel")]
    for f in d["failover"]:
        assert f["lookups"] > 0 and f["answered_again_after_ms"] is not None
        if f["what"] == "controller replica SIGKILLed":
            assert f["failed"] == 0, f  # a client with two URLs loses no lookup
        else:  # the primary's kill: Sentinel's promotion, timed next to the lookups' gap
            assert f["sentinel_down_after_ms"] > 0 and f["promoted_after_ms"] is not None, f
            # answered from the replica meanwhile (issue 45): none failed, none missed the instance
            assert f["failed"] == 0 and f["incomplete"] == 0 and f["stale"] > 0, f


def test_bench_controller_human_output_and_bad_chunks():
    r = subprocess.run([sys.executable, "-m", "lmcache.cli.main", "bench", "controller", "--instances", "1",
                        "--tokens", "256", "--count", "5", "--chunks", "4", "--entries", "40", "--no-failover"],
                       capture_output=True, text=True, cwd=ROOT, timeout=HANG)
    assert r.returncode == 0, r.stderr
    assert "index lookups by chunk hashes" in r.stdout and "index memory, memory:" in r.stdout
    assert "failover:" not in r.stdout
    r = subprocess.run([sys.executable, "-m", "lmcache.cli.main", "bench", "controller", "--chunks", "0,8"],
                       capture_output=True, text=True, cwd=ROOT, timeout=HANG)
    assert r.returncode != 0 and r.stderr.startswith("lmcache: error:") and "--chunks" in r.stderr
