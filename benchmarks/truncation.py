"""``lmcache bench truncation``: reuse when a sliding window cuts the oldest tokens.

SmolLM2-135M-Instruct on the CPU through the transformers connector reads two workloads
with a sliding window (the system prompt + the last ``W`` tokens, for several ``W``):

- **doc**: a long document read in steps of ``W / 8`` tokens; each prompt is the system
  prompt and the window, the held-out text the document's next 32 tokens;
- **chat**: a conversation (the handbook's prose as answers of ``W / 8`` tokens, fixed
  questions); each prompt
  is the system prompt, the last ``W`` tokens of the conversation and the new question,
  the held-out text the answer that follows.

Each mode runs the same prompts in order through its own engine (a CPU tier), storing
each prompt's KV as a server would: ``full`` (no cache: the reference), ``prefix`` (the
exact prefix cache), ``shifted-F`` (``approximate_reuse`` with ``recompute: F`` and the default
``select``), ``shifted-F-SELECT`` (and ``select: SELECT``), and, asked for by name, ``full-bf16`` (no cache,
the model in bf16, the precision GPU engines serve in: how far the quality metrics move for
a change that nobody calls approximate). For the
prompts after the first of each window size it reports the token hit rate (prompt tokens
the cache had: ``reused`` tokens taken as they are plus ``recomputed`` ones), TTFT and its
speed-up over ``full``, the first token's top-1 agreement with ``full``, the agreement of 32
greedy tokens (per position, and whole runs identical), and the perplexity of the held-out
text given the prompt's KV. Next to them, in the same run: memcpy GB/s, and the load of
reused KV as a ratio to it.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

from . import harness
from .harness import err, out

SYSTEM = "You are a careful assistant. Answer from the conversation and the documents above.\n"
QUESTIONS = ("What changed since the last step?", "Which part matters most here?", "Summarize the key point.",
             "What should the reader remember?", "How does this connect to what came before?",
             "What is the next thing to check?", "Name one risk in this.", "What is the main claim?")
PLAIN = ("full", "full-bf16")  # computed from scratch, no cache
DEFAULT_MODES = ("full", "prefix", "shifted-0", "shifted-5", "shifted-15", "shifted-30", "shifted-15-deviation")
SELECTS = ("leading", "deviation", "chunk_starts")
DEFAULT_FRACTION = "shifted-15"
GREEDY = 32
GOALS = {"hit_rate": 0.80, "prefix_hit_rate_below": 0.50, "top1": 0.97, "greedy_match": 0.90, "speedup_at_3k": 3.0}


def _prompts(tok: Any, workload: str, window: int, steps: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``steps + 1`` (prompt, held-out) pairs; the first only fills the cache."""
    from .handbook import prose_ids

    system = tok(SYSTEM)["input_ids"]
    stride = max(window // 8, 1)  # new tokens per step: an eighth of the window
    if workload == "doc":
        doc = prose_ids(tok, window + steps * stride + GREEDY, seed)
        return [(system + doc[e - window : e], doc[e : e + GREEDY])
                for e in (window + t * stride for t in range(steps + 1))]
    prose = prose_ids(tok, window + (steps + 1) * (stride + GREEDY), seed + 1)
    history, at, pairs = list(prose[:window]), window, []
    for t in range(steps + 1):
        ask = tok(f"\nUser: {QUESTIONS[t % len(QUESTIONS)]}\nAssistant:")["input_ids"]
        answer = prose[at : at + stride]
        at += stride
        pairs.append((system + history[-window:] + ask, answer[:GREEDY]))
        history += ask + answer
    return pairs


def shifted_mode(mode: str) -> dict[str, Any] | None:
    """The ``approximate_reuse`` settings of ``shifted-F`` or ``shifted-F-SELECT``, else ``None``."""
    head, _, rest = mode.partition("-")
    frac, _, select = rest.partition("-")
    if head != "shifted" or not frac.isdigit() or int(frac) > 100 or (select and select not in SELECTS):
        return None
    return {"enabled": True, "recompute": int(frac) / 100, **({"select": select} if select else {})}


def _engine(mode: str, chunk_size: int, kv_spec: Any) -> Any:
    import lmcache

    approx = shifted_mode(mode) or {"enabled": False}
    cfg = {"chunk_size": chunk_size, "tiers": [{"backend": "cpu", "capacity": "2GiB"}], "memory_pool_prefault": False,
           "approximate_reuse": approx}
    return lmcache.CacheEngine.from_config(cfg, kv_spec=kv_spec)


def _after_prefill(model: Any, pre: Any, held: list[int]) -> tuple[list[int], float]:
    """Greedy tokens from the prefill's state, and the perplexity of ``held`` given it."""
    import torch

    from lmcache.plugins.connectors.hf import _cache_of

    cache = pre.cache
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([held]), cache=cache, use_cache=True)
        logp = torch.log_softmax(torch.cat([pre.logits[None], out.logits[0, :-1].float()]), -1)
        nll = -logp[torch.arange(len(held)), torch.tensor(held)].mean().item()
        cache = _cache_of(out, cache)
        cache.crop(-len(held))  # back to the prompt
        tokens, logits = [], pre.logits
        for _ in range(GREEDY):
            tokens.append(int(logits.argmax()))
            o = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            cache, logits = _cache_of(o, cache), o.logits[0, -1].float()
    return tokens, math.exp(nll)


