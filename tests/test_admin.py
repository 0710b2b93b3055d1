"""The admin layer (lmcache.admin) in-process and offline, the backend additions it uses
(per-entry info, read-only opening, eviction order), the api config key and durations."""

from __future__ import annotations

import os
import time

import pytest
import torch
from _kv import wave

import lmcache
from lmcache.admin import Admin
from lmcache.config import load_config
from lmcache.errors import AdminError, ConfigError, NotFoundError
from lmcache.units import format_duration, parse_duration

CHUNK = 16


def kv_for(tokens):
    t = torch.as_tensor(list(tokens), dtype=torch.float32)
    base = torch.arange(2 * 2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 2, 8)
    return wave(base * 0.01 + t.reshape(1, 1, -1, 1, 1) * 0.37)


def prompt(i, n=64):
    return [1000 * (i + 1) + j for j in range(n)]


def make_config(tmp_path, **kw):
    return {
        "chunk_size": CHUNK,
        "model": "org/m",
        "tiers": [
            {"backend": "cpu", "capacity": "1MiB"},
            {"backend": "disk", "path": str(tmp_path / "kv"), "capacity": "4MiB"},
        ],
        **kw,
    }


@pytest.fixture
def engine(tmp_path):
    e = lmcache.CacheEngine.from_config(make_config(tmp_path))
    yield e
    e.close()


def fill(e, prompts=3):
    for i in range(prompts):
        e.store(prompt(i), kv_for(prompt(i)))
    e.flush()


# ------------------------------------------------------------------ stats and tiers


def test_engine_stats_per_tier_has_the_cli_numbers(engine):
    fill(engine, 2)
    engine.retrieve(prompt(0))
    st = engine.stats()
    cpu, disk = st["tiers"]["cpu"], st["tiers"]["disk"]
    assert cpu["backend"] == "cpu" and disk["backend"] == "disk"
    assert cpu["entries"] == 8 and cpu["hits"] == 4 and cpu["hit_rate"] == 1.0
    assert cpu["bytes_in"] == cpu["put_bytes"] == 8 * 4096 and cpu["bytes_out"] == 4 * 4096
    assert disk["hit_rate"] is None and disk["bytes_in"] == disk["used_bytes"] > 0
    assert st["hierarchy"]["pending_writes"] == 0
    assert engine.admin.tiers() == [engine.stats()["tiers"]["cpu"], engine.stats()["tiers"]["disk"]]


# ------------------------------------------------------------------ keys


def test_keys_have_metadata_and_are_paged_and_filtered(engine):
    fill(engine, 3)
    page = engine.admin.keys("disk", limit=5)
    assert page["total"] == 12 and len(page["entries"]) == 5 and page["next_offset"] == 5
    e = page["entries"][0]
    assert e["tier"] == "disk" and e["model"] == "org/m" and e["namespace"] == "default"
    assert e["codec"] == "raw" and e["size"] > 4096 and 0 <= e["age_s"] < 60 and e["pinned"] is False
    rest = engine.admin.keys("disk", offset=5, limit=100)
    assert rest["next_offset"] is None and len(rest["entries"]) == 7
    keys = [r["key"] for r in page["entries"] + rest["entries"]]
    assert keys == sorted(keys) and len(set(keys)) == 12
    both = engine.admin.keys(limit=None)
    assert both["total"] == 24 and [r["tier"] for r in both["entries"]] == ["cpu"] * 12 + ["disk"] * 12
    assert engine.admin.keys(model="other")["total"] == 0
    assert engine.admin.keys(model="org/m", namespace="default")["total"] == 24
    with pytest.raises(NotFoundError, match="unknown tier 'ssd'; tiers: cpu, disk"):
        engine.admin.keys("ssd")
    with pytest.raises(AdminError, match="offset"):
        engine.admin.keys(offset=-1)


# ------------------------------------------------------------------ eviction


def test_evict_bytes_follows_the_policy_order(engine):
    fill(engine, 3)
    engine.retrieve(prompt(0))  # prompt 0's chunks become the most recently used
    adm = engine.admin
    order = engine.hierarchy.tier("cpu").eviction_order()
    plan = adm.plan_evict("cpu", bytes=3 * 4096)
    assert [v["key"] for v in plan["evict"]] == order[:3] and plan["bytes"] == 3 * 4096
    _, p0_keys = engine.chunk_keys(prompt(0))
    assert not set(p0_keys) & {v["key"] for v in plan["evict"]}
    dry = adm.evict("cpu", bytes="10KiB", dry_run=True)  # sizes as strings too; 3 chunks cover 10 KiB
    assert dry["dry_run"] and len(dry["evicted"]) == 3 and len(engine.hierarchy.tier("cpu")) == 12
    res = adm.evict("cpu", bytes=3 * 4096)
    assert [v["key"] for v in res["evicted"]] == order[:3] and res["bytes"] == 3 * 4096
    t = engine.hierarchy.tier("cpu")
    assert len(t) == 9 and t.used == 9 * 4096 and t.stats.evictions == 3
    assert len(engine.hierarchy.tier("disk")) == 12  # an explicit eviction touches only its tier
    assert engine.lookup(prompt(0)) == 64


