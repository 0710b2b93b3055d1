"""A backend's declared ``max_value_size``/``max_key_length`` (:mod:`lmcache.fit`): a tier
splits larger values and hashes longer keys, so a store with memcached-like limits holds
real chunks under long model names; and an unknown backend option names the backend."""

from __future__ import annotations

import threading
from typing import Iterator, Sequence

import pytest
import torch

from lmcache import CacheEngine, hookimpl
from lmcache.config import load_config
from lmcache.errors import BackendError, ConfigError, PluginError
from lmcache.fit import MARK, FittedBackend, fit
from lmcache.plugin_manager import Registries, create_plugin_manager, get_registries
from lmcache.storage import BackendContext, BytesBackend, StorageBackend, check_backend_options
from lmcache.encoded import open_objects
from lmcache.testing import BytesBackendTests
from lmcache.testing.objects import LONG_MODEL

VALUE_LIMIT = 1 << 20  # memcached's default item size
KEY_LIMIT = 250  # memcached's key length


class LimitedBackend(BytesBackend):
    """An in-process store that refuses what memcached refuses: values over 1 MiB and keys
    over 250 bytes (it raises, as a client library does)."""

    OPTIONS = {"servers": "127.0.0.1:11211"}
    max_value_size = VALUE_LIMIT
    max_key_length = KEY_LIMIT

    def __init__(self, context: BackendContext):
        super().__init__(context)
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.largest_write = 0

    def put_one(self, key: str, buffers: Sequence[bytes | memoryview]) -> int:
        value = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
        if len(key.encode()) > KEY_LIMIT:
            raise BackendError(f"CLIENT_ERROR key of {len(key.encode())} bytes")
        if len(value) > VALUE_LIMIT:
            raise BackendError(f"SERVER_ERROR object too large for cache ({len(value)} bytes)")
        with self.lock:
            self.data[key] = value
            self.largest_write = max(self.largest_write, len(value))
        return len(value)

    def get_one(self, key: str) -> bytes | None:
        with self.lock:
            return self.data.get(key)

    def delete_one(self, key: str) -> bool:
        with self.lock:
            return self.data.pop(key, None) is not None

    def exists_one(self, key: str) -> bool:
        with self.lock:
            return key in self.data

    def keys(self) -> Iterator[tuple[str, int]]:
        with self.lock:
            return iter([(k, len(v)) for k, v in self.data.items()])


class _Plugin:
    @hookimpl
    def lmcache_register_backends(self, registry):
        registry.add("memlimited", LimitedBackend)


class TestLimitedBackend(BytesBackendTests):
    """The whole backend suite, real sizes included, over a store with memcached's limits."""

    @pytest.fixture
    def backend(self):
        b = LimitedBackend(BackendContext.standalone())
        yield b
        b.close()


def _registries() -> Registries:
    pm = create_plugin_manager(environ={})
    pm.register(_Plugin(), name="memlimited-test")
    return Registries(pm)


