"""``lmcache bench codecs``: codecs and chains measured on real KV from a real model.

KV is captured from SmolLM2-135M-Instruct (float32, on the CPU) over a text (by default
``benchmarks/data/codec_text.txt``, prose written for this repository) and cut into chunk
buffers ``(layers, 2, chunk_size, heads, head_size)`` exactly as a tier stores them.
For every codec or chain (a row; rows marked ``@bf16`` first convert the KV to bfloat16):

- ratio: raw chunk bytes / encoded bytes, over every chunk of the text;
- encode / decode GB/s: raw bytes / wall time of encoding (decoding) every chunk, best
  of ``--repeats``, one thread of Python calling the codec (10^9 bytes per second);
- K / V max and mean absolute error of the decoded chunks against the originals (in the
  row's dtype);
- top-1: over ``--prompts`` prompts, prefixes of the text of evenly spaced lengths, the KV
  of all but the last token is stored the way a tier would (full chunks, then the partial
  last chunk) through the codec and decoded; the model runs the last token on it, and the
  argmax of its logits is compared with the same run on the exact KV;
  Each prompt whose top-1 changed is listed (``top1_flips``) with the exact run's gap
  between its top-1 and top-2 logits: a flip at a gap of 0.003 is a near-tie;
- greedy: for ``--gen-prompts`` prompts, ``--gen-tokens`` tokens are generated greedily
  from decoded KV and from exact KV; the fraction of tokens produced before the first
  difference (1.0: identical continuations), and (``greedy_positions``) the fraction of
  positions holding the same token.

Rows: a codec or chain, ``@bf16``/``@fp16`` to convert the KV first, ``/gN`` to give a
quantizer group size N (``int8+zstd/g128``).

Lossless rows are checked bit-exact and their quality is 1.0 by construction.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import torch

from lmcache.codecs import decode_tensor, encode_tensor, load_codec
from lmcache.errors import LMCacheError
from lmcache.plugin_manager import get_registries

from .harness import emit, err, out, save_figure

GB = 1e9
DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "codec_text.txt"
DEFAULT_ROWS = (
    "zstd", "shuffle+zstd", "int8", "int8+zstd", "int8+zstd/g128", "int4", "int4+zstd", "int4+zstd/g32", "fp8+zstd",
    "cachegen", "cachegen/g128",
    "zstd@bf16", "shuffle+zstd@bf16", "int8+zstd@bf16", "int4+zstd@bf16", "cachegen@bf16",
)
QUANTIZERS = ("int8", "int4", "fp8", "cachegen")  # codecs with a group_size option
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def parse_row(spec: str) -> tuple[str, torch.dtype, int | None]:
    """``int8+zstd``, ``zstd@bf16``, ``int8+zstd/g128`` -> (codec spec, KV dtype, group size)."""
    spec, _, g = spec.partition("/g")
    codec, _, dt = spec.partition("@")
    if dt and dt not in _DTYPES:
        raise LMCacheError(f"row {spec!r}: unknown dtype {dt!r} (use fp32, bf16 or fp16)")
    if g and not g.isdigit():
        raise LMCacheError(f"row {spec!r}: /g must be followed by a group size, got {g!r}")
    return codec, _DTYPES[dt or "fp32"], int(g) if g else None


# ------------------------------------------------------------------------ model side


def capture_kv(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """KV of ``ids`` as one ``(layers, 2, tokens, heads, head_size)`` float tensor."""
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        outp = model(input_ids=torch.tensor([list(ids)]), cache=cache, use_cache=True)
        cache = _out_cache(outp, cache)
        layers = [torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]  # (2, H, T, D)
    return torch.stack(layers).permute(0, 1, 3, 2, 4).contiguous()  # (L, 2, T, H, D)


def _out_cache(outp: Any, fallback: Any) -> Any:
    """The model output's cache (``cache`` in transformers 5, ``past_key_values`` before)."""
    for name in ("cache", "past_key_values"):
        c = getattr(outp, name, None)
        if c is not None:
            return c
    return fallback


