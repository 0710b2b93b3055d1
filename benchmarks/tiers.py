"""``lmcache bench tiers``: reproducible measurements of the storage tiers.

``lmcache bench tiers`` runs a synthetic workload through a real :class:`CacheEngine`
with a CPU tier above a disk tier (write-through) and puts the throughput of each tier
next to the physical limit it is bound by, measured on the same machine in the same run:

- the CPU tier against ``memcpy`` (a torch ``copy_`` of a large buffer, best of several);
- the disk tier against plain file I/O (``os.write`` of new files and ``os.readv`` into a
  preallocated buffer, in the same directory, with files as large as one chunk).

How each tier's numbers are taken (GB/s are 10^9 bytes per second):

- CPU tier, store: KV bytes newly stored / wall time of the ``CacheEngine.store()`` calls.
  The CPU tier keeps references to memory-pool objects, so the bytes move once, when
  ``store()`` copies them into the pool (hashing, allocation and queueing the
  write-through to the disk tier are included).
- CPU tier, retrieve: bytes / wall time of the ``retrieve()`` calls whose every chunk came
  from the CPU tier (the copy out of the pool into the caller's tensor, touched once
  before the first, and the lookups); each such request is retrieved :data:`CPU_REPEATS`
  times and its median counts.
- disk tier, store: the tier's own timer (``engine.stats()["tiers"]["disk"]``): encoding the
  self-describing payload (header and checksum), writing a temporary file and renaming
  it into place, on the background writer thread. Bytes include the header.
- disk tier, retrieve: the tier's own timer: opening the file, reading it into host memory
  and verifying its checksum.

The same module holds the workload (:class:`Workload`) and the measurements that
``lmcache demo synthetic`` presents.

``lmcache bench e2e`` (:mod:`lmcache.benchmarks.e2e`) measures time to first token with a
real model: a full prefill against cpu-tier and disk-tier hits, next to memcpy and raw
file reads measured in the same run.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable

import typer

from lmcache.errors import LMCacheError
from lmcache.units import format_size

from .harness import (GB, err, machine_info, measure_file_io, measure_memcpy, open_work_dir, out,
                      emit, run_json_child, set_threads, size_option, warn_if_busy)

DTYPES = ("float16", "bfloat16", "float32")


# --------------------------------------------------------------------------- workload


@dataclass
class Workload:
    """Prompts of random token ids sharing a common prefix, with random KV.

    Prompt ``i`` is ``prefix`` shared tokens followed by ``tokens - prefix`` tokens of its
    own. Token ids and KV are generated from ``seed`` alone, so another process can
    regenerate exactly what was stored and compare it bit for bit.
    """

    layers: int = 32
    kv_heads: int = 8
    head_size: int = 128
    dtype: str = "float16"
    prompts: int = 8
    tokens: int = 2048
    prefix: int = 512
    chunk_size: int = 256
    seed: int = 0
    vocab: int = 128256

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_size", "prompts", "tokens", "chunk_size"):
            v = getattr(self, name)
            if v <= 0:
                raise typer.BadParameter(f"must be positive, got {v}", param_hint=f"'--{name.replace('_', '-')}'")
        if not 0 <= self.prefix <= self.tokens:
            raise typer.BadParameter(
                f"must be between 0 and --tokens ({self.tokens}), got {self.prefix}", param_hint="'--prefix'"
            )
        if self.dtype not in DTYPES:
            raise typer.BadParameter(f"must be one of {', '.join(DTYPES)}", param_hint="'--dtype'")
        self._prefix_kv: Any = None

    @classmethod
    def build(cls, *, prefix: int | None, **kw: Any) -> Workload:
        """``prefix=None``: 512 tokens, or a quarter of the prompt, whole chunks."""
        if prefix is None:
            tokens, chunk = kw.get("tokens", cls.tokens), kw.get("chunk_size", cls.chunk_size)
            prefix = min(512, tokens // 4) // chunk * chunk
        return cls(prefix=prefix, **kw)

    def params(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

    def cli_args(self) -> list[str]:
        """The options that rebuild this workload in another process."""
        args: list[str] = []
        for k, v in self.params().items():
            if k == "vocab":
                continue
            args += [f"--{k.replace('_', '-')}", str(v)]
        return args

    # sizes
    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        import torch

        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.layers * 2 * self.kv_heads * self.head_size * itemsize

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_size * self.bytes_per_token

    @property
    def unique_tokens(self) -> int:
        return self.prefix + self.prompts * (self.tokens - self.prefix)

    @property
    def unique_bytes(self) -> int:
        return self.unique_tokens * self.bytes_per_token

    def kv_spec(self):
        from lmcache.config import KVSpec

        return KVSpec(num_layers=self.layers, num_kv_heads=self.kv_heads, head_size=self.head_size, dtype=self.dtype)

    def shape(self, num_tokens: int) -> tuple[int, ...]:
        return (self.layers, 2, num_tokens, self.kv_heads, self.head_size)

    # content
    def _gen(self, stream: int):
        import torch

        return torch.Generator().manual_seed((self.seed * 1_000_003 + stream) & 0x7FFF_FFFF_FFFF_FFFF)

    def token_ids(self, i: int):
        import torch

        pre = torch.randint(self.vocab, (self.prefix,), generator=self._gen(1), dtype=torch.int64)
        own = torch.randint(self.vocab, (self.tokens - self.prefix,), generator=self._gen(1000 + 2 * i), dtype=torch.int64)
        return torch.cat([pre, own])

    def kv(self, i: int):
        """The KV of prompt ``i``: ``(layers, 2, tokens, kv_heads, head_size)``."""
        import torch

        kv = torch.empty(self.shape(self.tokens), dtype=self.torch_dtype)
        if self.prefix:
            if self._prefix_kv is None:
                self._prefix_kv = torch.randn(self.shape(self.prefix), generator=self._gen(2), dtype=self.torch_dtype)
            kv[:, :, : self.prefix].copy_(self._prefix_kv)
        if self.tokens > self.prefix:
            own = torch.randn(self.shape(self.tokens - self.prefix), generator=self._gen(1001 + 2 * i), dtype=self.torch_dtype)
            kv[:, :, self.prefix :].copy_(own)
            del own
        return kv

    def default_capacities(self) -> tuple[int, int]:
        """CPU tier: half the workload's distinct KV (whole chunks, at least one);
        disk tier: all of it with room to spare."""
        cpu = max(1, self.unique_bytes // 2 // self.chunk_bytes) * self.chunk_bytes
        disk = self.unique_bytes * 5 // 4 + (64 << 20)
        return cpu, disk



# --------------------------------------------------------------------------- the run


@dataclass
class StoreRecord:
    prompt: int
    tokens: int
    stored_tokens: int
    skipped_tokens: int
    dropped_tokens: int
    seconds: float  # the store() call
    flush_seconds: float  # waiting for the write-through to the disk tier


@dataclass
class RetrieveRecord:
    prompt: int
    tokens: int
    cached_tokens: int  # what lookup reported
    retrieved_tokens: int
    tiers: dict[str, int]  # chunks served per tier
    seconds: float  # the retrieve() call
    nbytes: int
    exact: bool
    phase: str = "retrieve"  # "retrieve", "warm" or "restart"

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / GB if self.seconds > 0 else 0.0


@dataclass
class TierRun:
    workload: Workload
    cpu_capacity: int
    disk_capacity: int
    directory: str
    stores: list[StoreRecord] = field(default_factory=list)
    retrieves: list[RetrieveRecord] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    pin: bool = True
    #: prompt -> the seconds of its CPU-tier retrieve made again (:data:`CPU_REPEATS` in all)
    cpu_repeats: dict[int, list[float]] = field(default_factory=dict)


#: times each wholly-CPU-tier retrieve is made; the median per prompt counts (one pass of a
#: few requests is at the mercy of one page fault or one preemption)
CPU_REPEATS = 5


def _retrieve_one(engine, wl: Workload, i: int, buf, phase: str, pin: bool = True) -> RetrieveRecord:
    import torch

    tokens = wl.token_ids(i)
    # Like a connector does: the lookup leases the hits until the retrieve, so that
    # promotions made by this retrieve cannot evict the chunks it is about to read.
    cached, _ = engine.locate(tokens, pin=pin)
    t0 = time.perf_counter()
    res = engine.retrieve(tokens, out=buf)
    dt = time.perf_counter() - t0
    n = res.num_tokens
    expected = wl.kv(i)
    exact = n == cached and torch.equal(buf[:, :, :n], expected[:, :, :n])
    del expected
    return RetrieveRecord(i, len(tokens), cached, n, dict(Counter(res.tiers)), dt, n * wl.bytes_per_token, exact, phase)


def engine_config(wl: Workload, tiers: list[dict[str, Any]]):
    """The config of the benchmark's engine: ``LMCACHE_CONFIG_FILE`` and ``LMCACHE_*``
    settings apply, but the tiers, chunk size and write policy are the benchmark's."""
    from lmcache.config import load_config

    return load_config(None, chunk_size=wl.chunk_size, write_policy="write-through", tiers=tiers)


