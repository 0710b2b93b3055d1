"""``lmcache demo synthetic``: a synthetic workload through a CPU tier and a disk tier.

Random KV of a Llama-3-8B-like shape is stored for several prompts that share a system
prompt, in a CPU tier too small to hold it all above a disk tier (write-through). Every
prompt is then looked up and retrieved, most recent first, and each retrieved tensor is
compared bit for bit with what was stored. A second process then opens only the disk
tier, as a restarted server would, and retrieves everything again. Throughput of each
tier is put next to memcpy and raw file I/O measured in the same run.

No model is involved: this is the storage path alone, at a realistic KV size. The real
model demo is ``lmcache demo`` (:mod:`lmcache.demos.model`); :mod:`lmcache.demos.commands`
registers this function as its ``synthetic`` subcommand.
"""

from __future__ import annotations

import shutil
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lmcache.units import format_size

from lmcache.benchmarks import harness, tiers
from lmcache.benchmarks.harness import err, out, size_option

def _tiers_text(tiers: dict[str, int]) -> str:
    return " + ".join(f"{name} x{n}" for name, n in tiers.items()) or "-"


def _x(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _gbps(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def synthetic(
    layers: tiers.Layers = 32,
    kv_heads: tiers.KVHeads = 8,
    head_size: tiers.HeadSize = 128,
    dtype: tiers.DType = "float16",
    prompts: tiers.Prompts = 8,
    tokens: tiers.Tokens = 2048,
    prefix: tiers.Prefix = None,
    chunk_size: tiers.ChunkSize = 256,
    seed: tiers.Seed = 0,
    cpu_capacity: tiers.CPUCapacity = "auto",
    disk_capacity: tiers.DiskCapacity = "auto",
    directory: tiers.Dir = None,
    memcpy_size: tiers.MemcpySize = "256MiB",
    file_io_size: tiers.FileIOSize = "auto",
    threads: tiers.Threads = None,
    pin: tiers.Pin = True,
    restart: Annotated[
        bool, typer.Option("--restart/--no-restart", help="Retrieve again from a new process that opens only the disk tier.")
    ] = True,
) -> None:
    """Store and retrieve synthetic Llama-like KV through a CPU tier and a disk tier."""
    wl = tiers.build_workload(layers, kv_heads, head_size, dtype, prompts, tokens, prefix, chunk_size, seed)
    cpu_cap = size_option(cpu_capacity, "--cpu-capacity")
    disk_cap = size_option(disk_capacity, "--disk-capacity")
    memcpy_bytes = size_option(memcpy_size, "--memcpy-size", auto=False) or (256 << 20)
    file_bytes = size_option(file_io_size, "--file-io-size") or wl.unique_bytes
    harness.set_threads(threads)
    auto_cpu, auto_disk = wl.default_capacities()
    cpu_cap, disk_cap = cpu_cap or auto_cpu, disk_cap or auto_disk

    wd = harness.open_work_dir(directory, "lmcache-demo-")
    try:
        cfg = tiers.tiers_config(wl, wd.path, cpu_cap, disk_cap)  # a bad config fails here, before any work
    except BaseException:
        if wd.temporary:
            shutil.rmtree(wd.path, ignore_errors=True)
        raise
    o, e = out(), err()
    machine = harness.machine_info(wd.path)
    _intro(o, wl, cpu_cap, disk_cap, wd, machine)
    harness.warn_if_busy(machine)
    try:
        e.print("measuring memcpy ...")
        physical = harness.measure_memcpy(memcpy_bytes)

        with Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=e, transient=True,
        ) as progress:
            task = progress.add_task("storing prompts", total=wl.prompts)
            run = tiers.run_tiers(wl, wd.path, config=cfg, pin=pin, on_store=lambda rec: progress.advance(task))
        e.print("measuring raw file I/O next to the disk tier's files ...")
        physical.update(harness.measure_file_io(wd.path, wl.chunk_bytes, file_bytes))
        restart_report = None
        if restart:
            e.print("retrieving from a new process that opens only the disk tier ...")
            restart_report = tiers.spawn_restart_check(wl, wd.path, run.disk_capacity, threads)
        data = tiers.report(run, physical, machine, restart_report)
    finally:
        if wd.temporary:
            shutil.rmtree(wd.path, ignore_errors=True)

    _physical(o, physical)
    _stores(o, run)
    _retrieves(o, run)
    _tiers(o, data)
    if restart_report is not None:
        _restart(o, data["restart"], restart_report, run.directory)
    ok = _summary(o, data, run)
    if not wd.temporary:
        o.print(f"The cache was kept in {run.directory}.")
    if not ok:
        raise typer.Exit(1)


# --------------------------------------------------------------------------- sections


def _intro(o, wl: tiers.Workload, cpu_cap: int, disk_cap: int, wd: harness.WorkDir, machine: dict[str, Any]) -> None:
    o.print("[bold]lmcache demo synthetic[/]: synthetic KV through a CPU tier and a disk tier")
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    like = " (Llama-3-8B-like)" if (wl.layers, wl.kv_heads, wl.head_size) == (32, 8, 128) else ""
    t.add_row(
        "model shape",
        f"{wl.layers} layers x {wl.kv_heads} KV heads x head size {wl.head_size}, {wl.dtype}{like}: "
        f"{format_size(wl.bytes_per_token)} of KV per token",
    )
    t.add_row(
        "workload",
        f"{wl.prompts} prompts x {wl.tokens} tokens, the first {wl.prefix} shared by all (a system prompt); "
        f"chunks of {wl.chunk_size} tokens ({format_size(wl.chunk_bytes)})",
    )
    t.add_row(
        "",
        f"{format_size(wl.prompts * wl.tokens * wl.bytes_per_token)} of KV in the requests, "
        f"{format_size(wl.unique_bytes)} of it distinct",
    )
    where = f"{wd.path / 'kv'}" + (" (temporary)" if wd.temporary else "")
    t.add_row("tiers", f"cpu {format_size(cpu_cap)} -> disk {format_size(disk_cap)} at {where}, write-through")
    t.add_row(
        "machine",
        f"{harness.machine_text(machine, ram=True)}, "
        f"filesystem {machine.get('filesystem') or '?'}, load average {machine.get('load_average_1m') or 0:.2f}",
    )
    o.print(t)


def _physical(o, ph: dict[str, Any]) -> None:
    o.print()
    o.print("[bold]Physical limits[/] (measured now, on this machine; GB/s = 10^9 bytes/s)")
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column()
    n = ph["file_bytes"] // ph["file_size"]
    t.add_row(
        "memcpy", f"{ph['memcpy_gbps']:.2f} GB/s",
        f"torch copy_ of {format_size(ph['memcpy_bytes'])}, best of {ph['memcpy_repeats']}",
    )
    t.add_row(
        "file write", f"{ph['file_write_gbps']:.2f} GB/s",
        f"os.write of {n} new files of {format_size(ph['file_size'])} ({format_size(ph['file_bytes'])}) "
        "next to the disk tier's files, no fsync",
    )
    t.add_row(
        "file read", f"{ph['file_read_gbps']:.2f} GB/s",
        f"os.readv of those files into a buffer, best of {ph['file_read_repeats']}; "
        "likely from the page cache (dropping it needs root)",
    )
    o.print(t)


def _stores(o, run: tiers.TierRun) -> None:
    wl = run.workload
    t = Table(title="Store (each prompt's KV handed to CacheEngine.store)", title_justify="left")
    for col in ("prompt", "tokens", "stored", "already cached", "dropped", "store ms", "GB/s", "write-through ms"):
        t.add_column(col, justify="right")
    for s in run.stores:
        nbytes = s.stored_tokens * wl.bytes_per_token
        t.add_row(
            str(s.prompt), str(s.tokens), str(s.stored_tokens), str(s.skipped_tokens), str(s.dropped_tokens),
            f"{s.seconds * 1e3:.1f}", _gbps(nbytes / s.seconds / harness.GB if s.seconds > 0 else None),
            f"{s.flush_seconds * 1e3:.1f}",
        )
    o.print()
    o.print(t)
    stored = sum(s.stored_tokens for s in run.stores)
    skipped = sum(s.skipped_tokens for s in run.stores)
    dropped = sum(s.dropped_tokens for s in run.stores)
    reusers = sum(1 for s in run.stores if s.skipped_tokens)
    msg = (
        f"{stored} tokens stored ({format_size(stored * wl.bytes_per_token)}), {skipped} found already cached"
    )
    if wl.prefix >= wl.chunk_size and reusers:
        shared = wl.prefix // wl.chunk_size * wl.chunk_size
        msg += (
            f": the shared {wl.prefix}-token prefix was stored once, by prompt 0, and its "
            f"{shared // wl.chunk_size} whole chunk(s) ({shared} tokens) were reused by the {reusers} later prompts"
        )
    if dropped:
        msg += f"; {dropped} tokens dropped (memory pool exhausted)"
    o.print(msg + ".")
    o.print(
        "The write-through queue to the disk tier is drained after each prompt (as an engine computing "
        "between requests would allow); 'store ms' excludes that wait."
    )


def _retrieves(o, run: tiers.TierRun) -> None:
    t = Table(
        title=(
            "Lookup and retrieve (most recent prompt first; "
            + ("the lookup leases its hits until the retrieve; " if run.pin else "lookups lease nothing; ")
            + "exact = torch.equal with the stored KV)"
        ),
        title_justify="left",
    )
    for col in ("prompt", "tokens", "cached", "retrieved", "served from (chunks)", "retrieve ms", "GB/s", "exact"):
        t.add_column(col, justify="left" if col.startswith("served") else "right")
    for r in run.retrieves:
        label = f"{r.prompt}" + (" (again)" if r.phase == "warm" else "")
        t.add_row(
            label, str(r.tokens), str(r.cached_tokens), str(r.retrieved_tokens), _tiers_text(r.tiers),
            f"{r.seconds * 1e3:.1f}", _gbps(r.gbps), "[green]yes[/]" if r.exact else "[red]NO[/]",
        )
    o.print()
    o.print(t)
    if any(r.phase == "warm" for r in run.retrieves):
        o.print(
            "No request was served wholly from the CPU tier in the first pass, so the prompts now wholly "
            "there were retrieved again ('again') to measure it."
        )
    promos = run.stats.get("hierarchy", {}).get("promotions", 0)
    o.print(f"Chunks read from the disk tier were promoted into the CPU tier: {promos} promotions.")


def _tiers(o, data: dict[str, Any]) -> None:
    ph = data["physical"]
    limits = {
        "memcpy": ("memcpy", ph["memcpy_gbps"]),
        "file_write": ("file write", ph["file_write_gbps"]),
        "file_read": ("file read", ph["file_read_gbps"]),
    }
    t = Table(title="Tiers against the physical limits (GB/s = 10^9 bytes/s)", title_justify="left")
    for col in ("tier", "hits", "hit bytes", "store GB/s", "retrieve GB/s", "limit GB/s", "store ratio", "retrieve ratio"):
        t.add_column(col, justify="left" if col == "tier" else "right")
    for name, s in data["tiers"].items():
        sl, rl = limits[s["store_limit"]], limits[s["retrieve_limit"]]
        lim = f"{sl[0]} {sl[1]:.2f}" if sl == rl else f"{sl[0]} {sl[1]:.2f} / {rl[0]} {rl[1]:.2f}"
        t.add_row(
            name, str(s["hits"]), format_size(s["hit_bytes"]), _gbps(s["store_gbps"]), _gbps(s["retrieve_gbps"]),
            lim, _x(s["store_ratio"]), _x(s["retrieve_ratio"]),
        )
    o.print()
    o.print(t)
    o.print(
        "cpu: store = bytes / CacheEngine.store() time (the one copy into the memory pool, plus hashing and "
        "queueing); retrieve = retrieve() calls served wholly from the CPU tier (the copy out of the pool)."
    )
    o.print(
        "disk: the tier's own timers: store = payload header and checksum, write of a new file, rename; "
        "retrieve = open, read into host memory, checksum check."
    )


def _restart(o, r: dict[str, Any], raw: dict[str, Any], kv_dir: str) -> None:
    t = Table(
        title=(
            f"After a restart: a new process (pid {raw['pid']}) opened only the disk tier at {kv_dir}; "
            f"it found {r['entries']} entries ({format_size(r['used_bytes'])}) in {r['open_seconds'] * 1e3:.0f} ms"
        ),
        title_justify="left",
    )
    for col in ("prompt", "tokens", "cached", "retrieved", "served from (chunks)", "retrieve ms", "GB/s", "exact"):
        t.add_column(col, justify="left" if col.startswith("served") else "right")
    for q in r["requests"]:
        gbps = q["nbytes"] / q["seconds"] / harness.GB if q["seconds"] > 0 else None
        t.add_row(
            str(q["prompt"]), str(q["tokens"]), str(q["cached_tokens"]), str(q["retrieved_tokens"]),
            _tiers_text(q["tiers"]), f"{q['seconds'] * 1e3:.1f}", _gbps(gbps),
            "[green]yes[/]" if q["exact"] else "[red]NO[/]",
        )
    o.print()
    o.print(t)
    o.print(
        f"End to end from disk (read, checksum, copy into the caller's tensor): {_gbps(r['retrieve_gbps'])} GB/s."
    )


def _summary(o, data: dict[str, Any], run: tiers.TierRun) -> bool:
    reqs = run.retrieves
    first = [r for r in reqs if r.phase == "retrieve"]
    exact = sum(r.exact for r in reqs)
    from_disk = sum(1 for r in first if "disk" in r.tiers)
    disk_chunks = sum(r.tiers.get("disk", 0) for r in first)
    ok = data["exact"]
    parts = [
        f"{exact}/{len(reqs)} retrieves bit-exact",
        f"{from_disk} of {len(first)} prompts partly served from disk ({disk_chunks} chunks, "
        f"{data['hierarchy'].get('promotions', 0)} promotions)",
    ]
    if "restart" in data:
        rs = data["restart"]
        n_ok = sum(q["exact"] for q in rs["requests"])
        parts.append(f"after restart {n_ok}/{len(rs['requests'])} bit-exact with {rs['disk_hits']} disk hits")
        ok = ok and rs["exact"] and rs["disk_hits"] > 0
    tiers = data["tiers"]
    parts.append(
        f"cpu tier {_x(tiers['cpu']['store_ratio'])} / {_x(tiers['cpu']['retrieve_ratio'])} of memcpy (store/retrieve)"
    )
    parts.append(
        f"disk tier {_x(tiers['disk']['store_ratio'])} of file write, {_x(tiers['disk']['retrieve_ratio'])} of file read"
    )
    complete = data["complete"] and ("restart" not in data or data["restart"]["complete"])
    if not complete:
        parts.append("some prompts were only partly cached")
    word = "[bold green]PASS[/]" if ok else "[bold red]FAIL[/]"
    o.print()
    o.print(f"{word}: " + "; ".join(parts) + f" ({data['seconds']:.1f} s).", soft_wrap=True)
    if not ok:
        err().print("lmcache demo synthetic: some retrieved KV differed from what was stored, or the restart found nothing")
    return ok
