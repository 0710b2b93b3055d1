"""Issue 10, item 3: a process storing to the disk tier is SIGKILLed at random moments;
a new process opening the directory sees no partial entry and is served every entry the
killed process completed, bit-exact.

A "zygote" child imports torch and lmcache once and forks one worker per kill point (so
that a kill point costs milliseconds, not an interpreter start). The worker stores KV
whose content is derived from (run, store number) through a disk-only CacheEngine and
prints ``done <run> <i>`` (one write(2)) after each store returns. The test kills the worker
with SIGKILL after a random delay, then opens the directory in a new engine in this
process and checks every entry.
"""

from __future__ import annotations

import os
import random
import resource
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import lmcache

HANG = 60.0  # hang guard for one line from the child, not a timing assertion

CHUNK = 16
SPEC = dict(num_layers=2, num_kv_heads=2, head_size=32, dtype="float32")
MAX_STORES = 200  # per worker: bounds the disk use of one run
KILLS = 20  # kill points per fsync mode
TIME_CAP = 20.0  # seconds of kill points per fsync mode (the count bound is KILLS)
TMP_PREFIX = ".tmp-"


def item(run: int, i: int) -> tuple[list[int], torch.Tensor]:
    """Tokens and KV of store ``i`` of worker ``run``: 1-6 chunks, last one sometimes partial."""
    rng = random.Random(run * 1_000_003 + i)
    n = rng.randint(1, 6) * CHUNK - (rng.randrange(CHUNK) if rng.random() < 0.3 else 0)
    tokens = [run, i] + [rng.randrange(50_000) for _ in range(n - 2)]
    g = torch.Generator().manual_seed(run * 1_000_003 + i)
    kv = torch.randn((SPEC["num_layers"], 2, n, SPEC["num_kv_heads"], SPEC["head_size"]), generator=g)
    return tokens, kv


def config(path: str, fsync: bool) -> dict:
    return {"chunk_size": CHUNK, "memory_pool_size": "32MiB",
            "tiers": [{"backend": "disk", "path": path, "capacity": "4GiB", "fsync": fsync}]}


def _say(text: str) -> None:
    """One line in one write(2) (atomic on a pipe): print() may write the text and the
    newline separately (unbuffered stdout), and a kill between them glues lines."""
    os.write(1, (text + "\n").encode())


def _worker(path: str, fsync: bool, run: int) -> None:
    torch.set_num_threads(1)
    eng = lmcache.CacheEngine.from_config(config(path, fsync), kv_spec=lmcache.KVSpec(**SPEC))
    _say(f"ready {run}")
    for i in range(MAX_STORES):
        tokens, kv = item(run, i)
        eng.store(tokens, kv)
        eng.flush()
        _say(f"done {run} {i}")
    _say(f"finished {run}")


def _zygote() -> None:  # runs in the child: `fork <path> <fsync> <run>` per line
    torch.set_num_threads(1)
    while True:
        line = sys.stdin.readline()
        if not line:
            return
        _, path, fsync, run = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                _worker(path, fsync == "1", int(run))
            finally:
                os._exit(0)
        _say(f"pid {pid}")
        os.waitpid(pid, 0)
        _say(f"reaped {pid}")


