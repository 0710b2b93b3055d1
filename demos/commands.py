"""``lmcache demo``: the typer group of the demos in :mod:`lmcache.demos` (the model demo
:mod:`~lmcache.demos.model`, ``synthetic``, ``distributed`` and ``vllm``). It plugs into
the command as the entry point ``demo`` of the group ``lmcache.commands``.

The demo modules import the model, transformers and vLLM only inside their functions, so
``lmcache --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lmcache.benchmarks.handbook import MAX_QUESTIONS, NUM_KEY_FACTS
from lmcache.benchmarks.tiers import Dir, MemcpySize, Threads

from . import distributed as demo_distributed
from . import model as impl  # its top imports no model: transformers load inside its functions
from . import synthetic as demo_synthetic
from . import vllm_serve as demo_vllm


app = typer.Typer(
    name="demo",
    help="A real model (SmolLM2-135M on the CPU) answering questions about a long document, "
    "with lmcache's CPU and disk tiers underneath. 'lmcache demo synthetic': the storage-only demo.",
    invoke_without_command=True,
    add_completion=False,
)
app.command("synthetic")(demo_synthetic.synthetic)
app.command("distributed")(demo_distributed.distributed_cmd)
app.command("vllm")(demo_vllm.demo_vllm_cmd)

# --------------------------------------------------------------------------- options

Questions = Annotated[
    int, typer.Option("--questions", min=1, max=MAX_QUESTIONS, help="Questions asked in the first process (the first one is the cold prefill).")
]
DocTokens = Annotated[
    int,
    typer.Option("--doc-tokens", min=64, help="Tokens of the shared prompt prefix (system prompt + handbook), rounded to whole chunks."),
]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", min=1, help="Longest answer, in tokens (greedy).")]
ChunkSize = Annotated[int, typer.Option("--chunk-size", min=1, help="Tokens per chunk.")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the handbook (its prose and its key facts).")]


@app.callback()
def demo(
    ctx: typer.Context,
    questions: Questions = 4,
    doc_tokens: DocTokens = 3072,
    max_new_tokens: MaxNewTokens = 24,
    chunk_size: ChunkSize = 256,
    seed: Seed = 0,
    cpu_capacity: Annotated[str, typer.Option("--cpu-capacity", help="CPU tier capacity.")] = "1GiB",
    disk_capacity: Annotated[str, typer.Option("--disk-capacity", help="Disk tier capacity.")] = "4GiB",
    directory: Dir = None,
    memcpy_size: MemcpySize = "256MiB",
    threads: Threads = None,
    restart: Annotated[
        bool, typer.Option("--restart/--no-restart", help="Ask one more question from a new process that opens only the disk tier.")
    ] = True,
    verify: Annotated[
        bool, typer.Option("--verify/--no-verify", help="Run one prompt on the plain model too (no lmcache) and compare the answers.")
    ] = True,
) -> None:
    """Run SmolLM2-135M on a long-document QA workload with lmcache: a cold prefill, CPU-tier
    hits, and a disk-tier hit after a restart, with time to first token for each."""
    if ctx.invoked_subcommand is not None:
        return
    impl.main(questions, doc_tokens, max_new_tokens, chunk_size, seed, cpu_capacity, disk_capacity, directory,
              memcpy_size, threads, restart, verify)


@app.command("restart-check", hidden=True)
def restart_check_cmd(
    directory: Annotated[Path, typer.Option("--dir")],
    fact: Annotated[int, typer.Option("--fact", min=1, max=NUM_KEY_FACTS)],
    disk_capacity: Annotated[int, typer.Option("--disk-capacity", min=1)],
    doc_tokens: DocTokens = 3072,
    chunk_size: ChunkSize = 256,
    seed: Seed = 0,
    max_new_tokens: MaxNewTokens = 24,
    verify: Annotated[bool, typer.Option("--verify/--no-verify")] = True,
    threads: Threads = None,
) -> None:
    """(internal) Open only the disk tier of --dir, ask about key fact --fact; print JSON."""
    from lmcache.benchmarks.harness import print_json, set_threads

    set_threads(threads)
    print_json(impl.restart_check(directory, doc_tokens, chunk_size, seed, fact, max_new_tokens, disk_capacity, verify))


