"""The backend contract as the tier sees it: declared capability flags (no ``getattr``
probes), ``get(keys, on_ready)``, the one ``check_options(options, capacity)`` signature,
and the tier's one vocabulary (issue 31, item 5)."""

from __future__ import annotations

import warnings

import pytest
import torch

from lmcache.backends.cpu import CPUBackend
from lmcache.config import load_config
from lmcache.errors import ConfigError
from lmcache.hierarchy import StorageHierarchy
from lmcache.hookspecs import hookimpl
from lmcache.memory import MemoryPool
from lmcache.plugin_manager import Registries, create_plugin_manager
from lmcache.storage import StorageBackend, check_backend_options
from lmcache.testing import make_key
from lmcache.tier_setup import check_tier

SHAPE = (2, 2, 4, 2, 8)


class Streaming(CPUBackend):
    """Declares ``streams_gets`` and keeps the base class's ``get``."""

    streams_gets = True


class NotStreaming(CPUBackend):
    """Declares nothing; records what its ``get`` was given."""

    def __init__(self, context):
        super().__init__(context)
        self.given: list[object] = []

    def get(self, keys, on_ready=None):
        self.given.append(on_ready)
        return super().get(keys, on_ready)


class OldCheckOptions(CPUBackend):
    """A third-party backend written before ``capacity`` was passed."""

    OPTIONS = {"size": 1}

    @classmethod
    def check_options(cls, options):
        opts = super().check_options(options)
        if not isinstance(opts["size"], int):
            raise ConfigError("size", f"expected an integer, got {opts['size']!r}")
        return opts


class _Plugin:
    @hookimpl
    def lmcache_register_backends(self, registry):
        registry.add("streaming", Streaming)
        registry.add("not-streaming", NotStreaming)
        registry.add("old-check", OldCheckOptions)


@pytest.fixture(scope="module")
def regs():
    pm = create_plugin_manager(autoload=False)
    pm.register(_Plugin(), name="contract-tests")
    return Registries(pm)


def _tier_with(regs, backend: str, n: int):
    cfg = load_config({"chunk_size": 4, "tiers": [{"backend": backend, "capacity": "1MiB"}]}, environ={})
    pool = MemoryPool(1 << 20)
    h = StorageHierarchy(cfg, pool, regs)
    keys = [make_key(i) for i in range(n)]
    for i, key in enumerate(keys):
        obj = pool.allocate(SHAPE, torch.float16)
        obj.tensor.fill_(i)
        h.put_one(key, obj)
        obj.unref()
    return h, keys


def test_capability_flags_are_declared_on_the_base_class():
    for flag in ("streams_gets", "holds_memory_objects", "shared"):
        assert getattr(StorageBackend, flag) is False, flag
    assert StorageBackend.integrity is None


def test_a_backend_declaring_streams_gets_gets_on_ready_through_the_tier(regs):
    """Before: the base class's ``get(keys)`` took no ``on_ready``, so a backend that
    declared ``streams_gets`` without writing its own ``get`` failed every read (the tier
    took the TypeError for an outage and reported misses)."""
    h, keys = _tier_with(regs, "streaming", 3)
    try:
        tier = h.tiers[0]
        seen: list[tuple[int, float]] = []
        asked = [keys[0], make_key(99), keys[2]]
        objs = tier.get(asked, lambda i, obj: seen.append((i, float(obj.tensor.flatten()[0]))))
        assert [o is not None for o in objs] == [True, False, True]
        assert seen == [(0, 0.0), (2, 2.0)]  # once per hit, never for the miss
        assert tier.info()["corrupt"] == 0 and tier.available
        for o in objs:
            if o is not None:
                o.unref()
    finally:
        h.close()


def test_a_backend_not_declaring_streams_gets_never_sees_on_ready(regs):
    h, keys = _tier_with(regs, "not-streaming", 3)
    try:
        tier = h.tiers[0]
        seen: list[int] = []
        objs = tier.get(keys, lambda i, obj: seen.append(i))
        assert all(o is not None for o in objs) and seen == []
        assert tier.backend.given == [None]
        for o in objs:
            o.unref()
    finally:
        h.close()


def test_check_options_with_the_old_one_argument_signature_is_deprecated(regs):
    """Before: the one-argument form was accepted silently (and never saw the capacity)."""
    with pytest.warns(DeprecationWarning, match=r"OldCheckOptions: check_options\(cls, options\) is deprecated"):
        assert check_backend_options(OldCheckOptions, {"size": 3}, 1 << 20) == {"size": 3}
    with pytest.warns(DeprecationWarning, match=r"check_options\(cls, options, capacity=None\)"):
        with pytest.raises(ConfigError, match="size"):
            check_backend_options(OldCheckOptions, {"size": "x"}, None)
    cfg = load_config({"tiers": [{"backend": "old-check", "capacity": "1MiB", "size": "x"}]}, environ={})
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match=r"tiers\[0\]\.size"):
        check_tier(0, cfg.tiers[0], registries=regs)


@pytest.mark.parametrize("name", ["cpu", "disk", "redis", "valkey", "s3", "fs", "gds", "mooncake", "lm"])
def test_builtin_backends_take_options_and_capacity(name):
    """The fixed signature: no builtin backend warns (see docs/plugins.md)."""
    regs = Registries(create_plugin_manager(autoload=False))
    cls = regs.backends.load(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with pytest.raises(ConfigError):  # a bad key (a DeprecationWarning would raise instead)
            check_backend_options(cls, {"bogus": 1}, 1 << 20)


def test_tier_keys_are_key_and_size_pairs_and_key_list_is_deprecated(regs):
    h, keys = _tier_with(regs, "streaming", 2)
    try:
        tier = h.tiers[0]
        nbytes = 2 * 2 * 4 * 2 * 8 * 2
        assert sorted(tier.keys()) == sorted((k, nbytes) for k in keys)
        with pytest.warns(DeprecationWarning, match=r"Tier\.keys\(\)"):
            assert sorted(tier.key_list()) == sorted(keys)
    finally:
        h.close()