def tiers_config(wl: Workload, directory: Path, cpu_capacity: int | None = None, disk_capacity: int | None = None):
    """The validated config of a CPU tier above a disk tier in ``directory/kv``
    (``None`` capacities: :meth:`Workload.default_capacities`)."""
    auto_cpu, auto_disk = wl.default_capacities()
    return engine_config(
        wl,
        [
            {"backend": "cpu", "capacity": cpu_capacity or auto_cpu},
            {"backend": "disk", "capacity": disk_capacity or auto_disk, "path": str(directory / "kv")},
        ],
    )


def run_tiers(
    wl: Workload,
    directory: Path,
    cpu_capacity: int | None = None,
    disk_capacity: int | None = None,
    on_store: Callable[[StoreRecord], None] | None = None,
    config: Any = None,
    pin: bool = True,
) -> TierRun:
    """Store every prompt, then look up and retrieve each one (most recent first),
    checking every retrieved tensor bit for bit against what was stored."""
    import torch

    from lmcache.engine import CacheEngine

    cfg = config if config is not None else tiers_config(wl, directory, cpu_capacity, disk_capacity)
    cpu_capacity, disk_capacity = cfg.tiers[0].capacity, cfg.tiers[1].capacity
    kv_dir = Path(cfg.tiers[1].options["path"])
    run = TierRun(wl, cpu_capacity, disk_capacity, str(kv_dir), pin=pin)
    start = time.perf_counter()
    engine = CacheEngine(cfg, kv_spec=wl.kv_spec())
    try:
        for i in range(wl.prompts):
            tokens, kv = wl.token_ids(i), wl.kv(i)
            t0 = time.perf_counter()
            r = engine.store(tokens, kv)
            t1 = time.perf_counter()
            # An engine computes between two stores; here the write-through queue drains.
            engine.flush()
            t2 = time.perf_counter()
            del kv
            rec = StoreRecord(i, len(tokens), r.stored_tokens, r.skipped_tokens, r.dropped_tokens, t1 - t0, t2 - t1)
            run.stores.append(rec)
            if on_store is not None:
                on_store(rec)

        # the engine's KV buffer is allocated and touched once, before any request (as
        # vLLM's paged cache is, and as memcpy's target is): no first-touch page faults in
        # the first retrieve's time
        buf = torch.zeros(wl.shape(wl.tokens), dtype=wl.torch_dtype)
        # Most recent first, as returning conversations tend to be: the newest prompts
        # are still in the CPU tier, the oldest only on disk.
        for i in reversed(range(wl.prompts)):
            run.retrieves.append(_retrieve_one(engine, wl, i, buf, "retrieve", pin))
        if not any(set(r.tiers) == {"cpu"} for r in run.retrieves):
            # No request was served wholly from the CPU tier (it is small, or promotions
            # pushed the prompts out one chunk at a time): retrieve again those that
            # are now wholly there, so that the CPU tier gets a measurement.
            for i in reversed(range(wl.prompts)):
                _, where = engine.locate(wl.token_ids(i))
                if where and set(where) == {"cpu"} and len(where) == len(engine.chunk_keys(wl.token_ids(i))[0]):
                    run.retrieves.append(_retrieve_one(engine, wl, i, buf, "warm", pin))
        for r in [r for r in run.retrieves if set(r.tiers) == {"cpu"} and r.exact]:
            again = [_retrieve_one(engine, wl, r.prompt, buf, "repeat", pin) for _ in range(CPU_REPEATS - 1)]
            run.cpu_repeats[r.prompt] = [a.seconds for a in again if set(a.tiers) == {"cpu"} and a.exact]
        del buf
        engine.flush()
        run.stats = engine.stats()
    finally:
        engine.close()
        del engine
        gc.collect()
    run.seconds = time.perf_counter() - start
    return run


