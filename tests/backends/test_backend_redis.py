"""The ``redis`` and ``valkey`` backends against real servers on loopback ports.

Standalone, 3-master cluster and sentinel stores (valkey: standalone and cluster) are
started once per session (``lmcache.testing.stores.redis``); each test works under its own key
prefix, so tests never see each other's entries. Fault tests start their own servers,
because they kill them.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid

import pytest
import torch
from _kv import wave
from _missing import missing

import lmcache
from lmcache import payload
from lmcache.codecs import load_codec
from lmcache.config import KVSpec
from lmcache.errors import BackendError, ConfigError
from lmcache.testing.stores import ServerUnavailable
from lmcache.plugin_manager import get_registries
from lmcache.storage import BackendContext
from lmcache.encoded import open_objects
from lmcache.testing import BytesBackendTests, PersistentBackendTests, assert_hang_times_out, assert_rejects, assert_survives_outage, make_key, make_obj

REGS = get_registries()

#: store kind -> (backend name, launcher name in lmcache.testing.stores.redis)
KINDS = {
    "redis": ("redis", "redis_store"),
    "redis-cluster": ("redis", "redis_cluster_store"),
    "redis-sentinel": ("redis", "redis_sentinel_store"),
    "valkey": ("valkey", "valkey_store"),
    "valkey-cluster": ("valkey", "valkey_cluster_store"),
}
L, H, D = 2, 2, 8


def baseline(name):
    """The raw-client baseline registered for backend ``name`` (lmcache_register_bench_baselines)."""
    from lmcache.plugin_manager import get_registries

    return get_registries().baselines.load(name)



def _launcher(kind: str):
    from lmcache.testing.stores import redis as lr

    return getattr(lr, KINDS[kind][1])


def _backend_cls(name: str):
    try:
        return REGS.backends.load(name)
    except ImportError as exc:
        missing(f"the {name} client is not installed: {exc}")


@pytest.fixture(scope="session")
def stores():
    """``stores(kind)``: that kind's store, started on first use, stopped at the end."""
    started: dict[str, object] = {}
    failed: dict[str, str] = {}
    with contextlib.ExitStack() as stack:

        def get(kind: str):
            if kind in failed:
                missing(failed[kind])
            if kind not in started:
                try:
                    started[kind] = stack.enter_context(_launcher(kind)())
                except ServerUnavailable as exc:
                    failed[kind] = f"{kind} store unavailable: {exc}"
                    missing(failed[kind])
            return started[kind]

        yield get


def open_backend(kind: str, stores, codec: str = "raw", **options):
    name = KINDS[kind][0]
    st = stores(kind)
    opts = {**st.options, "prefix": f"t-{uuid.uuid4().hex[:10]}:", **options}
    return _backend_cls(name)(BackendContext.standalone(opts, codec=load_codec(REGS.codecs.load, codec)))


@contextlib.contextmanager
def fresh(kind: str, **options):
    """A store of its own (fault tests kill it)."""
    try:
        with _launcher(kind)(**options) as st:
            yield st
    except ServerUnavailable as exc:
        missing(f"{kind} store unavailable: {exc}")


def kv_for(tokens):
    t = torch.as_tensor(list(tokens), dtype=torch.float64)
    base = torch.arange(L * 2 * H * D, dtype=torch.float64).reshape(L, 2, 1, H, D)
    return wave(base * 0.01 + t.reshape(1, 1, -1, 1, 1) * 0.37).to(torch.float32)


# ------------------------------------------------------------------ conformance
@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("kind", list(KINDS))
class TestRedisConformance(PersistentBackendTests, BytesBackendTests):
    @pytest.fixture
    def backend(self, kind, codec, stores):
        b = open_backend(kind, stores, codec)
        yield b
        b.delete([k for k, _ in b.keys()])
        assert list(b.keys()) == []
        b.close()

    @pytest.fixture
    def reopen(self, backend, kind, codec):
        return lambda read_only=False: _backend_cls(KINDS[kind][0])(BackendContext.standalone(
            dict(backend.options), codec=load_codec(REGS.codecs.load, codec), read_only=read_only))


