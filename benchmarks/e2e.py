"""``lmcache bench e2e``: time to first token with a real model, with and without lmcache.

For prompts of several lengths (default 1k, 2k and 4k tokens of the demo handbook's
prose), SmolLM2-135M-Instruct on the CPU through the transformers connector measures:

- **full prefill**: no cache; the model computes every prompt token (the first run also
  stores the KV, after its TTFT was taken);
- **cpu hit**: the same prompt again; all but the last token come from the CPU tier;
- **disk hit**: a fresh engine with only the disk tier on the same directory (so the KV
  really is read from files: the first engine wrote them, write-through) and the same
  model object; all but the last token come from disk. Without root the page cache
  cannot be dropped, so the reads most likely come from memory;
- **suffix compute**: the forward of the last prompt token given an already-built model
  cache of the others: what a hit cannot avoid. ``hit TTFT - KV load`` is reported too.

Next to them, in the same run: memcpy GB/s (torch ``copy_``, best of 10) and raw file
read GB/s (``os.readv`` of chunk-sized files in the same directory, best of 3). The ideal
hit is ``KV bytes / memcpy + suffix compute`` (``/ file read`` for the disk tier), and
each hit is reported as a ratio to it.

Each TTFT is measured ``--repeats`` times (the full prefill fewer times: it is slow) and
the best is reported, like the memcpy it is compared with; every sample is in ``--json``.
One model load per process; the disk-tier engine shares the loaded model.

``--workload qa`` (:func:`qa_main`) runs a multi-round QA workload instead: several users,
each with its own document behind a shared system prompt, ask several questions each,
round-robin, every prompt carrying the conversation so far. Each request runs without
lmcache (a full prefill) and with lmcache (a CPU tier above a disk tier, the CPU tier
holding half of the workload's KV), back to back; the report gives total time, prefill
time, TTFT statistics, tokens reused and the hit rate of both, whether the greedy answers
are identical, and the ideal: per request, the forward of only the tokens that no earlier
sequence started with (measured in the same run) plus the rest's KV at memcpy speed.
"""

from __future__ import annotations

import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from lmcache.errors import LMCacheError
from lmcache.units import format_size

from . import harness
from .harness import err, need_pyplot, out, size_option

GOALS = {"cpu_speedup": 50.0, "disk_speedup": 20.0, "warm_over_ideal": 2.0}


@dataclass
class LengthResult:
    tokens: int
    prefill: list[float] = field(default_factory=list)  # TTFT samples, seconds
    cpu: list[float] = field(default_factory=list)
    cpu_load: list[float] = field(default_factory=list)  # of which: KV load (lookup, retrieve, model cache)
    disk: list[float] = field(default_factory=list)
    disk_load: list[float] = field(default_factory=list)
    suffix: list[float] = field(default_factory=list)  # the last token's forward given the cache
    cached_tokens: dict[str, int] = field(default_factory=dict)
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    kv_bytes: int = 0
    max_abs_logit_diff: dict[str, float] = field(default_factory=dict)
    same_first_token: dict[str, bool] = field(default_factory=dict)


def parse_lengths(value: str) -> list[int]:
    try:
        got = sorted({int(v) for v in value.replace(" ", "").split(",") if v})
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated token counts, got {value!r}", param_hint="'--lengths'") from None
    if not got or got[0] < 2:
        raise typer.BadParameter("every length must be at least 2 tokens", param_hint="'--lengths'")
    return got


