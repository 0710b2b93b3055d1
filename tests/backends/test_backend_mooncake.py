"""The ``mooncake`` backend against a real ``mooncake_master`` on loopback.

One master serves the module (each backend gets its own key prefix, so tests never see
each other's entries); the fault tests start their own master, because they kill it.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from _kv import wave

import lmcache
from lmcache.codecs import load_codec
from lmcache.errors import BackendError, ConfigError, MissingDependencyError
from lmcache.testing.stores import ServerUnavailable, free_port
from lmcache.plugin_manager import get_registries
from lmcache.storage import BackendContext
from lmcache.encoded import open_objects
from lmcache.testing import BytesBackendTests, assert_rejects, make_key, make_obj
from _missing import missing

REGS = get_registries()
L, H, D = 2, 2, 8


def baseline(name):
    """The raw-client baseline registered for backend ``name`` (lmcache_register_bench_baselines)."""
    from lmcache.plugin_manager import get_registries

    return get_registries().baselines.load(name)



def _backend_class():
    try:
        return REGS.backends.load("mooncake")
    except MissingDependencyError as exc:
        missing(str(exc))


@pytest.fixture(scope="module")
def Mooncake():
    return _backend_class()


def _start(**kw):
    from lmcache.testing.stores.mooncake import mooncake_store

    cm = mooncake_store(**kw)
    try:
        return cm, cm.__enter__()
    except ServerUnavailable as exc:
        missing(f"mooncake store unavailable: {exc}")


@pytest.fixture(scope="module")
def store(Mooncake):
    cm, st = _start()
    yield st
    cm.__exit__(None, None, None)


@pytest.fixture
def own_store(Mooncake):
    """A master of its own, for tests that kill it."""
    cm, st = _start()
    yield st
    cm.__exit__(None, None, None)


@pytest.fixture(scope="module")
def _idle(Mooncake, store):
    """Backends kept open for the module: a Mooncake client takes 1-2 s to close (it
    joins its heartbeat thread) and a setup waits for a close in progress, so opening a
    client per test would cost most of the time budget. The store keeps no per-backend
    state besides its entries, so a backend with a fresh prefix is a fresh, empty one."""
    idle: dict[tuple, list] = {}
    opened: list = []
    yield idle, opened
    with ThreadPoolExecutor(len(opened) or 1) as ex:  # before the master stops
        list(ex.map(lambda b: b.close(), opened))


@pytest.fixture
def make(Mooncake, store, _idle):
    """``make(codec, **options)``: a backend on the module's master with a fresh prefix
    (unless ``prefix`` is given); distinct objects (distinct clients) within a test."""
    idle, opened = _idle
    taken = []

    def factory(codec="raw", prefix=None, **options):
        key = (codec, tuple(sorted(options.items())))
        free = idle.setdefault(key, [])
        if free:
            b = free.pop()
        else:
            opts = {**store.options, "timeout": 5.0, **options}
            b = Mooncake(BackendContext.standalone(opts, codec=load_codec(REGS.codecs.load, codec)))
            opened.append(b)
        b.prefix = prefix or f"t-{uuid.uuid4().hex[:12]}/"
        taken.append((key, b))
        return b

    yield factory
    for key, b in taken:
        idle[key].append(b)


@pytest.fixture(scope="module")
def raw(store):
    """A plain Mooncake client on the same master; it adds no memory to the store."""
    from lmcache.testing.stores.mooncake import ensure_client

    c = ensure_client().MooncakeDistributedStore()
    url = store.options["url"].removeprefix("mooncake://")
    assert c.setup("127.0.0.1", store.options["metadata_server"], 0, 16 << 20, "tcp", "", url) == 0
    yield c
    c.close()


# ----------------------------------------------------------------- conformance
class TestMooncakeConformance(BytesBackendTests):
    @pytest.fixture(params=["raw", "zstd"])
    def backend(self, request, make):
        return make(request.param)


# ----------------------------------------------------------------- options
@pytest.mark.parametrize(
    "options,key",
    [
        ({}, "url"),
        ({"url": "redis://127.0.0.1:6379"}, "url"),
        ({"url": "mooncake://"}, "url"),
        ({"url": "mooncake://host:notaport"}, "url"),
        ({"url": "mooncake://host:70000"}, "url"),
        ({"url": "mooncake://host:50051/db"}, "url"),
        ({"url": 50051}, "url"),
        ({"url": "mooncake://h", "timeout": 0}, "timeout"),
        ({"url": "mooncake://h", "timeout": True}, "timeout"),
        ({"url": "mooncake://h", "timeout": "soon"}, "timeout"),
        ({"url": "mooncake://h", "global_segment_size": "lots"}, "global_segment_size"),
        ({"url": "mooncake://h", "local_buffer_size": 0}, "local_buffer_size"),
        ({"url": "mooncake://h", "protocol": ""}, "protocol"),
        ({"url": "mooncake://h", "device_name": 3}, "device_name"),
        ({"url": "mooncake://h", "local_hostname": ""}, "local_hostname"),
        ({"url": "mooncake://h", "metadata_server": "ftp://h/x"}, "metadata_server"),
        ({"url": "mooncake://h", "admin_url": "h:9003"}, "admin_url"),
        ({"url": "mooncake://h", "prefix": "a,b"}, "prefix"),
        ({"url": "mooncake://h", "replicas": 2}, "replicas"),
    ],
)
def test_bad_options_name_the_key(Mooncake, options, key):
    assert_rejects(Mooncake, options, key)


def test_good_urls(Mooncake):
    from lmcache.backends.mooncake import parse_url

    assert parse_url("mooncake://master") == ("master", 50051)
    assert parse_url("mooncake://10.0.0.5:6000") == ("10.0.0.5", 6000)
    assert parse_url("mooncake://[::1]:6000/") == ("::1", 6000)


def test_engine_config_error_names_the_tier_key(Mooncake):
    with pytest.raises(ConfigError) as ei:
        lmcache.CacheEngine.from_config({"tiers": [{"backend": "mooncake", "url": "mooncake://h:x", "capacity": "1GiB"}]})
    assert ei.value.key == "tiers[0].url"


def test_loopback_options_are_backend_options(Mooncake, store):
    assert set(store.options) <= set(Mooncake.OPTIONS)
    Mooncake.check_options(store.options)


# ----------------------------------------------------------------- behaviour
def test_constructor_does_not_connect_and_a_down_master_fails_fast(Mooncake):
    port = free_port()  # nothing listens there
    b = Mooncake(BackendContext.standalone({"url": f"mooncake://127.0.0.1:{port}", "timeout": 0.5}))
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError):
            b.exists([make_key(1)])
        with pytest.raises(ConnectionError):
            open_objects(b).put([(make_key(1), make_obj(1))])
        assert time.monotonic() - t0 < 5  # a hang guard, not a performance check
    finally:
        b.close()


def test_two_instances_share_entries(make):
    a = make()
    b = make(prefix=a.prefix, codec="zstd")  # another client; reads any codec from the header
    o = make_obj(3)
    open_objects(a).put([(make_key(3), o)])
    (g,) = open_objects(b).get([make_key(3)])
    assert g is not None and torch.equal(g.tensor, o.tensor)
    g.unref()
    assert dict(b.keys()) == dict(a.keys()) and make_key(3) in dict(b.keys())
    assert b.delete([make_key(3)]) == [True]
    assert open_objects(a).get([make_key(3)]) == [None] and a.exists([make_key(3)]) == [False]


def test_keys_list_only_lmcache_keys_under_the_prefix(make, raw):
    b = make()
    other = make()
    open_objects(b).put([(make_key(1), make_obj(1))])
    open_objects(other).put([(make_key(2), make_obj(2))])
    assert raw.upsert(b.prefix + "not-an-lmcache-key", b"x") == 0
    assert raw.upsert(b.prefix + "lmc1:bad", b"x") == 0
    try:
        assert [k for k, _ in b.keys()] == [make_key(1)]
        assert [k for k, _ in other.keys()] == [make_key(2)]
        assert b.usage().entries == 1
    finally:
        raw.batch_remove([b.prefix + "not-an-lmcache-key", b.prefix + "lmc1:bad"], True)


def test_corrupt_and_truncated_payloads_are_misses_and_removed(make, raw):
    b = make()
    objects = open_objects(b)
    good, garbage, truncated, flipped = (make_key(i) for i in range(4))
    objs = {k: make_obj(i) for i, k in enumerate((good, truncated, flipped))}
    objects.put(list(objs.items()))
    whole = raw.get(b.prefix + truncated)
    assert len(whole) > 100
    assert raw.upsert(b.prefix + truncated, whole[: len(whole) // 2]) == 0
    body = bytearray(raw.get(b.prefix + flipped))
    body[-1] ^= 0xFF
    assert raw.upsert(b.prefix + flipped, bytes(body)) == 0
    assert raw.upsert(b.prefix + garbage, b"this is not a payload at all") == 0
    before = b.integrity.corrupt
    got = objects.get([good, garbage, truncated, flipped])
    assert got[1:] == [None, None, None]
    assert got[0] is not None and torch.equal(got[0].tensor, objs[good].tensor)
    got[0].unref()
    assert b.integrity.corrupt == before + 3
    assert b.exists([good, garbage, truncated, flipped]) == [True, False, False, False]
    assert raw.batch_is_exist([b.prefix + k for k in (garbage, truncated, flipped)]) == [0, 0, 0]
    # the single-key path drops a bad entry the same way
    assert raw.upsert(b.prefix + garbage, b"LMCK garbage") == 0
    assert objects.get_one(garbage) is None and raw.is_exist(b.prefix + garbage) == 0
    # the store's own get hands the bytes over as they are: checking them is the view's
    assert raw.upsert(b.prefix + garbage, b"LMCK garbage") == 0
    assert bytes(b.get_one(garbage)) == b"LMCK garbage" and b.delete_one(garbage) is True


def test_batches_larger_than_the_local_buffer(make):
    b = make(local_buffer_size="1MiB")
    objects = open_objects(b)
    objs = [(make_key(i), make_obj(i, num_tokens=2400)) for i in range(6)]  # ~300 KiB each
    sizes = objects.put(objs)
    assert sum(sizes) > 1 << 20
    got = objects.get([k for k, _ in objs])  # does not fit the local buffer at once
    for (_, o), g in zip(objs, got):
        assert g is not None and torch.equal(g.tensor, o.tensor)
        g.unref()
    big = make_obj(9, num_tokens=9000)  # ~1.1 MiB: cannot be staged as one value
    with pytest.raises(BackendError, match="local_buffer_size"):
        b.put_one(make_key(9), [bytes(big.nbytes + 4096)])
    assert b.exists([make_key(9)]) == [False]
    # the local buffer is the store's max_value_size: a tier stores such a payload in parts
    assert b.max_value_size == 1 << 20
    assert objects.put([(make_key(9), big)])[0] > 1 << 20
    (g,) = objects.get([make_key(9)])
    assert g is not None and torch.equal(g.tensor, big.tensor)
    g.unref()
    assert objects.delete([make_key(9)]) == [True] and objects.exists([make_key(9)]) == [False]


class _Overlaps:
    """The backend's real client, passed through; it notes how many upserts of one name
    were in flight at once."""

    def __init__(self, client):
        self._client, self._lock = client, threading.Lock()
        self.in_flight: dict[str, int] = {}
        self.most = 0

    def __getattr__(self, name):
        return getattr(self._client, name)

    def _watch(self, method: str, name: str, *parts):
        with self._lock:
            self.in_flight[name] = self.in_flight.get(name, 0) + 1
            self.most = max(self.most, self.in_flight[name])
        try:
            time.sleep(0.001)  # widen the window two calls would share
            return getattr(self._client, method)(name, *parts)
        finally:
            with self._lock:
                self.in_flight[name] -= 1

    def upsert_parts(self, name, *parts):
        return self._watch("upsert_parts", name, *parts)


def test_one_keys_upserts_from_one_process_never_overlap(make):
    """Two upserts of one key at once race inside Mooncake (once, under load, the loser's
    bytes landed in another key's object): this process sends them one at a time, while
    other keys' upserts still run side by side."""
    b = make()
    objects = open_objects(b)
    b.exists([make_key(0)])  # connects
    watched = b._store = _Overlaps(b._store)
    shared = make_key(10_000)
    shared_objs = [make_obj(900 + t) for t in range(6)]

    def work(t: int) -> None:
        for r in range(10):
            objects.put([(shared, shared_objs[t])])
            b.put_one(shared + "-bytes", [bytes([t]) * 64])
            own = [(make_key(1000 * t + 10 * r + j), make_obj(1000 * t + 10 * r + j)) for j in range(2)]
            objects.put(own)
            for (k, o), g in zip(own, objects.get([k for k, _ in own])):
                assert g is not None and torch.equal(g.tensor, o.tensor), k
                g.unref()

    with ThreadPoolExecutor(6) as ex:
        list(ex.map(work, range(6)))
    assert watched.most == 1, f"{watched.most} upserts of one key at once"
    (g,) = objects.get([shared])
    assert g is not None and any(torch.equal(g.tensor, o.tensor) for o in shared_objs)
    g.unref()
    assert b.get_one(shared + "-bytes") in {bytes([t]) * 64 for t in range(6)}


def test_read_only_backend_adds_no_memory(Mooncake, store, make):
    def segments():
        with urllib.request.urlopen(store.options["admin_url"] + "/get_all_segments", timeout=5) as r:
            return set(r.read().decode().split())

    w = make()
    open_objects(w).put([(make_key(1), make_obj(1))])
    before = segments()
    ro = Mooncake(BackendContext.standalone({**store.options, "prefix": w.prefix}, read_only=True))
    try:
        assert [k for k, _ in ro.keys()] == [make_key(1)]
        (g,) = open_objects(ro).get([make_key(1)])
        assert g is not None
        g.unref()
        assert segments() <= before  # no new segment (others may be leaving meanwhile)
    finally:
        ro.close()


def test_raw_transfer_moves_the_bytes_and_cleans_up(Mooncake, store, raw):
    prefix = f"raw-{uuid.uuid4().hex[:8]}/"
    items = [(f"bench-{i}", bytes([i]) * (100_000 + i)) for i in range(12)]
    put_s, get_s = baseline("mooncake")({**store.options, "prefix": prefix}, items, 5)
    assert put_s >= 0 and get_s >= 0
    assert raw.batch_is_exist([prefix + n for n, _ in items]) == [0] * len(items)


def test_bounded_calls_fail_fast_while_a_call_is_stuck():
    from lmcache.backends.mooncake import BoundedCalls

    calls = BoundedCalls(0.2, workers=2, name="lmcache-test-bounded")
    release = threading.Event()
    try:
        assert calls.run("quick", lambda: 7) == 7
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="did not return"):
            calls.run("stuck", release.wait, 30)
        with pytest.raises(TimeoutError, match="has not returned"):
            calls.run("next", lambda: 1)  # refused at once, not queued
        assert time.monotonic() - t0 < 5
        release.set()
        deadline = time.monotonic() + 5
        while True:
            try:
                assert calls.run("after", lambda: 2) == 2
                break
            except TimeoutError:
                assert time.monotonic() < deadline
                time.sleep(0.01)
    finally:
        release.set()
        calls.shutdown()