class Lines:
    """Lines from a child's stdout, read from the raw pipe (a select() on a buffered text
    stream misses lines already in its buffer), each within a hang guard."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.fd, self.buf = proc, proc.stdout.fileno(), b""

    def __call__(self) -> str:
        deadline = time.monotonic() + HANG
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            assert left > 0 and self.proc.poll() is None, f"child printed no line (exit {self.proc.poll()})"
            r, _, _ = select.select([self.fd], [], [], min(left, 0.5))
            if r:
                chunk = os.read(self.fd, 65536)
                assert chunk, "child closed its stdout"
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode().strip()


def _tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(f"{TMP_PREFIX}*")]


@pytest.mark.parametrize("fsync", [False, True], ids=["fsync_off", "fsync_on"])
def test_sigkill_while_storing_leaves_only_complete_entries(tmp_path, fsync):
    root = tmp_path / "kv"
    root.mkdir()
    here = str(Path(__file__).resolve().parent)
    z = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); import test_crash; test_crash._zygote()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
    )
    readline = Lines(z)
    rng = random.Random(f"crash-{fsync}")
    completed: dict[int, int] = {}  # run -> stores it reported done
    kills = torn = checked = interrupted_served = finished = 0
    spec = lmcache.KVSpec(**SPEC)
    end = time.monotonic() + TIME_CAP
    try:
        for run in range(KILLS):
            if run >= 4 and time.monotonic() > end:
                break
            z.stdin.write(f"fork {root} {int(fsync)} {run}\n")
            z.stdin.flush()
            first = sorted([readline(), readline()])  # the zygote's pid and the worker's ready, in either order
            assert first[0].startswith("pid ") and first[1] == f"ready {run}", first
            pid = int(first[0].split()[1])
            time.sleep(rng.uniform(0.0, 0.1))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            done = -1
            while True:
                line = readline()
                if line == f"reaped {pid}":
                    break
                if line == f"finished {run}":
                    finished += 1
                    continue
                assert len(line.split()) == 3, repr(line)
                tag, r, i = line.split()
                assert tag == "done" and int(r) == run and int(i) == done + 1, line
                done = int(i)
            kills += 1
            completed[run] = done + 1
            torn += len(_tmp_files(root))

            # a new engine opens the directory
            eng = lmcache.CacheEngine.from_config(config(str(root), fsync), kv_spec=spec)
            try:
                assert not _tmp_files(root), "temporary files survive opening the directory"
                tier = eng.hierarchy.tiers[0]
                # every completed store of this run is served whole and bit-exact
                for i in range(completed[run]):
                    tokens, kv = item(run, i)
                    res = eng.retrieve(tokens)
                    assert res.num_tokens == len(tokens), (run, i, res.num_tokens, len(tokens))
                    assert torch.equal(res.kv, kv), (run, i)
                    checked += 1
                # the interrupted store: whatever chunks of it are visible are exact
                tokens, kv = item(run, completed[run])
                if completed[run] < MAX_STORES:
                    res = eng.retrieve(tokens)
                    if res.num_tokens:
                        assert torch.equal(res.kv, kv[:, :, : res.num_tokens]), (run, "interrupted")
                        interrupted_served += 1
                # nothing else: every key in the directory is a chunk of a store that ran
                allowed = _allowed_keys(eng, completed)
                keys = [k for k, _ in tier.backend.keys()]
                assert set(keys) <= set(allowed), set(keys) - set(allowed)
                assert tier.backend.integrity.corrupt == 0  # no torn file under a final name
            finally:
                eng.close()
        assert kills >= 4

        # a final engine: every entry of every run, bit-exact, from one directory
        eng = lmcache.CacheEngine.from_config(config(str(root), fsync), kv_spec=spec)
        try:
            tier = eng.hierarchy.tiers[0]
            allowed = _allowed_keys(eng, completed)
            entries = 0
            for k, _ in tier.backend.keys():
                run, i, c = allowed[k]
                obj = tier.backend.get_one(k)
                assert obj is not None, k
                _, kv = item(run, i)
                assert torch.equal(obj.tensor, kv[:, :, c * CHUNK : (c + 1) * CHUNK]), k
                obj.unref()
                entries += 1
            for run, n in completed.items():
                for i in range(n):
                    tokens, kv = item(run, i)
                    res = eng.retrieve(tokens)
                    assert res.num_tokens == len(tokens) and torch.equal(res.kv, kv), (run, i)
            assert tier.backend.integrity.corrupt == 0
        finally:
            eng.close()
    finally:
        z.stdin.close()
        try:
            z.wait(10)
        except subprocess.TimeoutExpired:
            z.kill()
            z.wait()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"\ncrash[fsync={fsync}]: kill_points={kills} completed_stores={sum(completed.values())} "
          f"stores_checked_after_each_kill={checked} entries_checked_at_end={entries} "
          f"temp_files_left_by_kills={torn} interrupted_stores_partly_served={interrupted_served} "
          f"workers_finished_before_kill={finished} torn_entries_served=0 peak_rss_mib={rss}")


def _allowed_keys(eng, completed: dict[int, int]) -> dict[str, tuple[int, int, int]]:
    """key -> (run, store, chunk) for every store a worker reported or was running."""
    out = {}
    for run, n in completed.items():
        for i in range(min(n + 1, MAX_STORES)):
            tokens, _ = item(run, i)
            for c, k in enumerate(eng.chunk_keys(tokens)[1]):
                out[k] = (run, i, c)
    return out
