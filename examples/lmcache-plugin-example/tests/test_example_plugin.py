"""Tests of the example plugin, in the order a plugin author would write them:

1. the shipped conformance suites (``lmcache.testing``) for the backend and the codec;
2. discovery through the entry point, and the environment switches that hide it;
3. a real cache engine using the plugin as a tier.

The fixtures ``lmcache_engine`` and ``lmcache_key_prefix`` come from lmcache's pytest plugin
(``lmcache.testing.pytest_plugin``), which pytest loads wherever lmcache is installed.
"""

from __future__ import annotations

import importlib.metadata as md
import sqlite3
import subprocess
import sys
import threading

import pytest
import torch

from lmcache import hookimpl, payload
from lmcache.errors import BackendError, ConfigError, PluginError
from lmcache.plugin_manager import Registries, create_plugin_manager, plugin_source
from lmcache.storage import BackendContext
from lmcache.encoded import open_objects
from lmcache.testing import BytesBackendTests, CodecTests, FileBackendTests, assert_rejects, make_key, make_obj
from lmcache_plugin_example.sqlite_backend import SQLiteBackend
from lmcache_plugin_example.zlib_codec import ZlibCodec


def _backend(path, codec=None, **options) -> SQLiteBackend:
    return SQLiteBackend(BackendContext.standalone({"path": str(path), **options}, codec=codec))


def _objects(path, codec=None):
    """The sqlite store as a tier opens it: memory objects through its object view."""
    return open_objects(_backend(path, codec))


# ----------------------------------------------------------------- 1. conformance


class TestSQLiteBackend(FileBackendTests, BytesBackendTests):
    @pytest.fixture(params=["raw", "zlib"])
    def codec(self, request):
        return ZlibCodec() if request.param == "zlib" else None

    @pytest.fixture
    def backend(self, codec, tmp_path):
        b = _backend(tmp_path / "kv.db", codec=codec)
        yield b
        b.close()

    @pytest.fixture
    def reopen(self, codec, tmp_path):
        return lambda read_only=False: SQLiteBackend(
            BackendContext.standalone({"path": str(tmp_path / "kv.db")}, codec=codec, read_only=read_only))

    @pytest.fixture
    def open_at(self):
        return lambda path, read_only: SQLiteBackend(
            BackendContext.standalone({"path": str(path / "kv.db")}, read_only=read_only))


@pytest.mark.parametrize("level", [-1, 0, 1, 6, 9])
class TestZlibCodec(CodecTests):
    @pytest.fixture
    def codec(self, level):
        return ZlibCodec(level)


# ------------------------------------------------------- backend-specific behaviour


def test_entries_survive_reopening(tmp_path):
    obj = make_obj(1)
    with _objects(tmp_path / "kv.db") as b:
        size = b.put([(make_key(1), obj)])[0]
    with _objects(tmp_path / "kv.db") as b:
        assert list(b.keys()) == [(make_key(1), size)]
        (got,) = b.get([make_key(1)])
        assert got is not None and torch.equal(got.tensor, obj.tensor)
        got.unref()


def test_corrupt_row_is_a_miss_and_is_deleted(tmp_path):
    db = tmp_path / "kv.db"
    with _objects(db) as b:
        b.put([(make_key(1), make_obj(1)), (make_key(2), make_obj(2))])
        raw = sqlite3.connect(db)  # flip the last byte of one payload behind the backend's back
        with raw:
            (data,) = raw.execute("SELECT data FROM lmcache_payloads WHERE key = ?", (make_key(1),)).fetchone()
            data = bytearray(data)
            data[-1] ^= 0xFF
            raw.execute("UPDATE lmcache_payloads SET data = ? WHERE key = ?", (bytes(data), make_key(1)))
        raw.close()
        assert b.get([make_key(1)]) == [None]
        assert b.exists([make_key(1), make_key(2)]) == [False, True]
        assert b.integrity.corrupt == b.raw.integrity.corrupt == 1
        assert b.raw.exists([make_key(1)]) == [False]  # deleted from the store itself


def test_stored_payload_names_its_codec(tmp_path):
    with _objects(tmp_path / "kv.db", codec=ZlibCodec(9)) as b:
        b.put([(make_key(1), make_obj(1))])
        header = payload.parse_header(b.raw.get_one(make_key(1)))
    assert header.codec == "zlib" and header.key == make_key(1)


