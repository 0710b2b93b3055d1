"""The s3 backend against a real S3-compatible server: ``rclone serve s3`` on loopback.

One server serves the module (each test works under its own prefix); the fault tests
start their own, since they kill it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid

import pytest
import torch
from _kv import wave

import lmcache
from lmcache.testing import stores as loopback
from lmcache.codecs import load_codec
from lmcache.config import KVSpec
from lmcache.errors import BackendError, ConfigError
from lmcache.memory import MemoryPool
from lmcache.plugin_manager import get_registries
from lmcache.storage import BackendContext
from lmcache.encoded import open_objects
from lmcache.testing import BytesBackendTests, PersistentBackendTests, assert_rejects, make_key, make_obj
from _missing import loopback_store, missing

REGS = get_registries()
L, H, D = 3, 2, 16
SPEC = KVSpec(L, H, D, "float32")


def baseline(name):
    """The raw-client baseline registered for backend ``name`` (lmcache_register_bench_baselines)."""
    from lmcache.plugin_manager import get_registries

    return get_registries().baselines.load(name)



@pytest.fixture(scope="session")
def S3():
    try:
        return REGS.backends.load("s3")
    except ImportError as exc:
        missing(f"the s3 backend's client is not installed: {exc}")


@pytest.fixture(scope="session")
def s3_server(S3):
    with loopback_store("s3") as store:
        yield store


@pytest.fixture
def fresh_server(S3):
    """A server of its own, for tests that kill it."""
    with loopback_store("s3") as store:
        yield store


def unique(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def opts(s3_server):
    """Options of a private prefix on the shared server."""
    return {**s3_server.options, "prefix": unique("t")}


@pytest.fixture
def raw(S3, s3_server):
    """A plain boto3 client on the same server (to write what lmcache would not)."""
    client = S3._client(S3.check_options(s3_server.options), 4)
    yield client
    client.close()


def open_backend(S3, options, **kw):
    return S3(BackendContext.standalone(options, **kw))


def kv_for(tokens):
    t = torch.as_tensor(list(tokens), dtype=torch.float64)
    base = torch.arange(L * 2 * H * D, dtype=torch.float64).reshape(L, 2, 1, H, D)
    return wave(base * 0.01 + t.reshape(1, 1, -1, 1, 1) * 0.37).to(torch.float32)


def wipe(backend, settle: float = 10.0):
    """Remove every entry under the backend's prefix. An object can reappear after a
    delete on a loaded machine (a PUT that timed out at the client and was sent again
    may still land; rclone finishes an overwrite's rename after a concurrent delete),
    so once something was removed the prefix must list empty twice, 0.3 s apart,
    within ``settle`` seconds."""
    deadline = time.monotonic() + settle
    keys = [k for k, _ in backend.keys()]
    if not keys:
        return
    empty = 0
    while empty < 2 and time.monotonic() < deadline:
        if keys:
            backend.delete(keys)
            empty = 0
        else:
            empty += 1
        time.sleep(0.3)
        keys = [k for k, _ in backend.keys()]


# --------------------------------------------------------------------- conformance
class TestS3Conformance(PersistentBackendTests, BytesBackendTests):
    @pytest.fixture
    def reopen(self, backend, S3):
        return lambda read_only=False: open_backend(S3, dict(backend.options), codec=backend.context.codec,
                                                    read_only=read_only)

    @pytest.fixture(params=["raw", "zstd"])
    def backend(self, request, S3, opts):
        pool = MemoryPool(64 << 20)
        b = open_backend(S3, opts, codec=load_codec(REGS.codecs.load, request.param), pool=pool)
        yield b
        wipe(b)
        assert list(b.keys()) == []
        b.close()
        assert pool.used == 0, "the s3 backend leaked pool memory"


# --------------------------------------------------------------------- configuration
GOOD = {"url": "s3://lmcache"}


@pytest.mark.parametrize(
    "options,key",
    [
        ({}, "url"),
        ({"url": "s3://ab"}, "url"),  # bucket names need at least 3 characters
        ({"url": "s3://"}, "url"),
        ({"url": "s3:///prefix"}, "url"),
        ({"url": "bucket/prefix"}, "url"),
        ({"url": "http://bucket/prefix"}, "url"),
        ({"url": "s3://Bad_Bucket"}, "url"),
        ({"url": "s3://user:secret@bucket"}, "url"),
        ({"url": "s3://bucket:9000/x"}, "url"),
        ({"url": "s3://bucket/x?versionId=1"}, "url"),
        ({"url": "s3://bucket/a//b"}, "url"),
        ({"url": 42}, "url"),
        ({**GOOD, "timeout": 0}, "timeout"),
        ({**GOOD, "timeout": -1}, "timeout"),
        ({**GOOD, "timeout": "fast"}, "timeout"),
        ({**GOOD, "timeout": True}, "timeout"),
        ({**GOOD, "retries": -1}, "retries"),
        ({**GOOD, "concurrency": 0}, "concurrency"),
        ({**GOOD, "concurrency": 2.5}, "concurrency"),
        ({**GOOD, "multipart_threshold": "1MiB"}, "multipart_threshold"),
        ({**GOOD, "multipart_threshold": "lots"}, "multipart_threshold"),
        ({**GOOD, "multipart_chunksize": "6GiB"}, "multipart_chunksize"),
        ({**GOOD, "endpoint_url": "localhost:9000"}, "endpoint_url"),
        ({**GOOD, "endpoint_url": "ftp://127.0.0.1:21"}, "endpoint_url"),
        ({**GOOD, "endpoint_url": "http://127.0.0.1:notaport"}, "endpoint_url"),
        ({**GOOD, "access_key_id": "someaccesskey"}, "secret_access_key"),
        ({**GOOD, "secret_access_key": "somesecret"}, "access_key_id"),
        ({**GOOD, "region": ""}, "region"),
        ({**GOOD, "region": "eu west 1"}, "region"),
        ({**GOOD, "addressing_style": "sideways"}, "addressing_style"),
        ({**GOOD, "create_bucket": "yes"}, "create_bucket"),
        ({**GOOD, "verify": 1}, "verify"),
        ({"url": "s3://lmcache/a", "prefix": "b"}, "prefix"),
        ({**GOOD, "prefix": 7}, "prefix"),
        ({**GOOD, "bukket": "x"}, "bukket"),
    ],
)
def test_bad_options_are_config_errors_naming_the_key(S3, options, key):
    assert_rejects(S3, options, key)


def test_config_errors_name_the_tier_key(S3):
    cfg = {"tiers": [{"backend": "s3", "capacity": "1GiB", "url": "s3://ab"}]}
    with pytest.raises(ConfigError) as e:
        lmcache.CacheEngine.from_config(cfg)
    assert e.value.key == "tiers[0].url"
    cfg["tiers"][0].update(url="s3://lmcache", timeout="soon")
    with pytest.raises(ConfigError) as e:
        lmcache.CacheEngine.from_config(cfg)
    assert e.value.key == "tiers[0].timeout"


def test_good_options_are_normalised(S3):
    o = S3.check_options({"url": "s3://my.bucket-1/a/b/", "multipart_threshold": "8MiB", "timeout": 2})
    assert S3.location(o) == ("my.bucket-1", "a/b")
    assert o["multipart_threshold"] == 8 << 20 and o["timeout"] == 2.0
    assert S3.location(S3.check_options({"url": "s3://bkt", "prefix": "/p/"})) == ("bkt", "p")


# --------------------------------------------------------------------- data path
def test_keys_are_canonical_names_under_the_prefix(S3, opts, raw):
    with open_backend(S3, opts) as b:
        k = make_key(1, model="org/model v2")  # ':' and '%' in the key
        assert "%" in k and ":" in k
        (size,) = open_objects(b).put([(k, make_obj(1))])
        head = raw.head_object(Bucket="lmcache", Key=f"{opts['prefix']}/{k}")
        assert head["ContentLength"] == size
        assert list(b.keys()) == [(k, size)]
        (e,) = list(b.entries())
        assert e.key == k and e.size == size and abs(e.stored_at - time.time()) < 300
        wipe(b)


def test_keys_ignore_foreign_objects(S3, opts, raw):
    p = opts["prefix"]
    with open_backend(S3, opts) as b:
        k = make_key(2)
        open_objects(b).put([(k, make_obj(2))])
        for name in (f"{p}/readme.txt", f"{p}/lmc1:not:a:key", f"{p}/sub/{make_key(3)}", make_key(4), f"{p}x/{make_key(5)}"):
            raw.put_object(Bucket="lmcache", Key=name, Body=b"not ours")
        assert [key for key, _ in b.keys()] == [k]
        assert b.usage().entries == 1
        wipe(b)
        # foreign objects are left alone
        assert raw.head_object(Bucket="lmcache", Key=f"{p}/readme.txt")["ContentLength"] == 8


def test_prefix_isolation_and_sharing(S3, s3_server):
    p = unique("iso")
    a = open_backend(S3, {**s3_server.options, "prefix": p})
    same = open_backend(S3, {**s3_server.options, "url": f"s3://lmcache/{p}/"})
    other = open_backend(S3, {**s3_server.options, "prefix": unique("iso")})
    deeper = open_backend(S3, {**s3_server.options, "prefix": f"{p}/deeper"})
    top = open_backend(S3, s3_server.options)
    try:
        obj = make_obj(3)
        k = make_key(3)
        open_objects(a).put([(k, obj)])
        # another instance on the same bucket and prefix shares the entry
        assert same.exists([k]) == [True]
        (g,) = open_objects(same).get([k])
        assert g is not None and torch.equal(g.tensor, obj.tensor)
        g.unref()
        assert [key for key, _ in same.keys()] == [k]
        # other prefixes see nothing, and cannot remove it
        for b in (other, deeper, top):
            assert b.exists([k]) == [False]
            assert open_objects(b).get([k]) == [None]
            assert k not in dict(b.keys())
        assert other.delete([k]) == [False]
        assert top.delete_one(k) is False
        assert a.exists([k]) == [True]
        assert same.delete([k]) == [True]
        assert a.exists([k]) == [False]
    finally:
        for b in (a, same, other, deeper, top):
            b.close()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "other_key", "flipped"])
def test_corrupt_payload_is_a_miss_and_is_deleted(S3, opts, raw, damage):
    with open_backend(S3, opts) as b:
        objects = open_objects(b)
        k, other = make_key(10), make_key(11)
        objects.put([(k, make_obj(10)), (other, make_obj(11))])
        name = f"{opts['prefix']}/{k}"
        good = raw.get_object(Bucket="lmcache", Key=name)["Body"].read()
        bad = {
            "truncated": good[:-7],
            "garbage": b"\x00garbage" * 40,
            "empty": b"",
            "other_key": raw.get_object(Bucket="lmcache", Key=f"{opts['prefix']}/{other}")["Body"].read(),
            "flipped": good[:-1] + bytes([good[-1] ^ 1]),
        }[damage]
        raw.put_object(Bucket="lmcache", Key=name, Body=bad)
        got = objects.get([k, other])
        assert got[0] is None
        got[1].unref()
        assert b.integrity.corrupt == 1
        assert b.exists([k, other]) == [False, True]
        # the single-key path does the same
        raw.put_object(Bucket="lmcache", Key=name, Body=bad)
        assert objects.get_one(k) is None and b.exists([k]) == [False]
        wipe(b)


def test_large_object_goes_through_multipart(S3, opts):
    opts = {**opts, "multipart_threshold": "5MiB", "multipart_chunksize": "5MiB"}
    with open_backend(S3, opts) as b:
        calls: dict[str, int] = {}

        def count(event_name, **_):
            op = event_name.rsplit(".", 1)[-1]
            calls[op] = calls.get(op, 0) + 1

        b.client.meta.events.register("before-call.s3.*", count)
        big = make_obj(20, num_tokens=96 * 1024)  # 12 MiB
        small = make_obj(21)
        objects = open_objects(b)
        sizes = objects.put([(make_key(20), big), (make_key(21), small)])
        assert calls.get("UploadPart") == 3 and calls.get("CompleteMultipartUpload") == 1
        assert calls.get("PutObject") == 1
        assert dict(b.keys()) == {make_key(20): sizes[0], make_key(21): sizes[1]}
        g, s = objects.get([make_key(20), make_key(21)])
        assert torch.equal(g.tensor, big.tensor) and torch.equal(s.tensor, small.tensor)
        g.unref()
        s.unref()
        wipe(b)


def test_delete_deletes_in_batches(S3, opts, monkeypatch):
    monkeypatch.setattr(sys.modules[S3.__module__], "DELETE_BATCH", 3)
    with open_backend(S3, opts) as b:
        keys = [make_key(i) for i in range(7)]
        open_objects(b).put([(k, make_obj(i, num_tokens=1)) for i, k in enumerate(keys)])
        calls = []
        b.client.meta.events.register("before-call.s3.DeleteObjects", lambda **kw: calls.append(1))
        assert b.delete(keys + [make_key(99)]) == [True] * 7 + [False]
        assert len(calls) == 3
        assert list(b.keys()) == []


def test_a_failed_batch_get_raises_and_leaks_no_memory(S3, opts):
    pool = MemoryPool(16 << 20)
    with open_backend(S3, opts, pool=pool) as b:
        objects = open_objects(b)
        keys = [make_key(i) for i in range(24)]
        objects.put([(k, make_obj(i)) for i, k in enumerate(keys)])
        with pytest.raises(Exception, match="InvalidArgument"):
            objects.get(keys[:12] + [".."] + keys[12:])  # the server refuses this object name
        deadline = time.monotonic() + 5
        while pool.used and time.monotonic() < deadline:  # requests already running finish first
            time.sleep(0.05)
        assert pool.used == 0, "objects fetched by a failed batch were not released"
        wipe(b)


def test_missing_bucket_is_a_clear_error_or_created(S3, s3_server, raw):
    name = unique("nobucket")
    with open_backend(S3, {**s3_server.options, "url": f"s3://{name}"}) as b:
        with pytest.raises(BackendError, match="does not exist.*create_bucket"):
            open_objects(b).get([make_key(1)])
        with pytest.raises(BackendError, match="does not exist"):
            list(b.keys())
    # an inspecting (read-only) open never creates it
    with open_backend(S3, {**s3_server.options, "url": f"s3://{name}", "create_bucket": True}, read_only=True) as b:
        with pytest.raises(BackendError, match="does not exist"):
            b.exists([make_key(1)])
    with open_backend(S3, {**s3_server.options, "url": f"s3://{name}/p", "create_bucket": True}) as b:
        open_objects(b).put([(make_key(1), make_obj(1))])
        raw.head_bucket(Bucket=name)
        assert [k for k, _ in b.keys()] == [make_key(1)]
        wipe(b)


def test_raw_transfer_moves_the_bytes_and_cleans_up(S3, opts, raw):
    items = [(f"item-{i}", bytes([i]) * (1000 + i)) for i in range(20)]
    put_s, get_s = baseline("s3")(opts, items, 8)
    assert put_s > 0 and get_s > 0
    left = raw.list_objects_v2(Bucket="lmcache", Prefix=opts["prefix"] + "/")
    assert left.get("KeyCount", 0) == 0


class Answer500:
    """A loopback HTTP proxy in front of the real server that answers the first
    ``fail`` requests of ``method`` on an lmcache object with ``500 InternalError`` (as
    rclone does to a GET or PUT that falls inside an overwrite of the same key, and AWS
    does now and then) and forwards every other request as it came, Host header
    included, so the SigV4 signature still holds."""

    def __init__(self, upstream: str, fail: int, method: str = "GET"):
        import http.client
        import http.server
        from urllib.parse import urlsplit

        up = urlsplit(upstream)
        self.fail, self.gets = fail, 0  # gets: requests of `method` seen
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == method and "list-type" not in self.path and "/lmc1" in self.path:
                    proxy.gets += 1
                    if proxy.gets <= proxy.fail:
                        err = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
                               b"<Message>We encountered an internal error. Please try again.</Message></Error>")
                        self.send_response(500)
                        self.send_header("Content-Type", "application/xml")
                        self.send_header("Content-Length", str(len(err)))
                        self.end_headers()
                        self.wfile.write(err)
                        return
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=10)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for k, v in self.headers.items():
                        conn.putheader(k, v)
                    conn.endheaders(body)
                    r = conn.getresponse()
                    data = r.read()
                    self.send_response(r.status)
                    for k, v in r.getheaders():
                        if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("fail,served", [(3, True), (4, False)])
def test_an_internal_error_on_get_is_asked_again_three_times_then_raised(S3, opts, fail, served):
    """A GET answered ``InternalError`` is asked again three times (with ``retries: 0``
    botocore itself sends each request once): three such answers still serve
    the exact object, a fourth is raised with the server's code, no pool memory is held."""
    pool = MemoryPool(16 << 20)
    obj = make_obj(7)
    with open_backend(S3, opts, pool=pool) as b:
        open_objects(b).put([(make_key(1), obj)])
        proxy = Answer500(opts["endpoint_url"], fail)
        try:
            with open_backend(S3, {**opts, "endpoint_url": proxy.url, "retries": 0}, pool=pool) as via:
                if served:
                    (got,) = open_objects(via).get([make_key(1)])
                    assert got is not None and torch.equal(got.tensor, obj.tensor)
                    got.unref()
                else:
                    with pytest.raises(Exception, match="InternalError"):
                        open_objects(via).get([make_key(1)])
            assert proxy.gets == 4
        finally:
            proxy.close()
        wipe(b)
    assert pool.used == 0


@pytest.mark.parametrize("fail,stored", [(3, True), (4, False)])
def test_an_internal_error_on_put_is_sent_again_whole(S3, opts, fail, stored):
    """A PUT answered ``InternalError`` is sent again from the first byte, three times
    at most: after three such answers the object read back is exact; after four the put
    raises and nothing is stored."""
    obj = make_obj(8)
    proxy = Answer500(opts["endpoint_url"], fail, method="PUT")
    try:
        with open_backend(S3, {**opts, "endpoint_url": proxy.url, "retries": 0}) as via:
            if stored:
                open_objects(via).put([(make_key(2), obj)])
            else:
                with pytest.raises(Exception, match="InternalError"):
                    open_objects(via).put([(make_key(2), obj)])
        assert proxy.gets == 4
    finally:
        proxy.close()
    with open_backend(S3, opts) as b:
        (got,) = open_objects(b).get([make_key(2)])
        if stored:
            assert got is not None and torch.equal(got.tensor, obj.tensor)
            got.unref()
        else:
            assert got is None
        wipe(b)


# --------------------------------------------------------------------- faults
def test_unreachable_at_start_then_raises_quickly(S3):
    port = loopback.free_port()  # nothing listens there
    o = {"url": "s3://lmcache", "endpoint_url": f"http://127.0.0.1:{port}", "timeout": 0.5,
         "access_key_id": "lmcacheaccesskey", "secret_access_key": "lmcachesecretkey"}
    b = open_backend(S3, o)  # the constructor connects to nothing
    t0 = time.monotonic()
    objects = open_objects(b)
    for call in (lambda: objects.get([make_key(1), make_key(2)]), lambda: b.exists([make_key(1)]),
                 lambda: objects.put([(make_key(1), make_obj(1))]), lambda: list(b.keys())):
        with pytest.raises(Exception):
            call()
    assert time.monotonic() - t0 < 10  # a hang guard, not a performance assertion
    b.close()
    # an engine whose only tier is down starts, and serves misses
    cfg = {"chunk_size": 16, "tiers": [{"backend": "s3", "capacity": "64MiB", **o}]}
    with lmcache.CacheEngine.from_config(cfg, kv_spec=SPEC) as e:
        toks = list(range(48))
        e.store(toks, kv_for(toks))
        assert e.lookup(toks) == 0 and e.retrieve(toks).num_tokens == 0


def test_backend_reconnects_after_a_restart(S3, fresh_server):
    o = {**fresh_server.options, "timeout": 0.5}
    with open_backend(S3, o) as b:
        objects = open_objects(b)
        obj = make_obj(30)
        objects.put([(make_key(30), obj)])
        fresh_server.kill()
        t0 = time.monotonic()
        with pytest.raises(Exception):
            objects.get([make_key(30)])
        with pytest.raises(Exception):
            b.exists([make_key(30)])
        assert time.monotonic() - t0 < 5
        fresh_server.restart()
        (g,) = objects.get([make_key(30)])  # same client, new connections; rclone kept the data
        assert g is not None and torch.equal(g.tensor, obj.tensor)
        g.unref()


def test_engine_survives_the_store_dying_mid_workload_and_recovers(S3, fresh_server, caplog):
    cfg = {"chunk_size": 16, "tiers": [{"backend": "s3", "capacity": "64MiB", **fresh_server.options, "timeout": 0.5}]}
    a = list(range(64))
    kv_a = kv_for(a)
    with lmcache.CacheEngine.from_config(cfg, kv_spec=SPEC) as e:
        e.store(a, kv_a)
        r = e.retrieve(a)
        assert r.num_tokens == 64 and r.tiers == ["s3"] * 4 and torch.equal(r.kv, kv_a)

        errors: list[BaseException] = []
        slowest = [0.0]
        results: list[tuple[float, int]] = []  # (time, tokens retrieved)
        stop = threading.Event()

        def workload():
            i = 0
            while not stop.is_set():
                i += 1
                toks = [1000 * i + t for t in range(32)]
                for call in (lambda: e.store(toks, kv_for(toks)), lambda: e.lookup(a), lambda: e.retrieve(a)):
                    t0 = time.monotonic()
                    try:
                        out = call()
                    except BaseException as exc:  # noqa: BLE001 - any exception reaching the engine's caller fails the test
                        errors.append(exc)
                        return
                    slowest[0] = max(slowest[0], time.monotonic() - t0)
                    if hasattr(out, "num_tokens") and hasattr(out, "tiers"):
                        results.append((time.monotonic(), out.num_tokens))

        caplog.set_level(logging.WARNING, logger="lmcache.hierarchy")
        worker = threading.Thread(target=workload, daemon=True)
        worker.start()
        time.sleep(0.3)
        fresh_server.kill()
        killed_at = time.monotonic()
        time.sleep(1.5)
        stop.set()
        worker.join(timeout=30)
        assert not worker.is_alive(), "an engine call hung after the store died"
        assert not errors, f"an exception reached the engine's caller: {errors[0]!r}"
        assert slowest[0] < 5, f"an engine call took {slowest[0]:.1f}s with timeout 0.5s"
        assert any(n == 0 for t, n in results if t > killed_at), "no miss was served while the store was down"
        # while down: misses, quickly, and nothing raised
        t0 = time.monotonic()
        assert e.lookup(a) == 0
        assert e.retrieve(a).num_tokens == 0
        e.store([7] * 20, kv_for([7] * 20))
        assert time.monotonic() - t0 < 5
        outage_logs = [r for r in caplog.records if "serving misses" in r.getMessage()]
        assert len(outage_logs) == 1, "the outage was not logged exactly once"

        # the same engine gets hits again once the store is back (rclone kept the data)
        fresh_server.restart()
        deadline = time.monotonic() + 15
        while True:
            r = e.retrieve(a)
            if r.num_tokens == 64 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.num_tokens == 64 and torch.equal(r.kv, kv_a), "hits did not resume after the store came back"
        b = list(range(500, 548))
        e.store(b, kv_for(b))
        assert e.lookup(b) == 48 and torch.equal(e.retrieve(b).kv, kv_for(b))
