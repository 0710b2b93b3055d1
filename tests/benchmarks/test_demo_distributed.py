"""``lmcache demo distributed``: the 3-instance walk-through runs end to end with the real
model and its checks pass.

The walk-through is one run of real processes (a controller and three model instances),
so it is run once and every assertion reads its output: the check lines it prints are
what a user sees, and the product-level facts (a P2P hit skipped the prefill, the killed
instance left the lookups) are read back from the real CLI output it pasted.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HANG = 300.0  # a generous guard on the whole run, not a timing assertion


def _command() -> list[str]:
    """``lmcache demo distributed``, as users run it."""
    return [sys.executable, "-m", "lmcache.cli.main", "demo", "distributed"]


@pytest.fixture(scope="module")
def run(smollm2):
    """The walk-through's stdout and stderr (the model fixture only makes sure the model is there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env["HF_HUB_OFFLINE"] = "1"
    p = subprocess.run(_command(), capture_output=True, text=True, timeout=HANG, cwd=ROOT, env=env)
    return p


def _section(text: str, start: str, end: str | None = None) -> str:
    i = text.index(start)
    j = text.index(end, i) if end else len(text)
    return text[i:j]


def _output_lines(text: str) -> str:
    """The commands' own output: the demo's commentary and check lines are indented."""
    return "\n".join(line for line in text.splitlines()[1:] if line and not line.startswith((" ", "$")))


def test_walk_through_passes_every_check(run):
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^PASS: all (\d+) checks passed", run.stdout, re.M), run.stdout[-2000:]
    checks = re.findall(r"^  check: (.*): (ok|FAILED)$", run.stdout, re.M)
    assert len(checks) >= 10 and all(ok == "ok" for _, ok in checks), checks


def test_p2p_fetch_skipped_the_prefill_with_the_same_answer(run):
    step = _section(run.stdout, "3. prompt 1 on peer-c", "4. prefill -> decode")
    m = re.search(r"the prefill of ([\d,]+) tokens was skipped", step)
    assert m and int(m.group(1).replace(",", "")) > 0, step
    assert re.search(r"p2p: [1-9]\d* chunks .* fetched from prefill-a", step), step
    assert "answer is identical to prefill-a's full-prefill answer: ok" in step


def test_pushed_kv_serves_the_decode_instance(run):
    step = _section(run.stdout, "4. prefill -> decode", "5. the operator moves")
    assert '"missing": []' in step and "/v1/push" in step
    m = re.search(r"decode-b: prompt [\d,]+ tokens, cached ([\d,]+)", step)
    assert m and int(m.group(1).replace(",", "")) > 0, step
    assert "decode-b's answer is identical to its answer without lmcache: ok" in step


def test_lookup_and_move_show_the_real_cli_output(run):
    step2 = _section(run.stdout, "2. a KV-aware router", "3. prompt 1 on peer-c")
    assert "$ lmcache controller lookup --url http://127.0.0.1:" in step2
    assert re.search(r"^prefill-a\s+\d+ tokens\s+\(tiers: cpu \d+\)$", step2, re.M), step2
    step5 = _section(run.stdout, "5. the operator moves", "6. prefill-a dies")
    assert re.search(r"decode-b/cpu -> peer-c/cpu: sent [1-9]\d* chunks", step5), step5
    after = _output_lines(step5.split("$ lmcache controller lookup", 1)[1])
    assert re.search(r"^peer-c\s+\d+ tokens", after, re.M) and "decode-b" not in after, after


def test_the_killed_instance_is_gone(run):
    step = _section(run.stdout, "6. prefill-a dies", "PASS")
    table = step.split("$ lmcache controller instances", 1)[1].split("$ lmcache controller lookup", 1)[0]
    row = next(line for line in table.splitlines() if "prefill-a" in line)
    assert re.search(r"prefill-a\W+NO\b", row), row
    lookups = _output_lines(step.split("$ lmcache controller lookup", 1)[1])
    assert "prefill-a" not in lookups, lookups
    assert len(re.findall(r"^peer-c\s+\d+ tokens", lookups, re.M)) == 2, lookups


def test_an_instance_that_cannot_start_is_an_error_not_a_hang(tmp_path):
    """A broken instance (here: its spec file is missing) is reported with its log, promptly."""
    from lmcache.demos.distributed import Instance
    from lmcache.errors import LMCacheError

    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    inst = Instance("broken", tmp_path / "missing.json", tmp_path / "broken.log", env)
    t0 = time.monotonic()
    try:
        with pytest.raises(LMCacheError, match=r"broken exited \(code [1-9]"):
            inst.reply(timeout=60)
        assert time.monotonic() - t0 < 60  # a hang guard: it did not wait for the timeout
    finally:
        inst.stop()


def test_instance_roles():
    from lmcache.demos.distributed import DECODE, PEER, PREFILL, instance_config

    cfgs = {i: instance_config(i, "http://127.0.0.1:1", "c", "p", "a", 256, 0.5, "256MiB") for i in (PREFILL, DECODE, PEER)}
    assert [c["p2p"]["fetch"] for c in cfgs.values()] == [True, False, True]  # decode gets only what is pushed
    for iid, c in cfgs.items():
        assert c["controller"]["instance_id"] == iid and c["api"]["enabled"] and c["p2p"]["enabled"]
        assert c["api"]["token"] and c["p2p"]["token"] and c["controller"]["token"]