def test_the_byte_verbs_answer_batches_in_key_order(tmp_path):
    """The store's own five verbs over bytes (what ``Encoded`` calls): batches larger than
    one statement's host parameters, answers in the order of the keys asked, and the
    single-key forms derived from the batch ones."""
    keys = [make_key(i) for i in range(1200)]
    with _backend(tmp_path / "kv.db") as b:
        assert b.put([(k, [b"head-", k.encode()]) for k in keys[::2]]) == [5 + len(k) for k in keys[::2]]
        assert b.exists(keys) == [i % 2 == 0 for i in range(1200)]
        got = b.get(keys[::-1])
        assert got[1::2] == [b"head-" + k.encode() for k in keys[-2::-2]] and got[::2] == [None] * 600
        assert b.delete([keys[0], keys[1], keys[0]]) == [True, False, False]
        assert b.exists_one(keys[0]) is False and b.get_one(keys[2]) == b"head-" + keys[2].encode()
        assert b.put_one(keys[1], [memoryview(b"xy")]) == 2 and b.delete_one(keys[1]) is True
        assert [k for k, _ in b.keys()] == keys[2::2]  # oldest first
        assert b.usage().entries == 599


def test_a_read_only_store_refuses_writes_and_deletes_nothing(tmp_path):
    with _backend(tmp_path / "kv.db") as b:
        b.put_one(make_key(1), [b"kept"])
    ro = SQLiteBackend(BackendContext.standalone({"path": str(tmp_path / "kv.db")}, read_only=True))
    try:
        with pytest.raises(BackendError, match="read-?only"):
            ro.put([(make_key(2), [b"new"])])
        assert ro.get([make_key(1), make_key(2)]) == [b"kept", None]
    finally:
        ro.close()
    missing = SQLiteBackend(BackendContext.standalone({"path": str(tmp_path / "none.db")}, read_only=True))
    assert missing.delete([make_key(1)]) == [False] and missing.exists([make_key(1)]) == [False]
    missing.close()
    assert not (tmp_path / "none.db").exists()


def test_written_for_the_current_contract():
    """None of the old verbs (read/write/list, contains/remove): the class is created
    without the deprecation adapter of :mod:`lmcache.storage_legacy`."""
    from lmcache.storage_legacy import BYTE_VERBS, RENAMED

    assert not set(vars(SQLiteBackend)) & {*BYTE_VERBS, *RENAMED}


def test_threads_share_one_backend(tmp_path):
    errors: list[BaseException] = []

    with _objects(tmp_path / "kv.db") as b:

        def work(t: int) -> None:
            try:
                for i in range(20):
                    k, o = make_key(t * 100 + i), make_obj(t * 100 + i)
                    b.put([(k, o)])
                    (g,) = b.get([k])
                    assert g is not None and torch.equal(g.tensor, o.tensor)
                    g.unref()
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        assert b.usage().entries == 80


@pytest.mark.parametrize(
    "options, key",
    [
        ({}, "path"),
        ({"path": ""}, "path"),
        ({"path": 3}, "path"),
        ({"path": "PLACEHOLDER", "timeout": "soon"}, "timeout"),
        ({"path": "PLACEHOLDER", "timeout": -1}, "timeout"),
        ({"path": "PLACEHOLDER", "journal": "wal"}, "journal"),
    ],
)
def test_bad_options_name_the_key(tmp_path, options, key):
    """In check_options (what `lmcache config validate` runs) and when opening."""
    options = {k: str(tmp_path / "kv.db") if v == "PLACEHOLDER" else v for k, v in options.items()}
    assert_rejects(SQLiteBackend, options, key)


def test_entries_carry_codec_and_time_oldest_first(tmp_path):
    import time

    t0 = time.time()
    with _objects(tmp_path / "kv.db", codec=ZlibCodec()) as b:
        b.put([(make_key(i), make_obj(i)) for i in range(3)])
        b.put([(make_key(0), make_obj(0))])  # rewritten: now the newest
        entries = list(b.entries())
    assert [e.key for e in entries] == [make_key(1), make_key(2), make_key(0)]
    assert {e.codec for e in entries} == {"zlib"} and all(t0 - 1 <= e.stored_at <= time.time() for e in entries)


