"""Concurrency (reliability item 5).

N threads on one CacheEngine (cpu tier over a disk tier, both write policies) and two
processes on one shared fs tier store, retrieve (whole and layer-wise), look up with
leases, pin, evict and operator-evict overlapping prompts for a bounded time. Checked:
every retrieved token's KV is the KV stored for it (content derived from token and
position, so a mixed-up chunk is caught), no thread hangs (a watchdog join, not a
timing assertion), pins, leases and reader references return to zero, and the memory
pool is entirely free once the engine is closed.

Run as ``python tests/reliability/test_concurrency.py child CONFIG SECONDS SEED`` it is
the second process of the shared-tier test.
"""

from __future__ import annotations

import faulthandler
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import lmcache

SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}
CHUNK = 16
THREADS = 6
RUN_SECONDS = 6.0
HANG = 60.0
_IDX = torch.arange(2 * 2 * 2 * 8, dtype=torch.int64).view(2, 2, 1, 2, 8)


def kv_for(tokens: list[int]) -> torch.Tensor:
    """KV derived from (token, position) only: the same chunk key always has the same
    content, and any chunk served at the wrong place or for the wrong prompt differs."""
    t = torch.tensor(tokens, dtype=torch.int64).view(1, 1, -1, 1, 1)
    p = torch.arange(len(tokens), dtype=torch.int64).view(1, 1, -1, 1, 1)
    return ((t * 1_000_003 + p * 7919 + _IDX * 104_729) % 16_777_213).to(torch.float32)


def prompts(seed: int = 7, n: int = 10) -> list[list[int]]:
    """Overlapping prompts: shared prefixes of several lengths, own suffixes."""
    rng = random.Random(seed)
    base = [rng.randrange(50_000) for _ in range(8 * CHUNK)]
    out = []
    for j in range(n):
        cut = rng.choice([0, CHUNK, 2 * CHUNK, 4 * CHUNK, 6 * CHUNK])
        out.append(base[:cut] + [rng.randrange(50_000) for _ in range(rng.choice([2, 3, 5]) * CHUNK + rng.randrange(CHUNK))])
    return out


class Counts:
    def __init__(self):
        self.lock = threading.Lock()
        self.c: dict[str, int] = {}

    def add(self, k: str, n: int = 1) -> None:
        with self.lock:
            self.c[k] = self.c.get(k, 0) + n


def check(r_kv, n: int, tokens: list[int], what: str) -> None:
    if n:
        want = kv_for(tokens)[:, :, :n]
        assert torch.equal(r_kv[:, :, :n], want), f"{what}: retrieved KV differs from what was stored (mixed-up chunk)"


def worker(engine, plist, seed: int, deadline: float, counts: Counts, errors: list) -> None:
    rng = random.Random(seed)
    h = engine.hierarchy
    try:
        while time.monotonic() < deadline:
            tokens = rng.choice(plist)
            op = rng.randrange(9)
            if op <= 2:
                engine.store(tokens, kv_for(tokens))
                counts.add("store")
            elif op == 3:
                r = engine.retrieve(tokens)
                check(r.kv, r.num_tokens, tokens, "retrieve")
                counts.add("retrieve")
                counts.add("tokens_checked", r.num_tokens)
            elif op == 4:
                n = engine.lookup(tokens, pin=True)
                if rng.random() < 0.5:
                    r = engine.retrieve(tokens)
                    check(r.kv, r.num_tokens, tokens, "lookup+retrieve")
                    counts.add("tokens_checked", r.num_tokens)
                    counts.add("pinned_retrieves")
                    if r.num_tokens < n and any(t.backend.shared for t in h.tiers):
                        counts.add("pinned_short")  # another process may evict a shared store's entries
                    else:
                        # a pinned lookup's promise holds in this process's own tiers: before, a
                        # queued write landing between the tier read and the queue check cost ~1%
                        assert r.num_tokens >= n, f"lookup(pin=True) promised {n} tokens, retrieve served {r.num_tokens}"
                engine.release(tokens[:n])
                counts.add("lookup_pin")
            elif op == 5:
                out = torch.zeros(2, 2, len(tokens), 2, 8)
                lw = engine.retrieve_layerwise(tokens, out, timeout=HANG)
                lw.wait_all()
                # the copy thread drops its chunk references and leases just after the
                # last layer lands: wait for it (a hang guard) before counting references
                t = getattr(lw, "_thread", None)
                if t is not None:
                    t.join(HANG)
                    assert not t.is_alive(), "layer-wise copy thread hung"
                check(out, lw.num_tokens, tokens, "layerwise")
                counts.add("layerwise")
                counts.add("tokens_checked", lw.num_tokens)
            elif op == 6:
                keys = engine.chunk_keys(tokens)[1]
                with h.pinned(keys):  # an operator pin around a retrieve
                    r = engine.retrieve(tokens)
                    check(r.kv, r.num_tokens, tokens, "pinned retrieve")
                counts.add("pin")
            elif op == 7:
                h.tiers[rng.randrange(len(h.tiers))].evict_bytes(rng.randrange(1, 4) * 2048)
                counts.add("evict")
            else:
                keys = engine.chunk_keys(tokens)[1]
                h.tiers[rng.randrange(len(h.tiers))].evict_keys(rng.sample(keys, 1))
                counts.add("operator_evict")
    except BaseException as exc:  # reported by the test thread
        errors.append(exc)


