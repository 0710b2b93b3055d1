"""The ``gds`` backend: its POSIX path (O_DIRECT, aligned buffers) always; its kvikio
path where kvikio is installed and usable (``libcuda.so.1`` present, a GPU optional)."""

from __future__ import annotations

import fcntl
import logging
import os
import sys

import pytest
import torch

from _missing import missing
from lmcache.testing import stores as loopback
from lmcache.codecs import load_codec
from lmcache.errors import ConfigError
from lmcache.plugin_manager import get_registries
from lmcache.storage import BackendContext
from lmcache.encoded import open_objects
from lmcache.testing import BackendTests, BytesBackendTests, FileBackendTests, assert_rejects, make_key, make_obj

REGS = get_registries()
GDSBackend = REGS.backends.load("gds")

KVIKIO_HINT = (
    "the kvikio path needs kvikio and libcuda.so.1: pip install --no-deps kvikio-cu12 libkvikio-cu12 "
    "rapids-logger cuda-pathfinder nvidia-cufile-cu12, and Debian's libcuda1 (contrib + non-free)"
)


def open_gds(path, codec="raw", **opts):
    ctx = BackendContext.standalone({"url": f"gds://{path}", **opts}, codec=load_codec(REGS.codecs.load, codec))
    return GDSBackend(ctx)


@pytest.fixture(scope="module")
def kvikio_usable(tmp_path_factory):
    """Skip (fail under CI) unless kvikio imports and moves bytes here."""
    try:
        import kvikio  # noqa: F401  (pyflakes: imported to see that it imports)
    except Exception as exc:
        missing(f"kvikio is not importable ({exc}); {KVIKIO_HINT}")
    try:  # kvikio needs libcuda.so.1 even without a GPU; CI (root) installs Debian's
        loopback.ensure_library("libcuda.so.1", apt_package="libcuda1", components="contrib non-free")
    except loopback.ServerUnavailable as exc:
        missing(f"{exc}; {KVIKIO_HINT}")
    b = open_gds(tmp_path_factory.mktemp("probe"))
    b.close()
    if not b.io_path.startswith("kvikio"):
        missing(f"kvikio imports but cannot move bytes here: {b.kvikio_problem}; {KVIKIO_HINT}")


@pytest.mark.parametrize("codec", ["raw", "zstd"])
class TestGDSPosix(FileBackendTests, BytesBackendTests):
    @pytest.fixture
    def backend(self, codec, tmp_path):
        b = open_gds(tmp_path, codec, use_kvikio=False)
        assert b.io_path == "posix (O_DIRECT)"
        yield b
        b.close()

    @pytest.fixture
    def reopen(self, codec, tmp_path):
        def again(read_only=False):
            ctx = BackendContext.standalone({"url": f"gds://{tmp_path}", "use_kvikio": False},
                                            codec=load_codec(REGS.codecs.load, codec), read_only=read_only)
            return GDSBackend(ctx)
        return again

    @pytest.fixture
    def open_at(self, codec):  # (the class's parameter: every test must take it)
        return lambda path, read_only: GDSBackend(BackendContext.standalone(
            {"url": f"gds://{path}", "use_kvikio": False}, codec=load_codec(REGS.codecs.load, codec),
            read_only=read_only))


@pytest.mark.parametrize("codec", ["raw", "zstd"])
class TestGDSKvikio(BackendTests):
    @pytest.fixture
    def backend(self, kvikio_usable, codec, tmp_path):
        b = open_gds(tmp_path, codec, use_kvikio=True)
        assert b.io_path.startswith("kvikio")
        yield b
        b.close()


# ------------------------------------------------------------------ the POSIX path
def test_posix_path_opens_every_file_with_o_direct(tmp_path, monkeypatch):
    """Every data file is opened with O_DIRECT (read back from the kernel's own flags of
    each descriptor), and sizes that are no multiple of the block size round-trip."""
    b = open_gds(tmp_path, use_kvikio=False)
    flags: dict[str, int] = {}
    real_open = os.open

    def recording_open(path, mode, *args, **kw):
        fd = real_open(path, mode, *args, **kw)
        name = os.path.basename(str(path))
        # data files only: the directory's claim, ledger and live locks are not data (backends/disk_dir.py)
        if str(path).startswith(str(tmp_path)) and not name.startswith(".lmcache-"):
            flags[name] = fcntl.fcntl(fd, fcntl.F_GETFL)
        return fd

    monkeypatch.setattr(os, "open", recording_open)
    view = open_objects(b)
    objs = {make_key(i): make_obj(i, num_tokens=n) for i, n in enumerate((1, 3, 7, 129, 1000))}
    sizes = view.put(list(objs.items()))
    got = view.get(list(objs))
    monkeypatch.undo()
    assert all(s % 4096 for s in sizes)  # none aligned: the padding and the truncate both matter
    for (k, o), g in zip(objs.items(), got):
        assert g is not None and torch.equal(g.tensor, o.tensor)
        g.unref()
    assert len(flags) >= 2 * len(objs)  # a temporary and a final name per entry
    assert all(f & os.O_DIRECT for f in flags.values())
    files = sorted(tmp_path.rglob("*.lmc"))
    assert sorted(f.stat().st_size for f in files) == sorted(sizes)


def test_posix_path_without_o_direct_uses_the_page_cache(tmp_path):
    b = open_gds(tmp_path, use_kvikio=False, o_direct=False)
    assert b.io_path == "posix (page cache)"
    view = open_objects(b)
    view.put([(make_key(1), make_obj(1))])
    (g,) = view.get([make_key(1)])
    assert g is not None
    g.unref()