def test_a_version_1_database_is_read_and_upgraded(tmp_path):
    db = tmp_path / "kv.db"
    with _objects(db) as b:
        b.put([(make_key(1), make_obj(1))])
        data = b.raw.get_one(make_key(1))
    db.unlink()
    for extra in ("-wal", "-shm"):
        (tmp_path / f"kv.db{extra}").unlink(missing_ok=True)
    raw = sqlite3.connect(db)
    with raw:
        raw.execute("CREATE TABLE lmcache_payloads (key TEXT PRIMARY KEY NOT NULL, data BLOB NOT NULL, size INTEGER NOT NULL)")
        raw.execute("INSERT INTO lmcache_payloads VALUES (?, ?, ?)", (make_key(1), data, len(data)))
        raw.execute("PRAGMA user_version = 1")
    raw.close()
    ro = SQLiteBackend(BackendContext.standalone({"path": str(db)}, read_only=True))
    assert [e.key for e in ro.entries()] == [make_key(1)]
    ro.close()
    with _objects(db) as b:
        (got,) = b.get([make_key(1)])
        assert got is not None and torch.equal(got.tensor, make_obj(1).tensor)
        got.unref()
        assert [e.codec for e in b.entries()] == [None]


def test_a_file_that_is_not_a_database_is_a_config_error(tmp_path):
    (tmp_path / "kv.db").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ConfigError, match="not a usable SQLite database") as info:
        _backend(tmp_path / "kv.db")
    assert info.value.key == "path"


def test_zlib_level_is_checked():
    for bad in (10, -2, "6", True, 1.5):
        with pytest.raises(ValueError):
            ZlibCodec(bad)


def test_zlib_rejects_trailing_bytes_and_truncation():
    raw = bytes(range(256)) * 4
    enc = ZlibCodec().encode(memoryview(raw))
    with pytest.raises(ValueError):
        ZlibCodec().decode(memoryview(enc + b"\0"), len(raw))
    with pytest.raises(ValueError):
        ZlibCodec().decode(memoryview(enc[:-2]), len(raw))
    with pytest.raises(ValueError):
        ZlibCodec().decode(memoryview(enc), len(raw) - 1)


# ------------------------------------------------------------------ 2. discovery


def _registries(environ: dict[str, str]) -> Registries:
    return Registries(create_plugin_manager(environ=environ))


def test_discovered_through_the_entry_point_with_no_configuration():
    regs = _registries({})
    assert "sqlite" in regs.backends.names() and "zlib" in regs.codecs.names()
    backend, codec = regs.backends.entry("sqlite"), regs.codecs.entry("zlib")
    assert backend.plugin == codec.plugin == "example"
    assert backend.target == "lmcache_plugin_example.sqlite_backend:SQLiteBackend"
    assert regs.backends.load("sqlite") is SQLiteBackend
    assert regs.codecs.load("zlib") is ZlibCodec
    assert regs.hooks_of("example") == [
        "lmcache_register_backends", "lmcache_register_bench_baselines", "lmcache_register_codecs"]
    assert regs.baselines.entry("sqlite").target == "lmcache_plugin_example.bench:raw_baseline"
    dist, version = plugin_source("example")
    assert md.version(dist) == version == md.version("lmcache-plugin-example")