def run_threads(engine, plist, n_threads: int, seconds: float, seed: int) -> Counts:
    counts, errors = Counts(), []
    deadline = time.monotonic() + seconds
    threads = [
        threading.Thread(target=worker, args=(engine, plist, seed * 100 + i, deadline, counts, errors), daemon=True)
        for i in range(n_threads)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + HANG)  # watchdog: a hang guard, not a timing assertion
    alive = [t for t in threads if t.is_alive()]
    if alive:
        faulthandler.dump_traceback(all_threads=True)
    assert not alive, f"{len(alive)} worker threads deadlocked (stacks dumped above)"
    if errors:
        raise errors[0]
    return counts


def assert_quiescent(engine) -> dict:
    """Pins, leases and reader references back to zero; the pool holds exactly the
    cpu tier's entries."""
    engine.flush()
    h = engine.hierarchy
    assert not h._inflight, "queued writes left behind after a flush"
    cpu_entries = 0
    for t in h.tiers:
        assert not t._pins, f"tier {t.name}: pins left: {t._pins}"
        assert not t._leases, f"tier {t.name}: leases left: {t._leases}"
        assert t.ledger.reserved == 0, f"tier {t.name}: reserved bytes left: {t.ledger.reserved}"
        assert t.used <= t.capacity and t.used == sum(t.ledger.sizes.values())
        for k, _ in t.keys():
            assert not t.backend.in_use(k), f"tier {t.name}: {k} still held by a reader"
        if t.backend.holds_memory_objects:
            for obj in t.backend._objs.values():
                assert obj.refcount == 1 and obj.writer_refs == 0, obj
            cpu_entries += len(t.backend._objs)
    assert engine.pool.live == cpu_entries, f"pool has {engine.pool.live} live objects, cpu tiers hold {cpu_entries}"
    return {"pool_live": engine.pool.live, "cpu_entries": cpu_entries}


def _engine(tmp_path: Path, policy: str):
    tiers = [
        {"backend": "cpu", "capacity": 24 * 2048},
        {"backend": "disk", "path": str(tmp_path / "disk"), "capacity": 60 * 2800},
    ]
    return lmcache.CacheEngine.from_config(
        {"chunk_size": CHUNK, "tiers": tiers, "write_policy": policy, "staging_size": 8 * 2048, "kv_spec": SPEC}
    )


def _threads_case(tmp_path, policy):
    plist = prompts()
    engine = _engine(tmp_path, policy)
    pool = engine.pool
    try:
        counts = run_threads(engine, plist, THREADS, RUN_SECONDS, seed=1 if policy == "write-through" else 2)
        q = assert_quiescent(engine)
        # everything still cached is served exactly once the dust settles
        for tokens in plist:
            r = engine.retrieve(tokens)
            check(r.kv, r.num_tokens, tokens, "final retrieve")
        q2 = assert_quiescent(engine)
    finally:
        engine.close()
    assert pool.used == 0 and pool.live == 0, f"memory pool not fully free after close: {pool}"
    c = counts.c
    ops = sum(v for k, v in c.items() if k != "tokens_checked")
    print(f"[concurrency] {policy}: threads={THREADS} ops={ops} {c} end={q} after_final={q2} pool_free_after_close=True")
    assert c.get("store") and c.get("tokens_checked"), c