def _best(xs: list[float]) -> float | None:
    return min(xs) if xs else None


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run(
    model: Any, tok: Any, lengths: list[int], directory: Path, *, repeats: int, prefill_repeats: int | None,
    chunk_size: int, memcpy_bytes: int, seed: int, progress: Any = None,
) -> tuple[list[LengthResult], dict[str, Any], dict[str, Any]]:
    """Measure every length; returns the results, the physical limits and engine stats."""
    import torch

    from lmcache.engine import CacheEngine
    from lmcache import connector

    TransformersConnector = connector("transformers")  # through the plugin registries
    kv_spec_of = TransformersConnector.kv_spec_of

    from .handbook import demo_config, prose_ids

    def say(msg: str) -> None:
        if progress is not None:
            progress(msg)

    spec = kv_spec_of(model)
    bpt = spec.bytes_per_token()
    total = sum(lengths) * bpt
    chunk_bytes = chunk_size * bpt
    kv_dir = directory / "kv"
    cfg = demo_config(
        chunk_size,
        [{"backend": "cpu", "capacity": total * 5 // 4 + 4 * chunk_bytes},
         {"backend": "disk", "path": str(kv_dir), "capacity": total * 2 + (64 << 20)}],
    )
    say("measuring memcpy")
    physical: dict[str, Any] = harness.measure_memcpy(memcpy_bytes)
    prompts = {n: prose_ids(tok, n, seed=seed * 1_000_003 + n) for n in lengths}
    results = {n: LengthResult(n) for n in lengths}
    reference: dict[int, torch.Tensor] = {}
    stats: dict[str, Any] = {}

    engine = CacheEngine(cfg, kv_spec=spec)
    conn = TransformersConnector(model, tok, engine)
    try:
        for n in lengths:
            r, ids = results[n], prompts[n]
            k = prefill_repeats if prefill_repeats is not None else min(repeats, 2 if n <= 2048 else 1)
            for i in range(max(1, k)):
                say(f"{n} tokens: full prefill {i + 1}/{max(1, k)}")
                p = conn.prefill(ids, use_cache=False, store=(i == 0))
                r.prefill.append(p.ttft)
                if i == 0:
                    engine.flush()  # the write-through to disk must not run during the timings below
                    reference[n] = p.logits
                    say(f"{n} tokens: suffix compute")
                    cache = p.cache  # KV of all n tokens
                    x = torch.tensor([[ids[-1]]], dtype=torch.long)
                    with torch.inference_mode():
                        for _ in range(repeats):
                            cache.crop(-1)
                            t0 = time.perf_counter()
                            model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
                            r.suffix.append(time.perf_counter() - t0)
                del p
                cache = None
            for i in range(repeats):
                say(f"{n} tokens: cpu-tier hit {i + 1}/{repeats}")
                h = conn.prefill(ids, store=False)
                r.cpu.append(h.ttft)
                r.cpu_load.append(h.load_seconds)
                _record(r, "cpu", h, reference[n])
                h = None  # free its model cache before the next sample
        engine.flush()
        stats["first_engine"] = engine.stats()
    finally:
        engine.close()

    say("measuring raw file I/O")
    biggest = max(lengths) * bpt
    physical.update(harness.measure_file_io(directory, chunk_bytes, max(biggest, chunk_bytes)))

    disk_cfg = demo_config(
        chunk_size,
        [{"backend": "disk", "path": str(kv_dir), "capacity": total * 2 + (64 << 20)}],
        memory_pool_size=biggest * 5 // 4 + 2 * chunk_bytes,
    )
    t0 = time.perf_counter()
    engine = CacheEngine(disk_cfg, kv_spec=spec)
    stats["disk_open_seconds"] = time.perf_counter() - t0
    conn = TransformersConnector(model, tok, engine)
    try:
        for n in lengths:
            r, ids = results[n], prompts[n]
            for i in range(repeats):
                say(f"{n} tokens: disk-tier hit {i + 1}/{repeats} (a fresh engine with only the disk tier)")
                h = conn.prefill(ids, store=False)
                r.disk.append(h.ttft)
                r.disk_load.append(h.load_seconds)
                _record(r, "disk", h, reference[n])
                h = None
        stats["disk_engine"] = engine.stats()
    finally:
        engine.close()
    return [results[n] for n in lengths], physical, stats


def _record(r: LengthResult, case: str, h: Any, ref: Any) -> None:
    from collections import Counter

    r.cached_tokens[case] = min(r.cached_tokens.get(case, h.cached_tokens), h.cached_tokens)
    r.tiers[case] = dict(Counter(h.tiers))
    r.kv_bytes = max(r.kv_bytes, h.kv_bytes_loaded)
    diff = float((h.logits - ref).abs().max())
    r.max_abs_logit_diff[case] = max(r.max_abs_logit_diff.get(case, 0.0), diff)
    same = int(h.logits.argmax()) == int(ref.argmax())
    r.same_first_token[case] = r.same_first_token.get(case, True) and same


def summarize(results: list[LengthResult], physical: dict[str, Any]) -> list[dict[str, Any]]:
    """Per length: best and median TTFTs, the ideal hit, and the ratios."""
    mem = physical["memcpy_gbps"] * harness.GB
    rd = physical.get("file_read_gbps", 0) * harness.GB
    rows = []
    for r in results:
        pre, cpu, disk, suf = _best(r.prefill), _best(r.cpu), _best(r.disk), _best(r.suffix)
        memcpy_s = r.kv_bytes / mem if mem else None
        read_s = r.kv_bytes / rd if rd else None
        ideal_cpu = memcpy_s + suf if memcpy_s is not None and suf is not None else None
        ideal_disk = read_s + suf if read_s is not None and suf is not None else None
        rows.append({
            "tokens": r.tokens,
            "kv_bytes": r.kv_bytes,
            "cached_tokens": r.cached_tokens,
            "tiers": r.tiers,
            "full_prefill": {"ttft": pre, "median": _med(r.prefill), "samples": r.prefill},
            "cpu_hit": {
                "ttft": cpu, "median": _med(r.cpu), "samples": r.cpu,
                "kv_load": _best(r.cpu_load), "kv_load_samples": r.cpu_load,
                "kv_load_gbps": _div(r.kv_bytes / harness.GB, _best(r.cpu_load)),
                "minus_kv_load": _best([a - b for a, b in zip(r.cpu, r.cpu_load)]),
            },
            "disk_hit": {
                "ttft": disk, "median": _med(r.disk), "samples": r.disk,
                "kv_load": _best(r.disk_load), "kv_load_samples": r.disk_load,
                "kv_load_gbps": _div(r.kv_bytes / harness.GB, _best(r.disk_load)),
                "minus_kv_load": _best([a - b for a, b in zip(r.disk, r.disk_load)]),
            },
            "suffix_compute": {"seconds": suf, "samples": r.suffix},
            "ideal": {
                "memcpy_seconds": memcpy_s, "cpu_hit": ideal_cpu,
                "file_read_seconds": read_s, "disk_hit": ideal_disk,
            },
            "ratios": {
                "prefill_over_cpu_hit": _div(pre, cpu),
                "prefill_over_disk_hit": _div(pre, disk),
                "cpu_hit_over_ideal": _div(cpu, ideal_cpu),
                "disk_hit_over_ideal": _div(disk, ideal_disk),
                "disk_hit_over_cpu_ideal": _div(disk, ideal_cpu),
            },
            "max_abs_logit_diff": r.max_abs_logit_diff,
            "same_first_token": r.same_first_token,
        })
    return rows


def goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets, read at the longest prompt."""
    top = rows[-1]
    ra = top["ratios"]
    got = {
        "cpu_speedup": ra["prefill_over_cpu_hit"],
        "disk_speedup": ra["prefill_over_disk_hit"],
        "warm_over_ideal": ra["cpu_hit_over_ideal"],
    }
    met = {
        "cpu_speedup": got["cpu_speedup"] is not None and got["cpu_speedup"] >= GOALS["cpu_speedup"],
        "disk_speedup": got["disk_speedup"] is not None and got["disk_speedup"] >= GOALS["disk_speedup"],
        "warm_over_ideal": got["warm_over_ideal"] is not None and got["warm_over_ideal"] <= GOALS["warm_over_ideal"],
    }
    return {"tokens": top["tokens"], "targets": GOALS, "measured": got, "met": met}


# --------------------------------------------------------------------------- output


def _s(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x * 1e3:,.1f} ms" if x < 1 else f"{x:,.2f} s"


def _x(x: float | None) -> str:
    return "n/a" if x is None else (f"{x:,.0f}x" if x >= 10 else f"{x:.2f}x")


def print_table(data: dict[str, Any]) -> None:
    from rich.table import Table

    o = out()
    ph = data["physical"]
    t = Table(
        title=f"lmcache bench e2e: TTFT of {data['model']['name']} on {data['machine']['cpus_usable']} CPUs "
        f"(best of the samples; GB/s = 10^9 bytes/s)",
        title_justify="left",
    )
    for col in ("tokens", "KV bytes", "full prefill", "cpu hit", "disk hit", "prefill / cpu", "prefill / disk",
                "suffix compute", "ideal (memcpy)", "cpu / ideal", "ideal (file read)", "disk / ideal"):
        t.add_column(col, justify="right")
    for r in data["lengths"]:
        ra, idl = r["ratios"], r["ideal"]
        t.add_row(
            f"{r['tokens']:,}", f"{r['kv_bytes'] / 1e6:,.1f} MB", _s(r["full_prefill"]["ttft"]), _s(r["cpu_hit"]["ttft"]),
            _s(r["disk_hit"]["ttft"]), _x(ra["prefill_over_cpu_hit"]), _x(ra["prefill_over_disk_hit"]),
            _s(r["suffix_compute"]["seconds"]), _s(idl["cpu_hit"]), _x(ra["cpu_hit_over_ideal"]),
            _s(idl["disk_hit"]), _x(ra["disk_hit_over_ideal"]),
        )
    o.print(t)
    o.print(
        f"memcpy {ph['memcpy_gbps']:.2f} GB/s (torch copy_ of {format_size(ph['memcpy_bytes'])}, best of 10); "
        f"raw file read {ph['file_read_gbps']:.2f} GB/s (os.readv of {format_size(ph['file_size'])} files, best of 3, "
        "likely from the page cache)."
    )
    loads = "; ".join(
        f"{r['tokens']:,}: cpu {_s(r['cpu_hit']['kv_load'])}, disk {_s(r['disk_hit']['kv_load'])}" for r in data["lengths"]
    )
    o.print(f"KV load inside the hits (lookup, retrieve, building the model cache): {loads}.")
    g = data["goals"]
    parts = []
    for key, label, op in (("cpu_speedup", "prefill / cpu hit", ">="), ("disk_speedup", "prefill / disk hit", ">="),
                           ("warm_over_ideal", "cpu hit / ideal", "<=")):
        word = "[green]met[/]" if g["met"][key] else "[red]missed[/]"
        parts.append(f"{label} {_x(g['measured'][key])} ({op} {g['targets'][key]:g}x: {word})")
    o.print(f"Goals at {g['tokens']:,} tokens: " + "; ".join(parts) + ".")
    worst = max(max(r["max_abs_logit_diff"].values() or [0.0]) for r in data["lengths"])
    o.print(f"Every hit gave the full prefill's first token; max |Δ| first-token logits {worst:.1e}. "
            f"{data['seconds']:.0f} s in all.")


def plot(data: dict[str, Any], path: Path) -> None:
    """TTFT per prompt length for the three cases (log scale), with the ideal hit."""
    from .harness import pyplot

    plt = pyplot()

    from matplotlib.ticker import FuncFormatter, LogLocator

    rows = data["lengths"]
    xs = list(range(len(rows)))
    width = 0.26
    fig, ax = plt.subplots(figsize=(8.5, 5), dpi=120)
    cases = [("full_prefill", "full prefill (no cache)", "#9e9e9e", None),
             ("cpu_hit", "cpu-tier hit", "#1f77b4", "cpu_hit"),
             ("disk_hit", "disk-tier hit (fresh engine, reads files)", "#ff7f0e", "disk_hit")]
    values = []
    for j, (key, label, color, ideal_key) in enumerate(cases):
        vals = [r[key]["ttft"] or 0 for r in rows]
        values += [v for v in vals if v]
        pos = [x + (j - 1) * width for x in xs]
        bars = ax.bar(pos, vals, width, label=label, color=color)
        for b, v in zip(bars, vals):
            if v:
                ax.annotate(_s(v), (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7,
                            xytext=(0, 2), textcoords="offset points")
        if ideal_key is not None:
            ideal = [r["ideal"][ideal_key] for r in rows]
            ax.hlines([v for v in ideal if v], [p - width / 2 for p, v in zip(pos, ideal) if v],
                      [p + width / 2 for p, v in zip(pos, ideal) if v], colors="black", linestyles="--", linewidth=1.5,
                      label="ideal hit: KV bytes / memcpy (disk: / file read) + suffix compute" if j == 1 else None)
    ax.set_yscale("log")
    if values:
        ax.set_ylim(min(values) / 2, max(values) * 8)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v * 1e3:g} ms" if v < 1 else f"{v:g} s"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_xticks(xs, [f"{r['tokens']:,}" for r in rows])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (log scale)")
    m = data["machine"]
    ax.set_title(f"lmcache bench e2e: {data['model']['name']}, float32, {m['cpus_usable']} CPUs "
                 f"({m.get('cpu_model') or m['machine']}), torch {m['torch']}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    ax.grid(axis="y", which="major", alpha=0.3)
    harness.save_figure(fig, path)


# --------------------------------------------------------------------------- command



def main(
    lengths: str = "1024,2048,4096",
    repeats: int = 5,
    prefill_repeats: int | None = None,
    chunk_size: int = 256,
    seed: int = 0,
    directory: Path | None = None,
    memcpy_size: str = "256MiB",
    threads: int | None = None,
    as_json: bool = False,
    plot_path: Path | None = None,
) -> None:
    """``lmcache bench e2e`` (its options are declared in :mod:`lmcache.benchmarks.commands`, which calls this)."""
    from lmcache import connector

    kv_spec_of = connector("transformers").kv_spec_of

    from .handbook import MODEL_KEY, demo_config, load_model, warm_up

    ls = parse_lengths(lengths)
    memcpy_bytes = size_option(memcpy_size, "--memcpy-size", auto=False) or (256 << 20)
    demo_config(chunk_size, [{"backend": "cpu", "capacity": 1 << 20}])  # a bad LMCACHE_* setting fails here
    need_pyplot(plot_path)
    harness.set_threads(threads)
    wd = harness.open_work_dir(directory, "lmcache-e2e-")
    e = err()
    started = time.perf_counter()
    try:
        machine = harness.machine_info(wd.path)
        harness.warn_if_busy(machine)
        model, tok, load_info = load_model(e)
        with e.status("warming up the model ...") as st:
            load_info["warm_up_seconds"] = warm_up(model, tok, max(ls))
            results, physical, stats = run(
                model, tok, ls, wd.path, repeats=repeats, prefill_repeats=prefill_repeats, chunk_size=chunk_size,
                memcpy_bytes=memcpy_bytes, seed=seed, progress=lambda m: st.update(m + " ..."),
            )
    finally:
        if wd.temporary:
            shutil.rmtree(wd.path, ignore_errors=True)
    spec = kv_spec_of(model)
    rows = summarize(results, physical)
    disk = stats["disk_engine"]["tiers"]["disk"]
    data: dict[str, Any] = {
        "benchmark": "e2e",
        "machine": {**machine, "load_average_1m_end": harness.machine_info()["load_average_1m"]},
        "model": {
            "name": MODEL_KEY, "dtype": spec.dtype, "device": "cpu", "layers": spec.num_layers,
            "kv_heads": spec.num_kv_heads, "head_size": spec.head_size, "kv_bytes_per_token": spec.bytes_per_token(),
            "load_seconds": load_info["seconds"], "converted": load_info["converted"],
            "warm_up_seconds": load_info["warm_up_seconds"],
        },
        "settings": {
            "lengths": ls, "repeats": repeats, "prefill_repeats": prefill_repeats, "chunk_size": chunk_size,
            "seed": seed, "statistic": "best of the samples (all samples included)",
            "prompt": "handbook prose of `lmcache demo`, tokenized and cut to length, no chat template; a different text per length",
            "hit": "all but the last prompt token from lmcache; the last token is computed",
            "disk_hit": "a fresh CacheEngine with only the disk tier on the directory the first engine wrote (write-through); no upper tier, so every repeat reads the files again",
            "suffix_compute": "forward of the last prompt token given the model cache of the others (built by the full prefill)",
            "ideal": "KV bytes / memcpy GB/s + suffix compute (disk: / file read GB/s)",
        },
        "physical": physical,
        "disk_tier": {
            "open_seconds": stats["disk_open_seconds"], "hits": disk["hits"], "hit_bytes": disk["hit_bytes"],
            "get_seconds": disk["get_seconds"],
            "read_gbps": disk["hit_bytes"] / disk["get_seconds"] / harness.GB if disk["get_seconds"] > 0 else None,
        },
        "lengths": rows,
        "goals": goals(rows),
        "seconds": time.perf_counter() - started,
    }
    harness.emit(data, as_json, print_table, plot_path, plot)
    bad = [
        f"{r['tokens']} tokens {case}"
        for r in rows for case in ("cpu", "disk")
        if r["cached_tokens"].get(case, 0) != r["tokens"] - 1 or not r["same_first_token"].get(case, False)
    ]
    if bad:
        raise LMCacheError("a hit was incomplete or changed the first token: " + ", ".join(bad))


# =========================================================================== multi-round QA
#
# ``lmcache bench e2e --workload qa``: U users, each with its own document, ask R questions
# each, interleaved round-robin; every prompt is the shared system prompt + the user's
# document + the conversation so far + the new question. The same prompts run twice:
# without lmcache (every prompt prefilled in full) and with lmcache (a CPU tier above a
# disk tier, the CPU tier smaller than the workload's KV so that part of it spills), and
# the greedy answers of the two runs are compared token by token.

QA_QUESTIONS = (
    "What is the main subject of my document?",
    "Which rule in it matters most for new staff?",
    "Summarize the section on breaks in one sentence.",
    "Who has to report damaged goods, according to the document?",
    "What should be done with the first aid kit?",
    "Does the document say anything about parking?",
    "Which part of the document would you rewrite, and why?",
    "Name two duties of the team leads.",
    "Is there a rule about visitors? Quote it.",
    "What happens with lost property?",
)
QA_SYSTEM_INTRO = (
    "You are the assistant of a small company. Staff members show you a document and ask "
    "questions about it; answer each question in one short sentence, using only the document. "
    "Below is a story you may be asked to compare the documents with.\n\n"
)
QA_DEFAULTS = {"users": 4, "rounds": 4, "system_tokens": 1024, "doc_tokens": 384, "new_tokens": 16}
QA_QUICK = {"users": 2, "rounds": 2, "system_tokens": 256, "doc_tokens": 96, "new_tokens": 8}


@dataclass
class QARequest:
    """One turn of one conversation and what each run made of it."""

    index: int
    user: int  # 1-based
    round: int  # 1-based
    ids: list[int]  # the prompt
    unseen_tokens: int = 0  # prompt tokens no earlier sequence (prompt + answer) started with
    base: dict[str, Any] = field(default_factory=dict)  # without lmcache
    lmc: dict[str, Any] = field(default_factory=dict)  # with lmcache
    suffix_compute: float | None = None  # forward of the new tokens given a cache of the rest (best sample)
    suffix_samples: list[float] = field(default_factory=list)


def _qa_encode(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _qa_system_ids(tok: Any, n: int) -> list[int]:
    """``n`` tokens of a ChatML system message: the instructions, then the story in
    benchmarks/data/codec_text.txt (repeated if ``n`` needs more)."""
    head = _qa_encode(tok, "<|im_start|>system\n" + QA_SYSTEM_INTRO)
    tail = _qa_encode(tok, "<|im_end|>\n")
    story = _qa_encode(tok, bench_text_path().read_text())
    room = max(0, n - len(head) - len(tail))
    body: list[int] = []
    while len(body) < room:
        body += story
    return head + body[:room] + tail


def bench_text_path() -> Path:
    """benchmarks/data/codec_text.txt of this checkout."""
    here = Path(__file__).resolve().parent.parent
    path = here / "benchmarks" / "data" / "codec_text.txt"
    if not path.is_file():
        raise LMCacheError(f"the system prompt's text is missing: {path}")
    return path


def _qa_doc_ids(tok: Any, user: int, n: int, seed: int) -> list[int]:
    from .handbook import prose_ids

    head = _qa_encode(tok, "<|im_start|>user\nHere is my document:\n\n")
    tail = _qa_encode(tok, "<|im_end|>\n")
    return head + prose_ids(tok, n, seed=seed * 1_000_003 + 7919 * user) + tail


def _qa_question_ids(tok: Any, user: int, rnd: int) -> list[int]:
    q = QA_QUESTIONS[(3 * user + rnd) % len(QA_QUESTIONS)]
    return _qa_encode(tok, f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")


def _eos_ids(model: Any, tok: Any) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tok):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    return ids


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _pct(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) with linear interpolation."""
    if not xs:
        return None
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class QAPrompts:
    """The conversations' token ids: a shared system prompt, one document per user, the
    questions; the answers are appended as the run produces them."""

    def __init__(self, tok: Any, *, users: int, rounds: int, system_tokens: int, doc_tokens: int, seed: int):
        self.users, self.rounds = users, rounds
        self.system = _qa_system_ids(tok, system_tokens)
        self.history = {u: self.system + _qa_doc_ids(tok, u, doc_tokens, seed) for u in range(1, users + 1)}
        self.questions = {(u, r): _qa_question_ids(tok, u, r) for u in range(1, users + 1) for r in range(1, rounds + 1)}
        self.end = _qa_encode(tok, "<|im_end|>\n")

    def order(self) -> list[tuple[int, int]]:
        """(user, round) in arrival order: round-robin over the users."""
        return [(u, r) for r in range(1, self.rounds + 1) for u in range(1, self.users + 1)]

    def prompt(self, user: int, rnd: int) -> list[int]:
        return self.history[user] + self.questions[(user, rnd)]

    def answered(self, user: int, prompt: list[int], answer: list[int], eos: set[int]) -> None:
        body = answer[:-1] if answer and answer[-1] in eos else answer
        self.history[user] = prompt + body + self.end

    def distinct_tokens(self, new_tokens: int) -> int:
        """An upper bound of the workload's distinct tokens (the answers at full length)."""
        n = len(self.system)
        for u in range(1, self.users + 1):
            n += len(self.history[u]) - len(self.system)
            n += sum(len(self.questions[(u, r)]) + new_tokens + len(self.end) for r in range(1, self.rounds + 1))
        return n


def qa_run(
    model: Any, tok: Any, prompts: QAPrompts, directory: Path, *, new_tokens: int, chunk_size: int,
    cpu_capacity: int, disk_capacity: int, progress: Any = None,
) -> tuple[list[QARequest], dict[str, Any]]:
    """Every request twice, back to back (so that a change in the machine's load hits
    both alike): first without lmcache (a full prefill on a fresh model cache, greedy
    decoding, and then the forward of only the prompt's new tokens given a model cache of
    the rest: the ideal's compute), then with lmcache (``TransformersConnector.generate``,
    the answer's KV stored too). The conversation continues with the answer given
    without lmcache, so both runs see the same prompts even if an answer differs."""
    from collections import Counter

    import torch
    from transformers import DynamicCache

    from lmcache.engine import CacheEngine
    from lmcache.plugins.connectors.hf import TransformersConnector, _cache_of, kv_spec_of

    from .handbook import demo_config

    cfg = demo_config(
        chunk_size,
        [{"backend": "cpu", "capacity": cpu_capacity},
         {"backend": "disk", "path": str(directory / "kv"), "capacity": disk_capacity}],
    )
    engine = CacheEngine(cfg, kv_spec=kv_spec_of(model))
    conn = TransformersConnector(model, tok, engine)
    eos = _eos_ids(model, tok)
    seen: list[list[int]] = []  # every sequence whose KV was computed: prompt + answer[:-1]
    reqs: list[QARequest] = []
    wall_without = wall_with = 0.0
    try:
        for u, r in prompts.order():
            ids = prompts.prompt(u, r)
            req = QARequest(len(reqs), u, r, ids)
            if progress is not None:
                progress(f"user {u} round {r} ({len(ids):,} prompt tokens): without lmcache")
            with torch.inference_mode():
                t0 = time.perf_counter()
                cache = DynamicCache(config=model.config)
                o = model(input_ids=torch.tensor([ids], dtype=torch.long), cache=cache, use_cache=True, logits_to_keep=1)
                logits = o.logits[0, -1].float()
                ttft = time.perf_counter() - t0
                cache = _cache_of(o, cache)
                new: list[int] = []
                for step in range(new_tokens):  # greedy, as TransformersConnector.generate decodes
                    t = int(torch.argmax(logits))
                    new.append(t)
                    if t in eos or step == new_tokens - 1:
                        break
                    o = model(input_ids=torch.tensor([[t]], dtype=torch.long), cache=cache, use_cache=True)
                    cache = _cache_of(o, cache)
                    logits = o.logits[0, -1].float()
                total = time.perf_counter() - t0
                wall_without += total
                # the ideal: only what no earlier sequence started with is computed (at least the last token)
                reused = min(max((_common_prefix(ids, s) for s in seen), default=0), len(ids) - 1)
                req.unseen_tokens = len(ids) - reused
                x = torch.tensor([ids[reused:]], dtype=torch.long)
                samples = []
                for _ in range(3 if len(ids) - reused <= 512 else 1):  # short ones: best of 3 (cheap)
                    if reused:
                        cache.crop(reused - cache.get_seq_length())  # a negative count: tokens to drop
                    else:
                        cache = DynamicCache(config=model.config)
                    t1 = time.perf_counter()
                    o = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
                    samples.append(time.perf_counter() - t1)
                    cache = _cache_of(o, cache)
                req.suffix_compute = min(samples)
                req.suffix_samples = samples
                same = int(torch.argmax(o.logits[0, -1])) == new[0]
                del o, cache
            req.base = {"ttft": ttft, "seconds": total, "answer": new, "ideal_first_token_agrees": same}
            seen.append(ids + new[:-1])
            prompts.answered(u, ids, new, eos)

            if progress is not None:
                progress(f"user {u} round {r} ({len(ids):,} prompt tokens): with lmcache")
            t0 = time.perf_counter()
            g = conn.generate(ids, max_new_tokens=new_tokens, store=True, store_output=True)
            total = time.perf_counter() - t0
            wall_with += total
            req.lmc = {
                "ttft": g.ttft, "seconds": total, "answer": list(g.tokens), "cached_tokens": g.cached_tokens,
                "kv_load": g.timings.get("load", 0.0), "kv_bytes_loaded": g.kv_bytes_loaded,
                "tiers": dict(Counter(g.tiers)), "stored_output_tokens": g.stored_tokens,
            }
            g = None
            reqs.append(req)
        t0 = time.perf_counter()
        engine.flush()  # the write-through queue to disk: part of the run's total
        flush = time.perf_counter() - t0
        stats = engine.stats()
    finally:
        engine.close()
    return reqs, {"without_seconds": wall_without, "with_seconds": wall_with, "flush_seconds": flush, "engine": stats}


def qa_summarize(reqs: list[QARequest], physical: dict[str, Any], bpt: int, info: dict[str, Any]) -> dict[str, Any]:
    mem = physical["memcpy_gbps"] * harness.GB
    rows = []
    for q in reqs:
        reused_ideal = len(q.ids) - q.unseen_tokens
        # computing fewer tokens cannot take longer than the full prefill (the two differ by noise only)
        compute = min(q.suffix_compute or 0.0, q.base["ttft"])
        ideal = compute + (reused_ideal * bpt / mem if mem else 0.0)
        same = q.base["answer"] == q.lmc["answer"]
        rows.append({
            "index": q.index, "user": q.user, "round": q.round, "prompt_tokens": len(q.ids),
            "unseen_tokens": q.unseen_tokens, "cached_tokens": q.lmc["cached_tokens"],
            "prefilled_tokens": len(q.ids) - q.lmc["cached_tokens"],
            "ttft_without": q.base["ttft"], "ttft_with": q.lmc["ttft"], "ttft_ideal": ideal,
            "ideal_compute": compute, "ideal_compute_samples": q.suffix_samples, "kv_load": q.lmc["kv_load"], "kv_bytes_loaded": q.lmc["kv_bytes_loaded"],
            "tiers": q.lmc["tiers"], "seconds_without": q.base["seconds"], "seconds_with": q.lmc["seconds"],
            "answer_tokens": len(q.lmc["answer"]), "same_answer": same,
            "answer_without": q.base["answer"], "answer_with": q.lmc["answer"],
            "answer_text": None,
        })

    def mode(key: str) -> dict[str, Any]:
        xs = [r[key] for r in rows]
        return {"sum": sum(xs), "mean": statistics.fmean(xs), "p50": _pct(xs, 0.5), "p99": _pct(xs, 0.99),
                "max": max(xs), "samples": xs}

    prompt = sum(r["prompt_tokens"] for r in rows)
    reused = sum(r["cached_tokens"] for r in rows)
    ideal_reused = sum(r["prompt_tokens"] - r["unseen_tokens"] for r in rows)
    later = [r for r in rows if r["round"] >= 2]
    total_without = info["without_seconds"]
    total_with = info["with_seconds"] + info["flush_seconds"]
    ttft = {"without": mode("ttft_without"), "with": mode("ttft_with"), "ideal": mode("ttft_ideal")}
    by_round = []
    for rnd in sorted({r["round"] for r in rows}):
        rs = [r for r in rows if r["round"] == rnd]
        p = sum(r["prompt_tokens"] for r in rs)
        by_round.append({
            "round": rnd, "prompt_tokens": p, "cached_tokens": sum(r["cached_tokens"] for r in rs),
            "unseen_tokens": sum(r["unseen_tokens"] for r in rs),
            "hit_rate": sum(r["cached_tokens"] for r in rs) / p,
            "ideal_hit_rate": sum(r["prompt_tokens"] - r["unseen_tokens"] for r in rs) / p,
            "mean_ttft_without": statistics.fmean(r["ttft_without"] for r in rs),
            "mean_ttft_with": statistics.fmean(r["ttft_with"] for r in rs),
            "mean_ttft_ideal": statistics.fmean(r["ttft_ideal"] for r in rs),
        })
    tiers: dict[str, int] = {}
    for r in rows:
        for k, v in r["tiers"].items():
            tiers[k] = tiers.get(k, 0) + v
    mismatches = [r["index"] for r in rows if not r["same_answer"]]
    return {
        "requests": rows,
        "by_round": by_round,
        "ttft": ttft,
        "totals": {
            "without": {"seconds": total_without, "prefill_seconds": ttft["without"]["sum"],
                        "prefilled_tokens": prompt, "reused_tokens": 0},
            "with": {"seconds": total_with, "prefill_seconds": ttft["with"]["sum"], "prefilled_tokens": prompt - reused,
                     "reused_tokens": reused, "flush_seconds": info["flush_seconds"]},
            "ideal": {"prefill_seconds": ttft["ideal"]["sum"], "prefilled_tokens": prompt - ideal_reused,
                      "reused_tokens": ideal_reused},
        },
        "prompt_tokens": prompt,
        "hit_rate": reused / prompt if prompt else 0.0,
        "ideal_hit_rate": ideal_reused / prompt if prompt else 0.0,
        "hit_rate_rounds_2_plus": (sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later)) if later else None,
        "chunks_by_tier": tiers,
        "speedup": {
            "total": _div(total_without, total_with),
            "prefill": _div(ttft["without"]["sum"], ttft["with"]["sum"]),
            "ideal_prefill": _div(ttft["without"]["sum"], ttft["ideal"]["sum"]),
        },
        "with_over_ideal": {
            "prefill": _div(ttft["with"]["sum"], ttft["ideal"]["sum"]),
            "mean_ttft": _div(ttft["with"]["mean"], ttft["ideal"]["mean"]),
            "p50_ttft": _div(ttft["with"]["p50"], ttft["ideal"]["p50"]),
        },
        "answers": {"requests": len(rows), "identical": len(rows) - len(mismatches), "mismatches": mismatches},
    }


