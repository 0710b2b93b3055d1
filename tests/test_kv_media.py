"""lmcache.kv_media: tier -> medium, and per-medium presence over several tiers."""

from __future__ import annotations

import pytest

from lmcache.config import load_config
from lmcache.errors import ConfigError
from lmcache.kv_media import CPU, STORAGE, MediaTracker, medium_of


def test_cpu_is_CPU_every_other_backend_is_STORAGE_unless_overridden():
    assert medium_of("hot", "cpu") == CPU
    assert [medium_of(b, b) for b in ("disk", "fs", "gds", "redis", "valkey", "s3", "mooncake", "lm")] == [STORAGE] * 8
    assert medium_of("shared", "redis", {"redis": "REMOTE"}) == "REMOTE"
    assert medium_of("shared", "redis", {"shared": "NFS", "redis": "REMOTE"}) == "NFS"  # tier name first


def test_a_medium_ends_only_when_its_last_tier_drops_the_key():
    t = MediaTracker({"cpu": CPU, "disk": STORAGE, "redis": STORAGE})
    assert t.admit("cpu", "k") == CPU
    assert t.admit("disk", "k") == STORAGE
    assert t.admit("redis", "k") is None  # STORAGE held already (disk)
    assert t.evict("disk", "k") == (None, [CPU, STORAGE])  # redis still holds it: no removal
    assert t.evict("cpu", "k") == (CPU, [STORAGE])  # CPU ends; STORAGE still holds it
    assert t.evict("redis", "k") == (STORAGE, [])
    assert len(t) == 0
    assert t.evict("redis", "k") == (None, [])  # an unknown eviction changes nothing
    assert t.admit("nvme", "k") is None  # a tier without a medium is not announced


def test_media_option_is_checked():
    assert load_config({"kv_events": {"media": {"disk": "STORAGE"}}}).kv_events.media == {"disk": "STORAGE"}
    for bad in (["disk"], {"disk": 3}, {"": "X"}, {"disk": "X" * 65}, {f"t{i}": "X" for i in range(65)}):
        with pytest.raises(ConfigError, match="kv_events.media"):
            load_config({"kv_events": {"media": bad}})