def run(model: Any, tok: Any, workloads: list[str], windows: list[int], modes: list[str], steps: int,
        chunk_size: int, seed: int, progress: Any = None) -> list[dict[str, Any]]:
    import lmcache

    Conn = lmcache.connector("transformers")
    rows = []
    bf16 = None
    for workload in workloads:
        for window in windows:
            pairs = _prompts(tok, workload, window, steps, seed)
            ref: list[dict[str, Any]] = []
            for mode in ["full"] + [m for m in modes if m != "full"]:
                if progress:
                    progress(f"{workload}, window {window}, {mode}")
                samples = []
                m = model
                if mode == "full-bf16":
                    if bf16 is None:
                        import copy

                        import torch

                        bf16 = copy.deepcopy(model).to(torch.bfloat16)
                    m = bf16
                with _engine(mode, chunk_size, Conn.kv_spec_of(m)) as engine:
                    conn = Conn(m, tok, engine)
                    for i, (prompt, held) in enumerate(pairs):
                        pre = conn.prefill(prompt, use_cache=mode not in PLAIN, store=mode not in PLAIN)
                        if i == 0:
                            continue  # the cold prompt only fills the cache
                        greedy, ppl = _after_prefill(m, pre, held)
                        samples.append({"prompt_tokens": pre.prompt_tokens, "cached": pre.cached_tokens,
                                        "shifted": pre.shifted_tokens, "recomputed": pre.recomputed_tokens,
                                        "ttft": pre.ttft, "load_seconds": pre.load_seconds,
                                        "kv_bytes": pre.kv_bytes_loaded, "first": int(pre.logits.argmax()),
                                        "greedy": greedy, "ppl": ppl})
                if mode == "full":
                    ref = samples
                if mode in modes:
                    rows.append(_summary(workload, window, mode, samples, ref))
    return rows


def _summary(workload: str, window: int, mode: str, samples: list[dict], ref: list[dict]) -> dict[str, Any]:
    tokens = sum(s["prompt_tokens"] for s in samples)
    ttft = statistics.median(s["ttft"] for s in samples)
    full = statistics.median(s["ttft"] for s in ref)
    load_s, load_b = sum(s["load_seconds"] for s in samples), sum(s["kv_bytes"] for s in samples)
    match = [sum(a == b for a, b in zip(s["greedy"], r["greedy"])) / GREEDY for s, r in zip(samples, ref)]
    return {
        "workload": workload, "window": window, "mode": mode, "prompts": len(samples),
        "prompt_tokens": round(tokens / len(samples)),
        "hit_rate": (sum(s["cached"] for s in samples) + sum(s["recomputed"] for s in samples)) / tokens,
        "reused_rate": sum(s["cached"] for s in samples) / tokens,
        "recomputed_rate": sum(s["recomputed"] for s in samples) / tokens,
        "ttft_p50": ttft, "speedup": full / ttft,
        "load_gbps": load_b / load_s / harness.GB if load_s > 0 and load_b else None,
        "top1": sum(s["first"] == r["first"] for s, r in zip(samples, ref)) / len(samples),
        "greedy_match": statistics.mean(match),
        "greedy_identical": sum(m == 1.0 for m in match) / len(match),
        "ppl": statistics.mean(s["ppl"] for s in samples),
        "ppl_ratio": statistics.mean(s["ppl"] for s in samples) / statistics.mean(r["ppl"] for r in ref),
    }


def goals(rows: list[dict], default: str = DEFAULT_FRACTION) -> dict[str, Any]:
    """The issue's goals, checked on the rows of the default fraction (and the prefix cache)."""
    chosen = [r for r in rows if r["mode"] == default]
    prefix = {(r["workload"], r["window"]): r["hit_rate"] for r in rows if r["mode"] == "prefix"}
    if not chosen:
        return {}
    n = sum(r["prompts"] for r in chosen)
    pooled = {k: sum(r[k] * r["prompts"] for r in chosen) / n for k in ("top1", "greedy_match")}
    longest = max(r["window"] for r in chosen)
    speed = min(r["speedup"] for r in chosen if r["window"] == longest)
    hit = min(r["hit_rate"] for r in chosen)
    return {
        "mode": default,
        "hit_rate_min": hit, "hit_rate_ok": hit >= GOALS["hit_rate"],
        "prefix_hit_rate_max": max(prefix.values()) if prefix else None,
        "top1": pooled["top1"], "top1_ok": pooled["top1"] >= GOALS["top1"],
        "greedy_match": pooled["greedy_match"], "greedy_ok": pooled["greedy_match"] >= GOALS["greedy_match"],
        "speedup_longest_window": speed, "longest_window": longest, "speedup_ok": speed >= GOALS["speedup_at_3k"],
    }


