"""The files ``lmcache plugin new`` writes: one package per plugin kind.

Each template is a :class:`string.Template` (``$name`` the registered name, ``$module``
the import package, ``$dist`` the distribution, ``$cls`` the class-name prefix,
``$lmcache_version`` the lmcache it was made with). This module holds what every package
shares and each kind's test module; the kinds' implementations are in
:mod:`lmcache.cli.plugin_kinds`.
"""

from __future__ import annotations

PYPROJECT = '''\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "$dist"
version = "0.1.0"
description = "$summary"
readme = "README.md"
requires-python = ">=3.10"
# lmcache brings its pytest plugin (the lmcache_* fixtures) and the conformance suites.
dependencies = ["lmcache>=$lmcache_version"]

[project.optional-dependencies]
test = ["pytest>=8.0"]

# This table is what makes lmcache find the plugin: no configuration needed.
[project.entry-points.lmcache]
$name = "$module.plugin"

[tool.setuptools]
packages = ["$module"]

[tool.pytest.ini_options]
testpaths = ["tests"]
addopts = "-ra --strict-markers"
'''

INIT = '''\
"""$summary

Importing this package imports nothing heavy: lmcache imports :mod:`$module.plugin` to
discover it, and the implementation module only when it is used.
"""

__version__ = "0.1.0"
'''

PLUGIN = '''\
"""The module named by this package's ``lmcache`` entry point.

It only registers names: the target is a ``"module:Class"`` string that lmcache imports
the first time it is used, so discovering this plugin costs one small import. Keep it
importing nothing but ``lmcache``.
"""

from lmcache import hookimpl


@hookimpl
def lmcache_register_${hook}(registry):
    registry.add(
        "$name",
        "$module.$impl_module:$impl_class",
        description="$description",
    )
'''

CONFTEST = '''\
import os

import pytest


@pytest.fixture(autouse=True)
def _clean_lmcache_env(monkeypatch):
    """The tests never inherit LMCACHE_* settings from the shell."""
    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name, raising=False)
'''

# shared by every kind's test module: the plugin is found through its entry point
DISCOVERY_TEST = '''\


# ------------------------------------------------------------------- discovery


def test_found_through_the_entry_point():
    import importlib.metadata as md

    from lmcache.plugin_manager import Registries, create_plugin_manager, plugin_source

    regs = Registries(create_plugin_manager(environ={}))
    entry = regs.${registry}.entry("$name")
    assert entry.plugin == "$name"
    assert regs.${registry}.load("$name") is $impl_class
    assert plugin_source("$name") == ("$dist", md.version("$dist"))


def test_disabling_the_plugin_hides_it():
    from lmcache.plugin_manager import Registries, create_plugin_manager

    regs = Registries(create_plugin_manager(environ={"LMCACHE_DISABLED_PLUGINS": "$name"}))
    assert "$name" not in regs.${registry}
'''

GITIGNORE = '''\
__pycache__/
*.egg-info/
build/
dist/
.pytest_cache/
'''

README = '''\
# $dist

$summary

An [lmcache](https://github.com/LMCache/LMCache) plugin: it registers the $kind
`$name` through the entry point group `lmcache` (see `pyproject.toml`), so installing the
package is all it takes for lmcache to find it.

$usage

## Layout

```
$dist/
├── pyproject.toml          # the entry point: [project.entry-points.lmcache]
├── $module/
│   ├── plugin.py           # the hook implementation (registers "$name")
│   └── $impl_module.py$impl_pad# $impl_class
└── tests/test_$module.py   # lmcache's conformance suite + this plugin's own tests
```

## Install

```bash
pip install -e .            # in the environment that runs lmcache
lmcache plugins --kind $kind   # lists "$name" with this package and its version
```

## Test

```bash
pip install -e '.[test]'
pytest
```

The tests use what lmcache ships for plugin authors: the conformance suite in
`lmcache.testing` (`$suite`), which every built-in $kind passes too, and the
fixtures of lmcache's pytest plugin (installed with lmcache, nothing to configure):
`lmcache_engine(tiers, **config)` builds a `CacheEngine` over the given tiers and closes it
afterwards, `lmcache_key_prefix` is a fresh namespace per test, and `lmcache_store(backend)`
starts a loopback server for a networked backend (see lmcache's docs/plugins.md).

## Publish

```bash
python -m pip install build twine
python -m build             # dist/$dist-0.1.0.tar.gz and the wheel
twine upload dist/*
```

Keep the name `$dist` (lmcache plugins are `lmcache-*` by convention), raise `version`
in `pyproject.toml` for every release, and if your $kind needs a client library, add it to
`dependencies` and pass `requires="that-library>=x"` to `registry.add` in
`$module/plugin.py`, so that a missing install names the `pip install` to run.
'''

