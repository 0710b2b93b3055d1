"""``lmcache bench lookup``: chunk hashing and prefix lookup in the engine, in tokens/s,
next to the physical limit measured in the same run.

What is timed, for each prompt length (``--lengths``), with random token ids given the
way vLLM gives them (a Python list; ``--input numpy`` passes an int64 array instead):

- **hashing**: ``TokenProcessor.chunks`` (the chained 128-bit hash of every chunk) and
  ``CacheEngine.chunk_keys`` (the same plus each chunk's key string, what store, retrieve
  and lookup start with);
- **lookup**: ``engine.lookup(prompt)`` with the whole prompt cached (a hit must return
  its length), ``engine.locate(prompt)`` (the same, naming the tiers) and
  ``engine.lookup(other)`` for a prompt of the same length that was never stored (a miss
  must return 0); once with an engine whose index holds just that prompt, once with one
  whose index also holds ``--indexed`` other chunks (1M by default).

The engine is a genuine one with one CPU tier and a tiny KV shape (1 layer, 1 KV head,
head size 1, float16: 1 KiB per 256-token chunk), so a million chunks take about 1 GiB of
pool; it is filled by ordinary ``engine.store`` calls of long prompts (the time that takes
is reported as well). The lookup path never reads KV bytes, so the shape does not enter it.

The limit, measured in the same run on the same tokens:

- converting the tokens to the int64 array that is hashed: the faster of
  ``array('q', list)`` and ``struct`` packing the list into the array in batches
  (:func:`lmcache.keys.pack_tokens`), each timed here (nothing for ``--input numpy``);
- xxh3-128 (or blake2b) over the whole token array as one buffer, GB/s;
- a Python dict membership test of as many keys as the prompt has chunks, in a dict with
  as many entries as the engine's index (``map(dict.__contains__, keys)``).

A hit cannot cost less than all three over the whole prompt; a miss, than the same for
the first chunk only (a prefix that misses its first chunk is empty). The ratio is the
limit's time over the measured p50 (1.0 = at the limit). Each number is the p50/p99 of
many calls (as many as fit in about ``0.3 s``; ``--quick`` uses less).
"""

from __future__ import annotations

import array
import hashlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from .harness import emit, err, out, save_figure

DEFAULT_LENGTHS = "1024,4096,16384,32768,131072"
QUICK_LENGTHS = "1024,4096"
QUICK_INDEXED = 20000
VOCAB = 128000  # token ids drawn from [0, VOCAB), a Llama-3-sized vocabulary
KV_SPEC = {"num_layers": 1, "num_kv_heads": 1, "head_size": 1, "dtype": "float16"}
FILL_PROMPT = 131072  # tokens per store while filling the index