def test_an_engine_stores_real_chunks_under_a_long_model_name_in_a_limited_store():
    """A Llama-3.2-1B-shaped KV (8 MiB chunks) for a model named with 200 characters, stored
    by a real engine into a tier whose backend refuses values over 1 MiB and keys over 250
    bytes, comes back exact; the tier counts each chunk once. Before: every put raised
    "object too large" and nothing was stored."""
    from lmcache.config import KVSpec

    regs = _registries()
    cfg = load_config({"model": LONG_MODEL, "tiers": [{"backend": "memlimited", "capacity": "1GiB"}]})
    spec = KVSpec(num_layers=16, num_kv_heads=8, head_size=64)
    n = 512
    tokens = torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(1))
    kv = torch.randn(16, 2, n, 8, 64, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    eng = CacheEngine(cfg, kv_spec=spec, registries=regs)
    try:
        assert eng.store(tokens, kv).stored_tokens == n
        eng.flush()
        tier = eng.hierarchy.tiers[0]
        assert isinstance(tier.backend.store, FittedBackend)
        raw = tier.backend.raw
        assert raw.largest_write <= VALUE_LIMIT and all(len(k.encode()) <= KEY_LIMIT for k in raw.data)
        stats = eng.stats()["tiers"]["memlimited"]
        assert stats["entries"] == 2 and stats["skipped_puts"] == 0 and stats["errors"] == 0
        assert stats["used_bytes"] == sum(len(v) for k, v in raw.data.items() if k != MARK)
        assert eng.lookup(tokens) == n
        res = eng.retrieve(tokens)
        assert res.num_tokens == n and torch.equal(res.kv, kv)
    finally:
        eng.close()


def test_fit_leaves_an_unbounded_backend_as_it_is_and_checks_limits():
    """No limit declared: the object view uses the byte store itself (its layout and speed
    unchanged). A limit below the minimum, or declared by a backend that stores no bytes,
    is refused."""
    b = get_registries().backends.load("cpu")(BackendContext.standalone())
    assert fit(b) is b
    limited = LimitedBackend(BackendContext.standalone())
    view = fit(limited)
    assert isinstance(view, FittedBackend) and fit(view) is view
    assert fit(view, max_value_size=8192).max_value_size == 8192 and fit(limited, max_value_size=1 << 30).max_value_size == VALUE_LIMIT
    with pytest.raises(PluginError, match="max_key_length must be None or an integer of at least 80"):
        fit(limited, max_key_length=10)

    class ObjectsWithLimit(StorageBackend):
        max_value_size = 1 << 20

        def exists(self, keys):
            return [False] * len(keys)

        def get(self, keys, on_ready=None):
            return [None] * len(keys)

        def put(self, items):
            return [0] * len(items)

        def delete(self, keys):
            return [False] * len(keys)

    with pytest.raises(PluginError, match="does not store bytes"):
        fit(ObjectsWithLimit(BackendContext.standalone()))


@pytest.mark.parametrize(
    "name, options, limits",
    [("redis", {"url": "redis://127.0.0.1:1/0"}, (512 << 20, None)),
     ("valkey", {"url": "valkey://127.0.0.1:1/0"}, (512 << 20, None)),
     ("lm", {"url": "lm://127.0.0.1:1", "prefix": "p:"}, (1 << 30, 4094))],
)
def test_built_ins_declare_their_limits(name, options, limits):
    """What the stores refuse, declared (opening connects lazily: no server needed)."""
    try:
        b = get_registries().backends.load(name)(BackendContext.standalone(options))
    except ImportError as exc:
        from tests._missing import missing

        missing(f"{name}'s client library: {exc}")
    try:
        assert (b.max_value_size, b.max_key_length) == limits
    finally:
        b.close()


def test_an_unknown_backend_option_names_the_backend_and_the_near_miss():
    """Named as the config names it (a third-party plugin's too), with a "did you mean" as
    top-level keys have. Before: "unknown key for backend SQLiteBackend; its keys: path,
    timeout" (the class, no hint)."""
    regs = get_registries()
    if "sqlite" not in regs.backends:
        from tests._missing import missing

        missing("the example plugin (pip install -e examples/lmcache-plugin-example)")
    with pytest.raises(ConfigError) as info:
        check_backend_options(regs.backends.load("sqlite"), {"paht": "/tmp/x.db"}, None)
    assert info.value.key == "paht"
    assert "unknown key for backend 'sqlite'; did you mean 'path'? its keys: path, timeout" in str(info.value)
    disk = regs.backends.load("disk")
    with pytest.raises(ConfigError, match=r"unknown key for backend 'disk'; its keys: "):
        check_backend_options(disk, {"zzzz": 1}, None)
    # a class registered nowhere is named by its class
    with pytest.raises(ConfigError, match=r"unknown key for backend 'LimitedBackend'; did you mean 'servers'\?"):
        check_backend_options(LimitedBackend, {"server": "x"}, None)


class _CountingLimitedBackend(LimitedBackend):
    """memcached's limits, counting the keys it is asked about."""

    def __init__(self, context: BackendContext):
        super().__init__(context)
        self.asked: list[str] = []

    def exists_one(self, key: str) -> bool:
        self.asked.append(key)
        return super().exists_one(key)

    def get_one(self, key: str) -> bytes | None:
        self.asked.append(key)
        return super().get_one(key)


class _KeyLimitedBackend(_CountingLimitedBackend):
    """Keys limited as S3's object names are, values not."""

    max_value_size = None


def test_a_key_limit_alone_costs_a_fitting_key_no_head_lookup():
    """Before: every miss of a key that fits was looked up a second time as a head, also on
    a store that declares only a key limit (S3), where a key that fits is never split."""
    inner = _KeyLimitedBackend(BackendContext.standalone())
    view = fit(inner)
    objects = open_objects(inner)
    short = "lmc1:test:org%2Fmodel:float16-L2-H2-D8-lt2hd-tp0of1:" + "0" * 32
    assert view.exists([short]) == [False] and objects.get([short]) == [None] and view.get_one(short) is None
    assert set(inner.asked) == {short}, inner.asked
    long_key = short.replace("org%2Fmodel", "x" * 300)  # over the key limit: only its head is asked for
    inner.asked.clear()
    assert view.exists([long_key]) == [False]
    assert inner.asked and all(k.startswith("lmc1:lmcache.head:") for k in inner.asked), inner.asked


def test_a_value_limit_costs_a_miss_a_head_lookup_only_once_entries_are_split(monkeypatch):
    """Before: on a store with a value limit (redis, lm, mooncake) every miss of a key that
    fits was asked for again as a head. Now only once the store holds an entry in parts
    (a peer's mark, seen within MARK_RECHECK seconds; 0 here)."""
    import lmcache.fit as fitmod
    from lmcache.testing import make_key
    from lmcache.testing.sizes import make_chunk

    monkeypatch.setattr(fitmod, "MARK_RECHECK", 0.0)
    inner = _CountingLimitedBackend(BackendContext.standalone())
    reader, writer = open_objects(inner), open_objects(inner)  # two views over one store
    short = make_key(7)
    assert reader.exists([short]) == [False]
    assert [k for k in inner.asked if k.startswith("lmc1:lmcache.head:")] == [], inner.asked
    big = make_key(8)
    writer.put_one(big, make_chunk(8, (2, 2, 256, 8, 64)))  # 2 MiB: stored in parts, the store marked
    inner.asked.clear()
    assert reader.exists([short, big]) == [False, True]
    assert any(k.startswith("lmc1:lmcache.head:") for k in inner.asked)
    (got,) = reader.get([big])
    assert got is not None
    got.unref()