BACKEND_TESTS = '''\
"""Tests of the ``$name`` backend: lmcache's conformance suites, then this backend's own
behaviour, then a real cache engine with it as a tier."""

from __future__ import annotations

import pytest
import torch

from lmcache.storage import BackendContext
from lmcache.encoded import open_objects
from lmcache.testing import BytesBackendTests, FileBackendTests, make_key, make_obj
from $module.backend import ${cls}Backend, file_name


def _open(path, read_only=False, codec=None) -> ${cls}Backend:
    return ${cls}Backend(BackendContext.standalone({"path": str(path)}, codec=codec, read_only=read_only))


# ----------------------------------------------------------------- conformance


class Test${cls}Backend(FileBackendTests, BytesBackendTests):
    """The suites take the store itself (``backend``) and read and write chunks through
    the object view a tier opens it through (``lmcache.encoded.open_objects``)."""

    @pytest.fixture
    def backend(self, tmp_path):
        b = _open(tmp_path / "store")
        yield b
        b.close()

    @pytest.fixture
    def reopen(self, tmp_path):
        return lambda read_only=False: _open(tmp_path / "store", read_only)

    @pytest.fixture
    def open_at(self):
        return lambda path, read_only: _open(path, read_only)


# ------------------------------------------------------- this backend's own rules


def test_the_store_moves_bytes(tmp_path):
    """The store's own verbs, over bytes: batches answered in the order of the keys."""
    b = _open(tmp_path / "store")
    assert b.put([(make_key(1), [b"some ", b"bytes"]), (make_key(2), [b"more"])]) == [10, 4]
    assert [None if v is None else bytes(v) for v in b.get([make_key(2), make_key(3), make_key(1)])] == [
        b"more", None, b"some bytes"]
    assert b.exists([make_key(1), make_key(3)]) == [True, False]
    assert b.delete([make_key(1), make_key(1)]) == [True, False]
    assert [k for k, _ in b.keys()] == [make_key(2)]


def test_a_long_key_fits_a_file_name(tmp_path):
    key = make_key(1, model="org/" + "a-very-long-model-name-" * 20)
    objects = open_objects(_open(tmp_path / "store"))  # chunks, as a tier stores them
    objects.put([(key, make_obj(1))])
    assert [k for k, _ in objects.keys()] == [key]
    assert [p.name for p in (tmp_path / "store").iterdir()] == [file_name(key)]


def test_bad_options_name_the_key(tmp_path):
    from lmcache.errors import ConfigError

    (tmp_path / "a-file").write_text("x")
    cases = [({}, "path"), ({"path": ""}, "path"), ({"path": str(tmp_path / "a-file")}, "path"),
             ({"path": str(tmp_path), "size": 1}, "size")]
    for options, key in cases:
        with pytest.raises(ConfigError) as info:
            ${cls}Backend.check_options(options, None)
        assert info.value.key == key, options


# ----------------------------------------------------------------- in an engine


def test_a_tier_of_this_backend_round_trips_kv(lmcache_engine, lmcache_key_prefix, tmp_path):
    engine = lmcache_engine([{"backend": "$name", "path": str(tmp_path / "store"), "capacity": "64MiB"}])
    tokens = torch.arange(600)
    kv = torch.randn(2, 2, 600, 4, 64, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    assert engine.store(tokens, kv).stored_tokens == 600
    engine.flush()
    result = engine.retrieve(tokens)
    assert result.num_tokens == 600 and torch.equal(result.kv, kv)
    entries = engine.admin.keys(namespace=lmcache_key_prefix)["entries"]
    assert entries and {e["tier"] for e in entries} == {"$name"}
'''