# --------------------------------------------------------------------------- timing
def _pct(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    n = len(s)
    return {"p50": s[n // 2] * 1e3, "p99": s[min(n - 1, int(0.99 * n))] * 1e3}


def time_calls(fn: Callable[[], Any], budget: float, least: int = 20, most: int = 5000,
               before: Callable[[], Any] | None = None) -> tuple[dict[str, float], Any]:
    """p50/p99 in ms of ``fn()`` over as many calls as fit in ``budget`` seconds (within
    ``[least, most]``), after 3 untimed calls; and what the last call returned. ``before``
    runs, untimed, before each call."""
    prep = before or (lambda: None)
    for _ in range(3):
        prep()
        res = fn()
    prep()
    t0 = time.perf_counter()
    res = fn()
    first = time.perf_counter() - t0
    n = max(least, min(most, int(budget / max(first, 1e-7))))
    samples = []
    clock = time.perf_counter
    for _ in range(n):
        prep()
        t0 = clock()
        res = fn()
        samples.append(clock() - t0)
    return _pct(samples), res


def _tps(tokens: int, ms: float) -> float:
    return tokens / (ms / 1e3) if ms > 0 else float("inf")


# --------------------------------------------------------------------------- the pieces
def make_engine(capacity_chunks: int, chunk_size: int, hash_algorithm: str):
    from lmcache.config import KVSpec
    from lmcache.engine import CacheEngine

    chunk_bytes = KVSpec(**KV_SPEC).bytes_per_token() * chunk_size
    cap = (capacity_chunks + 64) * chunk_bytes + (64 << 20)
    return CacheEngine.from_config(
        {"chunk_size": chunk_size, "hash_algorithm": hash_algorithm, "memory_pool_size": cap,
         "tiers": [{"backend": "cpu", "capacity": cap}]},
        kv_spec=KV_SPEC,
    )


def store_prompt(engine, tokens) -> None:
    import numpy as np
    import torch

    n = len(tokens)
    kv = torch.zeros((1, 2, n, 1, 1), dtype=torch.float16)
    res = engine.store(np.asarray(tokens, dtype=np.int64), kv)
    if res.dropped_tokens:
        raise RuntimeError(f"the pool dropped {res.dropped_tokens} tokens while storing; make the pool larger")


def fill(engine, chunks: int, chunk_size: int, seed: int, show: bool) -> dict[str, Any]:
    """Store ``chunks`` chunks of random prompts (``FILL_PROMPT`` tokens each) through
    ``engine.store``; the time it took."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    per = max(1, FILL_PROMPT // chunk_size)
    kv = torch.zeros((1, 2, per * chunk_size, 1, 1), dtype=torch.float16)
    done = 0
    t0 = time.perf_counter()
    last_note = t0
    while done < chunks:
        k = min(per, chunks - done)
        toks = rng.integers(0, VOCAB, k * chunk_size, dtype=np.int64)
        res = engine.store(toks, kv[:, :, : k * chunk_size])
        if res.dropped_tokens:
            raise RuntimeError("the pool dropped chunks while filling the index; make the pool larger")
        done += k
        if show and time.perf_counter() - last_note > 10:
            last_note = time.perf_counter()
            err().print(f"  filled {done:,} of {chunks:,} chunks ({done / (last_note - t0):,.0f} chunks/s)")
    secs = time.perf_counter() - t0
    return {"chunks": chunks, "seconds": round(secs, 3), "chunks_per_s": round(chunks / secs) if secs else None,
            "prompt_tokens": min(per, chunks) * chunk_size}


def raw_digest(hash_algorithm: str) -> Callable[[Any], bytes]:
    import xxhash

    if hash_algorithm == "xxh3_128":
        return xxhash.xxh3_128_digest
    return lambda b: hashlib.blake2b(b, digest_size=16).digest()


#: the conversions of a Python list the limit takes the faster of
CONVERSIONS = ("array", "struct")


def to_int64(tokens: Any, how: str = "array"):
    """Tokens as little-endian int64, a list converted by ``array('q', ...)`` or by
    batched ``struct`` packing (``how``; the limit's first part is the faster)."""
    import numpy as np

    if isinstance(tokens, list):
        if how == "struct":
            from lmcache.keys import pack_tokens

            return pack_tokens(tokens)
        return np.frombuffer(array.array("q", tokens), dtype="<i8")
    return np.ascontiguousarray(tokens, dtype="<i8")


def limits(tokens: Any, arr, chunk_size: int, keys: list[str], index: dict[str, Any], hash_algorithm: str,
           budget: float) -> dict[str, Any]:
    """The floor of hashing and of a hit/miss lookup for this prompt (ms, p50 of many)."""
    digest = raw_digest(hash_algorithm)
    n_tok = len(arr)
    first = tokens[:chunk_size]
    by = {how: time_calls(lambda: to_int64(tokens, how), budget)[0] for how in CONVERSIONS}
    convert = min(by.values(), key=lambda x: x["p50"])
    convert_first = min((time_calls(lambda: to_int64(first, how), budget)[0] for how in CONVERSIONS),
                        key=lambda x: x["p50"])
    mv = memoryview(arr).cast("B")
    hash_all, _ = time_calls(lambda: digest(mv), budget)
    hash_first, _ = time_calls(lambda: digest(mv[: chunk_size * 8]), budget)
    contains = index.__contains__
    dict_all, got = time_calls(lambda: list(map(contains, keys)), budget)
    dict_one, _ = time_calls(lambda: contains(keys[0]), budget)
    hit = convert["p50"] + hash_all["p50"] + dict_all["p50"]
    miss = convert_first["p50"] + hash_first["p50"] + dict_one["p50"]
    return {
        "convert_ms": convert["p50"], "convert_ms_by": {how: t["p50"] for how, t in by.items()},
        "hash_ms": hash_all["p50"],
        "hash_gbps": n_tok * 8 / (hash_all["p50"] / 1e3) / 1e9 if hash_all["p50"] else None,
        "hash_tokens_per_s": _tps(n_tok, hash_all["p50"]),
        "dict_ms": dict_all["p50"], "dict_keys": len(keys), "dict_entries": len(index), "dict_hits": sum(got),
        "hashing_ms": convert["p50"] + hash_all["p50"], "hit_ms": hit, "miss_ms": miss,
    }


def synthetic_index(entries: int, prefix: str, seed: int) -> dict[str, None]:
    """A dict of ``entries`` key strings of the engine's form (for the dict-lookup limit)."""
    import numpy as np

    raw = np.random.default_rng(seed).bytes(16 * entries)
    hexed = raw.hex()
    return dict.fromkeys(prefix + hexed[i : i + 32] for i in range(0, len(hexed), 32))


# --------------------------------------------------------------------------- the run
def run(lengths: list[int], chunk_size: int, hash_algorithm: str, indexed: int, input_kind: str, budget: float,
        seed: int = 0, show: bool = True) -> dict[str, Any]:
    import gc

    import numpy as np

    from lmcache.keys import CacheKey, TokenProcessor

    rng = np.random.default_rng(seed)
    prompts = {n: rng.integers(0, VOCAB, n, dtype=np.int64) for n in lengths}
    others = {n: rng.integers(0, VOCAB, n, dtype=np.int64) for n in lengths}

    def given(a):
        return a.tolist() if input_kind == "list" else a

    tp = TokenProcessor(chunk_size, True, hash_algorithm)
    hashing: list[dict[str, Any]] = []
    lookups: list[dict[str, Any]] = []
    fill_info: dict[str, Any] | None = None
    prompt_chunks = sum(-(-n // chunk_size) for n in lengths)

    def measure(engine, n: int, big: bool, base_index: dict[str, None]) -> None:
        hit_t, miss_t = given(prompts[n]), given(others[n])
        store_prompt(engine, prompts[n])
        _, keys = engine.chunk_keys(hit_t)
        index = base_index
        index.update(dict.fromkeys(keys))
        arr = to_int64(hit_t)
        lim = limits(hit_t, arr, chunk_size, keys, index, hash_algorithm, budget)
        for k in keys:
            index.pop(k, None)
        if not big:
            chunks_ms, ch = time_calls(lambda: tp.chunks(hit_t), budget)
            keys_ms, _ = time_calls(lambda: engine.chunk_keys(hit_t), budget)
            hashing.append({
                "tokens": n, "chunks": len(ch), "chunks_ms": chunks_ms, "keys_ms": keys_ms,
                "tokens_per_s": _tps(n, keys_ms["p50"]),
                "limit": {k: lim[k] for k in ("convert_ms", "convert_ms_by", "hash_ms", "hash_gbps", "hash_tokens_per_s")},
                "limit_ms": lim["hashing_ms"],
                "ratio": lim["hashing_ms"] / keys_ms["p50"] if keys_ms["p50"] else None,
            })
        # each call a new request's lookup: the engine's prompt memo forgotten before it
        hit_ms, hit_n = time_calls(lambda: engine.lookup(hit_t), budget, before=engine.prompts.clear)
        locate_ms, (loc_n, tiers) = time_calls(lambda: engine.locate(hit_t), budget, before=engine.prompts.clear)
        miss_ms, miss_n = time_calls(lambda: engine.lookup(miss_t), budget, before=engine.prompts.clear)
        lookups.append({
            "tokens": n, "index": "large" if big else "prompt", "indexed_chunks": indexed_chunks(engine),
            "hit_ms": hit_ms, "hit_tokens": hit_n, "locate_ms": locate_ms, "locate_tokens": loc_n,
            "locate_tiers": sorted(set(tiers)), "miss_ms": miss_ms, "miss_tokens": miss_n,
            "hit_tokens_per_s": _tps(n, hit_ms["p50"]), "miss_tokens_per_s": _tps(n, miss_ms["p50"]),
            "limit": {"hit_ms": lim["hit_ms"], "miss_ms": lim["miss_ms"], "dict_ms": lim["dict_ms"],
                      "dict_entries": lim["dict_entries"]},
            "ratio_hit": lim["hit_ms"] / hit_ms["p50"] if hit_ms["p50"] else None,
            "ratio_miss": lim["miss_ms"] / miss_ms["p50"] if miss_ms["p50"] else None,
        })

    # an engine whose index holds just the prompt (a fresh one per length)
    for n in lengths:
        if show:
            err().print(f"index holds only the prompt: {n:,} tokens ...")
        with make_engine(-(-n // chunk_size), chunk_size, hash_algorithm) as engine:
            measure(engine, n, False, {})
    # one engine whose index holds `indexed` other chunks, then each prompt as well
    engine = make_engine(indexed + prompt_chunks, chunk_size, hash_algorithm)
    try:
        if show:
            err().print(f"filling the index with {indexed:,} chunks through engine.store ...")
        fill_info = fill(engine, indexed, chunk_size, seed + 1, show)
        if show:
            err().print(f"  done in {fill_info['seconds']:.1f}s ({fill_info['chunks_per_s']:,} chunks/s)")
        assert engine.kv_spec is not None
        prefix = CacheKey(engine.config.namespace, engine.config.model, engine.kv_spec.signature, "0" * 32).to_string()[:-32]
        base_index = synthetic_index(indexed, prefix, seed + 2)
        gc.collect()
        gc.freeze()  # the million objects of the index are not garbage: keep the collector off them
        try:
            for n in lengths:
                if show:
                    err().print(f"index holds {indexed:,} other chunks: {n:,}-token prompt ...")
                measure(engine, n, True, base_index)
        finally:
            gc.unfreeze()
    finally:
        engine.close()
        del engine
        gc.collect()
    return {
        "bench": "lookup", "lengths": lengths, "chunk_size": chunk_size, "hash_algorithm": hash_algorithm,
        "input": input_kind, "indexed": indexed, "kv_spec": KV_SPEC, "fill": fill_info,
        "hashing": hashing, "lookup": lookups,
    }


def indexed_chunks(engine) -> int:
    return sum(t["entries"] for t in engine.stats()["tiers"].values())


# --------------------------------------------------------------------------- output
def print_tables(data: dict[str, Any]) -> None:
    from rich.table import Table

    o = out()
    m = data.get("machine") or {}
    o.print(f"lmcache bench lookup: {data['hash_algorithm']}, {data['chunk_size']}-token chunks, tokens given as "
            f"{'a Python list' if data['input'] == 'list' else 'an int64 array'}; load average "
            f"{m.get('load_average_1m', 0):.2f} on {m.get('cpus_usable')} CPUs")
    t = Table(title="hashing (engine.chunk_keys; TokenProcessor.chunks alone in the second column)")
    for c in ("tokens", "chunks p50 ms", "keys p50 ms", "keys p99 ms", "Mtokens/s", "limit ms", "ratio",
              "xxh3 GB/s" if data["hash_algorithm"] == "xxh3_128" else "blake2b GB/s", "convert ms"):
        t.add_column(c, justify="right")
    for r in data["hashing"]:
        lim = r["limit"]
        t.add_row(f"{r['tokens']:,}", f"{r['chunks_ms']['p50']:.3f}", f"{r['keys_ms']['p50']:.3f}",
                  f"{r['keys_ms']['p99']:.3f}", f"{r['tokens_per_s'] / 1e6:.1f}", f"{r['limit_ms']:.3f}",
                  f"{r['ratio']:.2f}", f"{lim['hash_gbps']:.1f}", f"{lim['convert_ms']:.3f}")
    o.print(t)
    t = Table(title="prefix lookup (engine.lookup; hit = whole prompt cached, miss = nothing cached)")
    for c in ("tokens", "indexed chunks", "hit p50 ms", "hit p99 ms", "locate p50", "hit Mtok/s", "hit limit ms", "hit ratio",
              "miss p50 ms", "miss p99 ms", "miss limit ms", "miss ratio"):
        t.add_column(c, justify="right")
    for r in data["lookup"]:
        idx = f"{r['indexed_chunks']:,}"
        t.add_row(f"{r['tokens']:,}", idx, f"{r['hit_ms']['p50']:.3f}", f"{r['hit_ms']['p99']:.3f}",
                  f"{r['locate_ms']['p50']:.3f}", f"{r['hit_tokens_per_s'] / 1e6:.1f}", f"{r['limit']['hit_ms']:.3f}",
                  f"{r['ratio_hit']:.2f}", f"{r['miss_ms']['p50']:.3f}", f"{r['miss_ms']['p99']:.3f}",
                  f"{r['limit']['miss_ms']:.4f}", f"{r['ratio_miss']:.3f}")
    o.print(t)
    exact = all(r["hit_tokens"] == r["locate_tokens"] == r["tokens"] and r["miss_tokens"] == 0 for r in data["lookup"])
    o.print(f"every hit returned the whole prompt and every miss 0 tokens: {exact}")
    f = data.get("fill")
    if f:
        o.print(f"index filled with {f['chunks']:,} chunks by engine.store of {f['prompt_tokens']:,}-token prompts "
                f"in {f['seconds']:.1f}s ({f['chunks_per_s']:,} chunks/s)")


def plot(data: dict[str, Any], path: Path) -> None:
    from .harness import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8.5, 5), dpi=120)
    for idx, style in (("prompt", "-o"), ("large", "-s")):
        rows = [r for r in data["lookup"] if r["index"] == idx]
        label = "the prompt only" if idx == "prompt" else f"{data['indexed']:,} other chunks"
        ax.plot([r["tokens"] for r in rows], [r["hit_tokens_per_s"] for r in rows], style,
                label=f"lookup hit, index: {label}")
        ax.plot([r["tokens"] for r in rows], [r["miss_tokens_per_s"] for r in rows], style, alpha=0.5,
                label=f"lookup miss, index: {label}")
    rows = [r for r in data["lookup"] if r["index"] == "prompt"]
    ax.plot([r["tokens"] for r in rows], [_tps(r["tokens"], r["limit"]["hit_ms"]) for r in rows], "k--",
            label="limit of a hit (convert + one-buffer hash + dict lookups)")
    ax.plot([r["tokens"] for r in data["hashing"]], [r["tokens_per_s"] for r in data["hashing"]], ":^",
            label="hashing alone (engine.chunk_keys)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"lmcache bench lookup ({data['hash_algorithm']}, {data['chunk_size']}-token chunks, {data['input']} input)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


# --------------------------------------------------------------------------- command
def _lengths(text: str) -> list[int]:
    try:
        vals = [int(x.replace("_", "")) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated token counts, got {text!r}", param_hint="'--lengths'") from None
    if not vals or min(vals) <= 0:
        raise typer.BadParameter("expected positive token counts", param_hint="'--lengths'")
    return vals


def lookup_cmd(
    lengths: Annotated[str | None, typer.Option("--lengths", help=f"Prompt lengths in tokens, comma-separated (default {DEFAULT_LENGTHS}).")] = None,
    chunk_size: Annotated[int, typer.Option("--chunk-size", min=1, help="Tokens per chunk.")] = 256,
    hash_algorithm: Annotated[str, typer.Option("--hash-algorithm", help="xxh3_128 or blake2b (the engine's hash_algorithm).")] = "xxh3_128",
    indexed: Annotated[int | None, typer.Option("--indexed", min=1, help="Other chunks in the large index (default 1000000).")] = None,
    input_kind: Annotated[str, typer.Option("--input", help="How the tokens are given: list (as vLLM does) or numpy (int64 array).")] = "list",
    budget: Annotated[float | None, typer.Option("--budget", min=0.001, help="Seconds of calls per measurement (default 0.3).")] = None,
    quick: Annotated[bool, typer.Option("--quick", help=f"Small sizes for a smoke test: {QUICK_LENGTHS} tokens, {QUICK_INDEXED:,} chunks indexed.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    plot_path: Annotated[Path | None, typer.Option("--plot", dir_okay=False, help="Also draw tokens/s against prompt length into this PNG (needs matplotlib).")] = None,
) -> None:
    """Hashing and prefix lookup in the engine: tokens/s and p50/p99 per call, 1 vs 1M chunks indexed."""
    if hash_algorithm not in ("xxh3_128", "blake2b"):
        raise typer.BadParameter("expected xxh3_128 or blake2b", param_hint="'--hash-algorithm'")
    if input_kind not in ("list", "numpy"):
        raise typer.BadParameter("expected list or numpy", param_hint="'--input'")
    lens = _lengths(lengths or (QUICK_LENGTHS if quick else DEFAULT_LENGTHS))
    n_indexed = indexed or (QUICK_INDEXED if quick else 1_000_000)
    from .harness import need_pyplot

    need_pyplot(plot_path)
    from .harness import machine_info, warn_if_busy

    machine = machine_info()
    warn_if_busy(machine)
    data = run(lens, chunk_size, hash_algorithm, n_indexed, input_kind, budget or (0.05 if quick else 0.3))
    data["machine"] = machine
    emit(data, as_json, print_tables, plot_path, plot)


def _main(argv: list[str]) -> None:
    """``python -m lmcache.benchmarks.lookup [OPTIONS]`` runs the bench outside the CLI."""
    root = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    root.command()(lookup_cmd)
    root(prog_name="lmcache bench lookup", args=argv)


if __name__ == "__main__":
    _main(sys.argv[1:])
