"""Our side of ``lmcache bench compare``'s disk workloads on SmolLM2's fp32 KV (the
``cpu_over_disk`` part of the spec, see :mod:`lmcache.benchmarks.compare`), and the limits
they are measured against in the same run.

- store: a CPU tier over a disk tier (write-through), the wall time of the store call;
- persist: the same stores until every chunk is on disk (``store`` then ``flush``);
- disk hit: a fresh engine with only the disk tier opened on the files the stores left
  (in the page cache), its first retrieve of all 16 chunks into a preallocated, touched
  destination tensor; every byte compared.

Limits (:func:`over_disk_limits`): memcpy of the workload's bytes, raw writes of
chunk-sized new files the way LMCache 0.5.6's ``local_disk`` backend writes them (one
plain ``write`` per file, no fsync, no O_DIRECT, 4 threads), raw reads of those files
from the page cache into one buffer (4 threads) and one scatter of that buffer into a KV
tensor. Persist's limit is memcpy then the writes; the hit's limit is the reads alone
(one copy of the bytes: ours reads each file straight into the engine's tensor,
:mod:`lmcache.direct_read`); ``hit`` in the limits (reads then scatter) is what a hit
through a buffer can reach.

- disk hit, fresh process: the restart case, a new Python process per round
  (:func:`hit_in_a_fresh_process`); LMCache 0.5.6 cannot reopen a directory, so its
  side of that row is its fresh engine.
"""

from __future__ import annotations

import gc
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

GB = 1e9
#: LMCache 0.5.6 ``local_disk``: ``disk_io_threads`` defaults to 4 (writes and reads)
REF_DISK_THREADS = 4


def engine_for(spec: dict[str, Any], shape: dict[str, Any], tiers: list[dict[str, Any]], pool: int):
    """A write-through ``CacheEngine`` over ``tiers`` for KV of ``shape``."""
    from lmcache.config import KVSpec, load_config
    from lmcache.engine import CacheEngine

    cfg = load_config(None, chunk_size=spec["chunk_size"], write_policy="write-through", tiers=tiers,
                      memory_pool_size=pool)
    kv_spec = KVSpec(num_layers=shape["layers"], num_kv_heads=shape["kv_heads"], head_size=shape["head_size"],
                     dtype=spec["dtype"])
    return CacheEngine(cfg, kv_spec=kv_spec)


def random_bits32(shape: tuple[int, ...], gen):
    """Random fp32 bit patterns (compared as integers, so NaNs do not matter)."""
    import torch

    return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int32).view(torch.float32)


def _same(a, b) -> bool:
    import torch

    return a is not None and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def run_ours_over_disk(spec: dict[str, Any]) -> dict[str, Any]:
    """The store, persist and disk-hit figures (see the module docstring): ``repeats``
    stores into the CPU tier over the disk tier, each followed by a ``flush`` (the
    previous round's chunks removed from both tiers first), then ``hit_repeats`` fresh
    disk-only engines on the last round's files."""
    import torch

    od = spec["cpu_over_disk"]
    cs, n = od["chunk_size"], od["chunks"] * od["chunk_size"]
    L, H, D = od["layers"], od["kv_heads"], od["head_size"]
    gen = torch.Generator().manual_seed(spec["seed"] + 2)
    toks = torch.randint(0, 128256, (n,), generator=gen).tolist()
    directory = tempfile.mkdtemp(prefix="ours-cpu-over-disk-", dir=spec["dir"])
    cap = od["capacity"]
    espec = {**spec, "dtype": od["dtype"], "chunk_size": cs}
    disk = {"backend": "disk", "capacity": cap, "path": directory}
    engine = engine_for(espec, od, [{"backend": "cpu", "capacity": cap}, disk], cap)
    threads = torch.get_num_threads()
    try:
        kv = random_bits32((L, 2, n, H, D), gen)  # one engine buffer
        seconds: list[float] = []
        persist: list[float] = []
        stored = 0
        torch.set_num_threads(od["threads"])
        for r in range(od["repeats"]):
            if r:  # the previous store's disk writes are done; its chunks removed from both tiers
                engine.admin.clear(all=True)
                engine.flush()
            t0 = time.perf_counter()
            stored = engine.store(toks, kv).stored_tokens
            seconds.append(time.perf_counter() - t0)
            engine.flush()
            persist.append(time.perf_counter() - t0)
        on_disk = engine.hierarchy.tiers[1].usage().entries
        exact = _same(engine.retrieve(toks).kv, kv)
        engine.close()
        engine = None
        hits: list[float] = []
        hit_exact, hit_tokens = True, 0
        out = torch.empty_like(kv)
        for _ in range(od["hit_repeats"]):
            out.zero_()  # touched: the scatter does not pay for the destination's first use
            fresh = engine_for(espec, od, [disk], cap)
            try:
                t0 = time.perf_counter()
                hit_tokens = fresh.retrieve(toks, out=out).num_tokens
                hits.append(time.perf_counter() - t0)
            finally:
                fresh.close()
            hit_exact = hit_exact and hit_tokens == n and _same(out, kv)
        restarts = [hit_in_a_fresh_process(spec, directory, cap) for _ in range(od["hit_repeats"])]
        return {
            "tier": "cpu over disk",
            "shape": od["name"],
            "dtype": od["dtype"],
            "threads": torch.get_num_threads(),
            "chunks": od["chunks"],
            "bytes": od["bytes"],
            "stored_chunks": stored // cs,
            "disk_chunks": on_disk,
            "store_seconds": seconds,
            "store_gbps": od["bytes"] / statistics.median(seconds) / GB,
            "store_best_gbps": od["bytes"] / min(seconds) / GB,
            "persist_seconds": persist,
            "persist_gbps": od["bytes"] / statistics.median(persist) / GB,
            "hit_seconds": hits,
            "hit_gbps": od["bytes"] / statistics.median(hits) / GB,
            "hit_tokens": hit_tokens,
            "hit_exact": hit_exact,
            "restart_seconds": [r["seconds"] for r in restarts],
            "restart_gbps": od["bytes"] / statistics.median([r["seconds"] for r in restarts]) / GB,
            "exact": exact and hit_exact and all(r["exact"] for r in restarts),
            "complete": stored == n and on_disk == od["chunks"] and hit_tokens == n,
        }
    finally:
        torch.set_num_threads(threads)
        if engine is not None:
            engine.close()
        del engine
        gc.collect()
        shutil.rmtree(directory, ignore_errors=True)