def qa_print_table(data: dict[str, Any]) -> None:
    from rich.table import Table

    o = out()
    s = data["settings"]
    t = Table(
        title=f"lmcache bench e2e --workload qa: {s['users']} users x {s['rounds']} rounds on {data['model']['name']}, "
        f"{data['machine']['cpus_usable']} CPUs (chunks of {s['chunk_size']} tokens)",
        title_justify="left",
    )
    for col in ("", "total time", "total prefill", "mean TTFT", "p50 TTFT", "p99 TTFT", "tokens prefilled",
                "tokens reused", "hit rate"):
        t.add_column(col, justify="right")
    tot, tt = data["totals"], data["ttft"]
    for key, label, seconds, hit in (
        ("without", "without lmcache", _s(tot["without"]["seconds"]), 0.0),
        ("with", "with lmcache", _s(tot["with"]["seconds"]), data["hit_rate"]),
        ("ideal", "ideal (only new tokens)", "", data["ideal_hit_rate"]),
    ):
        t.add_row(label, seconds, _s(tot[key]["prefill_seconds"]), _s(tt[key]["mean"]), _s(tt[key]["p50"]),
                  _s(tt[key]["p99"]), f"{tot[key]['prefilled_tokens']:,}", f"{tot[key]['reused_tokens']:,}",
                  f"{hit:.1%}")
    o.print(t)
    r = Table(title="per round (means over the users)", title_justify="left")
    for col in ("round", "prompt tokens", "hit rate", "ideal hit rate", "TTFT without", "TTFT with", "TTFT ideal",
                "with / ideal"):
        r.add_column(col, justify="right")
    for b in data["by_round"]:
        r.add_row(str(b["round"]), f"{b['prompt_tokens']:,}", f"{b['hit_rate']:.1%}", f"{b['ideal_hit_rate']:.1%}",
                  _s(b["mean_ttft_without"]), _s(b["mean_ttft_with"]), _s(b["mean_ttft_ideal"]),
                  _x(_div(b["mean_ttft_with"], b["mean_ttft_ideal"])))
    o.print(r)
    sp, wi, a = data["speedup"], data["with_over_ideal"], data["answers"]
    o.print(
        f"Speedup with lmcache: total {_x(sp['total'])}, prefill {_x(sp['prefill'])} (the ideal would give "
        f"{_x(sp['ideal_prefill'])}); lmcache's prefill time / ideal {_x(wi['prefill'])}. "
        f"Chunks reused by tier: {', '.join(f'{k} {v}' for k, v in sorted(data['chunks_by_tier'].items())) or 'none'}."
    )
    o.print(
        f"Ideal TTFT = forward of the new tokens given a model cache of the rest (measured in this run) + their KV "
        f"bytes / memcpy ({data['physical']['memcpy_gbps']:.2f} GB/s, measured in this run). "
        f"Answers identical with and without lmcache: {a['identical']}/{a['requests']}"
        + (f" [red](mismatches at requests {a['mismatches']})[/]" if a["mismatches"] else "")
        + f". {data['seconds']:.0f} s in all."
    )


