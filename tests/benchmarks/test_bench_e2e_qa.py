"""``lmcache bench e2e --workload qa --quick``: the multi-round QA workload, run small in a
subprocess with the real model (no timing assertions: only behaviour)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_e2e_qa_quick(smollm2, tmp_path):
    # smollm2: the real model must be installed (a clear skip or failure otherwise)
    png = tmp_path / "qa.png"
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", "bench", "e2e", "--workload", "qa", "--quick", "--json",
         "--plot", str(png)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)  # --json: nothing else on stdout
    assert data["benchmark"] == "e2e-qa"
    s = data["settings"]
    assert (s["users"], s["rounds"], s["quick"]) == (2, 2, True)
    for key in ("totals", "ttft", "by_round", "speedup", "with_over_ideal", "answers", "physical", "hit_rate",
                "ideal_hit_rate", "requests", "chunks_by_tier", "engine", "seconds"):
        assert key in data, key
    for mode in ("without", "with", "ideal"):
        for stat in ("sum", "mean", "p50", "p99"):
            assert data["ttft"][mode][stat] > 0
        assert data["totals"][mode]["prefill_seconds"] > 0
    assert data["totals"]["with"]["seconds"] > 0 and data["totals"]["without"]["seconds"] > 0
    assert data["physical"]["memcpy_gbps"] > 0

    reqs = data["requests"]
    assert len(reqs) == 4
    # round-robin arrival: user 1 and 2 of round 1, then of round 2
    assert [(r["user"], r["round"]) for r in reqs] == [(1, 1), (2, 1), (1, 2), (2, 2)]
    # greedy float32: lmcache changes no answer
    assert data["answers"] == {"requests": 4, "identical": 4, "mismatches": []}
    assert all(r["same_answer"] and r["answer_with"] == r["answer_without"] for r in reqs)
    # growing history: a user's next prompt extends the previous one and its answer
    for r1, r2 in ((reqs[0], reqs[2]), (reqs[1], reqs[3])):
        assert r2["prompt_tokens"] > r1["prompt_tokens"] + r1["answer_tokens"] - 1
    # the first request has nothing to reuse; later rounds reuse their conversation
    assert reqs[0]["cached_tokens"] == 0 and reqs[0]["unseen_tokens"] == reqs[0]["prompt_tokens"]
    for r in reqs[2:]:
        assert r["cached_tokens"] > 0 and r["cached_tokens"] % s["chunk_size"] == 0
        assert r["cached_tokens"] <= r["prompt_tokens"] - r["unseen_tokens"]  # never more than the ideal
    later = [b for b in data["by_round"] if b["round"] >= 2]
    assert later and all(b["hit_rate"] > 0 for b in later)
    assert data["hit_rate_rounds_2_plus"] > 0 and 0 < data["hit_rate"] <= data["ideal_hit_rate"] < 1
    t = data["totals"]
    assert t["with"]["reused_tokens"] + t["with"]["prefilled_tokens"] == data["prompt_tokens"]
    assert t["with"]["reused_tokens"] == sum(r["cached_tokens"] for r in reqs)
    assert sum(data["chunks_by_tier"].values()) == sum(sum(r["tiers"].values()) for r in reqs) > 0
    assert png.stat().st_size > 0 and data["plot"] == str(png)
