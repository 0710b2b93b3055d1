"""``lmcache bench truncation --quick``: the report's shape, and that shifted reuse found what
the prefix cache could not (no timing assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LMCACHE = Path(sys.executable).with_name("lmcache")


# a hang guard as long as the subprocess's own timeout: beside the engines' suites (make
# test runs them in parallel) this took over 300 s on a fresh clone, against 68 s alone
@pytest.mark.timeout(900)
def test_bench_truncation_quick_json():
    proc = subprocess.run([str(LMCACHE), "bench", "truncation", "--quick", "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    rows = {(r["workload"], r["mode"]): r for r in data["rows"]}
    assert set(rows) == {(w, m) for w in ("doc", "chat") for m in ("full", "prefix", "shifted-15", "full-bf16")}
    assert data["physical"]["memcpy_gbps"] > 0 and data["settings"]["chunk_size"] == 32
    for w in ("doc", "chat"):
        full, prefix, shifted = rows[w, "full"], rows[w, "prefix"], rows[w, "shifted-15"]
        assert full["hit_rate"] == 0 and full["top1"] == 1 and full["greedy_match"] == 1 and full["ppl_ratio"] == 1
        assert prefix["hit_rate"] < 0.2  # the cut leaves the exact prefix cache nothing past the system prompt
        assert shifted["hit_rate"] > 0.5 > prefix["hit_rate"] and 0 < shifted["recomputed_rate"] < shifted["hit_rate"]
        assert 0 <= shifted["top1"] <= 1 and 0 <= shifted["greedy_match"] <= 1 and shifted["ppl"] > 0
        assert shifted["load_gbps"] and shifted["ttft_p50"] > 0
        # the model in bf16, computing everything: no cache, compared with the fp32 reference
        bf16 = rows[w, "full-bf16"]
        assert bf16["hit_rate"] == 0 and bf16["load_gbps"] is None and 0 <= bf16["greedy_match"] <= 1 and bf16["ppl"] > 0
    assert set(data["goals"]) >= {"hit_rate_ok", "top1_ok", "greedy_ok", "speedup_ok"}


def test_bad_modes_and_windows_are_one_line_errors():
    for args, hint in ((["--modes", "full,shifted-x"], "unknown mode 'shifted-x'"), (["--windows", "8"], "at least 16"),
                       (["--modes", "shifted-15-random"], "unknown mode 'shifted-15-random'")):
        proc = subprocess.run([str(LMCACHE), "bench", "truncation", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "COLUMNS": "200"})
        assert proc.returncode == 2 and hint in proc.stderr, proc.stderr
