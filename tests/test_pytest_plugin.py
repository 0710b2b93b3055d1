"""lmcache's pytest plugin (``lmcache.testing.pytest_plugin``) and the launcher hook, as a
third-party plugin package meets them.

A real package is installed on a private ``PYTHONPATH`` directory (a dist-info with an
``lmcache`` entry point): its plugin registers a backend ``thirdlm`` (lmcache's ``lm`` client
under another name), a raw-client baseline, and two loopback launchers through
``lmcache_register_store_launchers``: ``thirdlm`` (lmcache's own cache server, started with
``LocalServer``) and ``absent`` (a server binary that is not installed). A test file like the
package's own is then run by pytest in a fresh process (``pytester``), where the fixtures come
from lmcache's ``pytest11`` entry point alone; its tests start, freeze, kill and restart
servers with a backend or an engine reaching them, and run ``lmcache bench tiers`` on the
plugin's launcher.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from lmcache import hookimpl
from lmcache.errors import UnknownPluginError
from lmcache.plugin_manager import Registries, create_plugin_manager
from lmcache.testing import stores

pytest_plugins = ["pytester"]

PLUGIN_SOURCE = '''
"""A third-party plugin: a backend, its bench baseline and its loopback launchers."""
import contextlib
import sys

from lmcache import hookimpl
from lmcache.testing.stores import LocalServer, Store, ensure_binary, free_port


@hookimpl
def lmcache_register_backends(registry):
    registry.add("thirdlm", "lmcache.backends.lm:LMBackend")


@hookimpl
def lmcache_register_bench_baselines(registry):
    registry.add("thirdlm", "lmcache.benchmarks.raw_baselines:lm")


@hookimpl
def lmcache_register_store_launchers(registry):
    registry.add("thirdlm", "thirdlm_plugin:thirdlm_store")
    registry.add("absent", "thirdlm_plugin:absent_store")


@contextlib.contextmanager
def thirdlm_store(timeout=0.5):
    port = free_port()
    argv = [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", str(port),
            "--capacity", "256MiB"]
    with LocalServer("thirdlm-server", argv, port) as server:
        server.start()
        yield Store("thirdlm", {"url": f"lm://127.0.0.1:{port}", "timeout": timeout}, [server])


@contextlib.contextmanager
def absent_store():
    ensure_binary("thirdlm-server-that-is-not-installed", apt_package="thirdlm-server")
    yield  # never reached
'''

SUITE = '''
import json
import subprocess
import sys

import pytest
import torch

from lmcache.backends.lm import LMBackend
from lmcache.errors import BackendError, UnknownPluginError
from lmcache.storage import BackendContext
from lmcache.encoded import open_objects
from lmcache.testing import assert_hang_times_out, assert_survives_outage, make_key, make_obj

PREFIXES = []


def kv_for(tokens):
    t = torch.as_tensor(list(tokens), dtype=torch.float32)
    return (torch.arange(2 * 2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 2, 8) + t.reshape(1, 1, -1, 1, 1))


def test_builtin_server_frozen_and_killed_under_a_backend(lmcache_store):
    store = lmcache_store("lm", timeout=0.5)
    backend = open_objects(LMBackend(BackendContext.standalone(store.options)))  # chunks, as a tier sees it
    backend.put([(make_key(1), make_obj(1))])
    assert_hang_times_out(backend, store, "timed out")  # freeze() / thaw() inside
    store.kill()
    with pytest.raises(BackendError):
        backend.get([make_key(1)])
    backend.close()


def test_plugin_launcher_with_an_engine_through_an_outage(lmcache_store, lmcache_engine, lmcache_key_prefix, caplog):
    store = lmcache_store("thirdlm")
    assert store.backend == "thirdlm" and store.options["url"].startswith("lm://127.0.0.1:")
    e = lmcache_engine([{"backend": "thirdlm", "capacity": "64MiB", **store.options}], chunk_size=16,
                       staging_size="4MiB")
    assert e.config.namespace == lmcache_key_prefix
    toks = list(range(64))
    e.store(toks, kv_for(toks))
    e.flush()
    res = e.retrieve(toks)
    assert res.num_tokens == 64 and res.tiers == ["thirdlm"] * 4 and torch.equal(res.kv, kv_for(toks))
    assert_survives_outage(e, store, "thirdlm", toks, kv_for, caplog)  # kill() / restart() inside


def test_an_unknown_launcher_lists_the_known_ones(lmcache_store):
    with pytest.raises(UnknownPluginError, match="no loopback launcher for backend 'nosuch'") as info:
        lmcache_store("nosuch")
    assert "thirdlm" in str(info.value) and "redis" in str(info.value)


@pytest.mark.parametrize("run", range(2))
def test_each_test_gets_its_own_key_prefix(lmcache_key_prefix, run):
    assert lmcache_key_prefix.startswith("t-") and len(lmcache_key_prefix) == 10
    assert lmcache_key_prefix not in PREFIXES
    PREFIXES.append(lmcache_key_prefix)


def test_bench_tiers_starts_the_plugin_store_on_loopback():
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", "bench", "tiers", "--backend", "thirdlm", "--values", "2",
         "--batch", "2", "--repeats", "1", "--layers", "2", "--kv-heads", "2", "--head-size", "16",
         "--chunk-size", "16", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["backend"] == "thirdlm" and data["exact"] is True and data["raw_put_gbps"] > 0
    assert data["store"] == "thirdlm started on loopback for this run"
'''

ABSENT = '''

@pytest.mark.parametrize("ci", ["true", ""])
def test_needs_an_absent_server(lmcache_store, monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    lmcache_store("absent")
'''


def _install_plugin(site: Path) -> None:
    """The plugin as an installed distribution (dist-info with an ``lmcache`` entry point)."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "thirdlm_plugin.py").write_text(PLUGIN_SOURCE)
    info = site / "thirdlm_plugin-1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdlm-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[lmcache]\nthirdlm = thirdlm_plugin\n")


