"""``lmcache bench compare``: the tier and lookup workloads through lmcache and through
LMCache 0.5.6 (PyPI), side by side, on the same machine in the same run.

LMCache runs in a virtualenv of its own (``make bench-compare`` builds
``.venv-lmcache-ref``; both distributions are called ``lmcache``, so neither venv ever sees
the other), driven by ``benchmarks/compare/lmcache_ref.py`` in a subprocess started with
``python -I -P`` from a temporary directory. Both sides get one workload description
(``spec``, passed to the driver as JSON) and run it the same way:

- tiers, per KV shape and per tier (a CPU-only and a disk-only configuration, each sized to
  hold the whole workload; the same memory budget on both sides: our memory pool and
  LMCache's ``max_local_cpu_size``): ``chunks`` chunks of ``chunk_size`` tokens as prompts of
  ``tokens_per_prompt`` tokens, random KV (the same bytes per chunk on both sides).
  Store: the wall time of storing every prompt from a KV tensor that holds it (hashing,
  allocation, the one copy into the cache's memory, the put), until the tier holds every
  chunk (for the disk tiers: until every file is written). ``store_rounds`` rounds, the
  chunks removed between rounds; the first round is reported as "cold" (fresh memory) and
  the best as the store figure. Retrieve: each prompt into a preallocated destination
  tensor (both sides), best of ``retrieve_repeats``, every byte compared with what was
  stored. Our KV layout is ``(layers, 2, tokens, heads, head)``, LMCache's
  ``(2, layers, tokens, heads * head)``: a chunk is ``2 * layers`` strided blocks in both.
- lookup, per prompt length (1k..128k tokens, every one a prefix of one stored prompt, so
  fully cached): "hash" is tokens to chunk keys (our ``CacheEngine.chunk_keys``, LMCache's
  ``ChunkedTokenDatabase.process_tokens`` with keys made); "lookup" is tokens to the number
  of cached prefix tokens (``CacheEngine.lookup``; LMCache's ``LMCacheEngine.lookup`` path:
  ``process_tokens`` and ``StorageManager.batched_contains``), no pinning on either side.
  Token ids are Python lists on both sides (what vLLM hands a connector). p50/p99 per call.

- CPU over disk (with both tiers asked for): a CPU tier with a disk tier behind it
  (write-through; LMCache: ``local_cpu`` with ``local_disk``), SmolLM2's KV in fp32
  (30 layers, 3 KV heads, head 64: 11.8 MB a chunk), 16 chunks of 256 tokens stored
  from one engine buffer ``(30, 2, 4096, 3, 64)``, with torch's default intra-op threads
  (the number torch picked at start, the same on both sides): the workload of LMCache's
  own storage benchmark. Store: the wall time of the store call (our ``CacheEngine.store``;
  LMCache's allocate, copy and ``batched_put``), that is, until the CPU tier holds every
  chunk while the disk writes go on behind it; the median of ``repeats`` stores, each
  after the previous one's disk writes finished and its chunks were removed. What it
  measures is what the lower tier's write-behind takes from the store path. Persist: the
  same stores until every chunk is on disk (ours: ``store`` then ``flush``; LMCache: until
  ``local_disk`` holds every key). Disk hit: the first retrieve of the 16 chunks by a fresh
  engine with only the disk tier, the files in the page cache (ours: a new engine opened
  on the files the stores left; LMCache 0.5.6 does not index a directory it finds, so a
  new ``local_disk``-only storage manager that stored them), into a preallocated, touched
  tensor; the median of ``hit_repeats`` engines (:mod:`lmcache.benchmarks.compare_disk`).
  The workload runs in ``--passes`` passes, the two sides in turn (ours, LMCache, ours,
  ...), each figure the median of every round of every pass: on a small VM the disk's
  background writeback of an earlier pass moves a single pass's figures by 2x.

Limits measured in this run: memcpy (CPU tiers; for CPU over disk with the default
threads, over the workload's bytes), raw file write/read of chunk-sized files in the same
directory (disk tiers), one xxh3-128 pass over the token bytes (hashing); for persist,
memcpy then raw writes as LMCache's ``local_disk`` does them (a plain write per file, no
fsync, no O_DIRECT, 4 threads); for the disk hit, raw page-cache reads of those files then
one scatter into a KV tensor. Torch runs
with ``--threads`` intra-op threads on both sides (default 1: on a small shared machine a
second thread makes every copy wait for a busy core), except for CPU over disk.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from lmcache.errors import LMCacheError

from .compare_disk import engine_for, merge_over_disk, over_disk_limits, over_disk_rows, run_ours_over_disk
from .harness import emit, err, out, save_figure

GB = 1e9
REF_VENV = ".venv-lmcache-ref"
REF_VERSION = "0.5.6"
DRIVER = Path("benchmarks") / "compare" / "lmcache_ref.py"
SHAPES = {
    "llama3-8b": {"name": "llama3-8b", "layers": 32, "kv_heads": 8, "head_size": 128},
    "smollm2": {"name": "smollm2", "layers": 30, "kv_heads": 3, "head_size": 64},
}
LOOKUP_SHAPE = {"name": "lookup", "layers": 1, "kv_heads": 1, "head_size": 8}
#: CPU over disk: SmolLM2-135M's KV in fp32, 16 chunks from one engine buffer
OVER_DISK = {"name": "smollm2", "layers": 30, "kv_heads": 3, "head_size": 64, "dtype": "float32", "chunks": 16}


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def find_ref_venv(given: Path | None) -> Path:
    """The reference venv: ``given``, else ``.venv-lmcache-ref`` in the current directory
    or in the repository root."""
    candidates = [given] if given is not None else [Path.cwd() / REF_VENV, repo_root() / REF_VENV]
    for c in candidates:
        if (c / "bin" / "python").exists():
            return c
    where = ", ".join(str(c) for c in candidates)
    raise LMCacheError(
        f"no LMCache reference virtualenv at {where}: run `make bench-compare` "
        f"(it builds {REF_VENV} with LMCache {REF_VERSION}) or pass --ref-venv"
    )


def find_driver() -> Path:
    for base in (repo_root(), Path.cwd()):
        if (base / DRIVER).is_file():
            return base / DRIVER
    raise LMCacheError(f"{DRIVER} not found (it ships with the lmcache source tree, not the wheel)")


def build_spec(*, quick: bool, shapes: list[str], tiers: list[str], chunks: int | None, tokens_per_prompt: int | None,
               max_lookup_tokens: int | None, threads: int, seed: int, directory: Path,
               default_threads: int = 1) -> dict[str, Any]:
    chunk_size = 256
    if quick:
        shape_list = [{**SHAPES[s], "layers": 2} for s in shapes]
        chunks, tokens_per_prompt = chunks or 8, tokens_per_prompt or 512
        lengths = [1024, 4096, 16384]
        budget, lo, hi, repeats = 100_000, 3, 20, 1
    else:
        shape_list = [SHAPES[s] for s in shapes]
        chunks, tokens_per_prompt = chunks or 32, tokens_per_prompt or 2048
        lengths = [1024 << i for i in range(8)]  # 1k .. 128k
        budget, lo, hi, repeats = 4_000_000, 5, 200, 3
    if max_lookup_tokens:
        lengths = [n for n in lengths if n <= max_lookup_tokens] or [min(lengths)]
    if tokens_per_prompt % chunk_size:
        raise typer.BadParameter(f"must be a multiple of {chunk_size}", param_hint="'--tokens-per-prompt'")
    if (chunks * chunk_size) % tokens_per_prompt:
        raise typer.BadParameter("--chunks must fill whole prompts of --tokens-per-prompt tokens", param_hint="'--chunks'")
    biggest = max(s["layers"] * 2 * s["kv_heads"] * s["head_size"] * 2 for s in shape_list) * chunk_size * chunks
    over_disk = None
    if "cpu" in tiers and "disk" in tiers:  # the same sizes in --quick: the workload is the point
        od_bytes = OVER_DISK["layers"] * 2 * OVER_DISK["kv_heads"] * OVER_DISK["head_size"] * 4 * chunk_size * OVER_DISK["chunks"]
        over_disk = {**OVER_DISK, "chunk_size": chunk_size, "bytes": od_bytes, "capacity": od_bytes * 5 // 4 + (64 << 20),
                     "repeats": 3 if quick else 7, "hit_repeats": 3, "threads": default_threads}
    return {
        "chunk_size": chunk_size,
        "dtype": "float16",
        "shapes": shape_list,
        "chunks": chunks,
        "tokens_per_prompt": tokens_per_prompt,
        "tiers": tiers,
        # the whole workload with room to spare, the same on both sides
        "capacity": biggest * 5 // 4 + (64 << 20),
        "store_rounds": 2,
        "retrieve_repeats": repeats,
        "seed": seed,
        "threads": threads,
        "dir": str(directory),
        "lookup_lengths": lengths,
        # token ids as a Python list (what vLLM's scheduler hands a connector) and as an
        # int64 tensor (what a connector may hold after batching)
        "lookup_inputs": ["list", "tensor"],
        "lookup_shape": LOOKUP_SHAPE,
        "lookup_capacity": 64 << 20,
        "lookup_budget_tokens": budget,
        "lookup_min_calls": lo,
        "lookup_max_calls": hi,
        "cpu_over_disk": over_disk,
    }


# --------------------------------------------------------------------------- our side


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _timing(seconds: list[float], tokens: int) -> dict[str, Any]:
    p50 = _pct(seconds, 50)
    return {"calls": len(seconds), "p50_ms": p50 * 1e3, "p99_ms": _pct(seconds, 99) * 1e3,
            "tokens_per_s": tokens / p50 if p50 > 0 else None}


def _random_kv(shape: tuple[int, ...], gen):
    import torch

    return torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16).view(torch.float16)


def run_ours_tier(shape: dict[str, Any], spec: dict[str, Any], tier: str) -> dict[str, Any]:
    import shutil

    import torch

    cs, tpp = spec["chunk_size"], spec["tokens_per_prompt"]
    prompts = spec["chunks"] * cs // tpp
    L, H, D = shape["layers"], shape["kv_heads"], shape["head_size"]
    gen = torch.Generator().manual_seed(spec["seed"])
    toks = [torch.randint(0, 128256, (tpp,), generator=gen).tolist() for _ in range(prompts)]
    directory = tempfile.mkdtemp(prefix=f"ours-{tier}-", dir=spec["dir"]) if tier == "disk" else None
    cap = spec["capacity"]
    tiers = [{"backend": "cpu", "capacity": cap}] if tier == "cpu" else [
        {"backend": "disk", "capacity": cap, "path": str(directory)}]
    engine = engine_for(spec, shape, tiers, cap)
    try:
        kvs = [_random_kv((L, 2, tpp, H, D), gen) for _ in range(prompts)]
        chunk_bytes = L * 2 * cs * H * D * 2
        total = prompts * (tpp // cs) * chunk_bytes
        rounds: list[float] = []
        stored = 0
        for r in range(spec["store_rounds"]):
            if r:  # the same chunks again, into memory (and files) freed by a removal
                engine.flush()
                engine.admin.clear(all=True)
            t0 = time.perf_counter()
            stored = sum(engine.store(toks[i], kvs[i]).stored_tokens for i in range(prompts))
            engine.flush()
            rounds.append(time.perf_counter() - t0)
        out_t = torch.empty((L, 2, tpp, H, D), dtype=torch.float16)
        best: list[float] = []
        exact, retrieved = True, 0
        for i in range(prompts):
            times = []
            n = 0
            for _ in range(spec["retrieve_repeats"]):
                out_t.zero_()
                t0 = time.perf_counter()
                n = engine.retrieve(toks[i], out=out_t).num_tokens
                times.append(time.perf_counter() - t0)
                exact = exact and n == tpp and torch.equal(out_t[:, :, :n].view(torch.int16), kvs[i][:, :, :n].view(torch.int16))
            retrieved += n
            best.append(min(times))
        ret_s = sum(best)
        return {
            "tier": tier,
            "prompts": prompts,
            "chunks": prompts * (tpp // cs),
            "chunk_bytes": chunk_bytes,
            "bytes": total,
            "stored_chunks": stored // cs,
            "retrieved_tokens": retrieved,
            "store_seconds": rounds,
            "store_cold_gbps": total / rounds[0] / GB,
            "store_gbps": total / min(rounds) / GB,
            "retrieve_seconds": ret_s,
            "retrieve_gbps": total / ret_s / GB if ret_s > 0 else None,
            "exact": exact,
            "complete": stored == prompts * tpp and retrieved == prompts * tpp,
        }
    finally:
        engine.close()
        del engine
        gc.collect()
        if directory:
            shutil.rmtree(directory, ignore_errors=True)


def run_ours_lookup(spec: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    cs, lengths = spec["chunk_size"], spec["lookup_lengths"]
    longest = max(lengths)
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    tokens_t = torch.randint(0, 128256, (longest,), generator=gen)
    tokens = tokens_t.tolist()
    shape = spec["lookup_shape"]
    engine = engine_for(spec, shape, [{"backend": "cpu", "capacity": spec["lookup_capacity"]}], spec["lookup_capacity"])
    rows = []
    try:
        kv = torch.zeros((shape["layers"], 2, longest, shape["kv_heads"], shape["head_size"]), dtype=torch.float16)
        engine.store(tokens, kv)  # every length below is a prefix of this prompt: fully cached
        del kv
        for kind, n in [(k, n) for k in spec["lookup_inputs"] for n in lengths]:
            prompt = tokens[:n] if kind == "list" else tokens_t[:n]
            calls = max(spec["lookup_min_calls"], min(spec["lookup_max_calls"], spec["lookup_budget_tokens"] // n))
            engine.chunk_keys(prompt)  # warm up
            hs = []
            keys: list[str] = []
            for _ in range(calls):
                t0 = time.perf_counter()
                _, keys = engine.chunk_keys(prompt)
                hs.append(time.perf_counter() - t0)
            hit = engine.lookup(prompt)
            ls = []
            for _ in range(calls):
                engine.prompts.clear()  # each call a new request's lookup (LMCache keeps no prompt either)
                t0 = time.perf_counter()
                hit = engine.lookup(prompt)
                ls.append(time.perf_counter() - t0)
            rows.append({"tokens": n, "input": kind, "chunks": len(keys), "hash": _timing(hs, n),
                         "lookup": {**_timing(ls, n), "hit_tokens": hit},
                         "exact": hit == n // cs * cs and len(keys) == n // cs})
    finally:
        engine.close()
    return rows


# --------------------------------------------------------------------------- limits


def hash_limit(lengths: list[int], repeats: int = 20) -> dict[str, float]:
    """Tokens/s of one xxh3-128 pass over the prompt's int64 token bytes (best of)."""
    import numpy as np
    import xxhash

    out_: dict[str, float] = {}
    for n in lengths:
        data = np.arange(n, dtype="<i8").tobytes()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            xxhash.xxh3_128_digest(data)
            best = min(best, time.perf_counter() - t0)
        out_[str(n)] = n / best
    return out_


