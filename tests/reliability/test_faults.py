"""Reliability under faults: networked tiers and the controller are killed and restarted
during a workload, and a disk tier runs into a full filesystem (ENOSPC).

The guarantees: a fault costs hits, never correctness or liveness. No exception reaches
the engine's caller, every engine call returns within a hang guard derived from the
configured timeouts (a guard, not a performance bound), every retrieve that returns data
returns exactly the stored bytes, hits from a restarted tier resume in the same engine
with no restart, and a full disk skips the stores that do not fit, leaves no temporary
or corrupt file behind and keeps serving what it already holds.

Every loop is bounded by a count and by a time cap; each test prints a one-line summary
of what it did (calls, faults injected, peak RSS).
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from _kv import wave
from _missing import loopback_store, missing
from _procs import readline, stop, until

import lmcache

L, H, D = 2, 2, 8
CHUNK = 16
PROMPT_TOKENS = 64  # 4 chunks per prompt


def kv_for(tokens, heads: int = H, head_size: int = D) -> torch.Tensor:
    """KV derived from the token ids alone: any engine can check a retrieve bit-exactly."""
    t = torch.as_tensor(list(tokens), dtype=torch.float64)
    base = torch.arange(L * 2 * heads * head_size, dtype=torch.float64).reshape(L, 2, 1, heads, head_size)
    return wave(base * 0.01 + t.reshape(1, 1, -1, 1, 1) * 0.37).to(torch.float32)


def prompt(i: int, n: int = PROMPT_TOKENS) -> list[int]:
    return [(i * 1009 + j * 7) % 50000 + i for j in range(n)]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Workload:
    """store / lookup / retrieve of many prompts on one engine, in a thread, recording
    each call's duration, every exception and every inexact retrieve."""

    def __init__(self, engine: lmcache.CacheEngine, kv: Callable[[list[int]], torch.Tensor] = kv_for,
                 seed: int = 0, first: int = 0, max_steps: int = 2000, pause: float = 0.002):
        self.e = engine
        self.pause = pause
        self.max_steps = max_steps
        self.kv = kv
        self.rng = random.Random(seed)
        self.next = first
        self.stored: list[int] = []
        self.calls = 0
        self.slowest = 0.0
        self.slowest_op = ""
        self.errors: list[BaseException] = []
        self.wrong: list[str] = []
        self.hits = self.misses = self.retrieved_tokens = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _timed(self, what: str, fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        try:
            return fn()
        except BaseException as exc:  # noqa: BLE001 - reported by the test's assertions
            self.errors.append(exc)
            return None
        finally:
            dt = time.monotonic() - t0
            self.calls += 1
            if dt > self.slowest:
                self.slowest, self.slowest_op = dt, what

    def step(self) -> None:
        i = self.next
        self.next += 1
        toks = prompt(i)
        self._timed("store", lambda: self.e.store(toks, self.kv(toks)))
        self.stored.append(i)
        j = self.rng.choice(self.stored[-50:])
        old = prompt(j)
        n = self._timed("lookup", lambda: self.e.lookup(old))
        if n:
            self.hits += 1
        elif n == 0:
            self.misses += 1
        res = self._timed("retrieve", lambda: self.e.retrieve(old))
        if res is not None and res.num_tokens:
            self.retrieved_tokens += res.num_tokens
            if res.kv is None or not torch.equal(res.kv, self.kv(old[: res.num_tokens])):
                self.wrong.append(f"prompt {j}: {res.num_tokens} tokens from {res.tiers}")

    def _run(self) -> None:
        for _ in range(self.max_steps):
            if self._stop.is_set():
                break
            self.step()
            time.sleep(self.pause)

    def __enter__(self) -> Workload:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the workload thread hung"


# ======================================================================= networked tiers
#: backend -> (loopback launcher, configured timeout in seconds)
NETWORKED = {"redis": 0.5, "valkey": 0.5, "s3": 0.5, "lm": 0.5}


@pytest.mark.parametrize("backend", list(NETWORKED))
def test_networked_tier_killed_and_restarted_during_a_workload(backend):
    timeout = NETWORKED[backend]
    hang_guard = 5 * timeout + 2.0
    rng = random.Random(sum(map(ord, backend)))
    with loopback_store(backend) as st:
        remote = {"backend": backend, "capacity": "64MiB", **st.options, "timeout": timeout}
        cfg = {"chunk_size": CHUNK, "staging_size": "8MiB", "write_policy": "write-through",
               "tiers": [{"backend": "cpu", "capacity": "64KiB"}, remote]}  # 16 chunks on the CPU tier
        faults = 0
        with lmcache.CacheEngine.from_config(cfg) as e:
            # warm: the remote tier serves before any fault
            warm = prompt(10**6)
            e.store(warm, kv_for(warm))
            e.hierarchy.flush()
            assert e.hierarchy.tier(backend).exists(e.chunk_keys(warm)[1]) == [True] * 4
            t_end = time.monotonic() + 25  # the whole fault phase is capped
            with Workload(e, seed=faults) as w:
                time.sleep(0.3)
                for _ in range(3):
                    if time.monotonic() > t_end:
                        break
                    time.sleep(rng.uniform(0.2, 0.8))
                    st.kill()
                    faults += 1
                    time.sleep(rng.uniform(0.3, 1.0))
                    st.restart()
                time.sleep(0.5)
            assert not w.errors, f"{len(w.errors)} exceptions reached the engine's caller: {w.errors[:3]!r}"
            assert not w.wrong, f"inexact retrieves: {w.wrong[:5]}"
            assert w.slowest < hang_guard, f"{w.slowest_op} took {w.slowest:.2f}s (guard {hang_guard:.1f}s)"
            assert w.calls > 30

            # recovery in the same engine: a new prompt reaches the remote tier and is
            # served from it once the CPU tier no longer holds it
            # (a fresh prompt per poll: a chunk whose lower-tier write was skipped during
            # the outage stays in the CPU tier and is not written down again by a store)
            remote_tier = e.hierarchy.tier(backend)
            deadline = time.monotonic() + 30  # the backoff is at most 10 s
            polls = 0
            while True:
                polls += 1
                probe = prompt(2 * 10**6 + polls)
                keys = e.chunk_keys(probe)[1]
                e.store(probe, kv_for(probe))
                e.hierarchy.flush()
                if remote_tier.exists(keys) == [True] * 4:
                    break
                assert time.monotonic() < deadline, f"the {backend} tier did not serve again within 30 s"
                time.sleep(0.2)
            e.hierarchy.tier("cpu").delete(keys)
            t0 = time.monotonic()
            res = e.retrieve(probe)
            assert time.monotonic() - t0 < hang_guard
            assert res.num_tokens == PROMPT_TOKENS and res.tiers == [backend] * 4, res.tiers
            assert torch.equal(res.kv, kv_for(probe))
            errors = e.stats()["tiers"][backend]["errors"]
        print(f"[faults] {backend}: {w.calls} engine calls, {faults} kills+restarts, {errors} tier errors absorbed, "
              f"{w.hits} lookup hits/{w.misses} misses, {w.retrieved_tokens} tokens retrieved exact, "
              f"slowest {w.slowest_op} {w.slowest:.2f}s (guard {hang_guard:.1f}s), recovered after {polls} polls, "
              f"peak RSS {peak_rss_mib():.0f} MiB")


# ======================================================================= the controller
def test_write_through_writes_down_what_a_tier_missed_during_its_outage():
    """Write-through over cpu + lm: writes for the lm tier wait while its server is down,
    at most write_queue_size of them; chunks whose writes were dropped (more waited) stay
    only in the CPU tier; once it is back, those chunks are written to it when the CPU
    tier evicts them (not lost), and are then served from it, exact."""
    with loopback_store("lm") as st:
        remote = {"backend": "lm", "capacity": "64MiB", **st.options, "timeout": 0.5}
        cfg = {"chunk_size": CHUNK, "staging_size": "8MiB", "write_policy": "write-through",
               "write_queue_size": 32, "tiers": [{"backend": "cpu", "capacity": "64KiB"}, remote]}  # 16 chunks
        with lmcache.CacheEngine.from_config(cfg) as e:
            lm_tier = e.hierarchy.tier("lm")
            st.kill()
            missed = prompt(3 * 10**6)
            e.store(missed, kv_for(missed))
            assert e.lookup(missed, pin=True) == PROMPT_TOKENS  # kept in the CPU tier meanwhile
            for i in range(10):  # 40 more writes wait for lm: the oldest, missed's, are dropped
                more = prompt(6 * 10**6 + i)
                e.store(more, kv_for(more))
                e.hierarchy.flush()
            assert e.stats()["hierarchy"]["dropped_writes"] >= 4
            missed_keys = e.chunk_keys(missed)[1]
            assert e.hierarchy.tier("cpu").exists(missed_keys) == [True] * 4
            st.restart()
            deadline = time.monotonic() + 30  # the backoff is at most 10 s
            polls = 0
            while True:  # until the lm tier takes writes again
                polls += 1
                probe = prompt(4 * 10**6 + polls)
                e.store(probe, kv_for(probe))
                e.hierarchy.flush()
                if lm_tier.exists(e.chunk_keys(probe)[1]) == [True] * 4:
                    break
                assert time.monotonic() < deadline, "the lm tier did not take writes again within 30 s"
                time.sleep(0.2)
            assert lm_tier.exists(missed_keys) == [False] * 4, "the outage did not make the lm tier miss them"
            e.release(missed)
            repairs_before = e.stats()["hierarchy"]["repairs"]
            for i in range(6):  # 24 new chunks through a 16-chunk CPU tier: the missed ones are evicted
                churn = prompt(5 * 10**6 + i)
                e.store(churn, kv_for(churn))
            e.hierarchy.flush()
            assert e.hierarchy.tier("cpu").exists(missed_keys) == [False] * 4
            assert lm_tier.exists(missed_keys) == [True] * 4, "evicted chunks were lost instead of written down"
            repairs = e.stats()["hierarchy"]["repairs"] - repairs_before
            assert repairs >= 4
            res = e.retrieve(missed)
            assert res.num_tokens == PROMPT_TOKENS and res.tiers == ["lm"] * 4, res.tiers
            assert torch.equal(res.kv, kv_for(missed))
    print(f"[faults] write-through repair: 4 chunks missed by the lm tier during its outage were written down "
          f"when the CPU tier evicted them ({repairs} repairs after {polls} recovery polls), then served exact from lm")


def _start_controller(port: int = 0) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ)
    env.pop("LMCACHE_CONTROLLER_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache.cli.main", "controller", "serve", "--port", str(port),
         "--instance-timeout", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    url = readline(proc)
    assert url.startswith("http://127.0.0.1:"), url
    return proc, url


def test_engines_keep_serving_while_the_controller_is_killed_and_restarted():
    from lmcache.plugins.services.controller_client import ControllerClient

    ctl_timeout = 0.5
    hang_guard = 5 * ctl_timeout + 2.0
    ctl, url = _start_controller()
    port = int(url.rsplit(":", 1)[1])
    client = ControllerClient(url, timeout=5)
    faults = during_outage = 0
    try:
        with contextlib.ExitStack() as stack:
            engines = []
            for n, iid in enumerate(("faults-a", "faults-b")):
                cfg = {"chunk_size": CHUNK, "kv_spec": {"num_layers": L, "num_kv_heads": H, "head_size": D,
                                                        "dtype": "float32"},
                       "tiers": [{"backend": "cpu", "capacity": "8MiB"}],
                       "controller": {"url": url, "instance_id": iid, "heartbeat_interval": 0.2,
                                      "timeout": ctl_timeout}}
                engines.append(stack.enter_context(lmcache.CacheEngine.from_config(cfg)))
            shared = prompt(3 * 10**6)
            for e in engines:
                e.store(shared, kv_for(shared))

            def indexed() -> bool:
                rows = client.lookup(shared)["results"]
                return sorted((r["instance_id"], r["hit_tokens"]) for r in rows) == [
                    ("faults-a", PROMPT_TOKENS), ("faults-b", PROMPT_TOKENS)]

            until(indexed, "both engines indexed by the controller")
            # bounded so that the shared prompt is never evicted from the 8 MiB CPU tier
            loads = [Workload(e, seed=k, first=(k + 1) * 10**5, max_steps=300, pause=0.02) for k, e in enumerate(engines)]
            with contextlib.ExitStack() as wl:
                for w in loads:
                    wl.enter_context(w)
                for _ in range(2):
                    time.sleep(0.4)
                    ctl.kill()
                    ctl.wait(10)
                    faults += 1
                    before = sum(w.calls for w in loads)
                    time.sleep(0.8)  # the workers fail their calls meanwhile; the engines do not
                    during_outage += sum(w.calls for w in loads) - before
                    ctl, url2 = _start_controller(port)
                    assert url2 == url
                time.sleep(0.3)
            for w in loads:
                assert not w.errors, w.errors[:3]
                assert not w.wrong, w.wrong[:5]
                assert w.slowest < hang_guard, f"{w.slowest_op} took {w.slowest:.2f}s"
            # the restarted controller is healed by the same workers: lookups resume
            until(indexed, "lookups through the restarted controller")
            for e in engines:
                assert e.lookup(shared) == PROMPT_TOKENS
            failed = sum(e.controller_worker.failed_calls for e in engines)
            assert failed > 0  # the outages were seen by the workers, and absorbed
            assert during_outage > 0  # the engines served while the controller was down
            calls = sum(w.calls for w in loads)
    finally:
        stop(ctl)
    print(f"[faults] controller: {calls} engine calls on 2 engines, {faults} controller kills+restarts, "
          f"{during_outage} calls served while it was down, {failed} failed worker calls absorbed, lookups resumed, peak RSS {peak_rss_mib():.0f} MiB")


# ======================================================================= full disk
BIG_H, BIG_D = 4, 64  # 32 KiB of KV per 16-token chunk: a 4 MiB filesystem holds ~120


def kv_big(tokens) -> torch.Tensor:
    return kv_for(tokens, BIG_H, BIG_D)


@contextlib.contextmanager
def small_filesystem(root: Path, size_mib: int = 4):
    """A real filesystem of ``size_mib`` MiB mounted at ``root/mnt``: tmpfs, else an
    ext4 image on a loop device; skips (saying why) where neither can be mounted."""
    mnt = root / "mnt"
    mnt.mkdir()
    why = []
    kind = None
    if os.geteuid() != 0:
        missing("the ENOSPC test needs root to mount a small filesystem (tmpfs or loop)")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode == 0:
        kind = "tmpfs"
    else:
        why.append(f"tmpfs: {r.stderr.strip()}")
        img = root / "fs.img"
        with open(img, "wb") as f:
            f.truncate(size_mib * 1024 * 1024)
        mk = shutil.which("mkfs.ext4")
        if mk is None:
            why.append("loop: mkfs.ext4 not found")
        else:
            r1 = subprocess.run([mk, "-q", "-F", str(img)], capture_output=True, text=True)
            r2 = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True) \
                if r1.returncode == 0 else r1
            if r2.returncode == 0:
                kind = "ext4-loop"
            else:
                why.append(f"loop: {r2.stderr.strip()}")
    if kind is None:
        missing("cannot mount a small filesystem to provoke ENOSPC: " + "; ".join(why))
    try:
        yield mnt, kind
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_full_disk_skips_stores_and_keeps_serving(tmp_path, caplog):
    caplog.set_level("WARNING", logger="lmcache.hierarchy")
    with small_filesystem(tmp_path) as (mnt, fs_kind):
        cache_dir = mnt / "cache"
        cfg = {"chunk_size": CHUNK, "staging_size": "16MiB", "write_policy": "write-through",
               "tiers": [{"backend": "cpu", "capacity": "256KiB"},  # 8 chunks
                         {"backend": "disk", "path": str(cache_dir), "capacity": "64MiB"}]}  # > the filesystem
        hang_guard = 10.0
        calls = enospc = 0
        slowest = 0.0
        early: list[int] = []
        with lmcache.CacheEngine.from_config(cfg) as e:
            disk = e.hierarchy.tier("disk")

            def timed(fn: Callable[[], Any]) -> Any:
                nonlocal calls, slowest
                t0 = time.monotonic()
                out = fn()  # an exception fails the test: none may reach the engine's caller
                slowest = max(slowest, time.monotonic() - t0)
                calls += 1
                return out

            i = 0
            t_end = time.monotonic() + 30
            full_at = None
            while time.monotonic() < t_end and i < 400:
                toks = prompt(i)
                timed(lambda: e.store(toks, kv_big(toks)))
                e.hierarchy.flush()
                if disk.stats.skipped_puts > enospc and "No space left" in disk.stats.last_error:
                    enospc = disk.stats.skipped_puts  # a full device: puts skipped, the tier stays up
                    full_at = full_at if full_at is not None else i
                elif full_at is None:
                    early.append(i)
                # every retrieve that returns data is exact, full disk or not
                j = random.Random(i).randrange(i + 1)
                old = prompt(j)
                res = timed(lambda: e.retrieve(old))
                if res.num_tokens:
                    assert torch.equal(res.kv, kv_big(old[: res.num_tokens])), f"prompt {j}: wrong KV"
                i += 1
                if full_at is not None and i > full_at + 40:
                    break
            assert full_at is not None, f"the {fs_kind} filesystem never filled ({i} prompts)"
            assert "No space left" in disk.stats.last_error or "ENOSPC" in disk.stats.last_error or \
                "Errno 28" in disk.stats.last_error, disk.stats.last_error
            assert slowest < hang_guard
            # no temporary file left behind
            leftovers = [p for p in cache_dir.rglob("*") if p.name.startswith(".tmp-")]
            assert not leftovers, leftovers
            # a full device is a skipped put, not an outage: the disk tier stays available
            assert disk.available, "a full disk must not take the tier down"
            # ... and it is said, once (the outside review: "a full disk is silent")
            said = [r.getMessage() for r in caplog.records if "refuses writes" in r.getMessage()]
            assert len(said) == 1 and "No space left" in said[0], said
            assert "No space left" in (disk.info()["write_refused"] or ""), disk.info()
            assert disk.stats.refused_writes >= enospc > 0
            # the entries written before the disk filled are still served from the disk
            # tier, exactly
            served = 0
            for j in early[:20]:
                old = prompt(j)
                keys = e.chunk_keys(old)[1]
                e.hierarchy.tier("cpu").delete(keys)
                until(lambda: disk.exists(keys) == [True] * 4, f"prompt {j} on the disk tier", timeout=30)
                res = timed(lambda: e.retrieve(old))
                assert res.num_tokens == PROMPT_TOKENS and res.tiers == ["disk"] * 4, (j, res.tiers)
                assert torch.equal(res.kv, kv_big(old))
                served += 1
            assert served > 0, "nothing was stored before the disk filled"
            skipped = disk.stats.skipped_puts
        # nothing corrupt on disk: a fresh engine reopens the directory and every file checks out
        cfg2 = {"chunk_size": CHUNK, "staging_size": "16MiB",
                "tiers": [{"backend": "disk", "path": str(cache_dir), "capacity": "64MiB"}]}
        with lmcache.CacheEngine.from_config(cfg2, kv_spec={"num_layers": L, "num_kv_heads": BIG_H,
                                                            "head_size": BIG_D, "dtype": "float32"}) as e2:
            backend = e2.hierarchy.tier("disk").backend
            assert backend.integrity.corrupt == 0
            files = [k for k, _ in backend.keys()]
            for j in early[:20]:
                old = prompt(j)
                res = e2.retrieve(old)
                assert res.num_tokens == PROMPT_TOKENS and torch.equal(res.kv, kv_big(old))
            for k in files:
                obj = backend.get_one(k)
                assert obj is not None, k
                obj.unref()
            assert backend.integrity.corrupt == 0
        leftovers = [p for p in cache_dir.rglob("*") if p.name.startswith(".tmp-")]
        assert not leftovers, leftovers
    print(f"[faults] ENOSPC ({fs_kind} 4 MiB): {i} prompts stored into a 64 MiB disk tier, {calls} engine calls, "
          f"{enospc} ENOSPC put failures absorbed, {skipped} puts skipped, {len(files)} intact files, "
          f"{served} early prompts re-served exactly, 0 temporaries left, slowest call {slowest:.2f}s, "
          f"peak RSS {peak_rss_mib():.0f} MiB")