def restart_check(wl: Workload, directory: Path, disk_capacity: int) -> dict[str, Any]:
    """What a fresh process finds when it opens only the disk tier of ``directory``."""
    import torch

    from lmcache.engine import CacheEngine

    cfg = engine_config(wl, [{"backend": "disk", "capacity": disk_capacity, "path": str(directory / "kv")}])
    t0 = time.perf_counter()
    engine = CacheEngine(cfg, kv_spec=wl.kv_spec())
    open_s = time.perf_counter() - t0
    try:
        usage = engine.stats()["tiers"]["disk"]
        buf = torch.zeros(wl.shape(wl.tokens), dtype=wl.torch_dtype)  # touched before, as above
        recs = [_retrieve_one(engine, wl, i, buf, "restart") for i in range(wl.prompts)]
        stats = engine.stats()
    finally:
        engine.close()
    return {
        "pid": os.getpid(),
        "open_seconds": open_s,
        "entries": usage["entries"],
        "used_bytes": usage["used_bytes"],
        "requests": [asdict(r) for r in recs],
        "stats": stats,
    }


def spawn_restart_check(
    wl: Workload, directory: Path, disk_capacity: int, threads: int | None = None, timeout: float = 600
) -> dict[str, Any]:
    """Run :func:`restart_check` in a new Python process and return its report."""
    cmd = [
        sys.executable,
        "-m",
        "lmcache.cli.main",
        "bench",
        "restart-check",
        "--dir",
        str(directory),
        "--disk-capacity",
        str(disk_capacity),
        *wl.cli_args(),
        *(["--threads", str(threads)] if threads else []),
    ]
    return run_json_child(cmd, "restart check", timeout)


