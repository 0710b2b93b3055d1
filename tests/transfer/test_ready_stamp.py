"""A push's time until the receiver is ready (``ready_seconds``, ``push_ready_*``): taken
from the receiver's monotonic stamp only where both endpoints announced the same boot id
(one host, one clock), and never trusted outside the push's own span."""

from __future__ import annotations

import torch

from lmcache import transfer, transfer_wire
from lmcache.memory import MemoryPool
from lmcache.transfer import open_channel

MiB = 1 << 20


def _pair(got: dict):
    a, b = MemoryPool(16 * MiB, pin=False), MemoryPool(16 * MiB, pin=False)
    tx = open_channel("tcp", a)
    rx = open_channel("tcp", b, sink=lambda k, o: got.setdefault(k, o) is o)
    return a, tx, rx


def _push(a, tx, rx, request: str) -> dict:
    o = a.allocate((4096,), torch.float32)
    o.tensor.fill_(1.5)
    try:
        return tx.push(rx.url, request, [(f"k-{request}", o)])
    finally:
        o.unref()


def test_a_push_on_one_host_reports_when_the_receiver_was_ready():
    got: dict = {}
    a, tx, rx = _pair(got)
    try:
        r = _push(a, tx, rx, "r1")
        assert r["committed"] == 1
        assert r["ready_seconds"] is not None and 0 < r["ready_seconds"] <= r["seconds"], r
        st = tx.info()
        assert st["push_ready_count"] == 1 and abs(st["push_ready_seconds"] - r["ready_seconds"]) < 1e-9
    finally:
        tx.close()
        rx.close()
        for x in got.values():
            x.unref()


def test_a_peer_on_another_clock_gets_no_stamp_and_none_is_counted(monkeypatch):
    got: dict = {}
    a, tx, rx = _pair(got)
    # the receiver sees a hello from another boot (another host): it stamps nothing
    monkeypatch.setattr(transfer_wire, "_BOOT", ["another-host"])
    monkeypatch.setattr(transfer, "boot_id", lambda: "this-host")
    try:
        r = _push(a, tx, rx, "r2")
        assert r["committed"] == 1 and r["ready_seconds"] is None
        assert tx.info()["push_ready_count"] == 0
    finally:
        tx.close()
        rx.close()
        for x in got.values():
            x.unref()


class _Conn:
    def __init__(self, same: bool):
        self.state = {"same_clock": same}


def test_a_stamp_outside_the_push_or_not_a_number_is_ignored():
    ep = open_channel("tcp", MemoryPool(MiB, pin=False))
    try:
        m0 = 1000.0
        for at in ("1000.1", True, None, [1000.1], 999.0, 1000.0 + 5.0, float("nan"), float("inf")):
            assert ep._ready_after(_Conn(True), {"ready_at": at}, m0, 1.0) is None, at
        assert ep._ready_after(_Conn(False), {"ready_at": 1000.1}, m0, 1.0) is None
        assert ep.info()["push_ready_count"] == 0
        assert abs(ep._ready_after(_Conn(True), {"ready_at": 1000.25}, m0, 1.0) - 0.25) < 1e-9
        assert ep.info()["push_ready_count"] == 1
    finally:
        ep.close()


def test_same_clock_wants_this_boots_id_as_a_string():
    mine = transfer_wire.boot_id()
    assert mine is None or transfer_wire.same_clock(mine)
    for other in (None, 1, ["x"], {"boot": mine}, (mine or "") + "x", ""):
        assert not transfer_wire.same_clock(other), other
