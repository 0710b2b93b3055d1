"""The ``fs`` backend: conformance on file:// and memory://, sharing between engine
processes, atomic publish under concurrent writers, corrupt entries, a hung file, config."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from _missing import missing
from lmcache.codecs import load_codec
from lmcache.errors import ConfigError
from lmcache.plugin_manager import get_registries
from lmcache.storage import BackendContext
from lmcache.encoded import open_objects
from lmcache.testing import BytesBackendTests, FileBackendTests, assert_rejects, make_key, make_obj

REGS = get_registries()


def baseline(name):
    """The raw-client baseline registered for backend ``name`` (lmcache_register_bench_baselines)."""
    from lmcache.plugin_manager import get_registries

    return get_registries().baselines.load(name)



@pytest.fixture(scope="module")
def FSBackend():
    try:
        import fsspec  # noqa: F401  (pyflakes: imported to see that it imports)
    except ImportError:
        missing("fsspec is not installed (pip install 'lmcache[fs]')")
    return REGS.backends.load("fs")


def open_fs(FSBackend, url, codec="raw", **opts):
    ctx = BackendContext.standalone({"url": url, **opts}, codec=load_codec(REGS.codecs.load, codec))
    return FSBackend(ctx)


@pytest.mark.parametrize("where,codec", [("file", "raw"), ("file", "zstd"), ("memory", "raw")])
class TestFSConformance(FileBackendTests, BytesBackendTests):
    @pytest.fixture
    def url(self, where, tmp_path):
        return f"file://{tmp_path}/store" if where == "file" else f"memory://lmc-{uuid.uuid4().hex}"

    @pytest.fixture
    def backend(self, FSBackend, url, codec):
        b = open_fs(FSBackend, url, codec)
        yield b
        b.close()

    @pytest.fixture
    def reopen(self, FSBackend, url, codec):
        return lambda read_only=False: FSBackend(BackendContext.standalone(
            {"url": url}, codec=load_codec(REGS.codecs.load, codec), read_only=read_only))

    @pytest.fixture
    def open_at(self, FSBackend, where, codec):  # (the class's parameters: every test must take them)
        return lambda path, read_only: FSBackend(BackendContext.standalone(
            {"url": f"file://{path}"}, codec=load_codec(REGS.codecs.load, codec), read_only=read_only))


# ------------------------------------------------------------------ layout and listing
def test_keys_are_listed_from_names_alone(FSBackend, tmp_path):
    b = open_fs(FSBackend, str(tmp_path))
    items = [(make_key(i), make_obj(i)) for i in range(3)]
    sizes = open_objects(b).put(items)
    files = sorted(p for p in tmp_path.rglob("*.lmc"))
    assert len(files) == 3
    # not lmcache entries: skipped, and left alone
    (tmp_path / "README").write_text("hello")
    (tmp_path / "ab").mkdir(exist_ok=True)
    (tmp_path / "ab" / "not%20a%20key.lmc").write_bytes(b"x")
    # listing never reads a file: blank every entry (same size) and list again
    for f in files:
        f.write_bytes(bytes(f.stat().st_size))
    assert dict(b.keys()) == {k: s for (k, _), s in zip(items, sizes)}
    assert {e.key for e in b.entries()} == {k for k, _ in items}
    assert all(e.stored_at and abs(e.stored_at - time.time()) < 600 for e in b.entries())
    assert (tmp_path / "README").exists() and b.integrity.corrupt == 0


def test_prefix_separates_stores_in_one_directory(FSBackend, tmp_path):
    a = open_fs(FSBackend, str(tmp_path), prefix="team-a.")
    b = open_fs(FSBackend, str(tmp_path), prefix="team-b.")
    open_objects(a).put([(make_key(1), make_obj(1))])
    assert [k for k, _ in a.keys()] == [make_key(1)]
    assert list(b.keys()) == [] and open_objects(b).get([make_key(1)]) == [None] and b.get([make_key(1)]) == [None]
    assert any(p.name.startswith("team-a.lmc1") for p in tmp_path.rglob("*.lmc"))


def test_long_key_is_split_into_directories(FSBackend, tmp_path):
    b = open_fs(FSBackend, f"file://{tmp_path}")
    key = make_key(5, model="org/" + "m" * 400)
    obj = make_obj(5)
    objects = open_objects(b)
    objects.put([(key, obj)])
    (f,) = tmp_path.rglob("*.lmc")
    assert all(len(part) <= 255 for part in f.relative_to(tmp_path).parts)
    assert len(f.relative_to(tmp_path).parts) > 2
    assert [k for k, _ in b.keys()] == [key]
    (g,) = objects.get([key])
    assert g is not None and torch.equal(g.tensor, obj.tensor)
    g.unref()


def test_stale_temporaries_are_ignored_and_old_ones_removed(FSBackend, tmp_path):
    from lmcache.backends.fs import TMP_PREFIX

    b = open_fs(FSBackend, str(tmp_path), tmp_max_age=60)
    open_objects(b).put([(make_key(1), make_obj(1))])
    sub = next(tmp_path.rglob("*.lmc")).parent
    old, fresh = sub / f"{TMP_PREFIX}old", sub / f"{TMP_PREFIX}fresh"
    old.write_bytes(b"half a chunk")
    fresh.write_bytes(b"a chunk being written")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    assert [k for k, _ in b.keys()] == [make_key(1)]
    assert not old.exists() and fresh.exists()


def test_corrupt_and_truncated_files_are_misses_and_deleted(FSBackend, tmp_path):
    b = open_fs(FSBackend, str(tmp_path))
    objects = open_objects(b)
    k1, k2, k3 = make_key(1), make_key(2), make_key(3)
    objects.put([(k1, make_obj(1)), (k2, make_obj(2)), (k3, make_obj(3))])
    p1, p2 = Path(b._path(k1)), Path(b._path(k2))
    data = p1.read_bytes()
    p1.write_bytes(data[: len(data) // 2])  # truncated
    flipped = bytearray(p2.read_bytes())
    flipped[-5] ^= 0xFF  # one bit of the body
    p2.write_bytes(bytes(flipped))
    got = objects.get([k1, k2, k3])
    assert got[0] is None and got[1] is None and got[2] is not None
    got[2].unref()
    assert not p1.exists() and not p2.exists()
    assert b.integrity.corrupt == 2
    assert b.exists([k1, k2, k3]) == [False, False, True]


def test_raw_transfer_moves_the_bytes_and_cleans_up(FSBackend, tmp_path):
    items = [(make_key(i), os.urandom(10_000 + i)) for i in range(20)]
    put_s, get_s = baseline("fs")({"url": str(tmp_path), "concurrency": 4}, items, 8)
    assert put_s > 0 and get_s > 0
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "options,key",
    [
        ({}, "url"),
        ({"url": ""}, "url"),
        ({"url": 42}, "url"),
        ({"url": "bogus-proto://x/y"}, "url"),
        ({"url": "file://relative/dir"}, "url"),
        ({"url": "simplecache::memory://x"}, "url"),
        ({"url": "memory://x", "fs_options": "anon=true"}, "fs_options"),
        ({"url": "memory://x", "concurrency": 0}, "concurrency"),
        ({"url": "memory://x", "concurrency": 2.5}, "concurrency"),
        ({"url": "memory://x", "timeout": -1}, "timeout"),
        ({"url": "memory://x", "timeout": "soon"}, "timeout"),
        ({"url": "memory://x", "tmp_max_age": 0}, "tmp_max_age"),
        ({"url": "memory://x", "prefix": "a/b"}, "prefix"),
        ({"url": "memory://x", "path": "/tmp"}, "path"),
    ],
)
def test_bad_options_name_the_key(FSBackend, options, key):
    assert_rejects(FSBackend, options, key)


def test_bad_option_in_a_tier_config_names_the_tier_key(FSBackend, tmp_path):
    import lmcache

    with pytest.raises(ConfigError, match=r"tiers\[0\]\.url"):
        lmcache.CacheEngine.from_config({"tiers": [{"backend": "fs", "url": "file://x/y", "capacity": "1MiB"}]})


# ------------------------------------------------------------------ engines in two processes
_ENGINE_CHILD = textwrap.dedent(
    """
    import json, sys, torch, lmcache

    def kv_for(tokens):
        t = torch.as_tensor(tokens, dtype=torch.float64).reshape(1, 1, -1, 1, 1)
        base = torch.arange(3 * 2 * 2 * 16, dtype=torch.float64).reshape(3, 2, 1, 2, 16)
        x = base * 0.01 + t * 0.37  # exactly rounded steps only: the same bits in every process
        return (8 * (x - x.floor()) * (1 - (x - x.floor())) - 1).to(torch.float32)

    engine = lmcache.CacheEngine.from_config(
        {"chunk_size": 16, "tiers": [{"backend": "fs", "url": sys.argv[1], "capacity": "64MiB"}]},
        kv_spec={"num_layers": 3, "num_kv_heads": 2, "head_size": 16, "dtype": "float32"},
    )
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        toks = req["tokens"]
        if req["op"] == "store":
            r = engine.store(toks, kv_for(toks))
            engine.flush()
            out = {"stored": r.stored_tokens}
        else:
            n = engine.lookup(toks)
            res = engine.retrieve(toks)
            exact = res.num_tokens > 0 and torch.equal(res.kv, kv_for(toks)[:, :, : res.num_tokens])
            out = {"lookup": n, "retrieved": res.num_tokens, "exact": exact, "tiers": res.tiers}
        print(json.dumps(out), flush=True)
    engine.close()
    """
)


class _Child:
    def __init__(self, code: str, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def ask(self, **req) -> dict:
        if req:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"child exited with {self.proc.wait()}"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_two_engine_processes_share_one_directory(FSBackend, tmp_path):
    url = f"file://{tmp_path}/shared"
    a, b = _Child(_ENGINE_CHILD, url), _Child(_ENGINE_CHILD, url)
    try:
        assert a.ask() == {"ready": True} and b.ask() == {"ready": True}
        first, second = list(range(100)), list(range(1000, 1080))
        assert a.ask(op="store", tokens=first) == {"stored": 100}
        assert b.ask(op="get", tokens=first) == {"lookup": 100, "retrieved": 100, "exact": True, "tiers": ["fs"] * 7}
        assert b.ask(op="get", tokens=second)["retrieved"] == 0
        assert b.ask(op="store", tokens=second) == {"stored": 80}
        assert a.ask(op="get", tokens=second) == {"lookup": 80, "retrieved": 80, "exact": True, "tiers": ["fs"] * 5}
    finally:
        a.close()
        b.close()


_WRITER_CHILD = textwrap.dedent(
    """
    import sys
    from lmcache.backends.fs import FSBackend
    from lmcache.storage import BackendContext
    from lmcache.encoded import open_objects
    from lmcache.testing import make_key, make_obj

    b = open_objects(FSBackend(BackendContext.standalone({"url": sys.argv[1]})))
    objs = [make_obj(int(s), num_tokens=2048) for s in sys.argv[2].split(",")]
    print('{"ready": true}', flush=True)
    sys.stdin.readline()  # start together
    for i in range(int(sys.argv[3])):
        b.put([(make_key(0), objs[i % len(objs)])])
    print('{"done": true}', flush=True)
    """
)


def test_concurrent_writers_of_one_key_never_expose_a_partial_entry(FSBackend, tmp_path):
    url = str(tmp_path)
    seeds = {"w1": [11, 12], "w2": [21, 22]}
    expected = [make_obj(s, num_tokens=2048).tensor for ss in seeds.values() for s in ss]
    reader = open_fs(FSBackend, url)
    reader_objects = open_objects(reader)
    writers = [_Child(_WRITER_CHILD, url, ",".join(map(str, ss)), "150") for ss in seeds.values()]
    try:
        for w in writers:
            assert w.ask() == {"ready": True}
        for w in writers:
            w.proc.stdin.write("go\n")
            w.proc.stdin.flush()
        reads = hits = 0
        while (reads < 20 or any(w.proc.poll() is None for w in writers)) and reads < 5000:
            (g,) = reader_objects.get([make_key(0)])
            reads += 1
            if g is not None:
                hits += 1
                assert any(torch.equal(g.tensor, e) for e in expected)
                g.unref()
        for w in writers:
            assert w.ask() == {"done": True}
    finally:
        for w in writers:
            w.close()
    assert hits > 0
    assert reader.integrity.corrupt == 0
    assert [k for k, _ in reader.keys()] == [make_key(0)]  # one entry, no temporaries left
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith((".lmc", ".lmcache-tier"))]


# ------------------------------------------------------------------ a hung filesystem
def _unblock_fifo(path: Path) -> None:
    """Let a reader blocked opening the FIFO at ``path`` go: it reads EOF and fails."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # ENXIO: nobody is waiting
            raise
    else:
        os.close(fd)


