"""``lmcache bench``: reproducible measurements of the storage tiers.

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
  from the CPU tier (the copy out of the pool into the caller's tensor, and the lookups).
- disk tier, store: the tier's own timer (``engine.stats()["tiers"]["disk"]``): encoding the
  self-describing payload (header and checksum), writing a temporary file and renaming
  it into place, on the background writer thread. Bytes include the header.
- disk tier, retrieve: the tier's own timer: opening the file, reading it into host memory
  and verifying its checksum.

The same module holds the workload (:class:`Workload`) and the measurements that
``lmcache demo synthetic`` presents.

``lmcache bench e2e`` (:mod:`lmcache.cli.bench_e2e`) measures time to first token with a
real model: a full prefill against cpu-tier and disk-tier hits, next to memcpy and raw
file reads measured in the same run.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable

import typer

from lmcache.errors import LMCacheError
from lmcache.units import format_size

from ._util import err, out, print_json, size_option

GB = 1e9
DTYPES = ("float16", "bfloat16", "float32")

app = typer.Typer(
    name="bench",
    help="Reproducible benchmarks of lmcache against the machine's physical limits.",
    no_args_is_help=True,
    add_completion=False,
)


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


# --------------------------------------------------------------------------- machine


def _read_first(path: str, prefix: str) -> str | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(prefix):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _fs_type(path: Path) -> str | None:
    try:
        best, kind = "", None
        target = str(path.resolve())
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (target == parts[1] or target.startswith(parts[1].rstrip("/") + "/")):
                    if len(parts[1]) >= len(best):
                        best, kind = parts[1], parts[2]
        return kind
    except OSError:
        return None


def machine_info(directory: Path | None = None) -> dict[str, Any]:
    import torch

    from lmcache import __version__

    mem = _read_first("/proc/meminfo", "MemTotal")
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    info: dict[str, Any] = {
        "lmcache": __version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _read_first("/proc/cpuinfo", "model name") or platform.processor() or None,
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "memory_bytes": int(mem.split()[0]) * 1024 if mem else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    if directory is not None:
        info["directory"] = str(directory)
        info["filesystem"] = _fs_type(directory)
    return info


def warn_if_busy(machine: dict[str, Any]) -> None:
    load, cpus = machine.get("load_average_1m"), machine.get("cpus_usable") or 1
    if load is not None and load > 0.5 * cpus:
        err().print(
            f"[yellow]warning:[/] the machine is busy (load average {load:.1f} on {cpus} CPUs); "
            "the numbers will be lower and noisier than on an idle machine"
        )


def memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 10) -> float:
    """Host memory copy bandwidth: torch ``copy_`` between two buffers, best of ``repeats``."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.fill_(0)  # touch every page before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / GB