def test_corrupt_entry_is_a_miss_and_deleted(tmp_path):
    b = open_gds(tmp_path, use_kvikio=False)
    view = open_objects(b)
    view.put([(make_key(1), make_obj(1)), (make_key(2), make_obj(2))])
    f = b._path(make_key(1))
    data = f.read_bytes()
    f.write_bytes(data[:-10])
    got = view.get([make_key(1), make_key(2)])
    assert got[0] is None and got[1] is not None
    got[1].unref()
    assert not f.exists() and b.integrity.corrupt == 1
    assert b.exists([make_key(1), make_key(2)]) == [False, True]


def test_entries_survive_a_reopen_and_disk_reads_the_same_directory(tmp_path):
    b = open_gds(tmp_path, use_kvikio=False)
    o = make_obj(3, num_tokens=33)
    open_objects(b).put([(make_key(3), o)])
    b.close()
    again = open_gds(tmp_path, use_kvikio=False)
    assert [k for k, _ in again.keys()] == [make_key(3)]
    disk = REGS.backends.load("disk")(BackendContext.standalone({"path": str(tmp_path)}))
    (g,) = open_objects(disk).get([make_key(3)])
    assert g is not None and torch.equal(g.tensor, o.tensor)
    g.unref()


def test_without_kvikio_auto_falls_back_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "kvikio", None)  # as if not installed
    with caplog.at_level(logging.INFO, logger="lmcache.backends.gds"):
        b = open_gds(tmp_path)
    assert b.io_path == "posix (O_DIRECT)"
    assert "kvikio not used: cannot import kvikio" in caplog.text
    with pytest.raises(ConfigError) as info:
        open_gds(tmp_path, use_kvikio=True)
    assert info.value.key == "use_kvikio"


def test_engine_with_a_gds_tier(tmp_path):
    import lmcache

    toks = list(range(90))
    kv = torch.randn(3, 2, 90, 2, 16, generator=torch.Generator().manual_seed(0))
    cfg = {"chunk_size": 16, "tiers": [{"backend": "gds", "url": f"gds://{tmp_path}", "capacity": "8MiB"}]}
    with lmcache.CacheEngine.from_config(cfg) as e:
        e.store(toks, kv)
        e.flush()
    with lmcache.CacheEngine.from_config(cfg, kv_spec={"num_layers": 3, "num_kv_heads": 2, "head_size": 16,
                                                       "dtype": "float32"}) as e:
        res = e.retrieve(toks)
        assert res.num_tokens == 90 and torch.equal(res.kv, kv)


# ------------------------------------------------------------------ the kvikio path
def test_kvikio_and_posix_paths_read_each_others_files(kvikio_usable, tmp_path):
    k = open_objects(open_gds(tmp_path / "a", "zstd", use_kvikio=True))
    objs = {make_key(i): make_obj(i, num_tokens=n) for i, n in enumerate((1, 17, 300))}
    k.put(list(objs.items()))
    k.close()
    p = open_objects(open_gds(tmp_path / "a", use_kvikio=False))
    for (key, o), g in zip(objs.items(), p.get(list(objs))):
        assert g is not None and torch.equal(g.tensor, o.tensor)
        g.unref()
    p.put([(make_key(9), make_obj(9))])
    k = open_objects(open_gds(tmp_path / "a", use_kvikio=True))
    (g,) = k.get([make_key(9)])
    assert g is not None and torch.equal(g.tensor, make_obj(9).tensor)
    g.unref()


def test_kvikio_corrupt_entry_is_a_miss_and_deleted(kvikio_usable, tmp_path):
    b = open_gds(tmp_path, use_kvikio=True)
    view = open_objects(b)
    view.put([(make_key(1), make_obj(1, num_tokens=200))])
    f = b._path(make_key(1))
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    assert view.get([make_key(1)]) == [None]
    assert not f.exists() and b.integrity.corrupt == 1


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "options,key",
    [
        ({}, "url"),
        ({"url": "file:///tmp/x"}, "url"),
        ({"url": "gds://host/tmp/x"}, "url"),
        ({"url": "gds:relative"}, "url"),
        ({"url": "gds:///tmp/x?direct=1"}, "url"),
        ({"url": 7}, "url"),
        ({"url": "gds:///tmp/x", "path": "/tmp/y"}, "path"),
        ({"url": "gds:///tmp/x", "use_kvikio": "maybe"}, "use_kvikio"),
        ({"url": "gds:///tmp/x", "use_kvikio": 1}, "use_kvikio"),
        ({"url": "gds:///tmp/x", "o_direct": "yes"}, "o_direct"),
        ({"url": "gds:///tmp/x", "concurrency": 0}, "concurrency"),
        ({"url": "gds:///tmp/x", "compression": "on"}, "compression"),
    ],
)
def test_bad_options_name_the_key(options, key):
    assert_rejects(GDSBackend, options, key, construct=False)


def test_path_instead_of_url_and_string_booleans(tmp_path):
    opts = GDSBackend.check_options({"path": str(tmp_path), "use_kvikio": "False"})
    assert opts["use_kvikio"] is False and opts["path"] == str(tmp_path)
    b = GDSBackend(BackendContext.standalone({"path": str(tmp_path), "use_kvikio": "false"}))
    assert b.io_path == "posix (O_DIRECT)"
