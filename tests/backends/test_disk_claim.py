"""A disk tier over a directory it may share (issue 29, items 3 and 4).

Item 3: a disk tier claims its directory with a marker file, refuses one that an fs tier
claimed or that holds files it did not write (before, its start-up scan unlinked every
``*.lmc`` not named by its hash, so ``lmcache evict`` on an fs directory emptied it), and
in its own directory touches nothing outside its layout's names.

Item 4: several processes on one directory (the TP ranks of one vLLM server) share one
capacity and never remove each other's temporaries; real child processes
(tests/backends/disk_dir_peer.py), driven line by line, so the interleaving is fixed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from lmcache.backends.disk import _file_name
from lmcache.backends.disk_dir import LEDGER, MARKER
from lmcache.cli.main import app
from lmcache.errors import ConfigError
from lmcache.plugin_manager import get_registries
from lmcache.storage import BackendContext
from lmcache.encoded import open_objects
from lmcache.testing.conformance import make_key, make_obj

from _procs import readline, stop
from disk_dir_peer import key as rank_key

REGS = get_registries()
PEER = Path(__file__).with_name("disk_dir_peer.py")
runner = CliRunner()


def _disk(path: Path, read_only: bool = False):
    return REGS.backends.load("disk")(BackendContext.standalone({"path": str(path)}, read_only=read_only))


def _fs(path: Path, read_only: bool = False):
    return REGS.backends.load("fs")(BackendContext.standalone({"url": f"file://{path}"}, read_only=read_only))


def _tree(path: Path) -> dict[str, bytes | None]:
    """Every file and directory under ``path`` (a directory's value is ``None``)."""
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None) for p in sorted(path.rglob("*"))}


def _fs_dir(path: Path, n: int = 10) -> Path:
    fs = _fs(path)
    open_objects(fs).put([(make_key(i), make_obj(i)) for i in range(n)])
    fs.close()
    assert len(list(path.rglob("*.lmc"))) == n
    return path


# ------------------------------------------------------------------ item 3: the claim


def test_a_disk_tier_refuses_an_fs_tiers_directory_and_deletes_nothing(tmp_path):
    d = _fs_dir(tmp_path / "shared")
    before = _tree(d)
    for read_only in (False, True):
        with pytest.raises(ConfigError, match=r"belongs to a fs tier .*a disk tier needs a directory of its own"):
            _disk(d, read_only)
    assert _tree(d) == before


@pytest.mark.parametrize("what", ["fs-entries-without-marker", "tmp-like"])
def test_an_unclaimed_directory_with_foreign_files_is_refused_untouched(tmp_path, what):
    d = tmp_path / "dir"
    if what == "fs-entries-without-marker":  # an fs directory of the previous version
        _fs_dir(d)
        (d / MARKER).unlink()
    else:  # path: /tmp: other programs' files, temporaries included
        d.mkdir()
        (d / ".tmp-build1234").write_bytes(b"someone's")
        (d / ".tmp-dir").mkdir()
        (d / ".tmp-dir" / "x").write_bytes(b"x")
        (d / "notes.txt").write_text("mine")
    before = _tree(d)
    for read_only in (False, True):
        with pytest.raises(ConfigError, match=r"files that a disk tier did not write .*nothing was changed"):
            _disk(d, read_only)
    assert _tree(d) == before


def test_a_previous_versions_disk_directory_is_adopted(tmp_path):
    d = tmp_path / "kv"
    b = _disk(d)
    objs = {make_key(i): make_obj(i) for i in range(5)}
    open_objects(b).put(list(objs.items()))
    b.close()
    for p in d.glob(".lmcache-*"):  # the previous version wrote none of these
        p.unlink()
    some_sub = next(p for p in d.iterdir() if p.is_dir())
    legacy_tmp = some_sub / f".tmp-{'ab' * 16}"  # its writer's leftover, named as it named them
    legacy_tmp.write_bytes(b"half written")
    b2 = _disk(d)
    try:
        assert (d / MARKER).exists() and not legacy_tmp.exists()
        got = open_objects(b2).get(list(objs))
        assert all(g is not None and g.tensor.equal(o.tensor) for g, o in zip(got, objs.values()))
    finally:
        b2.close()


def test_an_fs_tier_refuses_a_disk_tiers_directory(tmp_path):
    d = tmp_path / "kv"
    b = _disk(d)
    open_objects(b).put([(make_key(i), make_obj(i)) for i in range(3)])
    before = _tree(d)
    for read_only in (False, True):
        with pytest.raises(ConfigError, match=r"'url'.*belongs to a disk tier .*an fs tier needs|belongs to a disk tier"):
            _fs(d, read_only)
    assert _tree(d) == before
    b.close()


