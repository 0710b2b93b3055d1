from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.config import load_config
from lmcache.hierarchy import StorageHierarchy
from lmcache.hookspecs import hookimpl
from lmcache.memory import MemoryPool
from lmcache.plugin_manager import Registries, create_plugin_manager
from lmcache.testing import make_key

from lmcache.backends.disk import DiskBackend

CHUNK = (2, 2, 16, 2, 8)  # 2 KiB of float16
CHUNK_BYTES = 2 * 2 * 16 * 2 * 8 * 2


class FlakyDisk(DiskBackend):
    """A disk store whose device can be 'unplugged': every read, write and listing then
    raises OSError (the object view a tier opens reads and writes through ``_load`` and
    ``_commit``)."""

    OPTIONS = {**DiskBackend.OPTIONS}
    unplugged = False

    def _check(self):
        if FlakyDisk.unplugged:
            raise OSError(5, "Input/output error (device unplugged)")

    def exists(self, keys):
        self._check()
        return super().exists(keys)

    def _load(self, path, key):
        self._check()
        return super()._load(path, key)

    def _commit(self, key, total, codec, fill):
        self._check()
        return super()._commit(key, total, codec, fill)

    def keys(self):
        self._check()
        return super().keys()


class SharedDisk(DiskBackend):
    """A disk directory treated as a store other processes share (like NFS or Redis)."""

    OPTIONS = {**DiskBackend.OPTIONS}
    shared = True


class _TestPlugin:
    @hookimpl
    def lmcache_register_backends(self, registry):
        registry.add("flaky-disk", FlakyDisk)
        registry.add("shared-disk", SharedDisk)


@pytest.fixture(scope="module")
def regs():
    pm = create_plugin_manager(autoload=False)
    pm.register(_TestPlugin(), name="tests")
    return Registries(pm)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _obj(pool, seed):
    o = pool.allocate(CHUNK, torch.float16)
    assert o is not None
    o.tensor.copy_(torch.randn(CHUNK, generator=torch.Generator().manual_seed(seed)).half())
    return o


def _h(tmp_path, regs, cpu_chunks=4, disk_chunks=100, policy="write-through", disk_backend="disk", clock=None, **kw):
    cfg = load_config(
        {
            "write_policy": policy,
            "tiers": [
                {"backend": "cpu", "capacity": cpu_chunks * CHUNK_BYTES},
                {"backend": disk_backend, "path": str(tmp_path / "d"), "capacity": disk_chunks * (CHUNK_BYTES + 400)},
            ],
            **kw,
        },
        environ={},
    )
    pool = MemoryPool(cfg.pool_size)
    return StorageHierarchy(cfg, pool, regs, clock=clock or Clock()), pool


def _put(h, pool, i):
    o = _obj(pool, i)
    h.put_one(make_key(i), o)
    o.unref()


def test_write_through_reaches_every_tier(tmp_path, regs):
    h, pool = _h(tmp_path, regs)
    for i in range(3):
        _put(h, pool, i)
    h.flush()
    cpu, disk = h.tiers
    assert len(cpu) == 3 and len(disk) == 3
    h.close()
    assert pool.used == 0


def test_write_back_demotes_only_what_the_top_evicts(tmp_path, regs):
    h, pool = _h(tmp_path, regs, cpu_chunks=3, policy="write-back")
    cpu, disk = h.tiers
    for i in range(3):
        _put(h, pool, i)
    h.flush()
    assert len(cpu) == 3 and len(disk) == 0  # nothing written below yet
    for i in range(3, 5):
        _put(h, pool, i)
    h.flush()
    assert len(cpu) == 3 and disk.backend.exists([make_key(0), make_key(1)]) == [True, True]
    assert len(disk) == 2 and cpu.stats.evictions == 2
    # the demoted bytes are exact
    obj, tier = h.find_one(make_key(0))
    assert tier is disk
    assert torch.equal(obj.tensor, torch.randn(CHUNK, generator=torch.Generator().manual_seed(0)).half())
    obj.unref()
    h.close()