# ----------------------------------------------------------------- faults
def kv_for(tokens):
    t = torch.as_tensor(list(tokens), dtype=torch.float64)
    base = torch.arange(L * 2 * H * D, dtype=torch.float64).reshape(L, 2, 1, H, D)
    return wave(base * 0.01 + t.reshape(1, 1, -1, 1, 1) * 0.37).to(torch.float32)


def _engine(options):
    tier = {"backend": "mooncake", "capacity": "64MiB", **options, "timeout": 0.5,
            "prefix": f"fault-{uuid.uuid4().hex[:8]}/"}
    return lmcache.CacheEngine.from_config({"chunk_size": 16, "tiers": [tier]})


def _bounded(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    assert time.monotonic() - t0 < 5, f"{fn.__name__} hung"  # a hang guard, not a performance check
    return out


def _wait_for_hits(e, tokens, seconds=20.0):
    """Store and look up until hits come back (the tier backs off for up to 10 s)."""
    deadline = time.monotonic() + seconds
    while True:
        _bounded(e.store, tokens, kv_for(tokens))
        if _bounded(e.lookup, tokens) == len(tokens):
            return
        assert time.monotonic() < deadline, f"no hits {seconds}s after the master came back"
        time.sleep(0.25)


def _workers(backend):
    name = f"lmcache-mooncake-{id(backend):x}"
    return [t for t in threading.enumerate() if t.name.startswith(name)]


def test_master_killed_mid_workload_then_restarted(own_store, caplog):
    from lmcache.backends.mooncake import WORKERS

    a, b, c = list(range(64)), list(range(100, 164)), list(range(200, 248))
    with _engine(own_store.options) as e:
        backend = e.hierarchy.tiers[0].backend.raw  # the byte store under the tier's view
        # the client's first setup (256 MiB registered, 1 GiB mounted) can outlast the 0.5 s
        # timeout on a loaded machine: its calls then miss and the tier backs off, as designed
        _wait_for_hits(e, a)
        assert torch.equal(e.retrieve(a).kv, kv_for(a))
        caplog.clear()  # outages counted from the kill on
        own_store.kill()
        with caplog.at_level(logging.WARNING, logger="lmcache.hierarchy"):
            for _ in range(3):
                assert _bounded(e.lookup, a) == 0
                assert _bounded(e.retrieve, a).num_tokens == 0
                _bounded(e.store, b, kv_for(b))  # raises nothing
                time.sleep(0.2)
        outage = [r for r in caplog.records if "serving misses" in r.getMessage()]
        assert len(outage) == 1  # once per outage, not per call
        # the backend itself: every call returns or raises within its timeout, and a
        # hung client holds a bounded number of threads
        for _ in range(6):
            t0 = time.monotonic()
            with pytest.raises(Exception):
                backend.exists([make_key(1)])
            assert time.monotonic() - t0 < 5
        assert len(_workers(backend)) <= WORKERS
        own_store.restart()  # a new, empty master on the same ports
        _wait_for_hits(e, c)  # the same engine, the same client: it mounted its segment again
        res = e.retrieve(c)
        assert res.num_tokens == len(c) and torch.equal(res.kv, kv_for(c))


def test_engine_starts_while_the_master_is_down(own_store):
    own_store.kill()
    with _bounded(_engine, own_store.options) as e:
        a = list(range(40))
        _bounded(e.store, a, kv_for(a))
        assert _bounded(e.lookup, a) == 0
        own_store.restart()
        _wait_for_hits(e, a)  # set up lazily on a later call
        assert torch.equal(e.retrieve(a).kv, kv_for(a))