# --------------------------------------------------------------------------- summary


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def tier_summary(run: TierRun, physical: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Per tier: hits, bytes, store and retrieve GB/s and their ratio to the physical limit."""
    tiers = run.stats["tiers"]
    cpu_stats, disk_stats = tiers["cpu"], tiers["disk"]
    stored_bytes = sum(s.stored_tokens for s in run.stores) * run.workload.bytes_per_token
    store_s = sum(s.seconds for s in run.stores)
    pure_cpu = [r for r in run.retrieves if set(r.tiers) == {"cpu"} and r.exact]
    def median_s(r: RetrieveRecord) -> float:
        return statistics.median([r.seconds, *run.cpu_repeats.get(r.prompt, [])])

    cpu_retrieve = (
        sum(r.nbytes for r in pure_cpu) / sum(median_s(r) for r in pure_cpu) / GB if pure_cpu else None
    )
    cpu_store = stored_bytes / store_s / GB if store_s > 0 else None
    disk_store = disk_stats["put_bytes"] / disk_stats["put_seconds"] / GB if disk_stats["put_seconds"] > 0 else None
    disk_retrieve = disk_stats["hit_bytes"] / disk_stats["get_seconds"] / GB if disk_stats["get_seconds"] > 0 else None

    def common(s: dict[str, Any]) -> dict[str, Any]:
        keys = ("hits", "misses", "hit_bytes", "puts", "put_bytes", "evictions", "skipped_puts", "errors",
                "used_bytes", "capacity_bytes", "entries")
        return {k: s.get(k) for k in keys}

    return {
        "cpu": {
            **common(cpu_stats),
            "store_gbps": cpu_store,
            "retrieve_gbps": cpu_retrieve,
            "store_limit": "memcpy",
            "retrieve_limit": "memcpy",
            "store_ratio": _ratio(cpu_store, physical["memcpy_gbps"]),
            "retrieve_ratio": _ratio(cpu_retrieve, physical["memcpy_gbps"]),
            "retrieve_requests": len(pure_cpu),
        },
        "disk": {
            **common(disk_stats),
            "store_gbps": disk_store,
            "retrieve_gbps": disk_retrieve,
            "store_limit": "file_write",
            "retrieve_limit": "file_read",
            "store_ratio": _ratio(disk_store, physical["file_write_gbps"]),
            "retrieve_ratio": _ratio(disk_retrieve, physical["file_read_gbps"]),
        },
    }


def report(run: TierRun, physical: dict[str, Any], machine: dict[str, Any], restart: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON document of ``lmcache bench tiers --json``."""
    wl = run.workload
    data: dict[str, Any] = {
        "benchmark": "tiers",
        "machine": machine,
        "workload": {
            **wl.params(),
            "bytes_per_token": wl.bytes_per_token,
            "chunk_bytes": wl.chunk_bytes,
            "unique_tokens": wl.unique_tokens,
            "unique_bytes": wl.unique_bytes,
            "retrieve_order": "most recent first",
            "lookup_pin": run.pin,
        },
        "config": {"cpu_capacity": run.cpu_capacity, "disk_capacity": run.disk_capacity, "write_policy": "write-through"},
        "physical": physical,
        "tiers": tier_summary(run, physical),
        "store": {
            "stored_tokens": sum(s.stored_tokens for s in run.stores),
            "skipped_tokens": sum(s.skipped_tokens for s in run.stores),
            "dropped_tokens": sum(s.dropped_tokens for s in run.stores),
            "seconds": sum(s.seconds for s in run.stores),
            "flush_seconds": sum(s.flush_seconds for s in run.stores),
        },
        "requests": [{**asdict(r), "gbps": r.gbps} for r in run.retrieves],
        "hierarchy": run.stats.get("hierarchy", {}),
        "exact": all(r.exact for r in run.retrieves),
        "complete": all(r.retrieved_tokens == r.tokens for r in run.retrieves),
        "seconds": run.seconds,
    }
    if restart is not None:
        reqs = restart["requests"]
        nbytes = sum(r["nbytes"] for r in reqs)
        secs = sum(r["seconds"] for r in reqs)
        data["restart"] = {
            "entries": restart["entries"],
            "used_bytes": restart["used_bytes"],
            "open_seconds": restart["open_seconds"],
            "disk_hits": sum(r["tiers"].get("disk", 0) for r in reqs),
            "retrieved_tokens": sum(r["retrieved_tokens"] for r in reqs),
            "exact": all(r["exact"] for r in reqs),
            "complete": all(r["retrieved_tokens"] == r["tokens"] for r in reqs),
            "retrieve_gbps": nbytes / secs / GB if secs > 0 else None,
            "requests": reqs,
        }
    return data


# --------------------------------------------------------------------------- options

Layers = Annotated[int, typer.Option("--layers", min=1, help="Model layers (Llama-3-8B: 32).")]
KVHeads = Annotated[int, typer.Option("--kv-heads", min=1, help="KV heads per layer (Llama-3-8B: 8).")]
HeadSize = Annotated[int, typer.Option("--head-size", min=1, help="Head size (Llama-3-8B: 128).")]
DType = Annotated[str, typer.Option("--dtype", help=f"KV dtype: {', '.join(DTYPES)}.")]
Prompts = Annotated[int, typer.Option("--prompts", min=1, help="Number of prompts.")]
Tokens = Annotated[int, typer.Option("--tokens", min=1, help="Tokens per prompt.")]
Prefix = Annotated[
    int | None,
    typer.Option("--prefix", min=0, help="Tokens of the common prefix every prompt starts with (default: 512, at most a quarter of --tokens)."),
]
ChunkSize = Annotated[int, typer.Option("--chunk-size", min=1, help="Tokens per chunk.")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the random tokens and KV.")]
CPUCapacity = Annotated[
    str, typer.Option("--cpu-capacity", help="CPU tier capacity, e.g. 512MiB; 'auto': half of the workload's KV.")
]
DiskCapacity = Annotated[
    str, typer.Option("--disk-capacity", help="Disk tier capacity, e.g. 4GiB; 'auto': all of the workload's KV.")
]
Dir = Annotated[
    Path | None,
    typer.Option("--dir", file_okay=False, help="Directory of the disk tier (new or empty; kept). Default: a temporary one, removed afterwards."),
]
Threads = Annotated[
    int | None,
    typer.Option("--threads", min=1, help="torch intra-op threads for the copies (default: torch's choice)."),
]
Pin = Annotated[
    bool,
    typer.Option("--pin/--no-pin", help="Lease lookup hits until the retrieve, as connectors do (so promotions cannot evict them)."),
]
MemcpySize = Annotated[str, typer.Option("--memcpy-size", help="Bytes copied by the memcpy measurement.")]
FileIOSize = Annotated[
    str,
    typer.Option("--file-io-size", help="Bytes written and read by the raw file I/O measurement; 'auto': as many as the workload's distinct KV."),
]


def build_workload(layers: int, kv_heads: int, head_size: int, dtype: str, prompts: int, tokens: int,
                   prefix: int | None, chunk_size: int, seed: int) -> Workload:
    return Workload.build(layers=layers, kv_heads=kv_heads, head_size=head_size, dtype=dtype, prompts=prompts,
                          tokens=tokens, prefix=prefix, chunk_size=chunk_size, seed=seed)


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)



def main(wl: Workload, cpu_capacity: str, disk_capacity: str, directory: Path | None, memcpy_size: str,
         file_io_size: str, threads: int | None, pin: bool, restart: bool, as_json: bool) -> None:
    """``lmcache bench tiers``: both tiers next to memcpy and raw file I/O."""
    cpu_cap = size_option(cpu_capacity, "--cpu-capacity")
    disk_cap = size_option(disk_capacity, "--disk-capacity")
    memcpy_bytes = size_option(memcpy_size, "--memcpy-size", auto=False) or (256 << 20)
    file_bytes = size_option(file_io_size, "--file-io-size") or wl.unique_bytes
    set_threads(threads)
    wd = open_work_dir(directory, "lmcache-bench-")
    try:
        cfg = tiers_config(wl, wd.path, cpu_cap, disk_cap)  # a bad config fails here, before any work
        e = err()
        warn_if_busy(machine_info())
        e.print("measuring memcpy ...")
        physical = measure_memcpy(memcpy_bytes)
        e.print(f"storing and retrieving {wl.prompts} prompts x {wl.tokens} tokens "
                f"({format_size(wl.unique_bytes)} of distinct KV) ...")
        run = run_tiers(wl, wd.path, config=cfg, pin=pin)
        e.print(f"measuring raw file I/O in {wd.path} ...")
        physical.update(measure_file_io(wd.path, wl.chunk_bytes, file_bytes))
        rs = None
        if restart:
            e.print("retrieving from a new process that opens only the disk tier ...")
            rs = spawn_restart_check(wl, wd.path, run.disk_capacity, threads)
        data = report(run, physical, machine_info(wd.path), rs)
    finally:
        if wd.temporary:
            shutil.rmtree(wd.path, ignore_errors=True)
    ok = data["exact"] and (rs is None or data["restart"]["exact"])
    emit(data, as_json, print_report)
    if not ok:
        raise LMCacheError("some retrieved KV differed from what was stored")


def print_report(data: dict[str, Any]) -> None:
    from rich.table import Table

    ph = data["physical"]
    limits = {"memcpy": ph["memcpy_gbps"], "file_write": ph["file_write_gbps"], "file_read": ph["file_read_gbps"]}
    t = Table(title="lmcache bench tiers (GB/s = 10^9 bytes/s)")
    for col in ("tier", "hits", "hit bytes", "store GB/s", "limit", "ratio", "retrieve GB/s", "limit", "ratio"):
        t.add_column(col, justify="left" if col in ("tier", "limit") else "right")
    for name, s in data["tiers"].items():
        t.add_row(
            name, str(s["hits"]), format_size(s["hit_bytes"]),
            _fmt(s["store_gbps"]), f"{s['store_limit']} {limits[s['store_limit']]:.2f}", _fmt(s["store_ratio"]),
            _fmt(s["retrieve_gbps"]), f"{s['retrieve_limit']} {limits[s['retrieve_limit']]:.2f}", _fmt(s["retrieve_ratio"]),
        )
    o = out()
    o.print(t)
    if "restart" in data:
        r = data["restart"]
        o.print(f"restart: {r['disk_hits']} disk hits, exact={r['exact']}, end-to-end {_fmt(r['retrieve_gbps'])} GB/s")
    o.print(f"exact={data['exact']} complete={data['complete']} in {data['seconds']:.1f} s")