def test_a_read_only_remount_keeps_serving_and_says_so_once(tmp_path, caplog):
    """The outside review: on a read-only remount the log flipped between "failed" and
    "recovered" on every store, and intact entries came back as misses (each refused put
    put the tier in backoff). Now a refused write skips that store only: reads go on,
    exactly; one warning when writes start being refused, one when they are taken again."""
    caplog.set_level("WARNING", logger="lmcache.hierarchy")
    with small_filesystem(tmp_path, size_mib=16) as (mnt, _):
        cfg = {"chunk_size": CHUNK, "staging_size": "16MiB",
               "tiers": [{"backend": "disk", "path": str(mnt / "cache"), "capacity": "8MiB"}]}
        with lmcache.CacheEngine.from_config(cfg) as e:
            disk = e.hierarchy.tier("disk")
            for i in range(8):
                e.store(prompt(i), kv_big(prompt(i)))
            e.flush()
            r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
            if r.returncode:
                missing(f"cannot remount {mnt} read-only: {r.stderr.strip()}")
            try:
                for i in range(8, 24):  # stores are refused; each earlier prompt is still served
                    e.store(prompt(i), kv_big(prompt(i)))
                    e.flush()
                    old = prompt(i % 8)
                    res = e.retrieve(old)
                    assert res.num_tokens == PROMPT_TOKENS, (i, disk.info())
                    assert torch.equal(res.kv, kv_big(old))
                assert disk.available
                assert e.lookup(prompt(9)) == 0
                assert "Read-only" in (disk.info()["write_refused"] or ""), disk.info()
            finally:
                subprocess.run(["mount", "-o", "remount,rw", str(mnt)], capture_output=True)
            e.store(prompt(30), kv_big(prompt(30)))
            e.flush()
            assert e.lookup(prompt(30)) == PROMPT_TOKENS
            assert disk.info()["write_refused"] is None
        said = [r.getMessage() for r in caplog.records if "tier disk" in r.getMessage()]
        assert len(said) == 2, said
        assert "refuses writes" in said[0] and "Read-only" in said[0], said
        assert "takes writes again" in said[1], said