def hit_in_a_fresh_process(spec: dict[str, Any], directory: str, capacity: int, timeout: float = 300.0) -> dict[str, Any]:
    """The restart case: a new Python process opens the engine a user's config gives
    after a restart (a CPU tier over the disk tier, both empty but for the disk's files,
    still in the page cache) and retrieves the whole prompt into a preallocated, touched
    tensor; ``{"seconds", "exact"}`` of that first retrieve (:func:`_restart_child`)."""
    import json
    import subprocess
    import sys

    arg = json.dumps({"spec": {k: spec[k] for k in ("seed", "cpu_over_disk")}, "dir": directory, "capacity": capacity})
    r = subprocess.run([sys.executable, "-m", "lmcache.benchmarks.compare_disk", arg], capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"the fresh-process disk hit failed: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _restart_child(arg: dict[str, Any]) -> dict[str, Any]:
    """The child of :func:`hit_in_a_fresh_process`: the workload's tokens and KV made as
    :func:`run_ours_over_disk` makes them (same seed, same order), then the timed retrieve."""
    import torch

    spec, od = arg["spec"], arg["spec"]["cpu_over_disk"]
    cs, n = od["chunk_size"], od["chunks"] * od["chunk_size"]
    gen = torch.Generator().manual_seed(spec["seed"] + 2)
    toks = torch.randint(0, 128256, (n,), generator=gen).tolist()
    kv = random_bits32((od["layers"], 2, n, od["kv_heads"], od["head_size"]), gen)
    out = torch.empty_like(kv)
    out.zero_()
    torch.set_num_threads(od["threads"])
    espec = {**spec, "dtype": od["dtype"], "chunk_size": cs}
    cap = arg["capacity"]
    engine = engine_for(espec, od, [{"backend": "cpu", "capacity": cap},
                                    {"backend": "disk", "capacity": cap, "path": arg["dir"]}], cap)
    try:
        t0 = time.perf_counter()
        got = engine.retrieve(toks, out=out).num_tokens
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    return {"seconds": seconds, "exact": got == n and _same(out, kv)}


def merge_over_disk(into: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """One side's CPU-over-disk figures over all its passes: ``more`` (another pass of
    the same workload) added to ``into``, each figure the median (or best) of every
    round of every pass."""
    for name in ("store", "persist", "hit", "restart"):
        if f"{name}_seconds" not in into:  # LMCache's side has no restart case
            continue
        into[f"{name}_seconds"] = [*into[f"{name}_seconds"], *more[f"{name}_seconds"]]
        into[f"{name}_gbps"] = into["bytes"] / statistics.median(into[f"{name}_seconds"]) / GB
    into["store_best_gbps"] = into["bytes"] / min(into["store_seconds"]) / GB
    for flag in ("exact", "hit_exact", "complete"):
        into[flag] = bool(into[flag] and more[flag])
    into["passes"] = into.get("passes", 1) + 1
    return into


def over_disk_limits(directory: Path, od: dict[str, Any], repeats: int = 3) -> dict[str, float]:
    """GB/s of the physical steps under the disk workloads (best of ``repeats``), with
    torch's default threads: ``memcpy``, ``write`` (new chunk-sized files, one plain write
    each, no fsync, :data:`REF_DISK_THREADS` threads, as LMCache writes), ``read`` (those
    files from the page cache into one buffer, the same threads), ``scatter`` (that
    buffer's chunks into a ``(layers, 2, tokens, heads, head)`` tensor), and the two
    limits: ``persist`` (memcpy then write) and ``hit`` (read then scatter)."""
    import torch

    torch.set_num_threads(od["threads"])
    L, H, D, cs, k = od["layers"], od["kv_heads"], od["head_size"], od["chunk_size"], od["chunks"]
    chunk = L * 2 * cs * H * D * 4
    src = torch.randint(-(2**31), 2**31 - 1, (k * chunk // 4,), dtype=torch.int32)
    pool = torch.empty_like(src)
    pool.zero_()
    kv = torch.empty((L, 2, k * cs, H, D), dtype=torch.int32)
    kv.zero_()
    views = [memoryview(pool.numpy()).cast("B")[i * chunk : (i + 1) * chunk] for i in range(k)]
    srcs = [memoryview(src.numpy()).cast("B")[i * chunk : (i + 1) * chunk] for i in range(k)]
    work = Path(tempfile.mkdtemp(prefix="raw-over-disk-", dir=directory))
    best = {"memcpy": float("inf"), "write": float("inf"), "read": float("inf"), "scatter": float("inf")}

    def write(i: int, sub: Path) -> None:
        with open(sub / f"c{i}", "wb") as f:  # LMCache's write_file without O_DIRECT
            f.write(srcs[i])

    def read(i: int, sub: Path) -> None:
        with open(sub / f"c{i}", "rb", buffering=0) as f:
            f.readinto(views[i])

    try:
        with ThreadPoolExecutor(REF_DISK_THREADS) as ex:
            for r in range(repeats):
                t0 = time.perf_counter()
                pool.copy_(src)
                best["memcpy"] = min(best["memcpy"], time.perf_counter() - t0)
                sub = work / str(r)
                sub.mkdir()
                t0 = time.perf_counter()
                list(ex.map(write, range(k), [sub] * k))
                best["write"] = min(best["write"], time.perf_counter() - t0)
                pool.zero_()
                t0 = time.perf_counter()
                list(ex.map(read, range(k), [sub] * k))
                best["read"] = min(best["read"], time.perf_counter() - t0)
                t0 = time.perf_counter()
                for i in range(k):
                    kv[:, :, i * cs : (i + 1) * cs].copy_(pool[i * chunk // 4 : (i + 1) * chunk // 4].view(L, 2, cs, H, D))
                best["scatter"] = min(best["scatter"], time.perf_counter() - t0)
                shutil.rmtree(sub)
        if not torch.equal(pool, src):  # pragma: no cover - a broken filesystem
            raise RuntimeError("raw file read returned other bytes than were written")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    nbytes = k * chunk
    gbps = {name: nbytes / s / GB for name, s in best.items()}
    gbps["persist"] = nbytes / (best["memcpy"] + best["write"]) / GB
    gbps["hit"] = nbytes / (best["read"] + best["scatter"]) / GB
    return gbps


def over_disk_rows(a: dict[str, Any], b: dict[str, Any], physical: dict[str, Any]) -> list[tuple]:
    """``(workload, ours, theirs, limit name, limit GB/s, exact)`` of the CPU-over-disk
    store, persist and disk-hit rows."""
    lim = physical.get("over_disk") or {}
    th = f"{a['threads']} threads"
    name = f"{a['shape']} {a['dtype']}"
    ex = bool(a["exact"] and b["exact"])
    return [
        (f"cpu over disk {name} store, {th} (default)", a["store_gbps"], b["store_gbps"], f"memcpy ({th})",
         physical.get("memcpy_over_disk_gbps"), ex),
        (f"cpu over disk {name} persist (store+flush)", a["persist_gbps"], b["persist_gbps"],
         "memcpy + raw write", lim.get("persist"), ex),
        # the limit of a page-cache hit is one copy of the bytes (ours reads each file straight
        # into the engine's tensor; LMCache reads into its buffer, then copies)
        (f"disk hit {name}, fresh engine, page cache", a["hit_gbps"], b["hit_gbps"],
         "page-cache read (one copy)", lim.get("read"), ex),
        # LMCache 0.5.6 does not reopen a directory: its side is the fresh engine above
        (f"disk hit {name}, fresh process (restart; theirs: fresh engine)", a["restart_gbps"], b["hit_gbps"],
         "page-cache read (one copy)", lim.get("read"), ex),
    ]


if __name__ == "__main__":  # the fresh process of hit_in_a_fresh_process
    import json
    import sys

    print(json.dumps(_restart_child(json.loads(sys.argv[1]))))