def test_evict_by_age_uses_the_wall_clock(tmp_path):
    now = [time.time()]
    with lmcache.CacheEngine.from_config(make_config(tmp_path)) as e:
        fill(e, 1)
        adm = Admin(e.hierarchy.tiers, engine=e, wall_clock=lambda: now[0])
        assert adm.plan_evict(older_than="1h")["evict"] == []
        now[0] += 7200
        plan = adm.plan_evict(older_than=3600)
        assert len(plan["evict"]) == 8  # 4 chunks in each tier
        assert len(adm.plan_evict("disk", older_than="1h", bytes=1)["evict"]) == 1


def test_pins_keep_entries_and_clear_drops_them(engine):
    fill(engine, 1)
    adm = engine.admin
    key = adm.keys("disk", limit=1)["entries"][0]["key"]
    assert adm.pin(key) == {"key": key, "pinned": ["cpu", "disk"]}
    assert adm.pin(key)["pinned"] == ["cpu", "disk"]  # idempotent
    assert adm.keys("disk", limit=1)["entries"][0]["pinned"] is True
    res = adm.evict(all=True)
    assert {(s["tier"], s["reason"]) for s in res["skipped"]} == {("cpu", "pinned"), ("disk", "pinned")}
    assert len(res["evicted"]) == 6
    by_key = adm.evict(keys=[key])
    assert by_key["evicted"] == [] and len(by_key["skipped"]) == 2
    assert adm.unpin(key, "disk") == {"key": key, "unpinned": ["disk"]}
    assert adm.unpin(key, "disk")["unpinned"] == []
    assert adm.evict("disk", keys=[key])["evicted"][0]["key"] == key
    res = adm.clear(all=True)
    assert [v["key"] for v in res["evicted"]] == [key] and res["skipped"] == []
    assert engine.stats()["tiers"]["cpu"]["entries"] == 0 and adm.pins() == []


def test_a_lookup_lease_is_never_evicted(engine):
    fill(engine, 1)
    engine.lookup(prompt(0), pin=True)
    res = engine.admin.evict("cpu", all=True)
    assert res["evicted"] == [] and {s["reason"] for s in res["skipped"]} == {"pinned"}


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({}, "say what to evict"),
        ({"all": True, "bytes": 5}, "all cannot be combined"),
        ({"keys": ["x"], "all": True}, "keys cannot be combined"),
        ({"keys": "lmc1:a"}, "non-empty list"),
        ({"keys": ["nope"]}, "not an lmcache key"),
        ({"bytes": "lots", "tier": "cpu"}, "bytes: cannot read 'lots'"),
        ({"bytes": 0, "tier": "cpu"}, "larger than 0"),
        ({"bytes": 10}, "bytes needs a tier"),
        ({"older_than": "soon"}, "older_than: cannot read 'soon'"),
        ({"all": "yes"}, "all must be true or false"),
    ],
)
def test_evict_rejects_bad_selections(engine, kwargs, fragment):
    with pytest.raises(AdminError, match=fragment):
        engine.admin.evict(**kwargs)


def test_pin_unknown_key_is_404_and_bad_key_400(engine):
    fill(engine, 1)
    missing = lmcache.CacheKey("default", "org/m", "x", "0" * 32).to_string()
    with pytest.raises(NotFoundError, match="not in any tier"):
        engine.admin.pin(missing)
    with pytest.raises(AdminError, match="not an lmcache key"):
        engine.admin.pin("k")


# ------------------------------------------------------------------ offline


def test_offline_admin_opens_only_the_persisted_tiers(tmp_path):
    with lmcache.CacheEngine.from_config(make_config(tmp_path)) as e:
        fill(e, 2)
    cfg = load_config(make_config(tmp_path))
    with Admin.open_config(cfg) as adm:
        assert [t["name"] for t in adm.tiers()] == ["disk"]
        assert adm.skipped_tiers[0][0] == "cpu" and "--url" in adm.skipped_tiers[0][1]
        assert adm.tiers()[0]["entries"] == 8 and adm.stats()["live"] is False
        with pytest.raises(AdminError, match="needs a running instance"):
            adm.pin(adm.keys(limit=1)["entries"][0]["key"])
        with pytest.raises(NotFoundError, match=r"unknown tier 'cpu' \(it lives in a running instance's memory"):
            adm.keys("cpu")
    with pytest.raises(AdminError, match="it lives in a running instance's memory"):
        Admin.open_config(cfg, tier="cpu")
    with pytest.raises(NotFoundError, match="the config's tiers: cpu, disk"):
        Admin.open_config(cfg, tier="ssd")
    with Admin.open_config(cfg, read_only=False) as adm:
        assert len(adm.evict("disk", all=True)["evicted"]) == 8
    assert not list((tmp_path / "kv").rglob("*.lmc"))