def test_bench_tiers_compares_the_backend_with_its_registered_baseline(tmp_path):
    """``lmcache bench tiers --backend sqlite`` finds the raw baseline this package
    registers through ``lmcache_register_bench_baselines`` (before: the baseline had to be
    a ``raw_transfer`` classmethod on the backend, and this failed with "no raw-client
    baseline"); the scratch database is removed afterwards."""
    import json

    db = tmp_path / "kv.db"
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", "bench", "tiers", "--backend", "sqlite", "-o", f"path={db}",
         "--values", "3", "--batch", "2", "--repeats", "1", "--layers", "2", "--kv-heads", "2",
         "--head-size", "16", "--chunk-size", "16", "--json"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["backend"] == "sqlite" and data["exact"] is True
    assert data["raw_put_gbps"] > 0 and data["raw_get_gbps"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv.db"]  # no scratch database left


def test_check_options_takes_the_tier_capacity():
    """The one signature of the contract, ``check_options(options, capacity)``."""
    assert SQLiteBackend.check_options({"path": "/tmp/x.db"}, 1 << 20)["timeout"] == 5.0


def test_discovery_imports_no_implementation_module():
    code = (
        "import sys\n"
        "from lmcache.plugin_manager import Registries, create_plugin_manager\n"
        "regs = Registries(create_plugin_manager(environ={}))\n"
        "assert 'sqlite' in regs.backends.names()\n"
        "loaded = [m for m in sys.modules if m.startswith('lmcache_plugin_example.')]\n"
        "assert loaded == ['lmcache_plugin_example.plugin'], loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(
    "environ",
    [
        {"LMCACHE_DISABLED_PLUGINS": "example"},
        {"LMCACHE_DISABLED_PLUGINS": "other, example"},
        {"LMCACHE_PLUGINS": ""},
        {"LMCACHE_PLUGINS": "some-other-plugin"},
        {"LMCACHE_DISABLE_PLUGIN_AUTOLOAD": "1"},
    ],
)
def test_environment_controls_hide_the_plugin(environ):
    regs = _registries(environ)
    assert "sqlite" not in regs.backends and "zlib" not in regs.codecs
    assert regs.pm.get_plugin("example") is None
    assert "cpu" in regs.backends and "raw" in regs.codecs  # built-ins still load


def test_allow_list_naming_the_plugin_loads_it():
    regs = _registries({"LMCACHE_PLUGINS": "example"})
    assert "sqlite" in regs.backends and "zlib" in regs.codecs


class _Squatter:
    """Another plugin that claims the example's names."""

    def __init__(self, kind: str):
        self.kind = kind

    @hookimpl
    def lmcache_register_backends(self, registry):
        if self.kind == "backend":
            registry.add("sqlite", "squatter.backend:Other")

    @hookimpl
    def lmcache_register_codecs(self, registry):
        if self.kind == "codec":
            registry.add("zlib", "squatter.codec:Other")


@pytest.mark.parametrize("kind, name", [("backend", "sqlite"), ("codec", "zlib")])
def test_a_duplicate_name_fails_naming_both_plugins(kind, name):
    pm = create_plugin_manager(environ={})
    pm.register(_Squatter(kind), name="squatter")
    with pytest.raises(PluginError) as info:
        Registries(pm)
    msg = str(info.value)
    assert f"{name!r}" in msg and "'example'" in msg and "'squatter'" in msg


def test_blocked_argument_hides_the_plugin():
    regs = Registries(create_plugin_manager(blocked=["example"], environ={}))
    assert "sqlite" not in regs.backends


# ------------------------------------------------------------------- 3. in a tier


def test_sqlite_tier_with_zlib_codec_round_trips_kv(tmp_path, lmcache_engine, lmcache_key_prefix):
    """``lmcache_engine`` (lmcache's pytest plugin) builds each engine in this test's own
    namespace (``lmcache_key_prefix``) and closes it at teardown."""
    db = str(tmp_path / "kv.db")
    layers, heads, head_size, n = 2, 4, 64, 600
    tokens = torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(1))
    kv = torch.randn(layers, 2, n, heads, head_size, generator=torch.Generator().manual_seed(2))
    kv = kv.to(torch.float16)

    first = lmcache_engine([
        {"backend": "cpu", "capacity": "8MiB"},
        {"backend": "sqlite", "path": db, "capacity": "64MiB", "codec": "zlib"},
    ])
    assert first.store(tokens, kv).stored_tokens == n
    first.flush()
    assert first.stats()["tiers"]["sqlite"]["entries"] == 3  # 256 + 256 + 88 tokens
    spec = first.kv_spec
    first.close()  # the second engine reads what the first one wrote to the file
    raw = sqlite3.connect(db)
    rows = raw.execute("SELECT key, data FROM lmcache_payloads").fetchall()
    raw.close()
    assert [payload.parse_header(r[1]).codec for r in rows] == ["zlib"] * 3
    assert all(f":{lmcache_key_prefix}:" in r[0] for r in rows)  # the test's own namespace

    second = lmcache_engine({"backend": "sqlite", "path": db, "capacity": "64MiB", "codec": "zlib"}, kv_spec=spec)
    assert second.lookup(tokens) == n
    res = second.retrieve(tokens)
    assert res.num_tokens == n
    assert torch.equal(res.kv, kv)
    assert res.tiers == ["sqlite"] * 3