CODEC_TESTS = '''\
"""Tests of the ``$name`` codec: lmcache's conformance suite, then this codec's own
behaviour, then a real cache engine that stores with it."""

from __future__ import annotations

import pytest
import torch

from lmcache.testing import CodecTests
from $module.codec import ${cls}Codec, shuffle, unshuffle


@pytest.mark.parametrize("level", [-1, 0, 1, 6, 9])
class Test${cls}Codec(CodecTests):
    @pytest.fixture
    def codec(self, level):
        return ${cls}Codec(level)


def test_shuffle_is_reversible():
    for n in (0, 1, 2, 7, 256):
        data = bytes(range(n))
        assert unshuffle(shuffle(data)) == data


def test_bad_level_is_refused():
    for bad in (10, -2, "6", True, 1.5):
        with pytest.raises(ValueError):
            ${cls}Codec(bad)


def test_a_tier_stores_with_this_codec(lmcache_engine, lmcache_key_prefix, tmp_path):
    engine = lmcache_engine([{"backend": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB", "codec": "$name"}])
    tokens = torch.arange(600)
    kv = torch.randn(2, 2, 600, 4, 64, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    assert engine.store(tokens, kv).stored_tokens == 600
    engine.flush()
    result = engine.retrieve(tokens)
    assert result.num_tokens == 600 and torch.equal(result.kv, kv)
    entries = engine.admin.keys(namespace=lmcache_key_prefix)["entries"]
    assert entries and {e["codec"] for e in entries} == {"$name"}
'''


POLICY_TESTS = '''\
"""Tests of the ``$name`` policy: lmcache's conformance suite, then its order, then a real
cache engine whose tier evicts with it."""

from __future__ import annotations

import pytest
import torch

from lmcache.testing import PolicyTraceTests
from $module.policy import ${cls}Policy


class MRUReference:
    """MRU written to be obviously right, not fast: a list, most recent use last. The
    trace suite replays random traces on the policy and on this and compares them."""

    def __init__(self):
        self.keys = []

    def on_insert(self, key):
        self.keys.append(key)

    def on_access(self, key):
        if key in self.keys:
            self.keys.remove(key)
            self.keys.append(key)

    def on_remove(self, key):
        if key in self.keys:
            self.keys.remove(key)

    def victim(self, skip):
        return next((k for k in reversed(self.keys) if not skip(k)), None)

    def __len__(self):
        return len(self.keys)


class Test${cls}Policy(PolicyTraceTests):
    @pytest.fixture
    def policy(self):
        return ${cls}Policy()

    @pytest.fixture
    def reference(self):
        return MRUReference()


def test_the_most_recently_used_goes_first():
    p = ${cls}Policy()
    for k in "abcd":
        p.on_insert(k)
    p.on_access("b")
    assert list(p.eviction_order()) == ["b", "d", "c", "a"]
    assert p.victim(lambda k: k == "b") == "d"


def test_a_tier_evicts_the_most_recently_used(lmcache_engine):
    # one 256-token chunk is 2 layers x 2 x 256 x 4 heads x 64 x 2 bytes = 512 KiB; room for 3
    engine = lmcache_engine([{"backend": "cpu", "capacity": "1792KiB", "policy": "$name"}], chunk_size=256)
    prompts = [torch.arange(i * 1000, i * 1000 + 256) for i in range(4)]
    kv = torch.randn(2, 2, 256, 4, 64, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    for p in prompts[:3]:
        assert engine.store(p, kv).stored_tokens == 256
    assert engine.retrieve(prompts[0]).num_tokens == 256  # now the most recently used
    assert engine.store(prompts[3], kv).stored_tokens == 256
    assert [engine.lookup(p) for p in prompts] == [0, 256, 256, 256]  # LRU would have evicted prompts[1]
'''


CONNECTOR_TESTS = '''\
"""Tests of the ``$name`` connector over a real cache engine."""

from __future__ import annotations

import lmcache
from $module.connector import ${cls}Connector, ToyEngine


def test_the_second_prefill_reads_the_prefix_from_the_cache(lmcache_engine):
    cache = lmcache_engine([{"backend": "cpu", "capacity": "64MiB"}], chunk_size=256)
    conn = ${cls}Connector(ToyEngine(), cache)
    tokens = list(range(100, 700))
    first = conn.prefill(tokens)
    assert (first.cached_tokens, first.computed_tokens) == (0, 600)
    second = conn.prefill(tokens)
    assert second.cached_tokens >= 512 and second.computed_tokens == 600 - second.cached_tokens
    assert conn.engine.computed == 600 + second.computed_tokens
    assert (second.kv == first.kv).all() and (first.kv == ToyEngine().forward(tokens)).all()


def test_a_prompt_that_shares_a_prefix_reuses_it(lmcache_engine):
    conn = ${cls}Connector(ToyEngine(), lmcache_engine([{"backend": "cpu", "capacity": "64MiB"}], chunk_size=256))
    conn.prefill(list(range(512)))
    other = conn.prefill(list(range(512)) + [7, 8, 9])
    assert other.cached_tokens == 512 and other.computed_tokens == 3


def test_loaded_by_name():
    assert lmcache.connector("$name") is ${cls}Connector
'''