def print_table(data: dict[str, Any]) -> None:
    from rich.table import Table

    o = out()
    m = data["machine"]
    o.print(f"[bold]lmcache bench truncation[/]: {data['model']} on {m['cpus']} CPUs, chunk {data['settings']['chunk_size']}, "
            f"memcpy {data['physical']['memcpy_gbps']:.1f} GB/s")
    t = Table(show_lines=False)
    for c in ("workload", "W", "mode", "tokens", "hit", "reused", "TTFT s", "vs full", "load/memcpy", "top-1",
              "greedy", "identical", "ppl", "ppl/full"):
        t.add_column(c, justify="right")
    mem = data["physical"]["memcpy_gbps"]
    for r in data["rows"]:
        lg = f"{r['load_gbps'] / mem:.2f}" if r["load_gbps"] else "-"
        t.add_row(r["workload"], str(r["window"]), r["mode"], str(r["prompt_tokens"]), f"{r['hit_rate']:.0%}",
                  f"{r['reused_rate']:.0%}", f"{r['ttft_p50']:.2f}", f"{r['speedup']:.1f}x", lg, f"{r['top1']:.0%}",
                  f"{r['greedy_match']:.0%}", f"{r['greedy_identical']:.0%}", f"{r['ppl']:.2f}", f"{r['ppl_ratio']:.3f}")
    o.print(t)
    g = data["goals"]
    if g:
        o.print(f"goals at {g['mode']}: hit >= 80% {g['hit_rate_ok']} (min {g['hit_rate_min']:.0%}); top-1 >= 97% "
                f"{g['top1_ok']} ({g['top1']:.1%}); greedy >= 90% {g['greedy_ok']} ({g['greedy_match']:.1%}); "
                f">= 3x at W={g['longest_window']} {g['speedup_ok']} ({g['speedup_longest_window']:.1f}x)")


def plot(data: dict[str, Any], path: Path) -> None:
    plt = harness.pyplot()
    rows = data["rows"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    groups = list(dict.fromkeys((r["workload"], r["window"]) for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        by = {(r["workload"], r["window"]): r for r in rows if r["mode"] == mode}
        xs = [i + j * width for i in range(len(groups))]
        for ax, key in zip(axes, ("speedup", "hit_rate", "greedy_match")):
            ax.bar(xs, [by[g][key] if g in by else 0 for g in groups], width, label=mode)
    labels = [f"{w}\nW={n}" for w, n in groups]
    for ax, title in zip(axes, ("TTFT speed-up over full recompute", "token hit rate", "greedy agreement (32 tokens)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], labels)
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"lmcache bench truncation: {data['model']}, CPU, chunk {data['settings']['chunk_size']}")
    harness.save_figure(fig, path, dpi=110)


def main(workloads: list[str], windows: list[int], modes: list[str], steps: int, chunk_size: int, seed: int,
         threads: int | None, as_json: bool, plot_path: Path | None) -> None:
    """``lmcache bench truncation`` (options in :mod:`lmcache.benchmarks.commands`)."""
    from .handbook import MODEL_KEY, load_model, warm_up

    harness.need_pyplot(plot_path)
    harness.set_threads(threads)
    e = err()
    started = time.perf_counter()
    machine = harness.machine_info()
    harness.warn_if_busy(machine)
    model, tok, load_info = load_model(e)
    physical = {"memcpy_gbps": harness.memcpy_gbps()}
    with e.status("warming up the model ...") as st:
        warm_up(model, tok, max(windows) + 64)
        rows = run(model, tok, workloads, windows, modes, steps, chunk_size, seed, lambda m: st.update(m + " ..."))
    data = {
        "benchmark": "truncation", "model": MODEL_KEY, "machine": machine, "physical": physical,
        "settings": {"workloads": workloads, "windows": windows, "modes": modes, "steps": steps,
                     "chunk_size": chunk_size, "seed": seed, "greedy_tokens": GREEDY,
                     "hit_rate": "prompt tokens whose KV the cache had (reused as is, or recomputed by choice)",
                     "ttft": "median over the prompts after the first of each window",
                     "reference": "full: every prompt computed from scratch (no cache)"},
        "rows": rows, "goals": goals(rows), "seconds": time.perf_counter() - started,
    }
    harness.emit(data, as_json, print_table, plot_path, plot)


__all__ = ["main", "run", "goals", "shifted_mode"]
