"""``lmcache bench tiers --matrix``: each tier's store and retrieve GB/s per chunk shape and
number of concurrent requests, next to the physical limit measured on the same buffers in
the same run.

For every (shape, concurrency) cell, ``C`` threads each run their own requests (prompts of
``--request-chunks`` chunks of 256 tokens) through one real :class:`CacheEngine` whose only
tier is the one measured, so every byte goes through that tier and nothing else:

- ``cpu``: ``store()`` copies the request's KV into the pool (the CPU tier keeps
  references); ``retrieve(out=...)`` copies it back into a preallocated tensor. Limit: the
  same threads copying the same tensors into the same destinations with ``copy_``
  (warm memcpy, both directions measured, the slower one is not chosen: each direction
  has its own limit).
- ``disk`` (buffered) and ``disk+odirect``: ``store()`` writes each chunk as a file
  (header, checksum, temporary name, rename) on the calling thread; ``retrieve`` reads and
  verifies it. Limit: the same threads writing new files of the chunk's size with
  ``os.write`` into the same directory, then reading them back with ``os.readv`` into
  preallocated buffers (page-aligned buffers and ``O_DIRECT`` for the odirect cell).
  Buffered reads come from the page cache on both sides. Before each side's writes,
  ``os.sync()`` flushes what earlier measurements left dirty, so that neither side's
  writes are throttled by the other's writeback.

GB/s are 10^9 bytes of KV per second of wall time from the moment all threads start
until the last one finishes; each cell is the best of ``--repeats`` rounds. Every
retrieved tensor is compared bit for bit with what was stored.
"""

from __future__ import annotations

import mmap
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

GB = 1e9
#: name -> (layers, kv heads, head size), float16, 256-token chunks
SHAPES = {
    "llama3-8b": (32, 8, 128),  # 32 MiB per 256-token chunk
    "smollm2": (30, 3, 64),  # 5.6 MiB per 256-token chunk (SmolLM2-135M)
}
TIERS = ("cpu", "disk", "disk+odirect")
ALIGN = 4096


@dataclass
class Cell:
    tier: str
    shape: str
    concurrency: int
    chunk_bytes: int
    total_bytes: int
    store_gbps: float
    retrieve_gbps: float
    raw_write_gbps: float
    raw_read_gbps: float
    exact: bool

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["store_ratio"] = self.store_gbps / self.raw_write_gbps if self.raw_write_gbps else None
        d["retrieve_ratio"] = self.retrieve_gbps / self.raw_read_gbps if self.raw_read_gbps else None
        return d


