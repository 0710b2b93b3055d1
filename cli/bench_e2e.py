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

from . import bench
from ._util import err, out, print_json, size_option

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
    from lmcache.plugins.connectors.hf import TransformersConnector, kv_spec_of

    from .demo import demo_config, prose_ids

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
    physical: dict[str, Any] = bench.measure_memcpy(memcpy_bytes)
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
    physical.update(bench.measure_file_io(directory, chunk_bytes, max(biggest, chunk_bytes)))

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
    mem = physical["memcpy_gbps"] * bench.GB
    rd = physical.get("file_read_gbps", 0) * bench.GB
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
                "kv_load_gbps": _div(r.kv_bytes / bench.GB, _best(r.cpu_load)),
                "minus_kv_load": _best([a - b for a, b in zip(r.cpu, r.cpu_load)]),
            },
            "disk_hit": {
                "ttft": disk, "median": _med(r.disk), "samples": r.disk,
                "kv_load": _best(r.disk_load), "kv_load_samples": r.disk_load,
                "kv_load_gbps": _div(r.kv_bytes / bench.GB, _best(r.disk_load)),
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
    try:
        import matplotlib
    except ImportError:
        raise LMCacheError("--plot needs matplotlib; install it with: pip install 'lmcache[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


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
    """``lmcache bench e2e`` (its options are declared in :mod:`lmcache.cli.bench`)."""
    from lmcache.plugins.connectors.hf import kv_spec_of

    from .demo import MODEL_KEY, demo_config, load_model, warm_up

    ls = parse_lengths(lengths)
    memcpy_bytes = size_option(memcpy_size, "--memcpy-size", auto=False) or (256 << 20)
    demo_config(chunk_size, [{"backend": "cpu", "capacity": 1 << 20}])  # a bad LMCACHE_* setting fails here
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise LMCacheError("--plot needs matplotlib; install it with: pip install 'lmcache[bench]'") from None
    bench.set_threads(threads)
    wd = bench.open_work_dir(directory, "lmcache-e2e-")
    e = err()
    started = time.perf_counter()
    try:
        machine = bench.machine_info(wd.path)
        bench.warn_if_busy(machine)
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
        "machine": {**machine, "load_average_1m_end": bench.machine_info()["load_average_1m"]},
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
            "read_gbps": disk["hit_bytes"] / disk["get_seconds"] / bench.GB if disk["get_seconds"] > 0 else None,
        },
        "lengths": rows,
        "goals": goals(rows),
        "seconds": time.perf_counter() - started,
    }
    if plot_path is not None:
        plot(data, plot_path)
        data["plot"] = str(plot_path)
    if as_json:
        print_json(data)
    else:
        print_table(data)
        if plot_path is not None:
            out().print(f"Plot written to {plot_path}.")
    bad = [
        f"{r['tokens']} tokens {case}"
        for r in rows for case in ("cpu", "disk")
        if r["cached_tokens"].get(case, 0) != r["tokens"] - 1 or not r["same_first_token"].get(case, False)
    ]
    if bad:
        raise LMCacheError("a hit was incomplete or changed the first token: " + ", ".join(bad))