def test_hung_file_is_a_miss_within_the_timeout_and_hits_resume(FSBackend, tmp_path):
    """A FIFO in place of a chunk file blocks ``open`` like a hung NFS server does: the
    engine must answer (with misses) within the timeout, and serve hits again once the
    file is back, with the same engine."""
    import lmcache

    url = f"file://{tmp_path}/store"
    toks = list(range(64))
    kv = torch.randn(3, 2, 64, 2, 16, generator=torch.Generator().manual_seed(0))
    cfg = {"chunk_size": 16, "tiers": [{"backend": "fs", "url": url, "capacity": "64MiB", "timeout": 0.5}]}
    with lmcache.CacheEngine.from_config(cfg) as engine:
        engine.store(toks, kv)
        engine.flush()
        assert engine.retrieve(toks).num_tokens == 64
        tier = engine.hierarchy.tier("fs")
        chunk0 = Path(tier.backend.raw._path(engine.chunk_keys(toks)[1][0]))  # the byte store under the tier's view
        saved = chunk0.read_bytes()
        chunk0.unlink()
        os.mkfifo(chunk0)
        try:
            t0 = time.monotonic()
            res = engine.retrieve(toks)
            assert time.monotonic() - t0 < 5.0  # a hang guard: the timeout is 0.5 s
            assert res.num_tokens == 0 and res.kv is None
            assert tier.stats.errors >= 1 and "did not finish within" in tier.stats.last_error
            assert engine.lookup(toks) in (0, 64)  # answers (misses while the tier backs off)
        finally:
            _unblock_fifo(chunk0)
            chunk0.unlink()
        tmp = chunk0.with_name(".restore")
        tmp.write_bytes(saved)
        tmp.rename(chunk0)
        deadline = time.monotonic() + 15
        while (res := engine.retrieve(toks)).num_tokens < 64 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert res.num_tokens == 64 and torch.equal(res.kv, kv)
        assert tier.available


def test_unreachable_filesystem_does_not_stop_the_backend_from_opening(FSBackend, tmp_path):
    """An unusable root (a file where the directory should be) is an error on each call,
    not at open: the engine starts, the tier serves misses."""
    (tmp_path / "blocker").write_text("not a directory")
    b = open_objects(open_fs(FSBackend, f"file://{tmp_path}/blocker/store", timeout=1))
    with pytest.raises(OSError):
        b.put([(make_key(1), make_obj(1))])
    with pytest.raises(OSError):
        b.get([make_key(1)])
    with pytest.raises(OSError):
        b.raw.put_one(make_key(2), [b"bytes"])
    (tmp_path / "blocker").unlink()  # the "server" is back: the next call works
    assert b.put([(make_key(1), make_obj(1))])[0] > 0
    (g,) = b.get([make_key(1)])
    assert g is not None
    g.unref()