def _parallel(n: int, fn: Callable[[int], None]) -> float:
    """Run ``fn(i)`` on ``n`` threads started together; wall seconds until all are done
    (an exception in any thread is raised here)."""
    barrier = threading.Barrier(n + 1)
    errors: list[BaseException] = []
    done = [0.0] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            fn(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
            errors.append(exc)
        done[i] = time.perf_counter()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return max(done) - t0


def _aligned(nbytes: int) -> memoryview:
    """A page-aligned writable buffer (anonymous mmap), touched."""
    m = mmap.mmap(-1, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
    m.write(b"\1" * len(m))
    return memoryview(m)[:nbytes]


class _Requests:
    """The KV and token ids of every request of a cell, made before any timing."""

    def __init__(self, shape: str, concurrency: int, per_stream: int, request_chunks: int, chunk_tokens: int, seed: int):
        import torch

        layers, heads, head = SHAPES[shape]
        self.spec = {"num_layers": layers, "num_kv_heads": heads, "head_size": head, "dtype": "float16"}
        tokens = request_chunks * chunk_tokens
        g = torch.Generator().manual_seed(seed)
        self.streams: list[list[tuple[Any, Any]]] = []
        base = 0
        for _ in range(concurrency):
            reqs = []
            for _ in range(per_stream):
                ids = torch.arange(base, base + tokens, dtype=torch.int64)
                base += tokens
                kv = torch.randn((layers, 2, tokens, heads, head), generator=g, dtype=torch.float32).to(torch.float16)
                reqs.append((ids, kv))
            self.streams.append(reqs)
        self.outs = [torch.empty_like(self.streams[0][0][1]).fill_(0) for _ in range(concurrency)]
        self.chunk_bytes = chunk_tokens * layers * 2 * heads * head * 2
        self.total_bytes = sum(kv.numel() * 2 for s in self.streams for _, kv in s)


def _engine(tier: str, req: _Requests, directory: Path, chunk_tokens: int):
    from lmcache.engine import CacheEngine

    if tier == "cpu":
        tiers = [{"backend": "cpu", "capacity": req.total_bytes + (64 << 20)}]
        extra = {"staging_size": "16MiB"}
    else:
        path = directory / f"kv-{time.monotonic_ns()}"
        tiers = [{"backend": "disk", "capacity": req.total_bytes * 2 + (64 << 20), "path": str(path),
                  "o_direct": tier == "disk+odirect"}]
        extra = {"staging_size": req.total_bytes + (64 << 20)}
    return CacheEngine.from_config({"chunk_size": chunk_tokens, "tiers": tiers, **extra}, kv_spec=req.spec)


def _ours(tier: str, req: _Requests, directory: Path, chunk_tokens: int) -> tuple[float, float, bool]:
    import torch

    n = len(req.streams)
    engine = _engine(tier, req, directory, chunk_tokens)
    try:
        def store(i: int) -> None:
            for ids, kv in req.streams[i]:
                r = engine.store(ids, kv)
                if r.stored_tokens != len(ids):
                    raise RuntimeError(f"stored {r.stored_tokens} of {len(ids)} tokens (pool or tier too small)")

        os.sync()  # both sides start writing with no dirty pages pending (see _raw_files)
        ws = _parallel(n, store)
        exact = [True] * n

        def retrieve(i: int) -> None:
            out = req.outs[i]
            for ids, _ in req.streams[i]:
                r = engine.retrieve(ids, out=out)
                if r.num_tokens != len(ids):
                    exact[i] = False

        rs = _parallel(n, retrieve)
        # exactness, outside the timing: the last request of each stream is in its out buffer
        for i in range(n):
            ids, kv = req.streams[i][-1]
            exact[i] = exact[i] and torch.equal(req.outs[i], kv)
            for ids, kv in req.streams[i][:-1]:  # and every other request, once more
                r = engine.retrieve(ids)
                exact[i] = exact[i] and r.num_tokens == len(ids) and torch.equal(r.kv, kv)
    finally:
        engine.close()
        if tier != "cpu":
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True, exist_ok=True)
    return req.total_bytes / ws / GB, req.total_bytes / rs / GB, all(exact)


def _raw_memcpy(req: _Requests) -> tuple[float, float]:
    """The same threads copying the same KV into the same destinations (store direction),
    and back out of a pool-like buffer (retrieve direction), warm."""
    import torch

    n = len(req.streams)
    pools = [[torch.empty_like(kv).fill_(0) for _, kv in s] for s in req.streams]

    def put(i: int) -> None:
        for (_, kv), dst in zip(req.streams[i], pools[i]):
            dst.copy_(kv)

    def get(i: int) -> None:
        for src in pools[i]:
            req.outs[i].copy_(src)

    put_s = _parallel(n, put)
    get_s = _parallel(n, get)
    return req.total_bytes / put_s / GB, req.total_bytes / get_s / GB


def _raw_files(req: _Requests, directory: Path, o_direct: bool) -> tuple[float, float]:
    """The same threads writing one new file per chunk (the chunk's bytes) into
    ``directory`` and reading them back into preallocated buffers."""
    import torch

    n = len(req.streams)
    cb = req.chunk_bytes
    flags = os.O_DIRECT if o_direct else 0
    work = directory / f"raw-{time.monotonic_ns()}"
    work.mkdir(parents=True)
    srcs = []
    for s in req.streams:
        src = _aligned(cb) if o_direct else memoryview(bytearray(cb))
        src[:] = s[0][1].reshape(-1).view(dtype=torch.uint8)[:cb].numpy().tobytes()
        srcs.append(src)
    dsts = [_aligned(cb) for _ in range(n)]
    per_stream = sum(kv.numel() * 2 for _, kv in req.streams[0]) // cb

    def write(i: int) -> None:
        for j in range(per_stream):
            fd = os.open(work / f"{i}-{j}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | flags, 0o644)
            try:
                view = srcs[i]
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)

    def read(i: int) -> None:
        for j in range(per_stream):
            fd = os.open(work / f"{i}-{j}", os.O_RDONLY | flags)
            try:
                got = 0
                while got < cb:
                    k = os.readv(fd, [dsts[i][got:]])
                    if k == 0:
                        raise OSError(f"short read of {work / f'{i}-{j}'}")
                    got += k
            finally:
                os.close(fd)

    try:
        os.sync()  # the writes of the previous measurement are not flushed on this one's time
        ws = _parallel(n, write)
        rs = _parallel(n, read)
        if bytes(dsts[0][:64]) != bytes(srcs[0][:64]):  # pragma: no cover - a broken filesystem
            raise OSError(f"read back different bytes from {work}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = per_stream * n * cb
    return total / ws / GB, total / rs / GB


def _o_direct_works(directory: Path) -> bool:
    probe = directory / f".odirect-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            os.write(fd, _aligned(ALIGN))
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError):
        return False
    finally:
        probe.unlink(missing_ok=True)


def run_matrix(shapes: list[str], concurrency: list[int], tiers: list[str], directory: Path, total_bytes: int,
               request_chunks: int, repeats: int, chunk_tokens: int = 256,
               progress: Callable[[str], None] | None = None) -> list[Cell]:
    cells: list[Cell] = []
    if "disk+odirect" in tiers and not _o_direct_works(directory):
        if progress is not None:
            progress(f"disk+odirect: skipped, the filesystem of {directory} does not support O_DIRECT")
        tiers = [t for t in tiers if t != "disk+odirect"]
    for shape in shapes:
        layers, heads, head = SHAPES[shape]
        chunk_bytes = chunk_tokens * layers * 2 * heads * head * 2
        for c in concurrency:
            per_stream = max(1, total_bytes // (c * request_chunks * chunk_bytes))
            req = _Requests(shape, c, per_stream, request_chunks, chunk_tokens, seed=c)
            for tier in tiers:
                if progress is not None:
                    progress(f"{tier}: {shape}, {c} concurrent request(s), {per_stream * c} requests "
                             f"of {request_chunks} chunk(s) of {chunk_bytes / 2**20:.1f} MiB")
                best = [0.0, 0.0, 0.0, 0.0]
                exact = True
                for _ in range(repeats):
                    s, r, ok = _ours(tier, req, directory, chunk_tokens)
                    if tier == "cpu":
                        rw, rr = _raw_memcpy(req)
                    else:
                        rw, rr = _raw_files(req, directory, o_direct=tier == "disk+odirect")
                    best = [max(a, b) for a, b in zip(best, (s, r, rw, rr))]
                    exact = exact and ok
                cells.append(Cell(tier, shape, c, chunk_bytes, req.total_bytes, *best, exact))
            del req
    return cells


def print_matrix(data: dict[str, Any]) -> None:
    from rich.table import Table

    from .harness import out

    t = Table(title="store / retrieve GB/s through one tier, next to the same bytes moved raw (best of "
                    f"{data['repeats']})")
    for col in ("tier", "shape", "conc.", "store", "raw write", "ratio", "retrieve", "raw read", "ratio", "exact"):
        t.add_column(col, justify="right" if col not in ("tier", "shape") else "left")
    for c in data["cells"]:
        t.add_row(c["tier"], c["shape"], str(c["concurrency"]), f"{c['store_gbps']:.2f}", f"{c['raw_write_gbps']:.2f}",
                  f"{c['store_ratio']:.2f}x", f"{c['retrieve_gbps']:.2f}", f"{c['raw_read_gbps']:.2f}",
                  f"{c['retrieve_ratio']:.2f}x", "yes" if c["exact"] else "NO")
    out().print(t)


def plot_matrix(data: dict[str, Any], path: Path) -> None:
    from .harness import pyplot, save_figure

    plt = pyplot()

    cells = data["cells"]
    tiers = sorted({c["tier"] for c in cells}, key=TIERS.index)
    shapes = list(dict.fromkeys(c["shape"] for c in cells))
    fig, axes = plt.subplots(len(shapes), 2, figsize=(10, 3.2 * len(shapes)), squeeze=False)
    for row, shape in enumerate(shapes):
        for col, (what, ratio) in enumerate((("store", "store_ratio"), ("retrieve", "retrieve_ratio"))):
            ax = axes[row][col]
            for tier in tiers:
                pts = sorted((c["concurrency"], c[ratio]) for c in cells if c["tier"] == tier and c["shape"] == shape)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=tier)
            ax.axhline(0.8, color="grey", linestyle="--", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, max(1.3, max((c[ratio] or 0) for c in cells) * 1.1))
            ax.set_title(f"{shape}: {what} / raw")
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel("ratio")
            ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def main(shapes: str, concurrency: str, tiers: str, total: str, request_chunks: int, repeats: int,
            directory: Path | None, threads: int | None, plot: Path | None, as_json: bool) -> None:
    """``lmcache bench tiers --matrix``: run the matrix and print it (table, JSON or plot)."""
    from lmcache.errors import LMCacheError

    from .harness import csv_option, emit, err, machine_info, open_work_dir, set_threads, size_option, warn_if_busy

    shape_list = csv_option(shapes, "'--shapes'", tuple(SHAPES))
    conc = csv_option(concurrency, "'--concurrency'", conv=int)
    tier_list = csv_option(tiers, "'--tiers'", TIERS)
    total_bytes = size_option(total, "--total", auto=False) or (512 << 20)
    set_threads(threads)
    wd = open_work_dir(directory, "lmcache-bench-")
    e = err()
    try:
        warn_if_busy(machine_info())
        t0 = time.perf_counter()
        cells = run_matrix(shape_list, conc, tier_list, wd.path, total_bytes, request_chunks, repeats,
                              progress=lambda m: e.print(m + " ..."))
        data = {"mode": "matrix", "repeats": repeats, "total_bytes": total_bytes, "request_chunks": request_chunks,
                "seconds": time.perf_counter() - t0, "cells": [c.as_dict() for c in cells],
                "exact": all(c.exact for c in cells), "machine": machine_info(wd.path)}
    finally:
        if wd.temporary:
            shutil.rmtree(wd.path, ignore_errors=True)
    emit(data, as_json, print_matrix, plot, plot_matrix)
    if not data["exact"]:
        raise LMCacheError("some retrieved KV differed from what was stored")