def _cache_of(model: Any, kv: torch.Tensor):
    """A model cache holding ``kv`` (L, 2, T, H, D), in the model's dtype."""
    from transformers import DynamicCache

    kv = kv.to(next(model.parameters()).dtype)
    pairs = [(kv[i, 0].transpose(0, 1).unsqueeze(0).contiguous(), kv[i, 1].transpose(0, 1).unsqueeze(0).contiguous())
             for i in range(kv.shape[0])]
    return DynamicCache(pairs, config=model.config)


def _step(model: Any, cache: Any, token: int) -> tuple[int, Any]:
    outp = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True, logits_to_keep=1)
    return int(outp.logits[0, -1].argmax()), _out_cache(outp, cache)


def logits_of(model: Any, kv: torch.Tensor, last: int) -> torch.Tensor:
    """Next-token logits after ``last``, given the KV of the tokens before it."""
    with torch.inference_mode():
        outp = model(input_ids=torch.tensor([[last]]), cache=_cache_of(model, kv), use_cache=True, logits_to_keep=1)
    return outp.logits[0, -1].float()


def first_token(model: Any, kv: torch.Tensor, last: int) -> int:
    return int(logits_of(model, kv, last).argmax())


def greedy(model: Any, kv: torch.Tensor, last: int, n: int) -> list[int]:
    toks = []
    with torch.inference_mode():
        cache = _cache_of(model, kv)
        tok = last
        for _ in range(n):
            tok, cache = _step(model, cache, tok)
            toks.append(tok)
    return toks


# ------------------------------------------------------------------------ codec side


def chunks_of(kv: torch.Tensor, chunk_size: int) -> list[torch.Tensor]:
    return [kv[:, :, s : s + chunk_size].contiguous() for s in range(0, kv.shape[2], chunk_size)]


def roundtrip(codec: Any, chunk: torch.Tensor) -> torch.Tensor:
    enc = encode_tensor(codec, chunk)
    return decode_tensor(codec, memoryview(enc).cast("B"), tuple(chunk.shape), chunk.dtype)


class StoredText:
    """The text's chunks through one codec, and prefixes of it as a tier would return them."""

    def __init__(self, codec: Any, kv: torch.Tensor, chunk_size: int):
        self.codec, self.kv, self.cs = codec, kv, chunk_size
        self.full = [roundtrip(codec, c) for c in chunks_of(kv, chunk_size)]

    def prefix(self, n: int) -> torch.Tensor:
        """Decoded KV of the first ``n`` tokens: whole chunks, then the partial one encoded on its own."""
        whole = n // self.cs
        parts = [c for c in self.full[:whole]]
        if n % self.cs:
            parts.append(roundtrip(self.codec, self.kv[:, :, whole * self.cs : n].contiguous()))
        return torch.cat(parts, dim=2)


