"""Model-based test of the storage hierarchy (reliability item 1).

A hypothesis state machine drives a real :class:`StorageHierarchy` (a cpu tier over one
or two real disk tiers, write-through and write-back) with puts, lookups+retrieves,
pins, unpins, evictions, operator evictions, flushes and restarts of a disk tier, and
checks after every step:

(a) everything a tier accounts for is served bit-exact (content derived from the key),
    and what a prefix lookup reports is exactly what a pinned retrieve returns;
(b) per tier: used bytes <= capacity, used == sum of its entries == the backend's own
    count, and its index == the set of keys a reference model rebuilt from the tier's
    admit/evict events says it holds;
(c) a pinned entry is never evicted from a tier that holds it;
(d) after a flush: write-through puts every stored key into the last tier, write-back
    loses no stored key (what an upper tier evicts lands below), unless the last tier
    itself evicted it (an event the model sees);
(e) after a disk tier is closed and reopened it holds the same entries, served bit-exact.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache.config import load_config
from lmcache.hierarchy import StorageHierarchy
from lmcache.memory import MemoryPool
from lmcache.testing import make_key

UNIVERSE = 24
SHAPES = {0: (2, 2, 8, 2, 8), 1: (2, 2, 16, 2, 8)}  # 1 KiB and 2 KiB of float16
BIG = 2 * 2 * 16 * 2 * 8 * 2
DISK_ENTRY = BIG + 600  # payload header upper bound included
KEYS = [make_key(i) for i in range(UNIVERSE)]
TOTALS = {"steps": 0, "puts": 0, "gets": 0, "pins": 0, "evictions": 0, "restarts": 0, "checks": 0, "examples": 0}


def expected(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(SHAPES[i % 2], generator=g).half()


def key_index(key: str) -> int:
    return KEYS.index(key)


class HierarchyMachine(RuleBasedStateMachine):
    write_policy = "write-through"
    three_tiers = False
    big_last = True  # the last tier holds the whole universe: (d) is strict

    def __init__(self):
        super().__init__()
        TOTALS["examples"] += 1
        self.tmp = Path(tempfile.mkdtemp(prefix="lmc-model-"))
        tiers = [{"backend": "cpu", "capacity": 5 * BIG}]
        if self.three_tiers:
            tiers.append({"backend": "disk", "path": str(self.tmp / "d1"), "capacity": 8 * DISK_ENTRY, "name": "disk1"})
        last_cap = (UNIVERSE + 1) * DISK_ENTRY if self.big_last else 10 * DISK_ENTRY
        tiers.append({"backend": "disk", "path": str(self.tmp / "d2"), "capacity": last_cap, "name": "disk2"})
        self.cfg = load_config(
            {"write_policy": self.write_policy, "tiers": tiers, "staging_size": 3 * BIG}, environ={}
        )
        self.pool = MemoryPool(self.cfg.pool_size)
        self.h = StorageHierarchy(self.cfg, self.pool)
        self.n = len(self.h.tiers)
        self.model: list[set[str]] = [set() for _ in range(self.n)]  # from admit/evict events
        self.pins: dict[str, int] = {}
        self.stored: set[str] = set()  # keys put (allocated and handed to the hierarchy)
        self.lost_from_last: set[str] = set()  # evicted from the last tier after their put
        self.operator_dropped: set[str] = set()  # removed by an operator's evict_keys
        self.violations: list[str] = []
        self.h.set_listener(self._event)

    # ------------------------------------------------------------- model feed
    def _event(self, op: str, tier: str, key: str) -> None:
        t = [x.name for x in self.h.tiers].index(tier)
        if op == "admit":
            self.model[t].add(key)
        else:
            self.model[t].discard(key)
            if self.pins.get(key):
                self.violations.append(f"pinned {key} evicted from {tier}")
            if t == self.n - 1:
                self.lost_from_last.add(key)

    # ------------------------------------------------------------- rules
    @rule(i=st.integers(0, UNIVERSE - 1))
    def put(self, i):
        TOTALS["steps"] += 1
        key = KEYS[i]
        obj = self.h.allocate(SHAPES[i % 2], torch.float16)
        if obj is None:  # pool exhausted: the store is skipped, never blocks
            return
        try:
            obj.tensor.copy_(expected(i))
            self.h.put_one(key, obj)
        finally:
            obj.unref()
        TOTALS["puts"] += 1
        self.stored.add(key)
        self.lost_from_last.discard(key)
        self.operator_dropped.discard(key)

    @rule(start=st.integers(0, UNIVERSE - 1), length=st.integers(1, 6))
    def lookup_retrieve(self, start, length):
        """What a prefix lookup reports is what a pinned retrieve returns, bit-exact."""
        TOTALS["steps"] += 1
        keys = [KEYS[(start + j) % UNIVERSE] for j in range(length)]
        self.h.flush()
        names = self.h.exists_prefix(keys)
        with self.h.pinned(keys):
            res = self.h.find(keys)
        try:
            for j in range(len(names)):
                assert res[j] is not None, f"lookup reported {keys[j]} in {names[j]} but get missed it"
                obj, _ = res[j]
                assert torch.equal(obj.tensor, expected(key_index(keys[j]))), f"wrong bytes for {keys[j]}"
            if len(names) < len(keys):
                assert res[len(names)] is None, f"lookup missed {keys[len(names)]} but get found it"
            for r, k in zip(res, keys):  # anything returned at all is right
                if r is not None:
                    assert torch.equal(r[0].tensor, expected(key_index(k)))
        finally:
            for r in res:
                if r is not None:
                    r[0].unref()
        TOTALS["gets"] += len(keys)

    @rule(i=st.integers(0, UNIVERSE - 1))
    def pin(self, i):
        TOTALS["steps"] += 1
        if sum(1 for v in self.pins.values() if v) >= 4:
            return
        key = KEYS[i]
        for t in self.h.tiers:
            t.pin(key)
        self.pins[key] = self.pins.get(key, 0) + 1
        TOTALS["pins"] += 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data):
        TOTALS["steps"] += 1
        key = data.draw(st.sampled_from(sorted(k for k, v in self.pins.items() if v)))
        for t in self.h.tiers:
            t.unpin(key)
        self.pins[key] -= 1

    @rule(t=st.integers(0, 2), chunks=st.integers(1, 4))
    def evict(self, t, chunks):
        TOTALS["steps"] += 1
        tier = self.h.tiers[min(t, self.n - 1)]
        tier.evict_bytes(chunks * BIG)
        TOTALS["evictions"] += 1

    @rule(t=st.integers(0, 2), i=st.integers(0, UNIVERSE - 1))
    def operator_evict(self, t, i):
        TOTALS["steps"] += 1
        tier = self.h.tiers[min(t, self.n - 1)]
        done, skipped = tier.evict_keys([KEYS[i]])
        if self.pins.get(KEYS[i]):
            assert not done, "an operator eviction removed a pinned entry"
        if done:  # an operator's eviction is a deliberate drop: nothing is demoted
            self.operator_dropped.add(KEYS[i])

    @rule()
    def flush(self):
        TOTALS["steps"] += 1
        self.h.flush()
        self._check_after_flush()

    @rule(t=st.integers(1, 2))
    def restart_disk(self, t):
        """Close a disk tier and open it again from its directory."""
        TOTALS["steps"] += 1
        t = min(t, self.n - 1)
        self.h.flush()
        old = self.h.tiers[t]
        before = {k: old.size_of(k) for k, _ in old.keys()}
        old.backend.close()
        new = self.h._build_tier(t, self.cfg.tiers[t])
        for key, n in self.pins.items():  # pins are process state: the operator keeps them
            for _ in range(n):
                new.pin(key)
        new.ledger.listeners = old.ledger.listeners
        new.on_evict = old.on_evict
        self.h.tiers[t] = new
        after = {k: new.size_of(k) for k, _ in new.keys()}
        assert after == before, f"disk tier {new.name} lost or changed entries across a restart"
        TOTALS["restarts"] += 1

    # ------------------------------------------------------------- invariants
    @invariant()
    def tiers_consistent(self):
        TOTALS["checks"] += 1
        assert not self.violations, self.violations
        for t, tier in enumerate(self.h.tiers):
            with tier._lock:
                idx = dict(tier.ledger.sizes)
                used, reserved = tier.used, tier.ledger.reserved
            assert used + reserved <= tier.capacity, f"{tier.name}: {used}+{reserved} > {tier.capacity}"
            assert used == sum(idx.values()), f"{tier.name}: used {used} != sum of entries"
            if not self.h._inflight and self.h.pending_writes() == 0:
                assert set(idx) == set(dict(tier.backend.keys())), f"{tier.name}: index != backend"
                assert tier.backend.usage().used_bytes == used
                assert set(idx) == self.model[t], f"{tier.name}: index != event model"
            # (a): every accounted entry is served bit-exact (read without side effects)
            for key in idx:
                obj = tier.backend.get_one(key)
                if obj is None:  # evicted meanwhile by the writer thread
                    assert self.h.pending_writes() or self.h._inflight or key not in tier.ledger
                    continue
                try:
                    assert torch.equal(obj.tensor, expected(key_index(key))), f"{tier.name}: wrong bytes for {key}"
                finally:
                    obj.unref()

    def _check_after_flush(self):
        """(c) and (d), in a quiescent hierarchy."""
        held = [{k for k, _ in t.keys()} for t in self.h.tiers]
        assert not self.violations, self.violations  # (c) from the event feed
        if not self.big_last:
            return
        last = held[-1]
        skipped = self.h.tiers[-1].stats.skipped_puts
        assert skipped == 0, "the last tier has room for everything; it may not skip a write"
        if self.h.stats.dropped_writes:
            return  # a full write queue drops lower-tier writes (counted); not strict then
        everywhere = set().union(*held)
        for key in self.stored - self.lost_from_last - self.operator_dropped:
            if self.write_policy == "write-through":
                assert key in last, f"write-through: {key} was stored but is not in the last tier"
            else:
                assert key in everywhere, f"write-back: {key} was stored but no tier has it"

    def teardown(self):
        try:
            self.h.flush()
            self._check_after_flush()
        finally:
            self.h.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
        # every reference handed out came back: the pool is whole again
        assert self.pool.used == 0 and self.pool.live == 0, self.pool


SETTINGS = settings(
    max_examples=25,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)


def _case(policy: str, three: bool, big: bool):
    cls = type(
        f"M_{policy}_{three}_{big}",
        (HierarchyMachine,),
        {"write_policy": policy, "three_tiers": three, "big_last": big},
    )
    cls.TestCase.settings = SETTINGS
    return cls


def _run(policy, three, big):
    for k in TOTALS:
        TOTALS[k] = 0
    _case(policy, three, big).TestCase("runTest").runTest()
    print(f"[model-based] policy={policy} tiers={3 if three else 2} big_last={big}: {TOTALS}")
    assert TOTALS["puts"] > 0 and TOTALS["gets"] > 0


def test_write_through_two_tiers():
    _run("write-through", False, True)


def test_write_back_two_tiers():
    _run("write-back", False, True)


def test_write_through_three_tiers_small_last():
    _run("write-through", True, False)


def test_write_back_three_tiers():
    _run("write-back", True, True)