def test_threads_write_through(tmp_path):
    _threads_case(tmp_path, "write-through")


def test_threads_write_back(tmp_path):
    _threads_case(tmp_path, "write-back")


# ------------------------------------------------------------------ two processes
def _shared_config(tmp_path: Path) -> dict:
    return {
        "chunk_size": CHUNK,
        "kv_spec": SPEC,
        "staging_size": 8 * 2048,
        "tiers": [
            {"backend": "cpu", "capacity": 8 * 2048},
            {"backend": "fs", "url": (tmp_path / "shared").as_uri(), "capacity": 40 * 2800},
        ],
    }


def child(config_path: str, seconds: float, seed: int) -> None:
    cfg = json.loads(Path(config_path).read_text())
    engine = lmcache.CacheEngine.from_config(cfg)
    pool = engine.pool
    try:
        counts = run_threads(engine, prompts(), 3, seconds, seed)
        q = assert_quiescent(engine)
    finally:
        engine.close()
    assert pool.used == 0 and pool.live == 0
    print("RESULT " + json.dumps({"counts": counts.c, "end": q}), flush=True)


def test_two_processes_on_a_shared_tier(tmp_path):
    cfg = _shared_config(tmp_path)
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    proc = subprocess.Popen(
        [sys.executable, __file__, "child", str(cfg_path), str(RUN_SECONDS), "11"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        engine = lmcache.CacheEngine.from_config(cfg)
        pool = engine.pool
        try:
            mine = run_threads(engine, prompts(), 3, RUN_SECONDS, seed=12)
            assert_quiescent(engine)
        finally:
            engine.close()
        assert pool.used == 0
        out, err = proc.communicate(timeout=RUN_SECONDS + HANG)  # hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"child process failed:\n{err[-4000:]}"
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert line, out
    theirs = json.loads(line[-1][7:])
    # a third reader after both: every chunk the shared store still has is exact
    engine = lmcache.CacheEngine.from_config(cfg)
    try:
        checked = 0
        for tokens in prompts():
            r = engine.retrieve(tokens)
            check(r.kv, r.num_tokens, tokens, "reader after both processes")
            checked += r.num_tokens
    finally:
        engine.close()
    print(
        f"[concurrency] 2 processes on a shared fs tier: parent={mine.c} child={theirs['counts']} "
        f"tokens_checked_after={checked}"
    )
    assert mine.c.get("tokens_checked") and theirs["counts"].get("tokens_checked")


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "child":
    child(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))


def test_a_disk_tier_stays_within_its_capacity_under_concurrent_store_and_retrieve(tmp_path):
    """The outside review: a 128 KiB disk tier, one thread storing a prompt while another
    retrieves it: after 400 rounds 346 files and 1.5 MB were on disk while the tier reported
    30 entries / 130 KB. A read that came back empty forgot the key even when the put beside
    it had just stored it, leaving a file the tier never evicted. Now the files on disk are
    exactly the tier's entries, within its capacity, every round."""
    cap = 128 << 10
    cfg = {"chunk_size": 16, "kv_spec": {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"},
           "tiers": [{"backend": "disk", "path": str(tmp_path / "kv"), "capacity": cap}]}
    rounds = 400
    errors: list[BaseException] = []
    with lmcache.CacheEngine.from_config(cfg) as e:
        for r in range(rounds):
            toks = [(r * 1000 + i) % 50_000 for i in range(64)]  # a new prompt of 4 chunks each round
            kv = kv_for(toks)

            def reader() -> None:
                try:
                    for _ in range(3):
                        got = e.retrieve(toks)
                        if got.num_tokens:
                            assert torch.equal(got.kv, kv[:, :, : got.num_tokens])
                except BaseException as exc:  # reported below
                    errors.append(exc)

            t = threading.Thread(target=reader)
            t.start()
            e.store(toks, kv)
            t.join(HANG)
            assert not t.is_alive(), "a retrieve hung"
        e.flush()
        tier = e.hierarchy.tiers[0]
        files = [f for f in (tmp_path / "kv").rglob("*.lmc")]
        on_disk = sum(f.stat().st_size for f in files)
        usage = tier.usage()
        assert not errors, errors[:3]
        assert len(files) == usage.entries, (len(files), usage)
        assert on_disk <= cap and usage.used_bytes <= cap, (on_disk, usage)
