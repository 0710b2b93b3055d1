"""``lmcache server`` and the ``lm`` backend against real server processes on loopback.

One server (``lmcache.testing.stores.lm``) serves the conformance and option tests, each test
under its own key prefix; tests that kill, stop, fill or fuzz a server start their own.
Nothing is mocked: the frames go through real sockets to a real server process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from _kv import wave
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lmcache
from lmcache import wire as proto
from lmcache.server.cache import ENTRY_OVERHEAD, CacheServer
from lmcache.codecs import load_codec
from lmcache.errors import BackendError, ConfigError
from lmcache.testing.stores import free_port
from lmcache.testing.stores.lm import lm_store
from lmcache.plugin_manager import get_registries
from lmcache.storage import BackendContext
from lmcache.encoded import open_objects
from lmcache.testing import BytesBackendTests, PersistentBackendTests, assert_hang_times_out, assert_rejects, assert_survives_outage, make_key, make_obj
from _procs import talk

REGS = get_registries()
LMBackend = REGS.backends.load("lm")
L, H, D = 2, 2, 8
TESTS = Path(__file__).parents[1]
PEER_DIR = TESTS / "backends"  # shared_store_peer.py, the peer process of backends/test_shared_stores.py


def baseline(name):
    """The raw-client baseline registered for backend ``name`` (lmcache_register_bench_baselines)."""
    from lmcache.plugin_manager import get_registries

    return get_registries().baselines.load(name)



@pytest.fixture(scope="module")
def server():
    with lm_store(capacity="512MiB") as s:
        yield s


def open_backend(store, codec: str = "raw", **options) -> LMBackend:
    opts = {**store.options, "prefix": f"t-{uuid.uuid4().hex[:10]}:", **options}
    return LMBackend(BackendContext.standalone(opts, codec=load_codec(REGS.codecs.load, codec)))


def kv_for(tokens):
    t = torch.as_tensor(list(tokens), dtype=torch.float64)
    base = torch.arange(L * 2 * H * D, dtype=torch.float64).reshape(L, 2, 1, H, D)
    return wave(base * 0.01 + t.reshape(1, 1, -1, 1, 1) * 0.37).to(torch.float32)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def frames(reply: bytes) -> list[tuple[proto.Frame, bytes]]:
    return [(f, v) for f, _, v in proto.iter_frames(reply, 1 << 30)]


# ------------------------------------------------------------------ conformance
@pytest.mark.parametrize("codec", ["raw", "zstd"])
class TestLMConformance(PersistentBackendTests, BytesBackendTests):
    @pytest.fixture
    def backend(self, codec, server):
        b = open_backend(server, codec)
        yield b
        b.delete([k for k, _ in b.keys()])
        assert list(b.keys()) == []
        b.close()

    @pytest.fixture
    def reopen(self, backend, codec):
        return lambda read_only=False: LMBackend(BackendContext.standalone(
            dict(backend.options), codec=load_codec(REGS.codecs.load, codec), read_only=read_only))


# ------------------------------------------------------------------ options
@pytest.mark.parametrize(
    "options,key",
    [
        ({}, "url"),
        ({"url": "redis://h:1"}, "url"),
        ({"url": "lm://"}, "url"),
        ({"url": "lm://h:0"}, "url"),
        ({"url": "lm://h:99999"}, "url"),
        ({"url": "lm://h:1/db"}, "url"),
        ({"url": "lm://user:pw@h:1"}, "url"),
        ({"url": "lm://h:1", "timeout": 0}, "timeout"),
        ({"url": "lm://h:1", "timeout": True}, "timeout"),
        ({"url": "lm://h:1", "token": ""}, "token"),
        ({"url": "lm://h:1", "prefix": 3}, "prefix"),
        ({"url": "lm://h:1", "batch": 0}, "batch"),
        ({"url": "lm://h:1", "max_connections": 1.5}, "max_connections"),
        ({"url": "lm://h:1", "urls": "x"}, "urls"),
    ],
)
def test_bad_options_are_config_errors_naming_the_key(options, key):
    assert_rejects(LMBackend, options, key)


def test_url_forms():
    from lmcache.backends.lm import parse_url

    assert parse_url("lm://127.0.0.1:9000") == ("127.0.0.1", 9000)
    assert parse_url("lm://cache") == ("cache", proto.DEFAULT_PORT)
    assert parse_url("LM://[::1]:7000/") == ("::1", 7000)


def test_bad_tier_url_in_an_engine_config_names_the_tier_key():
    with pytest.raises(ConfigError) as ei:
        lmcache.CacheEngine.from_config({"tiers": [{"backend": "lm", "capacity": "1MiB", "url": "http://h"}]})
    assert ei.value.key == "tiers[0].url"


# ------------------------------------------------------------------ server behaviour
def test_health_reports_usage(server):
    b = open_backend(server)
    try:
        h = b.health()
        assert h["status"] == "ok" and h["protocol"] == proto.VERSION and h["policy"] == "lru"
        before = h["used_bytes"]
        size = open_objects(b).put([(make_key(1), make_obj(1))])[0]
        # an entry counts its value, its key (with the backend's prefix) and a fixed overhead
        key_bytes = len((b.prefix + make_key(1)).encode())
        assert b.health()["used_bytes"] == before + size + key_bytes + ENTRY_OVERHEAD
    finally:
        b.delete([make_key(1)])
        b.close()


def test_list_streams_many_pages_and_skips_foreign_keys(server):
    b = open_backend(server)
    try:
        n = 2 * proto.LIST_PAGE + 17
        for part in range(0, n, 500):
            b._exchange("PUT", [(proto.PUT, b._k(make_key(i)), [b"v" * (i % 7 + 1)]) for i in range(part, min(n, part + 500))])
        assert b.put_one("not-a-key", [b"x"]) == 1
        listed = dict(b.keys())
        assert len(listed) == n and listed[make_key(5)] == 6
        assert b.usage().entries == n
    finally:
        b.delete([make_key(i) for i in range(2 * proto.LIST_PAGE + 17)] + ["not-a-key"])
        b.close()


def test_prefixes_isolate(server):
    a, c = open_backend(server), open_backend(server)
    try:
        open_objects(a).put([(make_key(1), make_obj(1))])
        assert c.exists([make_key(1)]) == [False] and list(c.keys()) == []
        assert c.get([make_key(1)]) == [None] and open_objects(c).get([make_key(1)]) == [None]
        assert a.exists([make_key(1)]) == [True]
    finally:
        a.delete([make_key(1)])
        a.close()
        c.close()


def test_corrupt_values_are_misses_and_deleted(server):
    b = open_backend(server)
    objs = open_objects(b)  # the store as a tier opens it: payloads decoded and checked
    try:
        keys = [make_key(i) for i in range(4)]
        objs.put([(k, make_obj(i)) for i, k in enumerate(keys)])
        good = bytes(b.get_one(keys[0]))
        b.put_one(keys[0], [good[:-5]])  # truncated
        b.put_one(keys[1], [b"garbage"])
        b.put_one(keys[2], [good])  # another key's payload
        got = objs.get(keys)
        assert got[:3] == [None] * 3 and got[3] is not None
        got[3].unref()
        assert objs.exists(keys) == [False, False, False, True]
        assert b.exists(keys) == [False, False, False, True]
        assert b.integrity.corrupt == 3
    finally:
        b.delete([make_key(i) for i in range(4)])
        b.close()


def test_capacity_and_lru_eviction_at_the_server():
    with lm_store(capacity="100KiB") as s:
        b = LMBackend(BackendContext.standalone(s.options))
        try:
            val = b"x" * ((20 << 10) - ENTRY_OVERHEAD - len(make_key(0)))
            for i in range(5):  # exactly full: values, keys and each entry's overhead
                assert b.put_one(make_key(i), [val]) == len(val)
            assert b.health()["entries"] == 5
            assert b.get_one(make_key(0)) is not None  # key 0 is now the most recent
            b.put_one(make_key(5), [val])  # evicts the least recently used: key 1
            assert b.exists([make_key(i) for i in range(6)]) == [True, False, True, True, True, True]
            h = b.health()
            assert h["used_bytes"] <= h["capacity_bytes"] == 100 << 10 and h["evictions"] == 1
            b.put_one(make_key(0), [b"y" * (60 << 10)])  # overwrite: the old size is released first
            assert b.health()["used_bytes"] <= 100 << 10 and b.get_one(make_key(0)) == b"y" * (60 << 10)
            with pytest.raises(BackendError, match="larger than the server's capacity"):
                b.put_one(make_key(9), [b"z" * (101 << 10)])
            assert b.get_one(make_key(0)) is not None  # the connection is still in step
        finally:
            b.close()


def test_fifo_policy_ignores_reads():
    with lm_store(capacity="40KiB", policy="fifo") as s:
        b = LMBackend(BackendContext.standalone(s.options))
        val = b"x" * ((20 << 10) - ENTRY_OVERHEAD - len(make_key(0)))  # two entries fill it exactly
        try:
            for i in range(2):
                b.put_one(make_key(i), [val])
            b.get_one(make_key(0))
            b.put_one(make_key(2), [val])
            assert b.exists([make_key(i) for i in range(3)]) == [False, True, True]
        finally:
            b.close()


def test_token_required_wrong_and_right():
    with lm_store(token="s3cret") as s:
        url = s.options["url"]
        for token, why in ((None, "authentication required"), ("wrong", "wrong token")):
            b = LMBackend(BackendContext.standalone({"url": url, "token": token}))
            with pytest.raises(BackendError, match=why):
                b.exists([make_key(1)])
            b.close()
        b = LMBackend(BackendContext.standalone(s.options))
        open_objects(b).put([(make_key(1), make_obj(1))])
        assert b.exists([make_key(1)]) == [True]
        b.close()
        # a raw client: no AUTH first -> FATAL and closed
        reply, closed = talk(s.servers[0].port, proto.encode(proto.HEALTH, 7))
        (f, msg), = frames(reply)
        assert closed and f.status == proto.FATAL and b"AUTH" in msg


def _recv_frame(sock: socket.socket, timeout: float = 5.0) -> tuple[proto.Frame, bytes]:
    sock.settimeout(timeout)
    hdr = bytearray()
    while len(hdr) < proto.HEADER_SIZE:
        c = sock.recv(proto.HEADER_SIZE - len(hdr))
        assert c, "closed before a reply"
        hdr += c
    f = proto.parse_header(bytes(hdr), 1 << 20)
    body = bytearray()
    while len(body) < f.key_len + f.value_len:
        c = sock.recv(f.key_len + f.value_len - len(body))
        assert c
        body += c
    return f, bytes(body[f.key_len:])


def _closed(sock: socket.socket, timeout: float = 5.0) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    return True


def test_unauthenticated_frames_are_refused_before_their_value_is_read():
    """The outside review: with a token, a client that never sent AUTH and declared a
    200 MiB PUT made the server read (and hold) all of it before refusing. Now the FATAL
    reply comes right after the header, while not one byte of the value has been sent, and
    the connection is closed."""
    srv = CacheServer(token="s3cret", capacity=1 << 30).start()
    try:
        host, port = srv.address
        for op, key, value_len in ((proto.PUT, b"k" * 100, 200 << 20), (proto.GET, b"k" * 4000, 0), (proto.LIST, b"", 0)):
            with socket.create_connection((host, port), timeout=5) as c:
                c.sendall(proto.pack_header(op, 3, key, value_len))  # the header only: no key, no value
                f, msg = _recv_frame(c)
                assert f.status == proto.FATAL and f.seq == 3 and b"AUTH" in msg, msg
                assert _closed(c)
    finally:
        srv.close()


def test_unauthenticated_connections_are_bounded_in_time_and_number():
    """Idle sockets that never authenticate cannot hold the server: each is closed after
    ``auth_timeout`` (also one that trickles its AUTH frame a byte at a time), at most
    ``max_unauthenticated`` wait at once (a 4th closes the oldest: issue 44, item 8), and
    an authenticating client gets in meanwhile."""
    srv = CacheServer(token="s3cret", auth_timeout=0.5, max_unauthenticated=3, max_connections=8).start()
    try:
        host, port = srv.address
        idle = [socket.create_connection((host, port), timeout=5) for _ in range(3)]
        time.sleep(0.1)
        extra = socket.create_connection((host, port), timeout=5)  # a 4th waits: the oldest is closed
        f, msg = _recv_frame(idle[0])
        assert f.status == proto.FATAL and b"waiting to authenticate" in msg, msg
        assert _closed(idle[0])
        idle[0].close()
        idle[0] = extra
        t0 = time.monotonic()
        for c in idle:
            f, msg = _recv_frame(c)
            assert f.status == proto.FATAL and b"AUTH" in msg, msg
            assert _closed(c)
            c.close()
        assert time.monotonic() - t0 < 10  # a hang guard, not a timing claim
        # a trickling AUTH frame: one byte at a time is still cut at the deadline
        auth = proto.encode(proto.AUTH, 1, b"", b"s3cret")
        with socket.create_connection((host, port), timeout=5) as c:
            deadline = time.monotonic() + 5
            cut = False
            for b in auth[:-1]:
                try:
                    c.sendall(bytes([b]))
                except OSError:
                    cut = True
                    break
                time.sleep(0.1)
                if time.monotonic() > deadline:
                    break
            assert cut or _closed(c, 2.0)
        # the slots are free again: an authenticated client is served
        b = LMBackend(BackendContext.standalone({"url": f"lm://{host}:{port}", "token": "s3cret"}))
        open_objects(b).put([(make_key(1), make_obj(1))])
        assert b.exists([make_key(1)]) == [True]
        b.close()
    finally:
        srv.close()


def test_cli_server_command_prints_listening_and_stops_on_sigterm():
    code = ("import typer; from lmcache.cli.server_cmd import server_cmd; "
            "app = typer.Typer(); app.command()(server_cmd); app()")
    p = subprocess.Popen([sys.executable, "-c", code, "--port", "0", "--capacity", "1MiB"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().strip()
        assert line.startswith("LISTENING 127.0.0.1:"), (line, p.stderr.read() if p.poll() is not None else "")
        port = int(line.rsplit(":", 1)[1])
        b = LMBackend(BackendContext.standalone({"url": f"lm://127.0.0.1:{port}"}))
        assert b.health()["capacity_bytes"] == 1 << 20
        b.close()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    bad = subprocess.run([sys.executable, "-c", code, "--port", "0", "--policy", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "nope" in bad.stderr


# ------------------------------------------------------------------ framing fuzz
HEADER_FIELDS = st.tuples(
    st.sampled_from([proto.MAGIC, b"LMCX", b"\x00\x00\x00\x00", b"GET "]),
    st.sampled_from([proto.VERSION, 0, 2, 255]),
    st.integers(0, 255),  # op: known and unknown
    st.integers(0, 3),
    st.integers(0, 3),
    st.integers(0, 2**32 - 1),
    st.one_of(st.integers(0, 64), st.sampled_from([proto.MAX_KEY + 1, 2**32 - 1])),
    st.one_of(st.integers(0, 4096), st.sampled_from([2**26, 2**26 + 1, 2**40, 2**64 - 1])),
)


@st.composite
def hostile_input(draw):
    kind = draw(st.sampled_from(["random", "frame", "truncated", "after_valid"]))
    if kind == "random":
        return draw(st.binary(min_size=1, max_size=2048))
    magic, ver, op, status, flags, seq, klen, vlen = draw(HEADER_FIELDS)
    header = struct.pack("<4sBBBBIIQ", magic, ver, op, status, flags, seq, klen, vlen)
    body = draw(st.binary(max_size=256))
    data = header + body
    if kind == "truncated":
        data = data[: draw(st.integers(1, len(data)))]
    if kind == "after_valid":
        data = proto.encode(proto.PUT, 1, b"k", b"value") + proto.encode(proto.GET, 2, b"k") + data
    return data


@pytest.fixture(scope="module")
def fuzz_server():
    with lm_store(capacity="64MiB", max_value_size="64MiB") as s:
        yield s


def _invalid_header(data: bytes) -> bool:
    """True when ``data`` starts with a header the server must refuse."""
    if len(data) < proto.HEADER_SIZE:
        return False
    try:
        proto.check_request(proto.parse_header(data[: proto.HEADER_SIZE], 64 << 20))
    except proto.ProtocolError:
        return True
    return False


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=hostile_input())
def test_fuzz_framing_closes_the_connection_and_the_server_lives(fuzz_server, data):
    port = fuzz_server.servers[0].port
    reply, closed = talk(port, data)
    assert closed, "the server kept a connection open after our side closed"
    got = frames(reply)
    if _invalid_header(data):
        assert got and got[-1][0].status == proto.FATAL, (data[:32], reply[:64])
    if data.startswith(proto.encode(proto.PUT, 1, b"k", b"value")):
        assert got[0][0].status == proto.OK and got[1][1] == b"value"  # served before the bad frame


def test_fuzz_leaves_rss_bounded_and_the_server_serving(fuzz_server):
    pid = fuzz_server.servers[0].proc.pid
    port = fuzz_server.servers[0].port
    before = rss_kib(pid)
    huge = struct.pack("<4sBBBBIIQ", proto.MAGIC, proto.VERSION, proto.PUT, 0, 0, 1, 1, 2**40) + b"k" + b"\0" * 1000
    for _ in range(50):
        reply, closed = talk(port, huge)
        assert closed and frames(reply)[-1][0].status == proto.FATAL
        assert b"exceeds the limit" in frames(reply)[-1][1]
    # many connections that declare the largest allowed value (64 MiB) and then stall
    # mid-frame: memory follows the bytes received, not the lengths declared (each sends a
    # HEALTH frame first: a connection with no complete frame is closed to make room)
    socks = []
    for _ in range(40):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(proto.encode(proto.HEALTH, 0, b"", b"") + struct.pack("<4sBBBBIIQ", proto.MAGIC, proto.VERSION, proto.PUT, 0, 0, 1, 1, 64 << 20) + b"k" + b"a" * 1000)
        socks.append(s)
    b = LMBackend(BackendContext.standalone(fuzz_server.options))
    assert b.health()["connections"] >= 40
    b.close()
    time.sleep(0.5)  # let the server read what they sent (no timing is asserted)
    during = rss_kib(pid)
    for s in socks:
        s.close()
    after = rss_kib(pid)
    # 40 x 64 MiB declared: 2.5 GiB if the server allocated what peers declare
    assert during - before < 64 << 10, (before, during)
    assert after - before < 64 << 10, (before, after)
    b = LMBackend(BackendContext.standalone(fuzz_server.options))
    try:
        objs = open_objects(b)
        objs.put([(make_key(1), make_obj(1))])
        (g,) = objs.get([make_key(1)])
        assert g is not None and torch.equal(g.tensor, make_obj(1).tensor)
        g.unref()
        assert b.health()["protocol_errors"] > 0
    finally:
        b.close()


# ------------------------------------------------------------------ faults
def test_unreachable_server_fails_fast_and_the_engine_serves_misses():
    port = free_port()
    b = LMBackend(BackendContext.standalone({"url": f"lm://127.0.0.1:{port}", "timeout": 0.5}))
    t0 = time.monotonic()
    with pytest.raises(BackendError, match=str(port)):
        b.exists([make_key(1)])
    assert time.monotonic() - t0 < 5
    b.close()
    cfg = {"chunk_size": 16, "staging_size": "1MiB",
           "tiers": [{"backend": "lm", "capacity": "1MiB", "url": f"lm://127.0.0.1:{port}", "timeout": 0.5}]}
    with lmcache.CacheEngine.from_config(cfg) as e:
        toks = list(range(32))
        e.store(toks, kv_for(toks))
        assert e.lookup(toks) == 0 and e.retrieve(toks).num_tokens == 0


def test_a_hung_server_times_out_and_the_client_reconnects():
    with lm_store(timeout=0.3) as s:
        b = open_objects(LMBackend(BackendContext.standalone(s.options)))
        b.put([(make_key(1), make_obj(1))])
        assert_hang_times_out(b, s.servers[0], "timed out")
        b.close()


def test_engine_serves_misses_while_the_server_is_down_and_hits_after_restart(caplog):
    with lm_store(timeout=0.5) as s:
        cfg = {"chunk_size": 16, "staging_size": "4MiB", "tiers": [{"backend": "lm", "capacity": "64MiB", **s.options}]}
        toks = list(range(64))
        with lmcache.CacheEngine.from_config(cfg) as e:
            e.store(toks, kv_for(toks))
            assert e.locate(toks) == (64, ["lm"] * 4)
            assert torch.equal(e.retrieve(toks).kv, kv_for(toks))

            assert_survives_outage(e, s, "lm", toks, kv_for, caplog)


# ------------------------------------------------------------------ sharing
PEER_CODE = (
    "import sys; from lmcache.plugin_manager import get_registries; r = get_registries().backends\n"
    "'lm' in r or r.add('lm', 'lmcache.backends.lm:LMBackend')\n"
    "import shared_store_peer; shared_store_peer.main()\n"
)


def test_two_engine_processes_share_one_server(server, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(PEER_DIR))
    from shared_store_peer import SPEC, TOKENS, check, prompt

    opts = {**server.options, "prefix": f"share-{uuid.uuid4().hex[:8]}:"}
    cfg = {"chunk_size": 16, "tiers": [{"backend": "lm", "capacity": "256MiB", **opts}]}
    cfg_path = tmp_path / "lmcache.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    err_path = tmp_path / "peer.err"
    with open(err_path, "w") as err:
        peer = subprocess.Popen([sys.executable, "-c", PEER_CODE, str(cfg_path)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, cwd=PEER_DIR)
    try:
        line = peer.stdout.readline().strip()
        assert line == "READY", f"peer did not start: {line!r} {err_path.read_text()[-2000:]}"
        with lmcache.CacheEngine.from_config(cfg, kv_spec=SPEC) as engine:
            assert check(engine, "a") == (TOKENS, True), "this process did not see the peer's chunks"
            tokens, kv = prompt("b")
            engine.store(tokens, kv)
            engine.flush()
            peer.stdin.write("CHECK b\n")
            peer.stdin.flush()
            assert peer.stdout.readline().split() == ["HIT", str(TOKENS), "True"], "the peer did not see our chunks"
    finally:
        with contextlib.suppress(Exception):
            peer.stdin.close()
        try:
            peer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()
    assert peer.returncode == 0, err_path.read_text()[-2000:]


# ------------------------------------------------------------------ raw baseline
def test_raw_transfer_moves_the_bytes(server):
    items = [(f"item{i}", os.urandom(1000 + i)) for i in range(50)]
    put_s, get_s = baseline("lm")(server.options, items, 16)
    assert put_s >= 0 and get_s >= 0