@pytest.fixture
def third_party(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytester directory whose subprocesses see the installed third-party plugin and no
    LMCACHE_* settings of the shell."""
    site = pytester.path / "site"
    _install_plugin(site)
    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PYTHONPATH", str(site))
    return pytester


def test_a_third_party_suite_uses_the_fixtures_and_the_launcher_hook(third_party: pytest.Pytester):
    """Also: a launcher whose server is absent fails the test under CI=true and skips it
    elsewhere, saying what to install."""
    third_party.makepyfile(test_thirdlm=SUITE + ABSENT)
    result = third_party.runpytest_subprocess("-q", "-rfs", "-p", "no:cacheprovider", timeout=200)
    result.assert_outcomes(passed=6, failed=1, skipped=1)
    result.stdout.fnmatch_lines([
        "*_ test_needs_an_absent_server?true? _*",
        "the absent store is unavailable: thirdlm-server-that-is-not-installed is not installed*",
        "SKIPPED*thirdlm-server-that-is-not-installed is not installed*apt-get install -y thirdlm-server*",
    ])


class _InProcessPlugin:
    """The same launcher registered on a plugin manager built by hand."""

    @hookimpl
    def lmcache_register_store_launchers(self, registry):
        registry.add("thirdlm", "lmcache.testing.stores.lm:lm_store")


def test_a_launcher_registered_through_the_hook_starts_a_store_that_freezes():
    pm = create_plugin_manager(autoload=False)
    pm.register(_InProcessPlugin(), name="inprocess")
    regs = Registries(pm)
    assert regs.launchers.entry("thirdlm").plugin == "inprocess"
    assert "thirdlm" in stores.launchers(regs) and "lm" in stores.launchers(regs)
    with pytest.raises(UnknownPluginError, match="known launchers: .*thirdlm"):
        stores.launcher("thirdlm2", regs)
    with stores.start("thirdlm", registries=regs, timeout=0.5) as store:
        server = store.servers[0]
        assert server.running and store.options["timeout"] == 0.5
        store.freeze()
        states = {p.read_text().rsplit(")", 1)[1].split()[0] for p in Path(f"/proc/{server.proc.pid}/task").glob("*/stat")}
        assert states <= {"T", "t"}
        store.thaw()
        assert stores.port_open(server.port, timeout=2) and server.running
        store.freeze()  # stopping a frozen server (at exit) does not wait for a SIGTERM it cannot take
    assert not server.running


def test_the_plugin_is_registered_as_a_pytest11_entry_point():
    import importlib.metadata as md

    eps = {ep.name: ep.value for ep in md.entry_points(group="pytest11")}
    assert eps.get("lmcache") == "lmcache.testing.pytest_plugin", "pip install -e . registers it"
    assert sys.modules.get("lmcache.testing.pytest_plugin") is not None  # loaded in this very run