def file_io_gbps(
    directory: Path, nbytes: int, file_size: int, read_repeats: int = 3
) -> tuple[float, float, int, int]:
    """(write GB/s, read GB/s, bytes, file size) of plain file I/O in ``directory``.

    Writes ``nbytes`` as new files of ``file_size`` bytes with ``os.write`` (no fsync,
    like the disk tier's default), once; then reads every file with ``os.readv`` into a
    preallocated buffer, best of ``read_repeats``. Reads are likely served from the page
    cache: dropping it needs root.
    """
    import torch

    file_size = max(4096, min(file_size, nbytes))
    nfiles = max(1, nbytes // file_size)
    data = memoryview(torch.randint(0, 256, (file_size,), dtype=torch.uint8).numpy()).cast("B")
    dst = memoryview(bytearray(file_size))
    work = directory / f"raw-io-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    best_r = float("inf")
    try:
        paths = [work / f"f{j}" for j in range(nfiles)]
        t0 = time.perf_counter()
        for p in paths:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = data
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
        write_s = time.perf_counter() - t0
        for _ in range(read_repeats):
            t0 = time.perf_counter()
            for p in paths:
                fd = os.open(p, os.O_RDONLY)
                try:
                    got = 0
                    while got < file_size:
                        n = os.readv(fd, [dst[got:]])
                        if n == 0:
                            break
                        got += n
                finally:
                    os.close(fd)
            best_r = min(best_r, time.perf_counter() - t0)
        if bytes(dst[:64]) != bytes(data[:64]):  # pragma: no cover - a broken filesystem
            raise OSError(f"read back different bytes from {work}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = nfiles * file_size
    return total / write_s / GB, total / best_r / GB, total, file_size


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

        buf = torch.empty(wl.shape(wl.tokens), dtype=wl.torch_dtype)
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
        buf = torch.empty(wl.shape(wl.tokens), dtype=wl.torch_dtype)
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
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise LMCacheError(f"the restart check process failed (exit {proc.returncode}): {last}")
    report = json.loads(proc.stdout)
    report["wall_seconds"] = wall
    return report


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
    cpu_retrieve = (
        sum(r.nbytes for r in pure_cpu) / sum(r.seconds for r in pure_cpu) / GB if pure_cpu else None
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


def measure_memcpy(nbytes: int) -> dict[str, Any]:
    return {"memcpy_gbps": memcpy_gbps(nbytes), "memcpy_bytes": nbytes, "memcpy_repeats": 10}


def measure_file_io(directory: Path, file_size: int, nbytes: int) -> dict[str, Any]:
    """Raw file I/O as the disk tier does it: files of one chunk, as many bytes as the
    tier wrote, in the same directory, while the tier's files are still there."""
    w, r, total, fsize = file_io_gbps(directory, nbytes, file_size)
    return {
        "file_write_gbps": w,
        "file_read_gbps": r,
        "file_bytes": total,
        "file_size": fsize,
        "file_read_repeats": 3,
        "page_cache": "writes land in the page cache (no fsync) and reads are likely served from it (dropping it needs root)",
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


@dataclass
class WorkDir:
    path: Path
    temporary: bool


def open_work_dir(directory: Path | None, prefix: str) -> WorkDir:
    """The run's directory: a new temporary one, or ``directory`` if it is empty or new."""
    if directory is None:
        return WorkDir(Path(tempfile.mkdtemp(prefix=prefix)), True)
    directory = directory.expanduser()
    if directory.exists():
        if not directory.is_dir():
            raise typer.BadParameter(f"{directory} is not a directory", param_hint="'--dir'")
        if any(directory.iterdir()):
            raise typer.BadParameter(
                f"{directory} is not empty; give a new or empty directory (the run must start from an empty cache)",
                param_hint="'--dir'",
            )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise typer.BadParameter(f"cannot create {directory}: {exc.strerror}", param_hint="'--dir'") from None
    return WorkDir(directory, False)


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


def set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def build_workload(layers: int, kv_heads: int, head_size: int, dtype: str, prompts: int, tokens: int,
                   prefix: int | None, chunk_size: int, seed: int) -> Workload:
    return Workload.build(layers=layers, kv_heads=kv_heads, head_size=head_size, dtype=dtype, prompts=prompts,
                          tokens=tokens, prefix=prefix, chunk_size=chunk_size, seed=seed)


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


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
    if matrix:
        _matrix(shapes, concurrency, matrix_tiers, total, request_chunks, repeats, directory, threads, plot, as_json)
        return
    wl = build_workload(layers, kv_heads, head_size, dtype, prompts, tokens, prefix, chunk_size, seed)
    if backend is not None:
        _backend_bench(backend, option or [], store, wl, values, batch, repeats, codec, as_json)
        return
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
    if as_json:
        print_json(data)
    else:
        _print_report(data)
    if not ok:
        raise LMCacheError("some retrieved KV differed from what was stored")


def _csv(value: str, hint: str, choices: Any = None, conv: Callable[[str], Any] = str) -> list[Any]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    try:
        got = [conv(v) for v in items]
    except ValueError:
        raise typer.BadParameter(f"not a comma-separated list: {value!r}", param_hint=hint) from None
    if not got:
        raise typer.BadParameter("give at least one", param_hint=hint)
    for v in got:
        if choices is not None and v not in choices:
            raise typer.BadParameter(f"{v!r} is not one of {', '.join(choices)}", param_hint=hint)
        if conv is int and not 1 <= v <= 64:
            raise typer.BadParameter(f"must be between 1 and 64, got {v}", param_hint=hint)
    return got


def _matrix(shapes: str, concurrency: str, tiers: str, total: str, request_chunks: int, repeats: int,
            directory: Path | None, threads: int | None, plot: Path | None, as_json: bool) -> None:
    from . import bench_matrix as bm

    shape_list = _csv(shapes, "'--shapes'", tuple(bm.SHAPES))
    conc = _csv(concurrency, "'--concurrency'", conv=int)
    tier_list = _csv(tiers, "'--tiers'", bm.TIERS)
    total_bytes = size_option(total, "--total", auto=False) or (512 << 20)
    set_threads(threads)
    wd = open_work_dir(directory, "lmcache-bench-")
    e = err()
    try:
        warn_if_busy(machine_info())
        t0 = time.perf_counter()
        cells = bm.run_matrix(shape_list, conc, tier_list, wd.path, total_bytes, request_chunks, repeats,
                              progress=lambda m: e.print(m + " ..."))
        data = {"mode": "matrix", "repeats": repeats, "total_bytes": total_bytes, "request_chunks": request_chunks,
                "seconds": time.perf_counter() - t0, "cells": [c.as_dict() for c in cells],
                "exact": all(c.exact for c in cells), "machine": machine_info(wd.path)}
    finally:
        if wd.temporary:
            shutil.rmtree(wd.path, ignore_errors=True)
    if plot is not None:
        bm.plot_matrix(data, plot)
        data["plot"] = str(plot)
    if as_json:
        print_json(data)
    else:
        bm.print_matrix(data)
    if not data["exact"]:
        raise LMCacheError("some retrieved KV differed from what was stored")


def _backend_bench(backend: str, option: list[str], store: str | None, wl: Workload, values: int, batch: int,
                   repeats: int, codec: str, as_json: bool) -> None:
    from . import bench_backends as bb

    opts = bb.parse_options(option)
    e = err()
    warn_if_busy(machine_info())
    with bb.open_store(backend, opts, store) as (options, where):
        e.print(f"{backend}: {values} chunks of {format_size(wl.chunk_bytes)} x {repeats} rounds against {where} ...")
        data = bb.run_backend(backend, options, shape=wl.shape(wl.chunk_size), dtype=wl.dtype, values=values,
                              batch=batch, repeats=repeats, codec=codec, seed=wl.seed)
    data["store"] = where
    data["machine"] = machine_info()
    if as_json:
        print_json(data)
    else:
        bb.print_report(data)
    if not data["exact"]:
        raise LMCacheError(f"some values read back from {backend} differed from what was stored")


def _print_report(data: dict[str, Any]) -> None:
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
    wl = Workload(layers=layers, kv_heads=kv_heads, head_size=head_size, dtype=dtype, prompts=prompts,
                  tokens=tokens, prefix=prefix, chunk_size=chunk_size, seed=seed)
    cap = size_option(disk_capacity, "--disk-capacity", auto=False)
    assert cap is not None
    set_threads(threads)
    print_json(restart_check(wl, directory, cap))


def _register_distributed() -> None:
    from . import bench_compare, bench_dist, bench_lookup

    app.command("compare")(bench_compare.compare_cmd)

    app.command("controller")(bench_dist.lookup_cmd)
    app.command("lookup")(bench_lookup.lookup_cmd)
    app.command("p2p")(bench_dist.p2p_cmd)


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
    from . import bench_e2e  # the model, transformers and matplotlib load only for this command

    if workload == "qa":
        bench_e2e.qa_main(users, rounds, system_tokens, doc_tokens, new_tokens, chunk_size, cpu_capacity, seed,
                          directory, memcpy_size, threads, quick, as_json, plot)
    elif workload == "ttft":
        bench_e2e.main(lengths, repeats, prefill_repeats, chunk_size, seed, directory, memcpy_size, threads, as_json, plot)
    else:
        raise typer.BadParameter(f"expected ttft or qa, got {workload!r}", param_hint="'--workload'")


@app.command("vllm")
def vllm_cmd(
    modes: Annotated[str, typer.Option("--modes", help="Comma-separated: vllm, vllm-simple-cpu, vllm-offloading, lmcache-cpu, lmcache-disk, lmcache-redis (the first is the reference for outputs and TTFT).")] = "vllm,vllm-simple-cpu,vllm-offloading,lmcache-cpu,lmcache-disk,lmcache-redis",
    docs: Annotated[int, typer.Option("--docs", min=1, help="Documents asked round robin.")] = 4,
    doc_tokens: Annotated[int, typer.Option("--doc-tokens", min=64, help="Tokens per document (at least).")] = 3000,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Rounds over the documents.")] = 3,
    chat_turns: Annotated[int, typer.Option("--chat-turns", min=0, help="Turns of the multi-round chat.")] = 4,
    kv_tokens: Annotated[int, typer.Option("--kv-tokens", min=128, help="vLLM's own KV memory in tokens (--num-gpu-blocks-override); smaller than the documents need.")] = 6144,
    cpu_capacity: Annotated[str, typer.Option("--cpu-capacity", help="CPU memory of the offloading connectors and lmcache's CPU tier (disk and Redis tiers get 8x).")] = "2GiB",
    threads: Annotated[int, typer.Option("--threads", min=1, help="OMP_NUM_THREADS of every server (the same in every mode).")] = 2,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Greedy tokens generated per request.")] = 16,
    chunk_size: Annotated[int, typer.Option("--chunk-size", min=16, help="lmcache's chunk size in the lmcache modes (default: vLLM's CPU block size, 128).")] = 128,
    vllm_venv: Annotated[Path | None, typer.Option("--vllm-venv", file_okay=False, help="The venv with vLLM (default: .venv-vllm-cpu of this repository, built by make engines).")] = None,
    directory: Dir = None,
    quick: Annotated[bool, typer.Option("--quick", help="A small run for tests: 3 documents of 500 tokens, 2 rounds, 2 chat turns, 1024 tokens of vLLM KV.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    plot: Annotated[Path | None, typer.Option("--plot", dir_okay=False, help="Also draw TTFT per round and mode into this PNG (needs matplotlib).")] = None,
) -> None:
    """A live vllm serve per mode (vLLM alone, its CPU offloading connectors, lmcache over
    cpu/disk/redis) on a workload larger than vLLM's KV memory: TTFT, hits, identical outputs."""
    from lmcache.units import parse_size

    from . import bench_vllm
    from ._util import need_pyplot

    need_pyplot(plot)
    if quick:
        docs, doc_tokens, rounds, chat_turns, kv_tokens, max_tokens = 3, 500, 2, 2, 1024, 8
    bench_vllm.main(_csv(modes, "'--modes'", bench_vllm.ALL_MODES), docs, doc_tokens, rounds, chat_turns, kv_tokens,
                    parse_size(cpu_capacity), threads, max_tokens, vllm_venv, directory, as_json, plot, chunk_size)


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
    from . import bench_codecs  # the model and transformers load only for this command

    bench_codecs.main(codec or list(bench_codecs.DEFAULT_ROWS), text, tokens, chunk_size, prompts, gen_prompts,
                      gen_tokens, repeats, group_size, threads, as_json, plot)