def test_hit_in_lower_tier_is_promoted(tmp_path, regs):
    h, pool = _h(tmp_path, regs, cpu_chunks=2)
    for i in range(4):
        _put(h, pool, i)
    h.flush()
    cpu, disk = h.tiers
    assert cpu.backend.exists([make_key(0)]) == [False]
    obj, tier = h.find_one(make_key(0))
    assert tier is disk and obj.pooled
    obj.unref()
    assert cpu.backend.exists([make_key(0)]) == [True]
    obj, tier = h.find_one(make_key(0))
    assert tier is cpu
    obj.unref()
    assert h.stats.promotions == 1
    h.close()


def test_pinned_and_held_entries_are_never_evicted(tmp_path, regs):
    h, pool = _h(tmp_path, regs, cpu_chunks=2)
    cpu = h.tiers[0]
    _put(h, pool, 0)
    _put(h, pool, 1)
    cpu.pin(make_key(0))
    held, _ = h.find_one(make_key(1))  # a reader holds chunk 1
    _put(h, pool, 2)  # no room, nothing evictable: skipped in cpu
    assert cpu.backend.exists([make_key(0), make_key(1), make_key(2)]) == [True, True, False]
    assert cpu.stats.skipped_puts == 1
    held.unref()
    _put(h, pool, 3)  # now chunk 1 may go
    assert cpu.backend.exists([make_key(0), make_key(1), make_key(3)]) == [True, False, True]
    cpu.unpin(make_key(0))
    _put(h, pool, 4)
    assert cpu.backend.exists([make_key(0)]) == [False]
    h.close()


def test_leases_expire(tmp_path, regs):
    clock = Clock()
    h, pool = _h(tmp_path, regs, cpu_chunks=1, clock=clock)
    cpu = h.tiers[0]
    _put(h, pool, 0)
    cpu.lease(make_key(0), 5.0)
    _put(h, pool, 1)
    assert cpu.backend.exists([make_key(0), make_key(1)]) == [True, False]
    clock.t += 6
    _put(h, pool, 2)
    assert cpu.backend.exists([make_key(0), make_key(2)]) == [False, True]
    h.close()


def test_failing_tier_degrades_to_misses_and_recovers(tmp_path, regs):
    clock = Clock()
    h, pool = _h(tmp_path, regs, cpu_chunks=1, disk_backend="flaky-disk", clock=clock)
    cpu, disk = h.tiers
    try:
        _put(h, pool, 0)
        _put(h, pool, 1)  # evicts 0 from cpu; 0 stays on disk
        h.flush()
        FlakyDisk.unplugged = True
        assert h.exists_prefix([make_key(1), make_key(0)]) == ["cpu"]  # disk: a miss
        assert h.find_one(make_key(0)) is None
        _put(h, pool, 2)  # the disk write fails quietly
        h.flush()
        assert disk.stats.errors >= 1 and not disk.available
        FlakyDisk.unplugged = False
        assert h.find_one(make_key(0)) is None  # still backing off
        clock.t += 60
        obj, tier = h.find_one(make_key(0))
        assert tier is disk
        obj.unref()
    finally:
        FlakyDisk.unplugged = False
        h.close()


def test_object_too_large_for_a_tier_is_skipped(tmp_path, regs):
    h, pool = _h(tmp_path, regs, cpu_chunks=1)
    big = pool.allocate((4, *CHUNK[1:]), torch.float16)  # 2x the cpu tier
    assert h.put_one(make_key(9), big) == 0
    big.unref()
    h.flush()
    assert h.tiers[1].backend.exists([make_key(9)]) == [True]
    h.close()


def test_disk_tier_index_rebuilt_and_capacity_enforced_on_reopen(tmp_path, regs):
    h, pool = _h(tmp_path, regs, disk_chunks=10)
    for i in range(8):
        _put(h, pool, i)
    h.close()
    h2, _ = _h(tmp_path, regs, disk_chunks=5)  # a smaller disk tier now
    disk = h2.tiers[1]
    assert len(disk) <= 5 and disk.used <= disk.capacity
    assert sum(s for _, s in disk.backend.keys()) == disk.used
    h2.close()