def test_foreign_files_in_a_claimed_directory_are_left_alone(tmp_path):
    d = tmp_path / "kv"
    b = _disk(d)
    open_objects(b).put([(make_key(i), make_obj(i)) for i in range(3)])
    b.close()
    sub = next(p for p in d.iterdir() if p.is_dir())
    foreign = [d / "notes.txt", d / ".tmp-other-program", sub / "lmc1%3Atest%3Ax.lmc", sub / "README"]
    for p in foreign:
        p.write_bytes(b"not the tier's")
    b2 = _disk(d)
    try:
        assert b2.usage().entries == 3
        assert all(p.read_bytes() == b"not the tier's" for p in foreign)
    finally:
        b2.close()


@pytest.mark.parametrize(
    "args",
    [["ls"], ["tiers"], ["evict", "--key", make_key(999), "--yes"], ["evict", "--all", "--dry-run"]],
    ids=["ls", "tiers", "evict-absent-key", "evict-dry-run"],
)
def test_cli_commands_with_a_disk_config_over_an_fs_directory_delete_nothing(tmp_path, args):
    d = _fs_dir(tmp_path / "shared")
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(yaml.safe_dump({"tiers": [{"backend": "disk", "path": str(d), "capacity": "1GiB"}]}))
    before = _tree(d)
    result = runner.invoke(app, [*args, "--config", str(cfg)])
    assert result.exit_code == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmcache: error: ") and "belongs to a fs tier" in lines[0], lines
    assert _tree(d) == before


# --------------------------------------------------------- item 4: several processes


def _peer(path: Path, capacity: str, rank: int, err: Path) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, str(PEER), str(path), capacity, str(rank)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err.open("w"), text=True, bufsize=1,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(PEER.parent), os.environ.get("PYTHONPATH", "")])},
    )
    assert readline(p) == "READY", err.read_text()[-2000:]
    return p


def _ask(p: subprocess.Popen, line: str) -> str:
    p.stdin.write(line + "\n")
    p.stdin.flush()
    return readline(p)


def _entry_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*.lmc"))


def _has(d: Path, rank: int, i: int) -> bool:
    name = _file_name(rank_key(rank, i))
    return (d / name[:2] / name).exists()


def test_two_processes_on_one_directory_share_one_capacity(tmp_path):
    d = tmp_path / "kv"
    ranks = [_peer(d, "1MiB", r, tmp_path / f"rank{r}.err") for r in (0, 1)]
    try:
        for rnd in range(8):  # 64 chunks of 32 KiB per rank: 4 MiB offered to 1 MiB
            for p in ranks:
                assert _ask(p, f"PUT {rnd * 8} {rnd * 8 + 8}").startswith("OK ")
        used = _entry_bytes(d)
        assert 0 < used <= 1 << 20, f"{used} bytes of entries in a 1 MiB directory"
        assert int.from_bytes((d / LEDGER).read_bytes()[:8], "little") == used
        for r, p in enumerate(ranks):  # each rank keeps its newest chunks
            held = _ask(p, "KEYS").split()[1:]
            assert held and "63" in held and all(_has(d, r, int(i)) for i in held)
    finally:
        for p in ranks:
            stop(p)


def test_a_restarting_process_keeps_the_other_processes_entries(tmp_path):
    d = tmp_path / "kv"
    a = _peer(d, "1MiB", 0, tmp_path / "a.err")
    b = _peer(d, "1MiB", 1, tmp_path / "b.err")
    try:
        assert _ask(a, "PUT 0 12") == "OK 12"
        assert _ask(b, "PUT 0 30").startswith("OK ")  # past what is left: b evicts its own
        assert all(_has(d, 0, i) for i in range(12))
        stop(b)
        b = _peer(d, "1MiB", 1, tmp_path / "b2.err")  # a restart indexes all and trims what is over
        assert all(_has(d, 0, i) for i in range(12)), "the restart trimmed the other rank's entries"
        assert _entry_bytes(d) <= 1 << 20
    finally:
        stop(a)
        stop(b)


def test_an_opener_never_removes_a_live_writers_temporary(tmp_path):
    d = tmp_path / "kv"
    a = _peer(d, "64MiB", 0, tmp_path / "a.err")
    try:
        reply = _ask(a, "PAUSE 1")
        assert reply.startswith("TMP "), reply
        tmp = Path(reply.split(" ", 1)[1])
        other = _disk(d)  # another process's start-up scan, while a's write is in flight
        other.close()
        assert tmp.exists(), "the opener removed a live writer's temporary file"
        assert _ask(a, "GO") == "OK 1"
        assert _has(d, 0, 1) and not tmp.exists()
        # a writer killed in the middle: its temporary is garbage, the next opener removes it
        reply = _ask(a, "PAUSE 2")
        dead_tmp = Path(reply.split(" ", 1)[1])
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=60)
        assert dead_tmp.exists()
        again = _disk(d)
        try:
            assert not dead_tmp.exists() and not list(d.rglob(".tmp-*"))
            assert again.usage().entries == 1
        finally:
            again.close()
    finally:
        stop(a)