# ------------------------------------------------------------------ URLs and options
GOOD_URLS = [
    ("redis://localhost", ("standalone", False, (("localhost", 6379),), 0, None)),
    ("redis://h:7000/3", ("standalone", False, (("h", 7000),), 3, None)),
    ("rediss://user:p%40ss@h:6380/1", ("standalone", True, (("h", 6380),), 1, None)),
    ("redis://[::1]:6379/0", ("standalone", False, (("::1", 6379),), 0, None)),
    ("redis+cluster://a:1,b:2,c", ("cluster", False, (("a", 1), ("b", 2), ("c", 6379)), 0, None)),
    ("rediss+cluster://a:1", ("cluster", True, (("a", 1),), 0, None)),
    ("redis+sentinel://s1:26379,s2/mymaster/2", ("sentinel", False, (("s1", 26379), ("s2", 26379)), 2, "mymaster")),
    ("redis+sentinel://s1/mymaster", ("sentinel", False, (("s1", 26379),), 0, "mymaster")),
    ("valkey://v:6390", ("standalone", False, (("v", 6390),), 0, None)),
    ("valkeys://v/4", ("standalone", True, (("v", 6379),), 4, None)),
    ("valkey+cluster://v1:7000,v2:7001", ("cluster", False, (("v1", 7000), ("v2", 7001)), 0, None)),
]

BAD_URLS = [
    None, "", "localhost:6379", "http://h:6379", "redis+raft://h", "memcached://h", "redis://", "redis://h:0",
    "redis://h:99999", "redis://h:port", "redis://h/abc", "redis://h/-1", "redis://h/1/2", "redis://a:1,b:2",
    "redis+cluster://a:1/3", "redis+sentinel://s:26379", "redis+sentinel://s:26379/", "redis://h?db=1",
    "redis://[::1", "redis://:1", 6379,
]


@pytest.mark.parametrize("url,want", GOOD_URLS)
def test_good_urls(url, want):
    from lmcache.backends.redis import parse_url

    t = parse_url(url)
    assert (t.mode, t.tls, t.nodes, t.db, t.master) == want
    assert "p@ss" not in t.describe()


def test_url_credentials():
    from lmcache.backends.redis import parse_url

    t = parse_url("rediss://alice:p%40ss@h:6380/1")
    assert (t.username, t.password) == ("alice", "p@ss")
    t = parse_url("redis://secret@h")
    assert (t.username, t.password) == (None, "secret")
    assert "secret" not in repr(t) and "secret" not in t.describe()


@pytest.mark.parametrize("name", ["redis", "valkey"])
@pytest.mark.parametrize("url", BAD_URLS)
def test_bad_urls_are_config_errors_naming_url(name, url):
    cls = _backend_cls(name)
    with pytest.raises(ConfigError) as ei:
        cls.check_options({"url": url})
    assert ei.value.key == "url"
    with pytest.raises(ConfigError) as ei:  # the constructor too, before any connection
        cls(BackendContext.standalone({"url": url}))
    assert ei.value.key == "url"