def qa_plot(data: dict[str, Any], path: Path) -> None:
    """Per-request TTFT without and with lmcache (log scale), with the ideal."""
    from .harness import pyplot

    plt = pyplot()

    from matplotlib.ticker import FuncFormatter, LogLocator

    rows = data["requests"]
    xs = list(range(len(rows)))
    width = 0.4
    fig, ax = plt.subplots(figsize=(max(8.0, 0.45 * len(rows) + 2), 5), dpi=120)
    ax.bar([x - width / 2 for x in xs], [r["ttft_without"] for r in rows], width, label="without lmcache (full prefill)",
           color="#9e9e9e")
    ax.bar([x + width / 2 for x in xs], [r["ttft_with"] for r in rows], width, label="with lmcache", color="#1f77b4")
    ax.hlines([r["ttft_ideal"] for r in rows], xs, [x + width for x in xs],
              colors="black", linestyles="--", linewidth=1.5,
              label="ideal: only the new tokens computed, the rest at memcpy speed")
    ax.set_yscale("log")
    values = [v for r in rows for v in (r["ttft_without"], r["ttft_with"], r["ttft_ideal"]) if v]
    if values:
        ax.set_ylim(min(values) / 2, max(values) * 6)  # room for the legend above the bars
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v * 1e3:g} ms" if v < 1 else f"{v:g} s"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_xticks(xs, [f"u{r['user']} r{r['round']}\n{r['prompt_tokens']:,}" for r in rows], fontsize=7)
    ax.set_xlabel("request (user, round; prompt tokens), in arrival order")
    ax.set_ylabel("time to first token (log scale)")
    m, s = data["machine"], data["settings"]
    ax.set_title(f"lmcache bench e2e --workload qa: {s['users']} users x {s['rounds']} rounds, {data['model']['name']} "
                 f"float32, {m['cpus_usable']} CPUs; hit rate {data['hit_rate']:.0%}", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", which="major", alpha=0.3)
    harness.save_figure(fig, path)


def qa_main(
    users: int | None = None,
    rounds: int | None = None,
    system_tokens: int | None = None,
    doc_tokens: int | None = None,
    new_tokens: int | None = None,
    chunk_size: int = 256,
    cpu_capacity: str = "auto",
    seed: int = 0,
    directory: Path | None = None,
    memcpy_size: str = "256MiB",
    threads: int | None = None,
    quick: bool = False,
    as_json: bool = False,
    plot_path: Path | None = None,
) -> None:
    """``lmcache bench e2e --workload qa``: unset sizes take the defaults (``--quick``: small ones)."""
    from lmcache import connector

    kv_spec_of = connector("transformers").kv_spec_of

    from .handbook import MODEL_KEY, demo_config, load_model, warm_up

    base = QA_QUICK if quick else QA_DEFAULTS
    users = users or base["users"]
    rounds = rounds or base["rounds"]
    system_tokens = system_tokens or base["system_tokens"]
    doc_tokens = doc_tokens or base["doc_tokens"]
    new_tokens = new_tokens or base["new_tokens"]
    cap = size_option(cpu_capacity, "--cpu-capacity")
    memcpy_bytes = size_option(memcpy_size, "--memcpy-size", auto=False) or (256 << 20)
    demo_config(chunk_size, [{"backend": "cpu", "capacity": 1 << 20}])  # a bad LMCACHE_* setting fails here
    need_pyplot(plot_path)
    harness.set_threads(threads)
    wd = harness.open_work_dir(directory, "lmcache-e2e-qa-")
    e = err()
    started = time.perf_counter()
    try:
        machine = harness.machine_info(wd.path)
        harness.warn_if_busy(machine)
        model, tok, load_info = load_model(e)
        spec = kv_spec_of(model)
        bpt = spec.bytes_per_token()
        with e.status("warming up the model ...") as st:
            longest = system_tokens + doc_tokens + rounds * (new_tokens + 40) + 32
            load_info["warm_up_seconds"] = warm_up(model, tok, longest)

            def say(m: str) -> None:
                st.update(m + " ...")

            say("measuring memcpy")
            physical: dict[str, Any] = harness.measure_memcpy(memcpy_bytes)
            prompts = QAPrompts(tok, users=users, rounds=rounds, system_tokens=system_tokens, doc_tokens=doc_tokens,
                                seed=seed)
            distinct = prompts.distinct_tokens(new_tokens)
            distinct_bytes = distinct * bpt
            cpu_cap = cap if cap is not None else max(distinct_bytes // 2, 4 * chunk_size * bpt)
            disk_cap = 2 * distinct_bytes + (64 << 20)
            reqs, info = qa_run(
                model, tok, prompts, wd.path, new_tokens=new_tokens, chunk_size=chunk_size, cpu_capacity=cpu_cap,
                disk_capacity=disk_cap, progress=say,
            )
    finally:
        if wd.temporary:
            shutil.rmtree(wd.path, ignore_errors=True)
    summary = qa_summarize(reqs, physical, bpt, info)
    for row, q in zip(summary["requests"], reqs):
        row["answer_text"] = tok.decode(q.lmc["answer"], skip_special_tokens=True)
    tiers = info["engine"].get("tiers", {})
    data: dict[str, Any] = {
        "benchmark": "e2e-qa",
        "machine": {**machine, "load_average_1m_end": harness.machine_info()["load_average_1m"]},
        "model": {
            "name": MODEL_KEY, "dtype": spec.dtype, "device": "cpu", "kv_bytes_per_token": bpt,
            "load_seconds": load_info["seconds"], "converted": load_info["converted"],
            "warm_up_seconds": load_info["warm_up_seconds"],
        },
        "settings": {
            "users": users, "rounds": rounds, "system_tokens": system_tokens, "doc_tokens": doc_tokens,
            "new_tokens": new_tokens, "chunk_size": chunk_size, "seed": seed, "quick": quick,
            "cpu_capacity": cpu_cap, "disk_capacity": disk_cap, "distinct_kv_tokens_max": distinct,
            "distinct_kv_bytes_max": distinct_bytes,
            "capacities": "cpu: --cpu-capacity, 'auto' = half of the workload's distinct KV (at least 4 chunks); "
                          "disk: twice the distinct KV + 64 MiB",
            "order": "round-robin: user 1 round 1, user 2 round 1, ..., user 1 round 2, ...",
            "prompt": "ChatML: shared system prompt (instructions + benchmarks/data/codec_text.txt) + the user's "
                      "document (demo handbook prose, one per user) + the previous questions and answers + the new question",
            "answers": "greedy, float32, up to new_tokens tokens (stops at EOS)",
            "without": "every prompt prefilled in full (model forward on a fresh cache)",
            "with": "TransformersConnector.generate(store_output=True) on a CacheEngine with a cpu tier above a disk "
                    "tier (write-through); the run's total includes draining the write queue",
            "ideal": "per request: forward of the tokens no earlier sequence (prompt + answer) started with, given a "
                     "model cache of the rest (measured in this run: best of 3 when at most 512 tokens, else 1; capped "
                     "at the full prefill's TTFT), + the rest's KV bytes / memcpy",
            "interleaving": "each request runs without, then with lmcache, back to back, so that load changes hit both",
        },
        "physical": physical,
        "engine": {
            "tiers": {name: {k: v for k, v in st.items() if isinstance(v, (int, float))} for name, st in tiers.items()},
            "hierarchy": info["engine"].get("hierarchy", {}),
        },
        **summary,
        "seconds": time.perf_counter() - started,
    }
    harness.emit(data, as_json, qa_print_table, plot_path, qa_plot)
    if summary["answers"]["mismatches"]:
        raise LMCacheError(
            f"{len(summary['answers']['mismatches'])} answers differ with lmcache (requests "
            f"{summary['answers']['mismatches']}); see --json"
        )