def test_read_only_opening_changes_nothing(tmp_path):
    with lmcache.CacheEngine.from_config(make_config(tmp_path)) as e:
        fill(e, 2)
    kv = tmp_path / "kv"
    tmp_file = kv / ".tmp-left-behind"
    tmp_file.write_bytes(b"partial")
    bad = next(kv.rglob("*.lmc"))
    bad_copy = bad.read_bytes()
    bad.write_bytes(b"garbage")
    # a capacity below what is stored: the engine would trim; inspection must not
    small = make_config(tmp_path)
    small["tiers"][1]["capacity"] = "8KiB"
    before = sorted(p.name for p in kv.rglob("*"))
    with Admin.open_config(load_config(small)) as adm:
        assert adm.tiers()[0]["entries"] == 7  # the bad file is skipped, not removed
    assert sorted(p.name for p in kv.rglob("*")) == before and tmp_file.exists()
    bad.write_bytes(bad_copy)
    missing = make_config(tmp_path / "never-created")
    with Admin.open_config(load_config(missing)) as adm:
        assert adm.tiers()[0]["entries"] == 0
    assert not (tmp_path / "never-created").exists()


def test_disk_index_is_rebuilt_oldest_first(tmp_path):
    with lmcache.CacheEngine.from_config(make_config(tmp_path)) as e:
        fill(e, 2)
        disk_keys = [r["key"] for r in e.admin.keys("disk", limit=None)["entries"]]
    kv = tmp_path / "kv"
    from lmcache.backends.disk import _file_name

    # make the files' ages the reverse of the sorted key order
    t0 = time.time() - 10_000
    for i, k in enumerate(reversed(disk_keys)):
        name = _file_name(k)
        os.utime(kv / name[:2] / name, (t0 + i, t0 + i))
    with Admin.open_config(load_config(make_config(tmp_path))) as adm:
        assert adm.tier("disk").eviction_order() == list(reversed(disk_keys))
        ages = {r["key"]: r["age_s"] for r in adm.keys(limit=None)["entries"]}
        assert ages[disk_keys[-1]] > ages[disk_keys[0]] > 9_000


def test_default_backend_entries_come_from_keys():
    from lmcache.storage import EntryInfo, StorageBackend

    class Tiny(StorageBackend, abstract=True):  # only what entries() is derived from
        def keys(self):
            return iter([("k", 3)])

    b = Tiny.__new__(Tiny)
    assert list(b.entries()) == [EntryInfo("k", 3, None, None)]


# ------------------------------------------------------------------ config


def test_api_config_is_validated_and_sources_are_recorded(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("chunk_size: 32\napi: {enabled: true, port: 8123}\n")
    cfg = load_config(f, environ={"LMCACHE_NAMESPACE": "team", "LMCACHE_API_TOKEN": "s3cret"}, model="m")
    assert (cfg.api.enabled, cfg.api.port, cfg.api.token, cfg.api.host) == (True, 8123, "s3cret", "127.0.0.1")
    assert cfg.sources == {
        "chunk_size": f"file:{f}",
        "api.enabled": f"file:{f}",
        "api.port": f"file:{f}",
        "namespace": "env:LMCACHE_NAMESPACE",
        "api.token": "env:LMCACHE_API_TOKEN",
        "model": "override",
    }
    rep = cfg.report()
    assert rep["values"]["api"]["token"] == "***" and rep["sources"]["write_policy"] == "default"
    assert rep["sources"]["api.host"] == "default" and rep["file"] == str(f)
    assert load_config({"api": True}, environ={}).api.enabled is True
    assert load_config({"chunk_size": 8}, environ={}).sources == {"chunk_size": "mapping"}


@pytest.mark.parametrize(
    "api,key,fragment",
    [
        ({"enabled": "yes"}, "api.enabled", "true or false"),
        ({"port": 70000}, "api.port", "<= 65535"),
        ({"port": -1}, "api.port", ">= 0"),
        ({"token": ""}, "api.token", "non-empty"),
        ({"timeout": 0}, "api.timeout", "positive"),
        ({"host": 5}, "api.host", "non-empty string"),
        ({"colour": 1}, "api.colour", "unknown key"),
        ("on", "api", "expected a mapping"),
    ],
)
def test_api_config_errors_name_the_key_and_file(tmp_path, api, key, fragment):
    import yaml

    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"api": api}))
    with pytest.raises(ConfigError) as ei:
        load_config(f, environ={})
    assert ei.value.key == key and str(f) in str(ei.value) and fragment in str(ei.value)


def test_durations():
    assert parse_duration("1h30m") == 5400 and parse_duration("90") == 90 and parse_duration(2.5) == 2.5
    assert parse_duration("2d") == 172800 and parse_duration("1w") == 604800
    for bad in ["", "1y", "h", "1h x", -1, True, None]:
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert format_duration(5400) == "1h30m" and format_duration(42) == "42s" and format_duration(3600) == "1h"
