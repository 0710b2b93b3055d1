"""A lower tier's outage and its recovery, with a real Redis server killed and restarted.

The guarantees: a chunk whose lower-tier write comes while that tier backs off waits for
it (bounded, its memory reference kept, so it survives the CPU tier evicting it) and is
written once the tier is back; one that cannot wait is counted in ``dropped_writes`` and
said once per outage; and a shared tier back from an outage forgets the entries the
server lost (counted in ``lost``, each one an evict event), so its books match the server.

The engine runs on an injected clock, so the backoff ends when the test says so: the
server is really down (every call to it fails), but no assert depends on timing.
"""

from __future__ import annotations

import logging

import torch
from _missing import loopback_store
from _procs import until

import lmcache
from lmcache.config import load_config

CHUNK = 16
SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 8 * 4


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def kv_for(tokens: list[int]) -> torch.Tensor:
    t = torch.as_tensor(tokens, dtype=torch.float32)
    base = torch.arange(2 * 2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 2, 8)
    return base * 0.01 + t.reshape(1, 1, -1, 1, 1) * 0.37


def prompt(i: int, chunks: int = 2) -> list[int]:
    return [(i * 1009 + j * 7) % 50000 + i for j in range(chunks * CHUNK)]


def _engine(st, clock: Clock, cpu_chunks: int, **kw) -> lmcache.CacheEngine:
    cfg = load_config({
        "chunk_size": CHUNK, "kv_spec": SPEC, "write_policy": "write-back", "staging_size": "1MiB",
        "tiers": [{"backend": "cpu", "capacity": cpu_chunks * CHUNK_BYTES},
                  {"backend": "redis", "capacity": "64MiB", **st.options, "timeout": 0.5}],
        **kw,
    }, environ={})
    return lmcache.CacheEngine(cfg, clock=clock)


def _outage(e: lmcache.CacheEngine, st) -> None:
    """Kill the server and let the tier see it (one failed call: backoff, which lasts
    until the test moves the clock), then restart it: it comes back empty."""
    bottom = e.hierarchy.tier("redis")
    st.kill()
    assert bottom.exists(["lmc1:probe"]) == [False]
    assert not bottom.available
    st.restart()


def test_a_chunk_evicted_while_its_lower_tier_backs_off_waits_for_it_and_the_books_resync():
    """Issue 29 item 5: write-back, the bottom tier in backoff after its server restarted;
    prompt A is stored, prompt B pushes it out of the CPU tier. Before: lookup(A) == 0,
    dropped_writes 0, and the tier kept counting the entries the server lost."""
    clock = Clock()
    events: list[tuple[str, str, str]] = []
    with loopback_store("redis") as st, _engine(st, clock, cpu_chunks=2) as e:
        bottom = e.hierarchy.tier("redis")
        for i in range(3):  # 6 chunks through a 2-chunk CPU tier: 4 written down
            e.store(prompt(100 + i), kv_for(prompt(100 + i)))
        e.hierarchy.flush()
        before = {k for k, _ in bottom.keys()}
        assert len(before) == 4 and sorted(k for k, _ in bottom.backend.keys()) == sorted(before)
        e.hierarchy.add_listener(lambda op, tier, key: events.append((op, tier, key)))

        _outage(e, st)
        a, b = prompt(1), prompt(2)
        res = e.store(a, kv_for(a))
        assert (res.stored_tokens, res.dropped_tokens) == (2 * CHUNK, 0)
        e.store(b, kv_for(b))  # A leaves the CPU tier while the redis tier backs off
        e.hierarchy.flush()
        assert e.lookup(a) == 2 * CHUNK, "a chunk evicted during the backoff was lost"
        st_h = e.stats()["hierarchy"]  # A's 2 chunks and those of prompt 102 that A pushed out
        assert (st_h["dropped_writes"], st_h["deferred_writes"], st_h["pending_writes"]) == (0, 4, 4)
        got = e.retrieve(a)  # from the waiting writes' memory (promoted into the CPU tier)
        assert got.num_tokens == 2 * CHUNK and torch.equal(got.kv, kv_for(a))

        clock.t += 60  # the backoff ends: the writer writes what waited, then resyncs the books
        keys_a = e.chunk_keys(a)[1]
        until(lambda: bottom.backend.exists(keys_a) == [True, True], "the parked writes reach redis")
        until(lambda: bottom.stats.lost == 4, "the redis tier forgets the 4 entries the restart lost")
        assert e.hierarchy.pending_writes() == 0 and not e.hierarchy._inflight
        held = sorted(k for k, _ in bottom.backend.keys())
        assert sorted(k for k, _ in bottom.keys()) == held and set(keys_a) <= set(held)
        assert bottom.used == sum(size for _, size in bottom.backend.keys())
        assert {k for op, t, k in events if op == "evict" and t == "redis"} == before
        e.hierarchy.tier("cpu").delete(keys_a)
        got = e.retrieve(a)
        assert got.tiers == ["redis", "redis"] and torch.equal(got.kv, kv_for(a))
        assert e.stats()["hierarchy"]["dropped_writes"] == 0


def test_writes_that_cannot_wait_are_dropped_counted_and_said_once(caplog):
    """At most write_queue_size writes wait for a tier in backoff; the oldest beyond that
    are dropped, counted in dropped_writes, with one warning for the whole outage."""
    clock = Clock()
    with loopback_store("redis") as st, _engine(st, clock, cpu_chunks=2, write_queue_size=4) as e:
        _outage(e, st)
        with caplog.at_level(logging.WARNING, logger="lmcache.hierarchy"):
            for i in range(6):  # 12 chunks: 10 leave the CPU tier while redis backs off
                e.store(prompt(200 + i), kv_for(prompt(200 + i)))
            e.hierarchy.flush()
        h = e.stats()["hierarchy"]
        assert h["pending_writes"] == 4 and h["dropped_writes"] == 6, h
        said = [r for r in caplog.records if "dropping chunks queued" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]
        newest = prompt(204)  # its chunks are among the 4 that wait: still served
        assert e.lookup(newest) == 2 * CHUNK
        clock.t += 60
        until(lambda: e.hierarchy.pending_writes() == 0, "the 4 waiting writes done")
        got = e.retrieve(newest)
        assert got.tiers == ["redis", "redis"] and torch.equal(got.kv, kv_for(newest))


def test_a_shared_tier_back_from_an_outage_forgets_what_the_server_lost():
    """Issue 29 item 5, the books: the server restarted empty; once the tier serves again
    its ledger drops the entries it still counted (before: 4 entries and their bytes
    counted for ever, the server holding none), each one an evict event for the
    controller and KV events."""
    clock = Clock()
    events: list[tuple[str, str, str]] = []
    with loopback_store("redis") as st, _engine(st, clock, cpu_chunks=8, write_policy="write-through") as e:
        bottom = e.hierarchy.tier("redis")
        for i in range(2):
            e.store(prompt(300 + i), kv_for(prompt(300 + i)))
        e.hierarchy.flush()
        counted = {k for k, _ in bottom.keys()}
        assert len(counted) == 4 and bottom.used > 0
        e.hierarchy.add_listener(lambda op, tier, key: events.append((op, tier, key)))
        _outage(e, st)
        clock.t += 60
        assert bottom.exists(["lmc1:probe"]) == [False]  # serves again
        until(lambda: len(bottom) == 0, "the redis tier forgets the 4 entries the restart lost", timeout=10)
        assert bottom.used == 0 and list(bottom.backend.keys()) == []
        assert {k for op, t, k in events if op == "evict" and t == "redis"} == counted
        assert e.stats()["tiers"]["redis"]["lost"] == 4