def measure_speed(codec: Any, chunks: list[torch.Tensor], repeats: int) -> dict[str, float]:
    raw = sum(c.numel() * c.element_size() for c in chunks)
    best_e = best_d = float("inf")
    encoded: list[Any] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        encoded = [encode_tensor(codec, c) for c in chunks]
        best_e = min(best_e, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for e, c in zip(encoded, chunks):
            decode_tensor(codec, memoryview(e).cast("B"), tuple(c.shape), c.dtype)
        best_d = min(best_d, time.perf_counter() - t0)
    enc = sum(len(memoryview(e).cast("B")) for e in encoded)
    return {"raw_bytes": raw, "encoded_bytes": enc, "ratio": raw / enc if enc else None,
            "encode_gbps": raw / best_e / GB, "decode_gbps": raw / best_d / GB}


def errors(orig: torch.Tensor, dec: torch.Tensor) -> dict[str, float]:
    d = (dec.float() - orig.float()).abs()
    return {"k_max_err": float(d[:, 0].max()), "k_mean_err": float(d[:, 0].mean()),
            "v_max_err": float(d[:, 1].max()), "v_mean_err": float(d[:, 1].mean())}


def prompt_lengths(tokens: int, prompts: int, smallest: int = 8) -> list[int]:
    """``prompts`` evenly spaced prompt lengths in [smallest, tokens] (distinct)."""
    if tokens <= smallest:
        return [tokens]
    step = (tokens - smallest) / max(prompts - 1, 1)
    return sorted({int(round(smallest + i * step)) for i in range(prompts)})


def run(
    rows: Sequence[str],
    *,
    text: Path,
    tokens: int,
    chunk_size: int,
    prompts: int,
    gen_prompts: int,
    gen_tokens: int,
    repeats: int,
    group_size: int | None,
    model: Any = None,
    tokenizer: Any = None,
) -> dict[str, Any]:
    e = err()
    regs = get_registries()
    parsed = []
    codecs = {}
    for r in rows:
        spec, dtype, g = parse_row(r)
        opts = None
        first = spec.split("+")[0]
        g = g or group_size
        parsed.append((r, spec, dtype, g if first in QUANTIZERS else None))
        if g is not None and first in QUANTIZERS:
            opts = {first: {"group_size": g}} if "+" in spec else {"group_size": g}
        try:
            codecs[r] = load_codec(regs.codecs.load, spec, opts)
        except Exception as exc:
            raise LMCacheError(f"row {r!r}: {exc}") from None
    if model is None:
        from lmcache.plugins.connectors.hf_models import load_smollm2

        e.print("loading SmolLM2-135M-Instruct ...")
        model, tokenizer = load_smollm2()
    if not text.is_file():
        raise LMCacheError(f"text file {text} does not exist (give one with --text)")
    ids = tokenizer(text.read_text(encoding="utf-8"))["input_ids"][:tokens]
    if len(ids) < 2:
        raise LMCacheError(f"{text} has fewer than 2 tokens")
    t_start = time.perf_counter()
    e.print(f"capturing KV of {len(ids)} tokens ...")
    kv32 = capture_kv(model, ids)
    lengths = prompt_lengths(len(ids), prompts)
    gen_lengths = lengths[:: max(1, len(lengths) // max(gen_prompts, 1))][:gen_prompts] if gen_prompts else []
    gen_lengths = [n for n in gen_lengths if n >= 2]
    e.print(f"reference runs: {len(lengths)} prompts, {len(gen_lengths)} x {gen_tokens} generated tokens ...")
    ref_logits = [logits_of(model, kv32[:, :, : n - 1], ids[n - 1]) for n in lengths]
    ref_top1 = [int(lg.argmax()) for lg in ref_logits]
    ref_margin = [float(lg.topk(2).values[0] - lg.topk(2).values[1]) for lg in ref_logits]
    ref_gen = [greedy(model, kv32[:, :, : n - 1], ids[n - 1], gen_tokens) for n in gen_lengths]
    results = []
    for r, spec, dtype, g in parsed:
        codec = codecs[r]
        kv = kv32.to(dtype)
        e.print(f"{r} ...")
        chunks = chunks_of(kv, chunk_size)
        if g is None and spec.split("+")[0] in QUANTIZERS:
            g = codec.stages[0].group_size if hasattr(codec, "stages") else codec.group_size
        row: dict[str, Any] = {"row": r, "codec": spec, "dtype": str(dtype).removeprefix("torch."), "group_size": g,
                               "lossless": bool(codec.lossless)}
        row.update(measure_speed(codec, chunks, repeats))
        stored = StoredText(codec, kv, chunk_size)
        row.update(errors(kv, torch.cat(stored.full, dim=2)))
        if codec.lossless:
            exact = all(torch.equal(a, b) for a, b in zip(stored.full, chunks))
            if not exact:
                raise LMCacheError(f"{r} claims to be lossless but did not round-trip exactly")
            one = 1.0 if dtype == torch.float32 else None
            row.update(top1=one, top1_flips=[], greedy=one, greedy_positions=one)
        if not codec.lossless or dtype != torch.float32:
            # quality against the float32 reference (a bf16 row includes the bf16 conversion)
            agree = [first_token(model, stored.prefix(n - 1), ids[n - 1]) == ref for n, ref in zip(lengths, ref_top1)]
            row["top1"] = sum(agree) / len(agree)
            # where the top-1 changed: prompt length and the exact run's top-1/top-2 logit gap
            row["top1_flips"] = [{"prompt_tokens": n, "ref_margin": m}
                                 for n, m, ok in zip(lengths, ref_margin, agree) if not ok]
            prefix_fr, pos_fr = [], []
            for n, ref in zip(gen_lengths, ref_gen):
                got = greedy(model, stored.prefix(n - 1), ids[n - 1], gen_tokens)
                same = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
                prefix_fr.append(same / len(ref))
                pos_fr.append(sum(a == b for a, b in zip(got, ref)) / len(ref))
            row["greedy"] = sum(prefix_fr) / len(prefix_fr) if prefix_fr else None
            row["greedy_positions"] = sum(pos_fr) / len(pos_fr) if pos_fr else None
        results.append(row)
    from .harness import machine_info

    shape = list(kv32.shape)
    return {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct (float32, CPU)",
        "text": str(text),
        "tokens": len(ids),
        "kv_shape": shape,
        "chunk_size": chunk_size,
        "prompts": len(lengths),
        "prompt_lengths": [lengths[0], lengths[-1]],
        "gen_prompts": len(gen_lengths),
        "gen_tokens": gen_tokens,
        "repeats": repeats,
        "group_size": group_size,
        "machine": machine_info(),
        "torch_threads": torch.get_num_threads(),
        "seconds": time.perf_counter() - t_start,
        "rows": results,
    }


def _f(x: Any, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _flips(flips: list[dict[str, Any]]) -> str:
    if not flips:
        return "0"
    return f"{len(flips)}: {min(f['ref_margin'] for f in flips):.3f}"


def print_table(data: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"lmcache bench codecs: SmolLM2-135M KV, {data['tokens']} tokens, chunks of {data['chunk_size']}")
    for col in ("codec", "dtype", "group", "ratio", "enc GB/s", "dec GB/s", "K max err", "K mean err", "V max err",
                "V mean err", f"top-1 ({data['prompts']})", "flips: min gap",
                f"greedy ({data['gen_prompts']}x{data['gen_tokens']})", "same pos."):
        t.add_column(col, justify="left" if col in ("codec", "dtype", "flips: min gap") else "right")
    for r in data["rows"]:
        t.add_row(r["codec"], r["dtype"], str(r["group_size"] or ""), _f(r["ratio"], ".2f"), _f(r["encode_gbps"], ".3f"), _f(r["decode_gbps"], ".3f"),
                  _f(r["k_max_err"], ".3g"), _f(r["k_mean_err"], ".3g"), _f(r["v_max_err"], ".3g"),
                  _f(r["v_mean_err"], ".3g"), _f(r["top1"], ".1%"), _flips(r.get("top1_flips") or []),
                  _f(r["greedy"], ".1%"), _f(r.get("greedy_positions"), ".1%"))
    o = out()
    o.print(t)
    o.print(f"in {data['seconds']:.1f} s; ratio = raw bytes of the row's dtype / encoded bytes; "
            "flips: prompts whose top-1 changed, and the smallest top-1/top-2 logit gap of the exact run among them")


def plot(data: dict[str, Any], path: Path) -> None:
    """Compression ratio against first-token top-1 agreement, one point per row."""
    from .harness import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in data["rows"]:
        if r.get("ratio") is None or r.get("top1") is None:
            continue
        colour = "tab:green" if r["lossless"] else ("tab:blue" if r["dtype"] == "float32" else "tab:orange")
        ax.scatter(r["ratio"], 100 * r["top1"], color=colour, s=40, zorder=3)
        ax.annotate(r["row"], (r["ratio"], 100 * r["top1"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.axhline(99, color="grey", ls="--", lw=1)
    ax.axvline(4, color="grey", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("compression ratio (raw bytes of the row's dtype / encoded bytes, log scale)")
    ax.set_ylabel(f"first-token top-1 agreement over {data.get('prompts', '')} prompts (%)")
    ax.set_title("lmcache bench codecs: SmolLM2-135M KV (green: lossless, blue: lossy fp32, orange: lossy bf16)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, path, dpi=110)


def main(rows: Sequence[str], text: Path | None, tokens: int, chunk_size: int, prompts: int, gen_prompts: int,
         gen_tokens: int, repeats: int, group_size: int | None, threads: int | None, as_json: bool,
         plot_path: Path | None = None) -> None:
    from .harness import set_threads

    set_threads(threads)
    data = run(rows, text=text or DEFAULT_TEXT, tokens=tokens, chunk_size=chunk_size, prompts=prompts,
               gen_prompts=gen_prompts, gen_tokens=gen_tokens, repeats=repeats, group_size=group_size)
    emit(data, as_json, print_table, plot_path, plot)
