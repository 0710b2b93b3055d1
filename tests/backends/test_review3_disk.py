"""A disk tier next to other processes and damaged files (issue 44, items 9, 13 and the
disk parts of 15).

Item 9: a second process on the same directory (its start-up scan holds the directory's
lock; one stopped mid-scan holds it until continued) never stops this process's reads,
and a store that cannot take the lock within a bound is skipped and counted, not a
failure that puts the tier in backoff. A real child process, stopped with SIGSTOP while it
holds the lock (tests/backends/disk_review3_peer.py).

Item 13: a damaged ``.lmcache-tier`` marker (empty, cut, one byte changed) no longer
stops the engine: a directory whose files are all the tier's own is adopted again and its
marker rewritten; one that also holds files the tier did not write leaves the engine
running without that tier, said in one line with what to do.

Item 15: a shared directory at its capacity is a skipped store, not "the device refuses
writes"; a ledger overwritten while the tier runs is recomputed, not a reason to skip
every store until a restart.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import lmcache
from lmcache.backends import disk_dir
from lmcache.backends.disk_dir import LEDGER, MARKER
from lmcache.config import load_config
from lmcache.hierarchy import build_tier
from lmcache.testing.conformance import make_key, make_obj

from _procs import readline, stop, until

PEER = Path(__file__).with_name("disk_review3_peer.py")
TOKENS = 256  # make_obj(i, TOKENS): 32 KiB of float16 per entry
SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float16"}


def _tier(path: Path, capacity: str = "1MiB", name: str = "disk"):
    cfg = load_config({"tiers": [{"name": name, "backend": "disk", "path": str(path), "capacity": capacity}]})
    return build_tier(0, cfg.tiers[0])


def _entry_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*.lmc"))


def _ledger(d: Path) -> int:
    return int.from_bytes((d / LEDGER).read_bytes()[:8], "little")


def _tree(path: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None) for p in sorted(path.rglob("*"))}


def _state(pid: int) -> str:
    """The process state letter from /proc (``T``: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


# ------------------------------------------------- item 9: another process holds the lock


def test_reads_go_on_while_another_opener_is_stopped_in_its_scan(tmp_path):
    d = tmp_path / "kv"
    tier = _tier(d)
    for i in range(40):  # 40 x 32 KiB offered to 1 MiB: at capacity, each further store evicts
        tier.put_one(make_key(i), make_obj(i, TOKENS))
    readable = [make_key(i) for i in range(36, 40)]
    for k in readable:
        tier.pin(k)  # the entries the reader reads stay; every other one may be evicted
    err = tmp_path / "peer.err"
    peer = subprocess.Popen(
        [sys.executable, str(PEER), str(d), "1MiB"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err.open("w"), text=True, bufsize=1,
    )
    done = threading.Event()
    reads = [0]
    puts: list[bool] = []
    threads: list[threading.Thread] = []
    try:
        assert readline(peer) == "SCANNING", err.read_text()[-2000:]
        until(lambda: _state(peer.pid) == "T", "the peer stopped while it holds the directory's lock")

        def store() -> None:
            j = 1000
            while not done.is_set():
                puts.append(tier.put_one(make_key(j), make_obj(j, TOKENS)))
                j += 1

        def read() -> None:
            while not done.is_set():
                got = tier.get([readable[reads[0] % len(readable)]])[0]
                assert got is not None
                got.unref()
                reads[0] += 1

        threads = [threading.Thread(target=store, daemon=True), threading.Thread(target=read, daemon=True)]
        for t in threads:
            t.start()
        start = reads[0]
        # before: the store evicting held the tier's lock while it waited on the directory's
        # lock for as long as the peer was stopped, and no read completed (0 in 5 s)
        until(lambda: reads[0] >= start + 200 and len(puts) >= 3,
              "reads and (skipped) stores go on while another process holds the directory's lock", timeout=30)
        assert not any(puts), "a store went through while another process held the directory's lock"
        assert tier.available and tier.stats.errors == 0, tier.stats.last_error
        assert tier.stats.skipped_puts >= 3
    finally:
        done.set()
        if peer.poll() is None:
            peer.send_signal(signal.SIGCONT)
        for t in threads:
            t.join(60)
    try:
        assert readline(peer) == "READY", err.read_text()[-2000:]
        stop(peer)
        assert peer.returncode == 0, err.read_text()[-2000:]
        # the lock is free again: stores go through, and the removals that waited for it
        # were made and counted, so the ledger matches the files
        assert tier.put_one(make_key(5000), make_obj(5000, TOKENS))
        assert _ledger(d) == _entry_bytes(d) <= 1 << 20
        assert all(tier.get([k])[0] is not None for k in readable)
    finally:
        stop(peer)
        tier.backend.close()


def test_an_engine_opening_while_another_opener_is_stopped_starts_without_that_tier(tmp_path, monkeypatch, caplog):
    d = tmp_path / "kv"
    tier = _tier(d)
    tier.backend.close()
    err = tmp_path / "peer.err"
    peer = subprocess.Popen(
        [sys.executable, str(PEER), str(d), "1MiB"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err.open("w"), text=True, bufsize=1,
    )
    monkeypatch.setattr(disk_dir, "OPEN_WAIT", 1.0)  # 60 s in use
    caplog.set_level(logging.WARNING)
    opener = threading.Thread()
    opened: list = []
    try:
        assert readline(peer) == "SCANNING", err.read_text()[-2000:]
        until(lambda: _state(peer.pid) == "T", "the peer stopped while it holds the directory's lock")
        opener = threading.Thread(target=lambda: opened.append(_engine(d)), daemon=True)
        opener.start()
        opener.join(30)  # a hang guard: before, the open waited for as long as the peer was stopped
        assert opened, "no engine within 30 s while another opener of its disk directory was stopped"
        e = opened[0]
        assert [t.name for t in e.hierarchy.tiers] == ["cpu"]
        e.store(list(range(32)), _kv(32))
        assert e.retrieve(list(range(32))).num_tokens == 32
        said = [r.getMessage() for r in caplog.records if "running without" in r.getMessage()]
        assert len(said) == 1 and f"process {peer.pid}" in said[0] and "restart" in said[0], said
    finally:
        if peer.poll() is None:
            peer.send_signal(signal.SIGCONT)
        stop(peer)
        if opener.ident is not None:
            opener.join(60)
        for e in opened:
            e.close()


# ------------------------------------------------------- item 13: a damaged marker


def _engine(path: Path):
    cfg = load_config({
        "chunk_size": 16,
        "tiers": [{"backend": "cpu", "capacity": "16MiB"}, {"name": "disk", "backend": "disk", "path": str(path),
                                                               "capacity": "64MiB"}],
    })
    return lmcache.CacheEngine(cfg, kv_spec=lmcache.KVSpec(**SPEC))


def _kv(tokens: int) -> torch.Tensor:
    return torch.arange(2 * 2 * tokens * 2 * 8, dtype=torch.float32).reshape(2, 2, tokens, 2, 8).to(torch.float16)


def _damage(marker: Path, how: str) -> None:
    data = marker.read_bytes()
    if how == "empty":
        marker.write_bytes(b"")
    elif how == "cut":
        marker.write_bytes(data[: len(data) // 2])
    elif how == "byte-in-syntax":
        marker.write_bytes(b"[" + data[1:])
    elif how == "byte-in-layout":  # still JSON, naming a layout no tier has
        at = data.index(b"xxh3")
        marker.write_bytes(data[:at] + b"y" + data[at + 1 :])
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["empty", "cut", "byte-in-syntax", "byte-in-layout"])
def test_a_damaged_marker_is_rewritten_and_the_entries_kept(tmp_path, how):
    d = tmp_path / "kv"
    toks = list(range(64))
    with _engine(d) as e:
        e.store(toks, _kv(64))
        e.flush()
    assert len(list(d.rglob("*.lmc"))) == 4
    _damage(d / MARKER, how)
    # before: "... is not an lmcache tier marker ...; the directory is not this tier's"
    # (or "belongs to a disk tier (layout disk/yxh3-128-hex ...)") and no engine
    with _engine(d) as e:
        assert [t.name for t in e.hierarchy.tiers] == ["cpu", "disk"]
        res = e.retrieve(toks)
        assert res.num_tokens == 64 and torch.equal(res.kv, _kv(64)) and set(res.tiers) == {"disk"}
    assert disk_dir.parse_marker((d / MARKER).read_bytes(), "marker", "path") == ("disk", disk_dir.DISK_LAYOUT)
    assert not list(d.rglob(".tmp-*"))


def test_a_damaged_marker_over_foreign_files_runs_without_that_tier(tmp_path, caplog):
    d = tmp_path / "kv"
    with _engine(d) as e:
        e.store(list(range(32)), _kv(32))
        e.flush()
    (d / "notes.txt").write_text("someone else's")
    _damage(d / MARKER, "empty")
    before = _tree(d)
    toks = list(range(100, 132))
    caplog.set_level(logging.WARNING)
    with _engine(d) as e:  # before: ConfigError, no engine
        assert [t.name for t in e.hierarchy.tiers] == ["cpu"]
        e.store(toks, _kv(32))
        res = e.retrieve(toks)
        assert res.num_tokens == 32 and torch.equal(res.kv, _kv(32))
    said = [r.getMessage() for r in caplog.records if "without" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    assert str(d) in said[0] and "notes.txt" in said[0] and "restart" in said[0], said[0]
    assert _tree(d) == before, "the tier changed a directory it did not take"


# ----------------------------------------------------------------- item 15: disk parts


def test_a_shared_directory_at_capacity_is_not_a_device_error(tmp_path, caplog):
    """Two tiers on one directory; the other one fills the room this one made for a store
    between its eviction and its rename (every other store), as a second process does."""
    d = tmp_path / "kv"
    a, b = _tier(d, name="a"), _tier(d, name="b")
    try:
        for i in range(16):
            assert a.put_one(make_key(i), make_obj(i, TOKENS))
        write_file = a.backend.raw._write_file  # the disk store's file write (under the tier's view)
        n = [0]

        def racing(tmp, buffers, total):
            write_file(tmp, buffers, total)
            n[0] += 1
            if n[0] % 2:
                for _ in range(2):  # the other process takes the room (and a bit) meanwhile
                    j = 10_000 + n[0] * 10 + _
                    b.put_one(make_key(j), make_obj(j, TOKENS))

        a.backend.raw._write_file = racing
        caplog.set_level(logging.INFO)
        for i in range(100, 140):
            a.put_one(make_key(i), make_obj(i, TOKENS))
        refused = [r.getMessage() for r in caplog.records if "refuses writes" in r.getMessage()]
        # before: 10 of them, one per store the full directory refused
        assert refused == [], refused
        assert a.stats.skipped_puts >= 5 and a.stats.refused_writes == 0 and a.stats.errors == 0
        assert a.info()["write_refused"] is None
        assert _ledger(d) == _entry_bytes(d) <= 1 << 20
    finally:
        a.backend.close()
        b.backend.close()


def test_a_device_that_refuses_every_other_write_is_said_once(tmp_path, caplog):
    """The device itself (ENOSPC from the write, injected into the real file write every
    other store, as a nearly full filesystem does): said once, not once per refusal."""
    import errno

    tier = _tier(tmp_path / "kv", capacity="64MiB")
    write_file = tier.backend.raw._write_file  # the disk store's file write (under the tier's view)
    n = [0]

    def nearly_full(tmp, buffers, total):
        n[0] += 1
        if n[0] % 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        write_file(tmp, buffers, total)

    tier.backend.raw._write_file = nearly_full
    caplog.set_level(logging.WARNING)
    try:
        for i in range(20):
            tier.put_one(make_key(i), make_obj(i, TOKENS))
        said = [r.getMessage() for r in caplog.records if "writes" in r.getMessage()]
        # before: 20 lines, 10 "refuses writes" and 10 "takes writes again"
        assert len(said) == 2 and "refuses writes" in said[0] and "takes writes again" in said[1], said
        assert tier.stats.refused_writes == 10 and tier.stats.puts == 10 and tier.available
    finally:
        tier.backend.close()


@pytest.mark.parametrize("garbage", [b"\xff" * 8, b"\0" * 8, b"", b"12345\n", os.urandom(16)],
                         ids=["huge", "zero", "empty", "text", "random-16"])
def test_a_ledger_overwritten_while_running_is_recomputed(tmp_path, garbage):
    d = tmp_path / "kv"
    tier = _tier(d)
    try:
        for i in range(40):
            tier.put_one(make_key(i), make_obj(i, TOKENS))
        (d / LEDGER).write_bytes(garbage)  # an operator, or another program
        stored = sum(bool(tier.put_one(make_key(i), make_obj(i, TOKENS))) for i in range(100, 120))
        assert stored == 20, f"{stored} of 20 stores after the ledger was overwritten"  # before: 0 with "huge"
        assert _ledger(d) == _entry_bytes(d) <= 1 << 20
    finally:
        tier.backend.close()
