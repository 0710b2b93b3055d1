"""The harness every benchmark and demo shares (imported by them, importing none of them).

- machine info (:func:`machine_info`, :func:`warn_if_busy`);
- physical limits measured in the same run: memcpy (:func:`memcpy_gbps`,
  :func:`measure_memcpy`) and raw file I/O (:func:`file_io_gbps`, :func:`measure_file_io`);
- work directories (:class:`WorkDir`, :func:`open_work_dir`) and torch threads;
- child processes that print one JSON report (:func:`run_json_child`, the restart checks);
- the consoles and result output of the command (:func:`out`, :func:`err`, :func:`emit`,
  ...), from :mod:`lmcache.cli.console`.

The benchmarks plug into the command (``lmcache bench``, an entry point of the group
``lmcache.commands``); the command never imports them.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from lmcache.errors import LMCacheError
from lmcache.units import format_size
from lmcache.cli.console import (csv_option, emit, err, need_pyplot, out, print_json, pyplot,  # noqa: F401
                                  save_figure, size_option)

GB = 1e9


def set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


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


def machine_text(machine: dict[str, Any], ram: bool = False) -> str:
    """The head of a report's "machine" line: CPUs, RAM (``ram``), GPU and torch."""
    mem = f"{format_size(machine['memory_bytes'] or 0)} RAM, " if ram else ""
    return (f"{machine['cpus_usable']} CPUs ({machine.get('cpu_model') or machine['machine']}), {mem}"
            f"{machine.get('gpu') or 'no GPU'}, torch {machine['torch']} ({machine['torch_threads']} threads)")


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



# --------------------------------------------------------------------------- work dirs and child processes


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



def child_procs() -> Any:
    """:mod:`lmcache.testing.procs` (start, read and stop child processes), imported on first
    use: the ``lmcache.testing`` package loads torch, which ``lmcache --help`` should not."""
    from lmcache.testing import procs as mod

    return mod


def run_json_child(cmd: list[str], what: str, timeout: float = 600) -> dict[str, Any]:
    """Run ``cmd`` (a new Python process that prints one JSON report) and return the report
    with its ``wall_seconds``; a failure raises with the child's last stderr line."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise LMCacheError(f"the {what} process failed (exit {proc.returncode}): {last}")
    report = json.loads(proc.stdout)
    report["wall_seconds"] = wall
    return report