@pytest.mark.parametrize(
    "options,key",
    [
        ({}, "url"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": "1s"}, "timeout"),
        ({"timeout": True}, "timeout"),
        ({"prefix": 3}, "prefix"),
        ({"batch": 0}, "batch"),
        ({"max_connections": True}, "max_connections"),
        ({"max_connections": 2.5}, "max_connections"),
        ({"ttl": -1}, "ttl"),
        ({"ssl_cert_reqs": "maybe"}, "ssl_cert_reqs"),
        ({"ssl_check_hostname": "yes"}, "ssl_check_hostname"),
        ({"ssl_ca_certs": "/ca.pem"}, "ssl_ca_certs"),  # TLS settings on a plain URL
        ({"urls": "redis://h"}, "urls"),
    ],
)
def test_bad_options_are_config_errors_naming_the_key(options, key):
    cls = _backend_cls("redis")
    opts = {"url": "redis://127.0.0.1:1/0", **options} if key != "url" else options
    assert_rejects(cls, opts, key, construct=False)


def test_a_missing_client_package_names_the_extra_to_install():
    from lmcache.errors import MissingDependencyError

    class NoClient(_backend_cls("redis")):
        CLIENT = {**_backend_cls("redis").CLIENT, "package": "lmcache_no_such_client"}

    with pytest.raises(MissingDependencyError, match=r"pip install 'lmcache\[lmcache_no_such_client\]'"):
        NoClient(BackendContext.standalone({"url": "redis://127.0.0.1:1/0"}))


def test_bad_url_in_an_engine_config_names_the_tier_key():
    with pytest.raises(ConfigError) as ei:
        lmcache.CacheEngine.from_config({"tiers": [{"backend": "redis", "capacity": "1MiB", "url": "redis://a:1,b:2"}]})
    assert ei.value.key == "tiers[0].url"


def test_unreachable_server_does_not_stop_the_backend_or_engine():
    from lmcache.testing.stores import free_port

    port = free_port()
    for url in (f"redis://127.0.0.1:{port}/0", f"redis+cluster://127.0.0.1:{port}", f"redis+sentinel://127.0.0.1:{port}/m"):
        b = _backend_cls("redis")(BackendContext.standalone({"url": url, "timeout": 0.5}))
        t0 = time.monotonic()
        with pytest.raises(BackendError, match=str(port)):
            b.exists([make_key(1)])
        assert time.monotonic() - t0 < 5
        b.close()
    cfg = {"chunk_size": 16, "staging_size": "1MiB",
           "tiers": [{"backend": "redis", "capacity": "1MiB", "url": f"redis://127.0.0.1:{port}/0", "timeout": 0.5}]}
    with lmcache.CacheEngine.from_config(cfg) as e:
        toks = list(range(32))
        e.store(toks, kv_for(toks))
        assert e.lookup(toks) == 0 and e.retrieve(toks).num_tokens == 0


# ------------------------------------------------------------------ integrity and keys
@pytest.mark.parametrize("kind", ["redis", "redis-cluster", "valkey"])
def test_corrupt_or_truncated_values_are_misses_and_deleted(kind, stores):
    b = open_backend(kind, stores)
    objs = open_objects(b)  # the store as a tier opens it: payloads decoded and checked
    try:
        keys = [make_key(i) for i in range(5)]
        objs.put([(k, make_obj(i)) for i, k in enumerate(keys)])
        raw = b._conn()  # the client library itself
        good = raw.get(b.prefix + keys[0])
        raw.set(b.prefix + keys[0], good[:-7])  # truncated body
        raw.set(b.prefix + keys[1], good[: payload.PREFIX_SIZE + 3])  # truncated header
        raw.set(b.prefix + keys[2], b"not a payload at all")  # garbage
        raw.set(b.prefix + keys[3], good)  # a valid payload of another key
        got = objs.get(keys)
        assert got[:4] == [None] * 4 and got[4] is not None
        got[4].unref()
        for k in keys[:4]:
            assert raw.exists(b.prefix + k) == 0, k
        assert b.integrity.corrupt == 4
        raw.set(b.prefix + keys[0], good[:-1])
        assert objs.get_one(keys[0]) is None and raw.exists(b.prefix + keys[0]) == 0
        assert objs.exists(keys) == [False] * 4 + [True]
        assert b.exists(keys) == [False] * 4 + [True]
    finally:
        b.delete([k for k, _ in b.keys()])
        b.close()


@pytest.mark.parametrize("kind", ["redis", "valkey"])
def test_a_non_string_value_under_a_key_is_a_miss_dropped_and_rewritten(kind, stores):
    """The outside review: a list under an lmcache key made EXISTS say yes and MGET nil:
    lookup promised 48 tokens, retrieve returned 16, nothing was logged, the key was never
    cleaned and stores skipped it. Now the lookup stops there (16), the key is dropped and
    counted as corrupt, and the next store writes the chunk again."""
    st = stores(kind)
    tier = {"backend": KINDS[kind][0], "capacity": "16MiB", **st.options, "prefix": f"t-{uuid.uuid4().hex[:10]}:"}
    toks = list(range(48))
    with lmcache.CacheEngine.from_config({"chunk_size": 16, "tiers": [tier], "kv_spec": KVSpec(L, H, D, "float32")}) as e:
        e.store(toks, kv_for(toks))
        backend = e.hierarchy.tiers[0].backend  # the store of objects the tier opened
        own = getattr(backend, "raw", backend)  # the Redis byte store itself (lmcache.encoded)
        raw = own._conn()
        second = own.prefix + e.chunk_keys(toks)[1][1]
        raw.delete(second)
        raw.rpush(second, b"not", b"a", b"payload")
        assert e.lookup(toks) == 16
        assert raw.exists(second) == 0 and backend.integrity.corrupt == 1
        assert e.retrieve(toks).num_tokens == 16
        e.store(toks, kv_for(toks))
        assert e.lookup(toks) == 48
        r = e.retrieve(toks)
        assert r.num_tokens == 48 and torch.equal(r.kv, kv_for(toks))
        backend.delete(e.chunk_keys(toks)[1])


def test_a_wrong_shape_hit_from_a_lower_tier_is_never_promoted(stores):
    """The outside review: a Redis hit of the wrong shape (a forged payload with valid
    checksums) was copied into the CPU tier before the engine's shape check. Now it is
    refused, removed from Redis, and the CPU tier never holds it."""
    st = stores("redis")
    tier = {"backend": "redis", "capacity": "16MiB", **st.options, "prefix": f"t-{uuid.uuid4().hex[:10]}:"}
    cfg = {"chunk_size": 16, "tiers": [{"backend": "cpu", "capacity": "4MiB"}, tier], "kv_spec": KVSpec(L, H, D, "float32")}
    toks = list(range(32))
    with lmcache.CacheEngine.from_config(cfg) as e:
        keys = e.chunk_keys(toks)[1]
        redis_tier = e.hierarchy.tiers[1]
        from lmcache.memory import MemoryPool

        wrong = MemoryPool.allocate_unpooled((L, 2, 16, H, D * 2), torch.float32)  # another head size
        wrong.tensor.zero_()
        data = b"".join(bytes(b) for b in payload.encode(keys[0], wrong, load_codec(REGS.codecs.load, "raw")))
        own = getattr(redis_tier.backend, "raw", redis_tier.backend)  # the Redis byte store (lmcache.encoded)
        raw = own._conn()
        raw.set(own.prefix + keys[0], data)  # valid header and checksums, wrong shape
        assert e.retrieve(toks).num_tokens == 0
        assert keys[0] not in dict(e.hierarchy.tiers[0].keys())  # never promoted into the CPU tier
        assert raw.exists(own.prefix + keys[0]) == 0  # and dropped from Redis
        assert e.stats()["tiers"][redis_tier.name]["corrupt"] == 1


@pytest.mark.parametrize("kind", ["redis", "redis-cluster", "valkey-cluster"])
def test_keys_lists_only_lmcache_keys_under_the_prefix(kind, stores):
    b = open_backend(kind, stores)
    try:
        sizes = open_objects(b).put([(make_key(i), make_obj(i)) for i in range(3)])
        raw = b._conn()
        foreign = [
            b.prefix + "lmc1:not:a:valid:key",
            b.prefix.encode() + b"lmc1:\xff\xfe:m:s:" + b"0" * 32,
            b.prefix + "session:42",
            make_key(99),  # a valid key outside our prefix
            "x" + b.prefix + make_key(98),
        ]
        for name in foreign:
            raw.set(name, b"LMCK whatever")
        listed = dict(b.keys())
        assert listed == {make_key(i): s for i, s in enumerate(sizes)}
        entries = {e.key: e for e in b.entries()}
        assert set(entries) == set(listed) and {e.codec for e in entries.values()} == {"raw"}
        assert b.usage().entries == 3
        for name in foreign:
            raw.delete(name)
    finally:
        b.delete([k for k, _ in b.keys()])
        b.close()


def test_prefixes_isolate_and_glob_characters_are_literal(stores):
    a = open_backend("redis", stores, prefix="a*[x]?:")
    b = open_backend("redis", stores, prefix="ab[x]y:")
    c = open_backend("redis", stores, prefix="")  # no prefix: the bare canonical key
    oa, ob, oc = (open_objects(x) for x in (a, b, c))
    try:
        k = make_key(1)
        oa.put([(k, make_obj(1))])
        assert b.exists([k]) == [False] and b.get([k]) == [None] and list(b.keys()) == []
        assert ob.get([k]) == [None]
        assert c.exists([k]) == [False]
        ob.put([(k, make_obj(2))])
        oc.put([(k, make_obj(3))])
        ga, gb, gc = oa.get([k])[0], ob.get([k])[0], oc.get([k])[0]
        assert torch.equal(ga.tensor, make_obj(1).tensor) and torch.equal(gb.tensor, make_obj(2).tensor)
        assert torch.equal(gc.tensor, make_obj(3).tensor)
        for g in (ga, gb, gc):
            g.unref()
        assert [key for key, _ in a.keys()] == [k] and [key for key, _ in b.keys()] == [k]
        assert c._conn().exists(k) == 1 and k in dict(c.keys())
        assert a.delete([k]) == [True]
        assert a.exists([k]) == [False] and b.exists([k]) == [True] and c.exists([k]) == [True]
    finally:
        for x in (a, b, c):
            x.delete([make_key(1)])
            x.close()


def test_ttl_expires_entries(stores):
    b = open_backend("redis", stores, ttl=100)
    try:
        open_objects(b).put([(make_key(1), make_obj(1))])
        assert 0 < b._conn().ttl(b.prefix + make_key(1)) <= 100
    finally:
        b.delete([make_key(1)])
        b.close()


def test_valkey_backend_uses_the_valkey_client(stores):
    b = open_backend("valkey", stores)
    try:
        assert type(b._conn()).__module__.startswith("valkey.")
        open_objects(b).put([(make_key(1), make_obj(1))])
        assert b.exists([make_key(1)]) == [True]
    finally:
        b.delete([make_key(1)])
        b.close()


@pytest.mark.parametrize("kind", ["redis", "redis-cluster", "valkey"])
def test_raw_transfer_moves_the_bytes_and_cleans_up(kind, stores):
    st = stores(kind)
    cls = _backend_cls(KINDS[kind][0])
    prefix = f"raw-{uuid.uuid4().hex[:8]}:"
    items = [(f"item{i}", os.urandom(1000 + i)) for i in range(50)]
    put_s, get_s = baseline(KINDS[kind][0])({**st.options, "prefix": prefix}, items, 16)
    assert put_s >= 0 and get_s >= 0
    b = cls(BackendContext.standalone({**st.options, "prefix": prefix}))
    try:
        assert list(b._conn().scan_iter(match=prefix + "*")) == []
    finally:
        b.close()


def test_two_engines_share_entries_through_one_store(stores):
    st = stores("redis-cluster")
    prefix = f"share-{uuid.uuid4().hex[:8]}:"
    tier = {"backend": "redis", "capacity": "16MiB", **st.options, "prefix": prefix}
    cfg = {"chunk_size": 16, "staging_size": "4MiB", "namespace": "team", "tiers": [tier]}
    toks = list(range(70))
    with lmcache.CacheEngine.from_config(cfg) as a:
        a.store(toks, kv_for(toks))
    with lmcache.CacheEngine.from_config(cfg, kv_spec=KVSpec(L, H, D, "float32")) as b:
        assert b.locate(toks) == (70, ["redis"] * 5)
        res = b.retrieve(toks)
        assert res.num_tokens == 70 and torch.equal(res.kv, kv_for(toks))
        keys = b.chunk_keys(toks)[1]
        listed = dict(b.hierarchy.tiers[0].backend.keys())
        assert set(listed) == set(keys) and all(k.startswith("lmc1:team:") for k in keys)
        b.hierarchy.tiers[0].backend.delete(keys)


def test_tls():
    with fresh("redis", tls=True) as st:
        assert st.options["url"].startswith("rediss://")
        b = _backend_cls("redis")(BackendContext.standalone(st.options))
        objs = open_objects(b)
        objs.put([(make_key(1), make_obj(1))])
        (g,) = objs.get([make_key(1)])
        assert g is not None and torch.equal(g.tensor, make_obj(1).tensor)
        g.unref()
        assert [k for k, _ in b.keys()] == [make_key(1)]
        b.close()
        # without the CA the server's certificate is refused
        no_ca = {k: v for k, v in st.options.items() if k != "ssl_ca_certs"}
        b = _backend_cls("redis")(BackendContext.standalone({**no_ca, "timeout": 0.5}))
        with pytest.raises(BackendError):
            b.exists([make_key(1)])
        b.close()


# ------------------------------------------------------------------ faults
def test_a_hung_server_times_out_and_the_client_reconnects():
    with fresh("redis", timeout=0.3) as st:
        b = _backend_cls("redis")(BackendContext.standalone(st.options))
        open_objects(b).put([(make_key(1), make_obj(1))])
        assert_hang_times_out(open_objects(b), st.servers[0], "Timeout")
        b.close()


@pytest.mark.parametrize("kind", ["redis", "redis-cluster", "redis-sentinel"])
def test_backend_raises_fast_when_killed_and_recovers_after_restart(kind):
    with fresh(kind, timeout=0.5) as st:
        raw = _backend_cls(KINDS[kind][0])(BackendContext.standalone(st.options))
        b = open_objects(raw)
        b.put([(make_key(1), make_obj(1))])
        st.kill()
        for call in (lambda: b.get([make_key(1)]), lambda: b.put([(make_key(2), make_obj(2))]), lambda: list(b.keys()),
                     lambda: raw.get([make_key(1)]), lambda: raw.put([(make_key(2), [b"x"])])):
            t0 = time.monotonic()
            with pytest.raises(BackendError):
                call()
            assert time.monotonic() - t0 < 5
        st.restart()
        deadline = time.monotonic() + 15
        while True:  # a cluster answers CLUSTERDOWN for a moment while its nodes meet again
            try:
                b.put([(make_key(2), make_obj(2))])
                present = b.exists([make_key(1), make_key(2)])
                break
            except BackendError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert present == [False, True]  # no persistence: 1 is gone
        b.close()


@pytest.mark.parametrize("kind", ["redis", "valkey", "redis-cluster"])
def test_engine_serves_misses_while_the_store_is_down_and_hits_after_restart(kind, caplog):
    name = KINDS[kind][0]
    with fresh(kind, timeout=0.5) as st:
        cfg = {"chunk_size": 16, "staging_size": "4MiB",
               "tiers": [{"backend": name, "capacity": "64MiB", **st.options}]}
        toks = list(range(64))
        with lmcache.CacheEngine.from_config(cfg) as e:
            e.store(toks, kv_for(toks))
            assert e.locate(toks) == (64, [name] * 4)
            assert torch.equal(e.retrieve(toks).kv, kv_for(toks))

            assert_survives_outage(e, st, name, toks, kv_for, caplog)


def test_engine_writes_the_same_chunks_again_after_the_store_restarted_empty():
    with fresh("redis", timeout=0.5) as st:
        cfg = {"chunk_size": 16, "staging_size": "4MiB", "tiers": [{"backend": "redis", "capacity": "64MiB", **st.options}]}
        toks = list(range(64))
        with lmcache.CacheEngine.from_config(cfg) as e:
            e.store(toks, kv_for(toks))
            st.kill()
            assert e.lookup(toks) == 0
            st.restart()
            probe = list(range(10**6, 10**6 + 16))
            deadline = time.monotonic() + 15
            while e.lookup(probe) == 0:  # until the tier serves again
                assert time.monotonic() < deadline
                e.store(probe, kv_for(probe))
                time.sleep(0.1)
            e.store(toks, kv_for(toks))  # the same prompt again: its chunks must be written
            assert e.lookup(toks) == 64
