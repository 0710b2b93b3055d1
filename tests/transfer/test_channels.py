"""Transfer channels (lmcache.transfer) between real processes on loopback, over real NIXL
(UCX) and over tcp: bit-exact pushes and pulls, bounded backpressure, aborts, a sender
killed mid-transfer, an unusable NIXL at start, and what an idle endpoint costs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmcache import hookimpl
from tests._missing import missing

ROOT = Path(__file__).resolve().parents[2]
PEER = [sys.executable, str(ROOT / "tests" / "transfer" / "_peer.py")]
MiB = 1 << 20


def nixl_or_missing() -> None:
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        missing(f"NIXL is not installed ({exc}): pip install nixl-cu12==1.5.1 && pip install --no-deps nixl==1.5.1")


CHANNELS = [pytest.param("tcp", id="tcp"), pytest.param("nixl", id="nixl")]


class Peer:
    def __init__(self, channel: str, env: dict[str, str] | None = None, **opts):
        e = {**os.environ, "PEER_OPTS": json.dumps(opts), **(env or {})}
        self.p = subprocess.Popen(PEER + [channel], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=e, cwd=ROOT)
        self.first = self.p.stdout.readline().strip()
        self.url = self.first.split()[1] if self.first.startswith("READY") else None

    def __call__(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, f"peer died on {cmd['op']}"
        return json.loads(line)

    def close(self):
        if self.p.poll() is None:
            try:
                self.p.stdin.close()
            except OSError:
                pass
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


@pytest.fixture
def peers(request):
    made = []

    def make(channel, **kw):
        if channel == "nixl":
            nixl_or_missing()
        p = Peer(channel, **kw)
        made.append(p)
        assert p.url, p.first
        return p

    yield make
    for p in made:
        p.close()


def _cpu_over(peer: Peer, seconds: float) -> float:
    a = peer(op="cpu")
    time.sleep(seconds)
    b = peer(op="cpu")
    return b["cpu"] - a["cpu"] - 0.0  # the two answers themselves cost microseconds


@pytest.mark.parametrize("channel,by", [("tcp", "read"), ("nixl", "read"), ("nixl", "write")])
def test_push_and_pull_are_bit_exact(peers, channel, by):
    rx, tx = peers(channel), peers(channel)
    want = tx(op="fill", n=24, nbytes=2 * MiB + 512, seed=1)["digests"]
    r = tx(op="push", url=rx.url, request="req-1", by=by)
    assert r["committed"] == 24 and r["rejected"] == [], r
    # over nixl a push by read is made by the receiver (one fetch); tcp cannot read one-sidedly: it writes
    assert r["by"] == ("read" if (channel, by) == ("nixl", "read") else "write"), r
    fetched = rx(op="stats")
    assert fetched["fetched_requests"] == (1 if r["by"] == "read" else 0), fetched
    # both processes on this host share the monotonic clock: the push knows when the receiver was ready
    assert r["ready_seconds"] is not None and 0 < r["ready_seconds"] <= r["seconds"], r
    pushed = tx(op="stats")
    assert pushed["push_ready_count"] == 1 and pushed["push_ready_recent"] == [round(r["ready_seconds"], 6)], pushed
    assert rx(op="digests")["digests"] == want
    # pull (vLLM's direction): the other side reads what this one offers
    want2 = tx(op="fill", n=16, nbytes=MiB, seed=2)["digests"]
    offer = tx(op="offer", request="req-2")
    r = rx(op="pull", offer=offer)
    assert r["committed"] == 16, r
    got = rx(op="digests")["digests"]
    assert {k: got[k] for k in want2} == want2
    st_tx, st_rx = tx(op="stats"), rx(op="stats")
    assert st_tx["offers_released"] == 1 and st_tx["open_offers"] == 0
    assert st_rx["open_allocations"] == 0 and st_rx["in_flight_bytes"] == 0
    idle_rx, idle_tx = _cpu_over(rx, 2.0), _cpu_over(tx, 2.0)
    print(f"\n{channel}: idle CPU over 2 s after transfers: receiver {idle_rx * 1000:.1f} ms, "
          f"sender {idle_tx * 1000:.1f} ms")


@pytest.mark.parametrize("channel", CHANNELS)
def test_full_buffer_waits_a_bounded_time_then_refuses_and_an_abort_frees_it(peers, channel):
    from lmcache.transfer import Connection

    rx = peers(channel, buffer_size=4 * MiB, slot_timeout=30.0)
    tx = peers(channel)
    tx(op="fill", n=2, nbytes=MiB)
    # another sender holds 3 MiB of the 4 (allocated, never written); this test process speaks
    # the control protocol itself (tcp) so it needs no NIXL agent: alloc needs no hello
    c = Connection(rx.url, None, 5.0)
    held = c.call({"op": "alloc", "request": "holder", "chunks": [["h", [3 * MiB], "uint8"]]})
    t0 = time.monotonic()
    r = tx(op="push", url=rx.url, request="req-full", alloc_wait=0.5)
    waited = time.monotonic() - t0
    assert "TransferRefused" in r.get("error", ""), r
    assert "gave up after 0.5s" in r["error"]
    assert 0.4 < waited < 5, waited  # bounded: no endless retry
    st = rx(op="stats")
    assert st["full"] >= 2 and st["open_allocations"] == 1 and st["committed"] == 0
    assert tx(op="stats")["push_refused"] == 1
    # a request larger than the whole buffer is refused at once, without waiting
    tx(op="fill", n=5, nbytes=MiB)
    t0 = time.monotonic()
    r = tx(op="push", url=rx.url, request="req-huge", alloc_wait=5.0)
    assert "more than the whole receive buffer" in r.get("error", ""), r
    assert time.monotonic() - t0 < 2
    # the holder aborts: its slots are freed and the next push goes through
    assert c.call({"op": "abort", "alloc": held["alloc"]})["aborted"] is True
    c.close()
    st = rx(op="stats")
    assert st["open_allocations"] == 0 and st["in_flight_bytes"] == 0 and st["aborted"] == 1
    want = tx(op="fill", n=2, nbytes=MiB, seed=3)["digests"]
    r = tx(op="push", url=rx.url, request="req-after", alloc_wait=0.5)
    assert r.get("committed") == 2, r
    assert rx(op="digests")["digests"] == want


@pytest.mark.parametrize("channel", CHANNELS)
def test_sender_killed_mid_transfer_leaves_nothing_committed_and_no_slot_held(peers, channel):
    rx = peers(channel, slot_timeout=1.0)
    tx = peers(channel)
    tx(op="fill", n=16, nbytes=MiB)
    r = tx(op="hold", url=rx.url, request="req-killed")
    assert r["slots"] == 16, r
    st = rx(op="stats")
    assert st["open_allocations"] == 1 and st["in_flight_bytes"] >= 16 * MiB
    tx.p.send_signal(signal.SIGKILL)
    tx.p.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        st = rx(op="stats")
        if st["open_allocations"] == 0:
            break
        time.sleep(0.1)
    assert st["open_allocations"] == 0 and st["in_flight_bytes"] == 0, st
    assert st["expired"] == 1 and st["committed"] == 0 and st["committed_chunks"] == 0
    assert rx(op="digests")["digests"] == {}
    # the receiver still serves the next sender
    tx2 = peers(channel)
    want = tx2(op="fill", n=4, nbytes=MiB, seed=5)["digests"]
    assert tx2(op="push", url=rx.url, request="req-next")["committed"] == 4
    assert rx(op="digests")["digests"] == want


def test_a_push_of_chunks_outside_the_registered_pool_is_made_by_write(peers):
    rx, tx = peers("nixl"), peers("nixl")
    want = tx(op="fill", n=3, nbytes=MiB, seed=4, heap=True)["digests"]
    r = tx(op="push", url=rx.url, request="req-heap", by="read")
    assert r["committed"] == 3 and r["by"] == "write", r
    assert rx(op="digests")["digests"] == want


def test_a_sender_dying_while_the_receiver_reads_leaves_all_or_nothing_and_no_slot_held(peers):
    """Push by read: the sender asks the receiver to fetch, then exits at once (a prefiller
    killed mid-transfer). Whatever the race gives, the receiver commits every chunk with its
    exact bytes or none of them, holds no slot, and serves the next sender."""
    rx = peers("nixl", slot_timeout=2.0)
    fetched = 0
    for attempt in range(3):
        tx = peers("nixl")
        want = tx(op="fill", n=16, nbytes=MiB, seed=10 + attempt)["digests"]
        tx.p.stdin.write(json.dumps({"op": "fetch_and_die", "url": rx.url, "request": f"dying-{attempt}"}) + "\n")
        tx.p.stdin.flush()
        assert tx.p.wait(10) == 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            st = rx(op="stats")
            if st["fetched_requests"] + st["fetch_failed"] > attempt:
                break
            time.sleep(0.05)
        assert st["fetched_requests"] + st["fetch_failed"] == attempt + 1, st
        assert st["open_allocations"] == 0 and st["in_flight_bytes"] == 0, st
        got = rx(op="digests")["digests"]
        exact = [k for k, v in want.items() if got.get(k) == v]
        committed = st["fetched_requests"] > fetched
        fetched = st["fetched_requests"]
        assert len(exact) == (16 if committed else 0), (attempt, st, len(exact))
        print(f"attempt {attempt}: {'committed whole' if committed else 'nothing committed'}")
    tx2 = peers("nixl")
    want = tx2(op="fill", n=4, nbytes=MiB, seed=5)["digests"]
    assert tx2(op="push", url=rx.url, request="req-next")["committed"] == 4
    assert {k: v for k, v in rx(op="digests")["digests"].items() if k in want} == want


@pytest.mark.parametrize("patch,expires_in,why", [
    ({"addrs": [[0, 1]]}, 30.0, "another number of chunks"),
    ({"checksums": [1, 2, 3]}, 30.0, "one checksum per chunk"),
    ({"checksums": [1, 2]}, 30.0, "rejected"),
    ({"chunks": []}, 30.0, "1-"),
    ({"request": ""}, 30.0, "request id"),
    ({}, -1.0, "positive expires_in"),
    ({}, True, "positive expires_in"),
], ids=["addrs", "checksum-count", "wrong-checksums", "no-chunks", "no-request", "expired", "bool-expiry"])
def test_a_hostile_fetch_is_one_line_and_leaves_nothing(peers, patch, expires_in, why):
    rx, tx = peers("nixl"), peers("nixl")
    tx(op="fill", n=2, nbytes=MiB)
    r = tx(op="fetch_raw", url=rx.url, patch=patch, expires_in=expires_in)
    if why == "rejected":  # checksums that do not match the bytes read: nothing reaches the sink
        assert r.get("committed") == 0 and r.get("rejected") == ["k0", "k1"], r
    else:
        assert why in r.get("error", ""), r
        assert "\n" not in r["error"]
    st = rx(op="stats")
    assert st["open_allocations"] == 0 and st["in_flight_bytes"] == 0 and st["committed_chunks"] == 0, st
    assert rx(op="digests")["digests"] == {}


def test_an_unknown_nixl_backend_is_one_line_at_start(peers):
    nixl_or_missing()
    p = Peer("nixl", options={"nixl_backends": ["NO_SUCH_BACKEND"]})
    out, _ = p.p.communicate(timeout=60)
    assert p.first.startswith("ERROR ChannelUnavailable: transfer_channel nixl: NIXL backend NO_SUCH_BACKEND is "
                              "not available here (this NIXL has: "), p.first
    assert "UCX" in p.first and "\n" not in p.first
    assert p.p.returncode == 3


def test_missing_nixl_is_one_line_naming_what_to_install(tmp_path):
    # a process where `import nixl` fails as it does where the package is not installed
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'nixl' or name.startswith(('nixl.', 'nixl_cu')):\n"
        "            raise ModuleNotFoundError(f\"No module named '{name}'\", name=name)\n"
        "sys.meta_path.insert(0, _Hide())\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = Peer("nixl", env=env)
    p.p.communicate(timeout=60)
    assert p.first == ("ERROR ChannelUnavailable: channel 'nixl' (from plugin 'lmcache.plugins.services.builtin') "
                       "needs the Python package 'nixl', which is not installed; install it with: "
                       "pip install nixl-cu12==1.5.1"), p.first


def test_an_unknown_channel_names_the_registered_ones():
    from lmcache.errors import UnknownPluginError
    from lmcache.memory import MemoryPool
    from lmcache.transfer import open_channel

    pool = MemoryPool(8 * MiB, pin=False)
    with pytest.raises(UnknownPluginError, match=r"unknown channel 'rdma'.*registered channels: nixl, tcp"):
        open_channel("rdma", pool)


def test_a_wrong_token_gets_no_allocation():
    from lmcache.memory import MemoryPool
    from lmcache.transfer import Connection, TransferError, open_channel

    pool = MemoryPool(8 * MiB, pin=False)
    ep = open_channel("tcp", pool, token="right")
    try:
        with pytest.raises(TransferError, match="does not know the transfer token"):
            Connection(ep.url, "wrong", 2.0)
        with pytest.raises(TransferError, match="does not know the transfer token"):
            Connection(ep.url, None, 2.0)
        c = Connection(ep.url, "right", 2.0)
        assert c.call({"op": "alloc", "request": "r", "chunks": [["k", [16], "uint8"]]})["slots"]
        c.close()
    finally:
        ep.close()


class _LoopbackChannelPlugin:
    """A third-party channel: the tcp channel under another name, registered through the hook."""

    @hookimpl
    def lmcache_register_channels(self, registry):
        registry.add("tcp-copy", "lmcache.plugins.channels.tcp:TcpChannel", description="test")


def test_a_plugin_registers_a_channel_through_the_hook():
    import torch

    from lmcache.memory import MemoryPool
    from lmcache.plugin_manager import Registries, create_plugin_manager
    from lmcache.transfer import checksum, open_channel

    pm = create_plugin_manager(autoload=False)
    pm.register(_LoopbackChannelPlugin(), name="loopback-channel")
    regs = Registries(pm)
    assert {"nixl", "tcp", "tcp-copy"} <= set(regs.channels.names())
    got = {}

    def sink(key, obj):
        got[key] = obj
        return True

    a, b = MemoryPool(16 * MiB, pin=False), MemoryPool(16 * MiB, pin=False)
    rx = open_channel("tcp-copy", a, sink=sink, registries=regs)
    tx = open_channel("tcp-copy", b, registries=regs)
    try:
        o = b.allocate((4096,), torch.float32)
        o.tensor.copy_(torch.arange(4096, dtype=torch.float32))
        r = tx.push(rx.url, "req", [("key", o)])
        assert r["committed"] == 1 and checksum(got["key"]) == checksum(o)
        o.unref()
    finally:
        tx.close()
        rx.close()
        for x in got.values():
            x.unref()


def test_an_offer_not_pulled_in_time_is_released_and_a_late_pull_commits_nothing():
    import torch

    from lmcache.memory import MemoryPool
    from lmcache.transfer import TransferError, open_channel

    a, b = MemoryPool(16 * MiB, pin=False), MemoryPool(16 * MiB, pin=False)
    got = {}
    tx = open_channel("tcp", a)
    rx = open_channel("tcp", b, sink=lambda k, o: got.setdefault(k, o) is o)
    try:
        o = a.allocate((1024,), torch.float32)
        offer = tx.offer("req", [("k", o)], ttl=0.3)
        o.unref()  # the offer holds its own reference
        assert a.live == 1
        deadline = time.monotonic() + 10
        while tx.info()["offers_expired"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tx.info()["offers_expired"] == 1 and a.live == 0  # the chunk went back to the pool
        with pytest.raises(TransferError, match="unknown or expired offer"):
            rx.pull(offer)
        assert got == {} and rx.info()["in_flight_bytes"] == 0 and b.live == 0
    finally:
        tx.close()
        rx.close()


def test_channels_that_differ_refuse_each_other(peers):
    nixl_or_missing()
    rx = peers("nixl")
    tx = peers("tcp")
    tx(op="fill", n=1, nbytes=MiB)
    r = tx(op="push", url=rx.url, request="req")
    assert "TransferError" in r["error"] and "no NIXL agent metadata" in r["error"], r
    assert rx(op="stats")["allocated"] == 0


def test_the_channel_benchmark_runs_small():
    from lmcache.benchmarks import channel as bench

    rows = bench.run(("tcp",), chunks=2, chunk_mib=0.25, passes=1, verify=("off",), progress_thread=False)
    assert len(rows) == 1 and "error" not in rows[0], rows
    assert rows[0]["bytes"] == 2 * (1 << 18) and rows[0]["push_s"] > 0 and rows[0]["memcpy_s"] > 0
    table = bench.markdown(rows, 2, 0.25)
    assert "| tcp | off |" in table
    print("\n" + table)


def test_a_pull_checks_the_identity_the_offer_names():
    import torch

    from lmcache.memory import MemoryPool
    from lmcache.transfer import TransferError, open_channel

    a, b = MemoryPool(16 * MiB, pin=False), MemoryPool(16 * MiB, pin=False)
    tx, rx = open_channel("tcp", a, token="t"), open_channel("tcp", b, token="t")
    try:
        o = a.allocate((1024,), torch.float32)
        offer = tx.offer("req", [("k", o)])
        o.unref()
        with pytest.raises(TransferError, match="not 'someone-else'"):  # a relay, or a forged offer
            rx.pull({**offer, "identity": "someone-else"})
        assert rx.info()["in_flight_bytes"] == 0 and b.live == 0
        assert rx.pull(offer)["committed"] == 0  # the default sink drops what arrives
    finally:
        tx.close()
        rx.close()


def test_a_pull_whose_release_times_out_keeps_the_bytes_it_read():
    """The read is done and checked: a release that the offering side answers too late
    (a stalled host) leaves the offer to its ttl there, and the pull still commits."""
    import torch

    from lmcache.memory import MemoryPool
    from lmcache.transfer import checksum, open_channel

    a, b = MemoryPool(16 * MiB, pin=False), MemoryPool(16 * MiB, pin=False)
    got = {}
    tx = open_channel("tcp", a)
    rx = open_channel("tcp", b, timeout=0.5, sink=lambda k, o: got.setdefault(k, o) is o)
    handle = tx.server.handler

    def slow_release(conn, msg):
        if msg.get("op") == "release":
            time.sleep(1.5)  # past the puller's 0.5 s timeout
        return handle(conn, msg)

    tx.server.handler = slow_release
    try:
        objs = []
        for i in range(3):
            o = a.allocate((4096,), torch.float32)
            o.tensor.copy_(torch.arange(4096, dtype=torch.float32) + i)
            objs.append((f"k{i}", o))
        want = {k: checksum(o) for k, o in objs}
        offer = tx.offer("req", objs, ttl=30)
        r = rx.pull(offer)
        assert r["committed"] == 3 and r["rejected"] == [], r
        assert {k: checksum(o) for k, o in got.items()} == want
        assert rx.info()["release_failed"] == 1 and rx.info()["pull_failed"] == 0
        deadline = time.monotonic() + 10  # the late release still lands there
        while tx.info()["offers_released"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tx.info()["offers_released"] == 1 and tx.info()["open_offers"] == 0
    finally:
        for _, o in objs:
            o.unref()
        for o in got.values():
            o.unref()
        tx.close()
        rx.close()


def _nice(native_id: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, native_id)


def test_transfer_threads_run_above_the_engines_priority_where_permitted():
    """``thread_nice: -5``: the endpoint's threads (and each connection's, which inherit it)
    run 5 nice values above the caller's where the process may raise a thread's priority
    (root, CAP_SYS_NICE); elsewhere at the caller's. ``raised_priority`` gives it back."""
    import threading

    from lmcache.memory import MemoryPool
    from lmcache.transfer import open_channel, raised_priority

    base = _nice(threading.get_native_id())
    probe = {}

    def try_raise():
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(-20, base - 1))
            probe["ok"] = True
        except PermissionError:
            probe["ok"] = False

    t = threading.Thread(target=try_raise)
    t.start()
    t.join()
    want = max(-20, base - 5) if probe["ok"] else base
    ep = open_channel("tcp", MemoryPool(4 * MiB, pin=False), thread_nice=-5)
    peer = open_channel("tcp", MemoryPool(4 * MiB, pin=False))
    try:
        assert peer.remote_stats(ep.url)["open_offers"] == 0  # opens a connection: a thread of ep's serves it
        served = [th.native_id for th in threading.enumerate() if th.name == "lmcache-transfer-conn"]
        assert _nice(ep._thread.native_id) == want and _nice(ep.server._thread.native_id) == want
        assert _nice(peer._thread.native_id) == base and _nice(peer.server._thread.native_id) == base
        assert served and want in {_nice(n) for n in served}
        with raised_priority(-5):
            assert _nice(threading.get_native_id()) == want
        assert _nice(threading.get_native_id()) == base
    finally:
        ep.close()
        peer.close()
