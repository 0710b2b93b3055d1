"""The eviction policy contract as the core keeps it: the victim()/on_remove handshake,
byte sizes for policies that declare ``takes_sizes``, policy options from the config,
and planning (``evict --dry-run``) that leaves a policy alone."""

from __future__ import annotations

import pytest

from lmcache.config import load_config
from lmcache.errors import ConfigError
from lmcache.ledger import Ledger
from lmcache.plugins.policies import LRUPolicy, S3FIFOPolicy
from lmcache.testing import make_key, make_obj
from lmcache.tier_setup import build_tier, check_tier


class OneArgPolicy(LRUPolicy):
    """A third-party policy written before sizes: ``on_insert(key)`` only."""

    def on_insert(self, key):  # noqa: D401 - the old one-argument form
        super().on_insert(key)


class SizeLog(S3FIFOPolicy):
    def __init__(self):
        super().__init__()
        self.log = []

    def on_insert(self, key, size=1):
        self.log.append(("insert", key, size))
        super().on_insert(key, size)

    def on_resize(self, key, size):
        self.log.append(("resize", key, size))
        super().on_resize(key, size)


def test_a_sized_policy_gets_each_entrys_bytes_and_an_old_one_still_works():
    sized = Ledger("t", 1000, SizeLog())
    sized.admit("a", 10)
    sized.admit("a", 30)  # stored again, another size
    sized.admit("a", 30)  # same size: nothing to tell
    sized.admit("b", 5)
    assert sized.policy.log == [("insert", "a", 10), ("resize", "a", 30), ("insert", "b", 5)]
    old = Ledger("t", 1000, OneArgPolicy())
    old.admit("a", 10)
    old.admit("a", 30)
    assert old.victim(lambda k: False) == "a" and len(old.policy) == 1


def test_a_victim_the_tier_does_not_hold_is_removed_and_the_next_asked():
    """A policy that drifted (it tracks a key the tier never admitted) cannot make a tier
    evict nothing forever: the ledger completes the handshake for it and asks again."""
    led = Ledger("t", 1000, LRUPolicy())
    led.policy.on_insert("ghost")
    led.admit("a", 10)
    assert led.victim(lambda k: False) == "a"
    assert len(led.policy) == 1
    assert led.victim(lambda k: True) is None


def _tier_cfg(**tier):
    return load_config({"tiers": [{"backend": "cpu", "capacity": 4096, **tier}]}, environ={}).tiers[0]


def test_policy_options_reach_the_policy_with_the_tier_capacity():
    tcfg = _tier_cfg(policy="s3fifo", policy_options={"small_ratio": 0.25, "ghost_ratio": 2})
    policy = check_tier(0, tcfg).policy
    assert isinstance(policy, S3FIFOPolicy)
    assert (policy.small_ratio, policy.ghost_ratio, policy.capacity) == (0.25, 2.0, 4096)


@pytest.mark.parametrize(
    "tier,fragment",
    [
        ({"policy": "s3fifo", "policy_options": {"smal_ratio": 0.1}},
         "unknown option 'smal_ratio' for policy 's3fifo'; did you mean 'small_ratio'?"),
        ({"policy": "lru", "policy_options": {"size": 3}}, "unknown option 'size' for policy 'lru'; it takes no options"),
        ({"policy": "s3fifo", "policy_options": {"small_ratio": 2}}, "small_ratio must be a number in (0, 1)"),
        ({"policy": "s3fifo", "policy_options": {"capacity": 9}}, "'capacity' is the tier's capacity"),
    ],
)
def test_bad_policy_options_are_one_line_naming_the_policy_and_key(tier, fragment):
    with pytest.raises(ConfigError) as ei:
        check_tier(0, _tier_cfg(**tier))
    assert ei.value.key == "tiers[0].policy_options"
    assert fragment in str(ei.value) and "\n" not in str(ei.value)


def test_policy_options_must_be_a_mapping():
    with pytest.raises(ConfigError) as ei:
        _tier_cfg(policy="s3fifo", policy_options=[0.1])
    assert ei.value.key == "tiers[0].policy_options" and "mapping" in str(ei.value)


def test_a_policy_whose_victim_changes_state_needs_an_eviction_order():
    """Planning must not ask such a policy's victim(): it is refused when built, and the
    planner refuses to fall back on victim() for it."""
    from lmcache.errors import PluginError
    from lmcache.policies import build_policy, eviction_order

    class Hand:  # a CLOCK-like hand without a way to plan
        victim_changes_state = True

        def __init__(self):
            self.keys, self.hand = [], 0

        def on_insert(self, key):
            self.keys.append(key)

        def victim(self, skip):
            self.hand += 1
            return self.keys[0] if self.keys else None

        def __len__(self):
            return len(self.keys)

    with pytest.raises(PluginError, match="policy 'hand' declares victim_changes_state but has no eviction_order"):
        build_policy(Hand, "hand")
    h = Hand()
    h.on_insert("a")
    with pytest.raises(TypeError):
        list(eviction_order(h))
    assert h.hand == 0


def test_an_s3fifo_tier_evicts_in_the_planned_order_and_planning_changes_nothing():
    """``lmcache evict --dry-run`` plans with ``Tier.eviction_order``; the evictions that
    follow are exactly that plan, for a policy whose victim() promotes and turns a hand."""
    obj = make_obj(0)
    tier = build_tier(0, _tier_cfg(policy="s3fifo", capacity=40 * obj.nbytes, policy_options={"small_ratio": 0.2}))
    evicted = []
    tier.ledger.listeners = (lambda op, name, key: evicted.append(key) if op == "evict" else None,)
    keys = [make_key(i) for i in range(30)]
    for i, k in enumerate(keys):
        o = make_obj(i)
        assert tier.put_one(k, o)
        o.unref()  # the tier keeps its own reference
        if i % 3 == 0:
            tier.get([k]).pop().unref()  # read once: promoted when the hand passes it
    for o in tier.get([keys[1], keys[4]]):
        o.unref()
    plan = tier.eviction_order()
    assert tier.eviction_order() == plan and sorted(plan) == sorted(keys)
    freed = tier.evict_bytes(10 * obj.nbytes)
    assert freed >= 10 * obj.nbytes
    assert evicted == plan[: len(evicted)] and len(evicted) >= 10
    assert plan[:10] != keys[:10]  # read keys were promoted, not evicted in insertion order
    tier.backend.close()