ops = st.lists(
    st.tuples(st.sampled_from(["put", "get", "pin", "unpin"]), st.integers(0, 30), st.integers(1, 40)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, policy=st.sampled_from(["write-through", "write-back"]), evict=st.sampled_from(["lru", "lfu", "fifo"]))
def test_capacity_never_exceeded_and_data_exact(tmp_path_factory, regs, ops, policy, evict):
    """Random workloads: no tier ever holds more bytes than its capacity, accounting
    matches the backends, the pool stays bounded and every hit is bit-exact."""
    tmp = tmp_path_factory.mktemp("h")
    cfg = load_config(
        {
            "write_policy": policy,
            "write_queue_size": 4,
            "staging_size": 64 << 10,
            "tiers": [
                {"backend": "cpu", "capacity": 12 * 1024, "policy": evict},
                {"backend": "disk", "path": str(tmp), "capacity": 40 * 1024, "policy": evict},
            ],
        },
        environ={},
    )
    pool = MemoryPool(cfg.pool_size)
    h = StorageHierarchy(cfg, pool, regs)
    truth: dict[str, torch.Tensor] = {}
    pinned: list[str] = []
    try:
        for op, i, ntok in ops:
            key = make_key(i)
            if op == "put":
                t = torch.randn((2, 2, ntok, 2, 8), generator=torch.Generator().manual_seed(i * 100 + ntok)).half()
                o = h.allocate(t.shape, t.dtype)
                if o is None:
                    continue
                o.tensor.copy_(t)
                if not any(h.exists([key])):
                    h.put_one(key, o)
                    truth.setdefault(key, t)
                o.unref()
            elif op == "get":
                r = h.find_one(key)
                if r is not None:
                    obj, _ = r
                    assert torch.equal(obj.tensor, truth[key])
                    obj.unref()
            elif op == "pin":
                h.tiers[0].pin(key)
                pinned.append(key)
            elif op == "unpin" and pinned:
                h.tiers[0].unpin(pinned.pop())
            for tier in h.tiers:
                assert tier.used <= tier.capacity, tier
            assert pool.used <= pool.capacity
        h.flush()
        for tier in h.tiers:
            assert tier.used <= tier.capacity
            assert tier.used == sum(s for _, s in tier.backend.keys())
        disk_bytes = sum(f.stat().st_size for f in tmp.rglob("*.lmc"))
        assert disk_bytes == h.tiers[1].used <= h.tiers[1].capacity
    finally:
        h.close()
    assert pool.used == 0, "memory leaked after close"


def test_tier_opens_while_its_store_is_unreachable(tmp_path, regs, caplog):
    """An engine starts while a lower tier is down: the tier serves misses, then recovers
    (and the outage is logged once, not once per call)."""
    clock = Clock()
    h, pool = _h(tmp_path, regs, cpu_chunks=1, disk_backend="flaky-disk", clock=clock)
    _put(h, pool, 0)
    h.flush()
    h.close()
    FlakyDisk.unplugged = True
    try:
        with caplog.at_level("WARNING", logger="lmcache.hierarchy"):
            h, pool = _h(tmp_path, regs, cpu_chunks=1, disk_backend="flaky-disk", clock=clock)
            disk = h.tiers[1]
            assert disk.stats.errors == 1 and "listing entries" in disk.stats.last_error
            for _ in range(20):  # many calls during one outage
                clock.t += 1
                assert h.find_one(make_key(0)) is None
            failures = [r for r in caplog.records if "serving misses" in r.getMessage()]
            assert len(failures) == 1, [r.getMessage() for r in caplog.records]
            FlakyDisk.unplugged = False
            clock.t += 60
            obj, tier = h.find_one(make_key(0))
            assert tier is disk
            obj.unref()
            assert len([r for r in caplog.records if "recovered" in r.getMessage()]) == 1
    finally:
        FlakyDisk.unplugged = False
        h.close()


def test_shared_tier_is_not_listed_at_open_but_serves_peers_entries(tmp_path, regs):
    h, pool = _h(tmp_path, regs, cpu_chunks=1, disk_backend="shared-disk")
    for i in range(3):
        _put(h, pool, i)
    h.flush()
    h.close()
    h, pool = _h(tmp_path, regs, cpu_chunks=1, disk_backend="shared-disk")
    try:
        disk = h.tiers[1]
        assert disk.usage().entries == 0  # not enumerated: a peer's entries are not ours to account
        assert h.exists_prefix([make_key(0), make_key(1)]) == ["shared-disk", "shared-disk"]
        obj, tier = h.find_one(make_key(2))
        assert tier is disk
        obj.unref()
        # an operator's listing adopts the store's entries, so they can be evicted
        assert sorted(e.key for e, _ in disk.entries()) == sorted(make_key(i) for i in range(3))
        assert disk.usage().entries == 3 and disk.used > 0
        assert disk.evict_keys([make_key(0)])[0][0][0] == make_key(0)
        disk.backend.delete_one(make_key(1))  # a peer removes one
        disk.refresh()
        assert disk.usage().entries == 1
    finally:
        h.close()


def test_get_asks_each_tier_once_for_the_keys_above_missed(tmp_path, regs):
    h, pool = _h(tmp_path, regs, cpu_chunks=2, disk_chunks=100)
    try:
        for i in range(6):
            _put(h, pool, i)
        h.flush()
        disk = h.tiers[1]
        calls = []
        real_get = disk.backend.get
        disk.backend.get = lambda keys: calls.append(list(keys)) or real_get(keys)
        keys = [make_key(i) for i in range(7)]  # 4 and 5 are in the cpu tier, 6 nowhere
        got = h.find(keys)
        assert calls == [[make_key(i) for i in (0, 1, 2, 3, 6)]]
        assert [r is not None for r in got] == [True] * 6 + [False]
        for r, i in zip(got[:6], range(6)):
            obj, _ = r
            want = torch.randn(CHUNK, generator=torch.Generator().manual_seed(i)).half()
            assert torch.equal(obj.tensor, want), i
            obj.unref()
    finally:
        h.close()


def _wait_until(cond, deadline=30.0):
    import time

    end = time.monotonic() + deadline
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_lower_tier_writes_wait_for_the_store_in_progress(tmp_path, regs, monkeypatch):
    import time

    import lmcache.write_behind as write_behind

    monkeypatch.setattr(write_behind, "WRITER_YIELD_MAX", 60.0)
    h, pool = _h(tmp_path, regs, cpu_chunks=8)
    try:
        cpu, disk = h.tiers
        with h.storing():
            for i in range(3):
                _put(h, pool, i)
            time.sleep(0.2)
            assert len(cpu) == 3 and len(disk) == 0  # queued behind the store's copies
            assert h.exists_prefix([make_key(i) for i in range(3)]) == [cpu.name] * 3
        h.flush()
        assert len(disk) == 3
    finally:
        h.close()


def test_writer_stops_yielding_when_half_its_queue_waits(tmp_path, regs, monkeypatch):
    import lmcache.write_behind as write_behind

    monkeypatch.setattr(write_behind, "WRITER_YIELD_MAX", 60.0)
    h, pool = _h(tmp_path, regs, cpu_chunks=8, write_queue_size=2)
    try:
        with h.storing():  # a long store: its writes go on beside it, none is dropped
            for i in range(2):
                _put(h, pool, i)
            _wait_until(lambda: len(h.tiers[1]) >= 1)
        h.flush()
        assert len(h.tiers[1]) == 2 and h.stats.dropped_writes == 0
    finally:
        h.close()


def test_writer_stops_yielding_when_the_pool_runs_short(tmp_path, regs, monkeypatch):
    import lmcache.write_behind as write_behind

    monkeypatch.setattr(write_behind, "WRITER_YIELD_MAX", 60.0)
    h, pool = _h(tmp_path, regs, cpu_chunks=4)
    held = []
    try:
        with h.storing():
            for i in range(2):
                _put(h, pool, i)
            while (o := pool.allocate(CHUNK, torch.float16)) is not None:
                held.append(o)
            got = h.allocate(CHUNK, torch.float16)  # short: what the queued writes hold is needed
            if got is not None:
                got.unref()
            _wait_until(lambda: len(h.tiers[1]) == 2)
    finally:
        for o in held:
            o.unref()
        h.close()


def test_a_ledger_admits_and_forgets_each_key_once():
    from lmcache.ledger import Ledger
    from lmcache.plugins.policies import LRUPolicy

    heard = []
    led = Ledger("t", 100, LRUPolicy())
    led.listeners = (lambda *event: heard.append(event),)
    led.admit("a", 10)
    led.admit("a", 30)  # a new size for a held key: no second admit
    led.admit("b", 5)
    assert led.used == 35 and led.over(66) and not led.over(65)
    assert led.forget("a") == 30 and led.forget("a") is None
    assert heard == [("admit", "t", "a"), ("admit", "t", "b"), ("evict", "t", "a")]
    assert led.used == 5 and len(led.policy) == len(led) == 1


def test_the_ledger_alone_keeps_each_tiers_books(tmp_path, regs):
    """Through puts, capacity evictions (and their demotions), removes, an operator's
    evictions, reads that find an entry gone, and a shared store's adoption: a tier's
    bytes used are the sum of its ledger's sizes, its policy knows exactly those keys, and
    the listeners heard each admit and each evict once."""
    h, pool = _h(tmp_path, regs, cpu_chunks=2, disk_chunks=4, disk_backend="shared-disk")
    held = {t.name: set() for t in h.tiers}
    twice = []

    def listen(op, tier, key):
        if (op == "admit") == (key in held[tier]):
            twice.append((op, tier, key))
        (held[tier].add if op == "admit" else held[tier].discard)(key)

    h.set_listener(listen)

    def check():
        h.flush()
        for t in h.tiers:
            sizes = dict(t.ledger.sizes)
            assert t.used == sum(sizes.values()) and t.ledger.reserved == 0, t.name
            assert set(t.ledger.eviction_order()) == set(sizes) and len(t.ledger.policy) == len(sizes)
            assert set(sizes) == held[t.name], t.name
        assert not twice, twice

    cpu, disk = h.tiers
    try:
        for i in range(8):  # both tiers evict by capacity
            _put(h, pool, i)
            check()
        assert cpu.stats.evictions and disk.stats.evictions
        cpu.delete([make_key(7)])
        disk.delete([make_key(7), make_key(99)])
        check()
        assert disk.evict_keys([make_key(6)])[0]
        check()
        o = _obj(pool, 20)
        disk.backend.put_one(make_key(20), o)  # a peer writes one and removes two
        o.unref()
        disk.backend.delete_one(make_key(5))
        disk.backend.delete_one(make_key(4))
        assert h.find_one(make_key(4)) is None  # a read finds it gone: forgotten
        check()
        disk.refresh()  # adopts the peer's entry, drops the one it removed
        check()
        assert make_key(20) in disk.ledger and make_key(5) not in disk.ledger
    finally:
        h.close()


def test_leases_of_a_hot_key_stay_bounded_and_a_release_still_works(tmp_path, regs):
    """Issue 29 item 7: 200k pinned lookups of one key, never released (a vLLM worker
    whose answer came after lookup_timeout leaves its pins to expire), 1000 a second
    against a 30 s lease. Before, every lease's end stayed stored (400k floats: +13 MB
    here) and each release scanned them all."""
    import tracemalloc

    clock = Clock()
    h, pool = _h(tmp_path, regs, clock=clock)
    k = make_key(0)
    _put(h, pool, 0)
    h.flush()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for i in range(200_000):
            assert h.lease_prefix([k], ["cpu"], 30.0) == 1
            if i % 1000 == 999:
                clock.t += 1.0
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert grown < 256 * 1024, f"the leases of one key took {grown} bytes"
    for t in h.tiers:
        assert t._leases.records() <= t._leases.GRAIN + 1
        assert 29_000 <= t._leases.count(k) <= 31_000  # the last 30 s of leases are live
        assert t.is_pinned(k)
    clock.t += 31  # every lease ended: a lookup and its release leave nothing behind
    assert h.lease_prefix([k], ["cpu"], 30.0) == 1
    assert all(t.is_pinned(k) for t in h.tiers)
    h.release_leases([k])
    assert not any(t.is_pinned(k) or len(t._leases) for t in h.tiers)
    h.close()


def test_a_release_drops_the_live_lease_that_ends_first(tmp_path, regs):
    clock = Clock()
    h, pool = _h(tmp_path, regs, clock=clock)
    cpu = h.tiers[0]
    k = make_key(0)
    cpu.lease(k, 10.0)
    clock.t += 5
    cpu.lease(k, 10.0)
    assert cpu._leases.count(k) == 2
    cpu.release_lease(k)  # the one ending at +10 goes; the other holds until +15
    clock.t += 6
    assert cpu.is_pinned(k)
    cpu.release_lease(k)
    assert not cpu.is_pinned(k) and not len(cpu._leases)
    cpu.release_lease(k)  # one release too many: nothing to drop, no error
    h.close()