# --------------------------------------------------------------------------- LMCache side


def run_ref(venv: Path, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    driver = find_driver()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    with tempfile.TemporaryDirectory(prefix="lmcache-ref-cwd-") as cwd:
        cmd = [str(venv / "bin" / "python"), "-I", "-P", str(driver), "--spec", json.dumps(spec)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise LMCacheError(f"the LMCache driver did not finish within {timeout:.0f} s") from None
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise LMCacheError(f"the LMCache driver failed (exit {proc.returncode}): {tail[0]}")
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise LMCacheError(f"the LMCache driver printed no JSON: {proc.stdout[-200:]!r}") from None
    if doc.get("lmcache_version") != REF_VERSION or not str(doc.get("lmcache_path", "")).startswith(str(venv.resolve())):
        raise LMCacheError(f"the reference venv {venv} runs lmcache {doc.get('lmcache_version')} from "
                           f"{doc.get('lmcache_path')}, not LMCache {REF_VERSION} of that venv")
    doc["wall_seconds"] = wall
    return doc


def over_disk_passes(spec: dict[str, Any], ours: dict[str, Any], ref: dict[str, Any], venv: Path, timeout: float,
                     passes: int) -> None:
    """More passes of the CPU-over-disk workload after the first, ours then LMCache's in
    turn, merged into each side's figures: the disk's own background work (writing back
    what an earlier pass left in the page cache) then falls on both sides alike instead
    of on whichever ran second."""
    only = {**spec, "shapes": [], "tiers": [], "lookup_lengths": []}
    e = err()
    for p in range(1, passes):
        e.print(f"CPU over disk, pass {p + 1} of {passes}: lmcache, then LMCache {REF_VERSION} ...")
        merge_over_disk(ours["cpu_over_disk"], run_ours_over_disk(spec))
        merge_over_disk(ref["cpu_over_disk"], run_ref(venv, only, timeout)["cpu_over_disk"])


# --------------------------------------------------------------------------- the report


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def build_rows(ours: dict[str, Any], ref: dict[str, Any], physical: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(workload: str, kind: str, unit: str, a: float | None, b: float | None, limit_name: str | None,
            limit: float | None, exact: bool) -> None:
        rows.append({"workload": workload, "kind": kind, "unit": unit, "ours": a, "lmcache": b, "ours_over_lmcache": _ratio(a, b),
                     "limit": limit_name, "limit_value": limit, "ours_vs_limit": _ratio(a, limit),
                     "lmcache_vs_limit": _ratio(b, limit), "exact": exact})

    theirs = {(t["shape"], t["tier"]): t for t in ref["tiers"]}
    for t in ours["tiers"]:
        r = theirs.get((t["shape"], t["tier"]))
        if r is None:
            continue
        ex = bool(t["exact"] and r["exact"])
        if t["tier"] == "cpu":
            lim_s = lim_r = ("memcpy", physical["memcpy_gbps"])
        else:
            fio = physical["file_io"][t["shape"]]
            lim_s, lim_r = ("file write", fio["write_gbps"]), ("file read", fio["read_gbps"])
        base = f"{t['tier']} {t['shape']}"
        add(f"{base} store (cold)", "tier", "GB/s", t["store_cold_gbps"], r["store_cold_gbps"], *lim_s, ex)
        add(f"{base} store", "tier", "GB/s", t["store_gbps"], r["store_gbps"], *lim_s, ex)
        add(f"{base} retrieve", "tier", "GB/s", t["retrieve_gbps"], r["retrieve_gbps"], *lim_r, ex)
    a, b = ours.get("cpu_over_disk"), ref.get("cpu_over_disk")
    if a and b:
        for workload, x, y, lim_name, lim, ex in over_disk_rows(a, b, physical):
            add(workload, "tier", "GB/s", x, y, lim_name, lim, ex)
    theirs_l = {(row["input"], row["tokens"]): row for row in ref["lookup"]}
    for row in ours["lookup"]:
        r = theirs_l.get((row["input"], row["tokens"]))
        if r is None:
            continue
        n = row["tokens"]
        ex = bool(row["exact"] and r["exact"])
        lim = physical["hash_tokens_per_s"].get(str(n))
        label = f"{n // 1024}k" if n % 1024 == 0 else str(n)
        for what in ("hash", "lookup"):
            add(f"{what} {label} tokens ({row['input']})", "lookup", "Mtok/s", row[what]["tokens_per_s"] / 1e6,
                r[what]["tokens_per_s"] / 1e6, "xxh3 pass", lim / 1e6 if lim else None, ex)
    return rows


def goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    look = [r for r in rows if r["kind"] == "lookup" and r["workload"].startswith("lookup")]
    tiers = [r for r in rows if r["kind"] == "tier" and "(cold)" not in r["workload"]]
    worst_l = min((r["ours_over_lmcache"] for r in look if r["ours_over_lmcache"]), default=None)
    worst_t = min((r["ours_over_lmcache"] for r in tiers if r["ours_over_lmcache"]), default=None)
    return {
        "lookup_min_ratio": worst_l,
        "lookup_at_least_5x": worst_l is not None and worst_l >= 5,
        "tiers_min_ratio": worst_t,
        "tiers_at_least_lmcache": worst_t is not None and worst_t >= 1,
        "losses": [r["workload"] for r in rows if r["ours_over_lmcache"] is not None and r["ours_over_lmcache"] < 1],
    }


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(data: dict[str, Any]) -> None:
    from rich.table import Table

    o = out()
    m = data["machine"]
    o.print(f"lmcache bench compare: lmcache {m.get('lmcache')} vs LMCache {data['lmcache']['lmcache_version']} "
            f"(torch {m.get('torch')}, {data['spec']['threads']} thread(s), {m.get('cpus_usable')} CPUs, "
            f"load {_f(m.get('load_average_1m'), '.1f')})")
    od = data["spec"].get("cpu_over_disk")
    od_lim = data["physical"].get("memcpy_over_disk_gbps")
    o.print(f"memcpy {data['physical']['memcpy_gbps']:.2f} GB/s"
            + (f" ({od['threads']} threads: {od_lim:.2f})" if od and od_lim else "") + "; "
            + "; ".join(f"{k}: file write {v['write_gbps']:.2f} / read {v['read_gbps']:.2f} GB/s"
                        for k, v in data["physical"]["file_io"].items()))
    lim = data["physical"].get("over_disk")
    if lim:
        o.print("cpu over disk limits: " + ", ".join(f"{k} {v:.2f}" for k, v in lim.items()) + " GB/s")
    t = Table(show_lines=False)
    for col, just in (("workload", "left"), ("unit", "left"), ("lmcache (ours)", "right"), (f"LMCache {REF_VERSION}", "right"),
                      ("ours/theirs", "right"), ("limit", "left"), ("ours/limit", "right"), ("theirs/limit", "right"),
                      ("exact", "left")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in data["rows"]:
        ratio = r["ours_over_lmcache"]
        style = "green" if ratio and ratio >= 1 else "red" if ratio else ""
        t.add_row(r["workload"], r["unit"], _f(r["ours"]), _f(r["lmcache"]),
                  f"[{style}]{_f(ratio)}x[/]" if style else _f(ratio),
                  f"{r['limit']} {_f(r['limit_value'])}" if r["limit"] else "-",
                  _f(r["ours_vs_limit"]), _f(r["lmcache_vs_limit"]), "yes" if r["exact"] else "[red]NO[/]")
    o.print(t)
    g = data["goals"]
    o.print(f"goals: lookup >= 5x LMCache: {g['lookup_at_least_5x']} (worst {_f(g['lookup_min_ratio'])}x); "
            f"every tier >= LMCache: {g['tiers_at_least_lmcache']} (worst {_f(g['tiers_min_ratio'])}x)"
            + (f"; behind on: {', '.join(g['losses'])}" if g["losses"] else ""))


def plot(data: dict[str, Any], path: Path) -> None:
    from .harness import pyplot

    plt = pyplot()

    tier_rows = [r for r in data["rows"] if r["kind"] == "tier"]
    look = [r for r in data["rows"] if r["kind"] == "lookup"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, 5.5))
    xs = range(len(tier_rows))
    w = 0.4
    a1.bar([x - w / 2 for x in xs], [r["ours"] or 0 for r in tier_rows], w, label="lmcache (ours)")
    a1.bar([x + w / 2 for x in xs], [r["lmcache"] or 0 for r in tier_rows], w, label=f"LMCache {REF_VERSION}")
    a1.axhline(data["physical"]["memcpy_gbps"], color="grey", ls="--", lw=1, label="memcpy")
    a1.set_xticks(list(xs), [r["workload"] for r in tier_rows], rotation=60, ha="right", fontsize=7)
    a1.set_ylabel("GB/s")
    a1.set_title("tiers: store and retrieve")
    a1.legend(fontsize=8)
    for what, kind, ls in (("hash", "list", ":"), ("lookup", "list", "-"), ("lookup", "tensor", "--")):
        rows = [r for r in look if r["workload"].startswith(what) and r["workload"].endswith(f"({kind})")]
        n = [int(r["workload"].split()[1].rstrip("k")) * 1024 for r in rows]
        a2.plot(n, [r["ours"] for r in rows], ls, marker="o", color="C0", label=f"{what} ({kind}), lmcache (ours)")
        a2.plot(n, [r["lmcache"] for r in rows], ls, marker="s", color="C1", label=f"{what} ({kind}), LMCache {REF_VERSION}")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("prompt tokens")
    a2.set_ylabel("million tokens/s (p50)")
    a2.set_title("hashing and prefix lookup (prompt cached)")
    a2.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


# --------------------------------------------------------------------------- command


def compare_cmd(
    ref_venv: Annotated[Path | None, typer.Option("--ref-venv", file_okay=False, help=f"The LMCache venv (default: {REF_VENV} in the current directory or the repository root; `make bench-compare` builds it).")] = None,
    shapes: Annotated[str, typer.Option("--shapes", help=f"KV shapes, comma-separated: {', '.join(SHAPES)}.")] = "llama3-8b,smollm2",
    tiers: Annotated[str, typer.Option("--tiers", help="Tiers, comma-separated: cpu, disk.")] = "cpu,disk",
    chunks: Annotated[int | None, typer.Option("--chunks", min=1, help="Chunks of 256 tokens stored and retrieved per shape and tier (default 32; --quick 8).")] = None,
    tokens_per_prompt: Annotated[int | None, typer.Option("--tokens-per-prompt", min=256, help="Tokens per prompt (default 2048; --quick 512).")] = None,
    max_lookup_tokens: Annotated[int | None, typer.Option("--max-lookup-tokens", min=256, help="Longest lookup prompt (default 131072; --quick 16384).")] = None,
    directory: Annotated[Path | None, typer.Option("--dir", file_okay=False, help="Where the disk tiers write (default: a temporary directory).")] = None,
    threads: Annotated[int, typer.Option("--threads", min=1, help="torch intra-op threads, both sides.")] = 1,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the tokens and KV.")] = 0,
    quick: Annotated[bool, typer.Option("--quick", help="Small sizes (for tests): 2-layer shapes, 8 chunks, lookups up to 16k tokens.")] = False,
    passes: Annotated[int | None, typer.Option("--passes", min=1, help="Passes of the CPU-over-disk workload, the two sides in turn; each figure is the median of every round of every pass (default 3; --quick 1).")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds the LMCache driver may take.")] = 1800.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    plot_path: Annotated[Path | None, typer.Option("--plot", dir_okay=False, help="Also draw a bar chart into this PNG (needs matplotlib).")] = None,
) -> None:
    """The tier and lookup workloads through lmcache and through LMCache 0.5.6, side by side."""
    import shutil

    import torch

    from .harness import file_io_gbps, machine_info, memcpy_gbps, warn_if_busy

    shape_names = [s.strip() for s in shapes.split(",") if s.strip()]
    for s in shape_names:
        if s not in SHAPES:
            raise typer.BadParameter(f"unknown shape {s!r}; known: {', '.join(SHAPES)}", param_hint="'--shapes'")
    tier_names = [t.strip() for t in tiers.split(",") if t.strip()]
    for t in tier_names:
        if t not in ("cpu", "disk"):
            raise typer.BadParameter(f"unknown tier {t!r}; known: cpu, disk", param_hint="'--tiers'")
    venv = find_ref_venv(ref_venv)
    find_driver()
    default_threads = torch.get_num_threads()  # what torch picked for this machine (CPU over disk)
    torch.set_num_threads(threads)
    temporary = directory is None
    work = Path(tempfile.mkdtemp(prefix="lmcache-bench-compare-")) if directory is None else directory.expanduser()
    work.mkdir(parents=True, exist_ok=True)
    e = err()
    try:
        spec = build_spec(quick=quick, shapes=shape_names, tiers=tier_names, chunks=chunks,
                          tokens_per_prompt=tokens_per_prompt, max_lookup_tokens=max_lookup_tokens,
                          threads=threads, seed=seed, directory=work, default_threads=default_threads)
        machine = machine_info(work)
        warn_if_busy(machine)
        e.print("measuring memcpy, raw file I/O and raw hashing ...")
        physical: dict[str, Any] = {"memcpy_gbps": memcpy_gbps(256 << 20 if not quick else 32 << 20), "file_io": {}}
        if "disk" in tier_names:
            for s in spec["shapes"]:
                cb = s["layers"] * 2 * s["kv_heads"] * s["head_size"] * 2 * spec["chunk_size"]
                w, r, nbytes, fsize = file_io_gbps(work, min(cb * spec["chunks"], 1 << 30), cb)
                physical["file_io"][s["name"]] = {"write_gbps": w, "read_gbps": r, "bytes": nbytes, "file_size": fsize}
        physical["hash_tokens_per_s"] = hash_limit(spec["lookup_lengths"])
        if spec["cpu_over_disk"]:
            torch.set_num_threads(default_threads)
            physical["memcpy_over_disk_gbps"] = memcpy_gbps(spec["cpu_over_disk"]["bytes"], repeats=5)
            physical["over_disk"] = over_disk_limits(work, spec["cpu_over_disk"])
            torch.set_num_threads(threads)
        e.print("running the workloads through lmcache ...")
        t0 = time.perf_counter()
        ours: dict[str, Any] = {"tiers": [], "lookup": []}
        for s in spec["shapes"]:
            for t in tier_names:
                ours["tiers"].append({"shape": s["name"], **run_ours_tier(s, spec, t)})
        ours["lookup"] = run_ours_lookup(spec)
        ours["cpu_over_disk"] = run_ours_over_disk(spec) if spec["cpu_over_disk"] else None
        ours["seconds"] = time.perf_counter() - t0
        e.print(f"running the workloads through LMCache {REF_VERSION} ({venv}) ...")
        ref = run_ref(venv, spec, timeout)
        if spec["cpu_over_disk"]:
            over_disk_passes(spec, ours, ref, venv, timeout, passes or (1 if quick else 3))
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
    rows = build_rows(ours, ref, physical)
    data = {
        "benchmark": "compare",
        "machine": machine,
        "spec": spec,
        "physical": physical,
        "ours": ours,
        "lmcache": ref,
        "rows": rows,
        "exact": {side: all(t["exact"] for t in d["tiers"]) and all(r["exact"] for r in d["lookup"])
                  and (d.get("cpu_over_disk") or {}).get("exact", True) for side, d in (("ours", ours), ("lmcache", ref))},
        "complete": {side: all(t["complete"] for t in d["tiers"]) and (d.get("cpu_over_disk") or {}).get("complete", True)
                     for side, d in (("ours", ours), ("lmcache", ref))},
    }
    data["goals"] = goals(rows)
    emit(data, as_json, print_table, plot_path, plot)
    if not data["exact"]["ours"]:
        raise LMCacheError("lmcache returned KV that differs from what was stored (see 'exact' in --json)")
