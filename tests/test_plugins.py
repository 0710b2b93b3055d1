from __future__ import annotations

import inspect
import re
from pathlib import Path

import pluggy
import pytest

from lmcache import hookimpl, hookspecs
from lmcache.errors import MissingDependencyError, PluginError, UnknownPluginError
from lmcache.plugin_manager import DEFAULT_PLUGINS, Registries, Registry, create_plugin_manager
from lmcache.storage import BytesBackend

ROOT = Path(__file__).resolve().parents[1]
HOOKS = sorted(n for n in dir(hookspecs) if n.startswith("lmcache_"))


def test_builtins_register_through_the_hooks():
    regs = Registries(create_plugin_manager(autoload=False))
    assert {"cpu", "disk"} <= set(regs.backends.names())
    assert {"raw", "zstd"} <= set(regs.codecs.names())
    assert {"lru", "lfu", "fifo"} <= set(regs.policies.names())
    assert regs.backends.entry("cpu").plugin == "lmcache.backends.builtin"
    for mod in DEFAULT_PLUGINS:
        assert regs.pm.get_plugin(mod) is not None


def test_builtins_are_also_declared_as_entry_points():
    import importlib.metadata as md

    values = {ep.value for ep in md.entry_points(group="lmcache")}
    assert set(DEFAULT_PLUGINS) <= values


class _DupA:
    @hookimpl
    def lmcache_register_backends(self, registry):
        registry.add("cpu", "somewhere.else:Backend")


def test_duplicate_names_fail_naming_both_plugins():
    pm = create_plugin_manager(autoload=False)
    pm.register(_DupA(), name="third-party-a")
    with pytest.raises(PluginError) as ei:
        Registries(pm)
    msg = str(ei.value)
    assert "'cpu'" in msg and "lmcache.backends.builtin" in msg and "third-party-a" in msg


def test_blocked_builtin_and_env_controls():
    pm = create_plugin_manager(autoload=False, environ={"LMCACHE_DISABLED_PLUGINS": "lmcache.plugins.policies"})
    regs = Registries(pm)
    assert regs.policies.names() == []
    # a built-in can also be named by its entry-point name
    pm = create_plugin_manager(autoload=False, environ={"LMCACHE_DISABLED_PLUGINS": "builtin-policies"})
    assert Registries(pm).policies.names() == []
    pm = create_plugin_manager(environ={"LMCACHE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert {name for name, _ in pm.list_name_plugin()} == set(DEFAULT_PLUGINS)


def test_lazy_import_with_install_hint():
    reg = Registry("backend")
    reg.add("redis-x", "no_such_module_for_lmcache_tests:RedisBackend", extra="redis")
    with pytest.raises(MissingDependencyError) as ei:
        reg.load("redis-x")
    assert "pip install 'lmcache[redis]'" in str(ei.value)
    assert "no_such_module_for_lmcache_tests" in str(ei.value)
    # a typo in the plugin's own module path is not blamed on a missing extra
    reg.add("typo", "lmcache.backends.no_such_backend:Backend", extra="redis")
    with pytest.raises(MissingDependencyError) as ei:
        reg.load("typo")
    assert "pip install" not in str(ei.value) and "lmcache.backends.no_such_backend" in str(ei.value)
    reg.add("bad-attr", "lmcache.plugins.policies:NoSuchPolicy")
    with pytest.raises(PluginError, match="no attribute 'NoSuchPolicy'"):
        reg.load("bad-attr")
    with pytest.raises(PluginError, match="module:Class"):
        reg.add("noclass", "lmcache.plugins.policies")
    with pytest.raises(UnknownPluginError, match="registered backends: bad-attr, redis-x, typo"):
        reg.entry("nope")


def test_codec_names_may_not_contain_the_chain_separator():
    with pytest.raises(PluginError, match="may not contain '\\+'"):
        Registry("codec").add("int8+zstd", "lmcache.plugins.codecs.quant:Int8Codec")
    Registry("backend").add("a+b", "x.y:Z")  # only codec names form chains


def test_target_imported_only_on_first_use():
    import sys

    reg = Registry("codec")
    reg.add("json-ish", "json.decoder:JSONDecoder")
    sys.modules.pop("json.decoder", None) if "json.decoder" not in sys.modules else None
    cls = reg.load("json-ish")
    assert cls.__name__ == "JSONDecoder" and reg.load("json-ish") is cls


class _Misspelled:
    @hookimpl
    def lmcache_register_backend(self, registry):  # no such hook
        pass


def test_check_pending_catches_unknown_hooks():
    pm = create_plugin_manager(autoload=False)
    pm.register(_Misspelled())
    with pytest.raises(pluggy.PluginValidationError):
        pm.check_pending()


def test_importing_lmcache_loads_no_plugins():
    import subprocess
    import sys

    code = "import lmcache, sys; print(any(m.startswith('lmcache.backends.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


class MRUPolicy:
    """Most recently used first: a third-party policy that suits one-pass scans."""

    def __init__(self):
        self._order = []

    def on_insert(self, key):
        self._order.append(key)

    def on_access(self, key):
        if key in self._order:
            self._order.remove(key)
            self._order.append(key)

    def on_remove(self, key):
        if key in self._order:
            self._order.remove(key)

    def victim(self, skip):
        for k in reversed(self._order):
            if not skip(k):
                return k
        return None

    def __len__(self):
        return len(self._order)


class EchoConnector:
    """A stand-in engine connector class; the connector contract arrives with engines."""


from lmcache.kernels import KVLayout  # noqa: E402

THIRD_PARTY_LAYOUT = KVLayout("thirdparty_hnd", block_axis=0, heads_axis=1, kv_axis=2, offset_axis=3, dim_axis=4)


class _ThirdParty:
    """Implements every hook, as a package's plugin module would."""

    @hookimpl
    def lmcache_register_backends(self, registry):
        registry.add("cpu2", "lmcache.backends.cpu:CPUBackend", description="the cpu backend again")

    @hookimpl
    def lmcache_register_codecs(self, registry):
        registry.add("raw2", "lmcache.plugins.codecs.raw:RawCodec")

    @hookimpl
    def lmcache_register_connectors(self, registry):
        registry.add("echo", EchoConnector, extra="lmcache-echo")

    @hookimpl
    def lmcache_register_policies(self, registry):
        registry.add("mru", MRUPolicy)

    @hookimpl
    def lmcache_register_layouts(self, registry):
        registry.add("thirdparty_hnd", THIRD_PARTY_LAYOUT)

    @hookimpl
    def lmcache_register_services(self, registry):
        registry.add("counter", CountingService)

    @hookimpl
    def lmcache_register_channels(self, registry):
        registry.add("tcp2", "lmcache.plugins.channels.tcp:TcpChannel")

    @hookimpl
    def lmcache_register_bench_baselines(self, registry):
        registry.add("cpu2", "lmcache.benchmarks.raw_baselines:lm")

    @hookimpl
    def lmcache_register_store_launchers(self, registry):
        registry.add("lm2", "lmcache.testing.stores.lm:lm_store")


class CountingService:
    """A third-party service: counts the chunks the engine's tiers admit."""

    @staticmethod
    def enabled(config):
        return True

    def __init__(self, view):
        self.admitted = 0
        view.hierarchy.add_listener(self._heard)

    def _heard(self, op, tier, key):
        self.admitted += op == "admit"

    def info(self):
        return {"admitted": self.admitted}

    def close(self):
        pass


def test_a_third_party_plugin_using_every_hook_works_in_a_tier():
    import torch

    import lmcache

    pm = create_plugin_manager(autoload=False)
    pm.register(_ThirdParty(), name="thirdparty")
    regs = Registries(pm)
    assert regs.hooks_of("thirdparty") == HOOKS
    assert regs.connectors.load("echo") is EchoConnector
    assert regs.layouts.load("thirdparty_hnd") is THIRD_PARTY_LAYOUT
    assert regs.baselines.entry("cpu2").plugin == "thirdparty" and callable(regs.baselines.load("cpu2"))
    assert regs.launchers.entry("lm2").plugin == "thirdparty" and callable(regs.launchers.load("lm2"))
    assert regs.connectors.entry("echo").plugin == "thirdparty"
    assert regs.channels.entry("tcp2").plugin == "thirdparty"
    cfg = lmcache.load_config(
        {"chunk_size": 4, "tiers": [{"backend": "cpu2", "capacity": 3 * 4 * 2 * 4 * 4, "codec": "raw2", "policy": "mru"}]}
    )
    with lmcache.CacheEngine(cfg, registries=regs) as e:
        for start in (0, 100, 200, 300):
            toks = list(range(start, start + 4))
            e.store(toks, torch.full((4, 2, 4, 1, 1), float(start)))
        # MRU evicted the most recent entry before each new one once full
        assert [e.lookup(list(range(s, s + 4))) for s in (0, 100, 200, 300)] == [4, 4, 0, 4]
        assert e.hierarchy.tiers[0].ledger.policy.__class__ is MRUPolicy
        assert e.stats()["counter"] == {"admitted": 4}


# ------------------------------------------------------------------ meta-tests

@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_specified_typed_and_documented(hook):
    fn = getattr(hookspecs, hook)
    assert fn.__doc__ and len(fn.__doc__.strip()) > 80, f"{hook} needs a contract docstring"
    sig = inspect.signature(fn)
    assert all(p.annotation is not inspect.Parameter.empty for p in sig.parameters.values())
    docs = (ROOT / "docs" / "plugins.md").read_text()
    assert hook in docs, f"docs/plugins.md does not document {hook}"


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_test(hook):
    text = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    text += "\n".join(p.read_text() for p in (ROOT / "examples").rglob("test_*.py"))
    assert re.search(rf"def {hook}\b", text), f"no test implements {hook}"


# ------------------------------------------------- what an outside plugin author met
def _install_plugin(site: Path, dist: str, module: str, source: str) -> None:
    """A real installed distribution (dist-info with an ``lmcache`` entry point) on ``site``."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(source)
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[lmcache]\n{dist} = {module}\n")


def _lmcache_plugins(site: Path, *args: str):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-m", "lmcache.cli.main", "plugins", *args], capture_output=True,
                          text=True, env=env, timeout=120)


PLUGIN_HEAD = "from lmcache import hookimpl\n\n"


@pytest.mark.parametrize(
    "source, expected",
    [
        # the hook's argument must be called ``registry``: before, a raw pluggy traceback
        (PLUGIN_HEAD + "@hookimpl\ndef lmcache_register_connectors(reg):\n    pass\n",
         "plugin 'fancy-kv': hook lmcache_register_connectors must take exactly the argument 'registry'"),
        # a misspelled hook: before, a 40-line traceback
        (PLUGIN_HEAD + "@hookimpl\ndef lmcache_register_backend(registry):\n    pass\n",
         "plugin 'fancy-kv' implements unknown hook 'lmcache_register_backend'; did you mean lmcache_register_backends?"),
        # a hook that raises: the plugin and the hook are named
        (PLUGIN_HEAD + "@hookimpl\ndef lmcache_register_codecs(registry):\n    raise RuntimeError('boom')\n",
         "plugin 'fancy-kv': hook lmcache_register_codecs failed: RuntimeError: boom"),
    ],
    ids=["argument-name", "misspelled-hook", "hook-raises"],
)
def test_plugin_mistakes_are_one_line_errors_naming_plugin_and_hook(tmp_path, source, expected):
    _install_plugin(tmp_path / "site", "fancy-kv", "fancy_kv_plugin", source)
    proc = _lmcache_plugins(tmp_path / "site")
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert expected in err, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err


def test_a_hook_without_hookimpl_is_warned_about(tmp_path):
    source = "def lmcache_register_backends(registry):\n    registry.add('fancy', 'fancy_kv_plugin:X')\n"
    _install_plugin(tmp_path / "site", "fancy-kv", "fancy_kv_plugin", source)
    proc = _lmcache_plugins(tmp_path / "site")
    assert proc.returncode == 0, proc.stderr
    assert "plugin 'fancy-kv': lmcache_register_backends is not decorated with @lmcache.hookimpl" in proc.stderr


def test_third_party_install_hints_name_the_plugin_and_are_quoted(tmp_path):
    """Before: ``extra=`` on a third-party plugin printed ``pip install 'lmcache[lmcache-lmdb]'``,
    a requirement went unquoted (``pip install fancy-kv>=1.0`` redirects to a file), and
    the message no longer named the plugin."""
    import shlex

    source = PLUGIN_HEAD + (
        "@hookimpl\ndef lmcache_register_backends(registry):\n"
        "    registry.add('lmdb', 'lmdb_missing_for_tests:LMDB', extra='lmdb')\n"
        "    registry.add('fancy', 'fancy_missing_for_tests:Fancy', requires='fancy-kv>=1.0')\n"
    )
    _install_plugin(tmp_path / "site", "lmcache-lmdb", "lmcache_lmdb_plugin", source)
    import os
    import subprocess
    import sys

    code = ("from lmcache.plugin_manager import get_registries\nr = get_registries()\n"
            "for n in ('lmdb', 'fancy'):\n    try:\n        r.backends.load(n)\n"
            "    except Exception as e:\n        print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "site")}).stdout.splitlines()
    assert len(out) == 2, out
    assert "backend 'lmdb' (from plugin 'lmcache-lmdb')" in out[0]
    assert out[0].endswith("install it with: pip install 'lmcache-lmdb[lmdb]'"), out[0]
    assert "backend 'fancy' (from plugin 'lmcache-lmdb')" in out[1]
    hint = out[1].split("install it with: ")[1]
    assert hint == "pip install 'fancy-kv>=1.0'" and shlex.split(hint) == ["pip", "install", "fancy-kv>=1.0"]


def test_one_builtin_backend_can_be_disabled_alone():
    """Before, disabling one built-in backend meant disabling lmcache.backends.builtin, all of them."""
    regs = Registries(create_plugin_manager(autoload=False, environ={"LMCACHE_DISABLED_PLUGINS": "backend:s3,codec:fp8"}))
    assert "s3" not in regs.backends.names() and {"cpu", "disk", "redis"} <= set(regs.backends.names())
    assert "fp8" not in regs.codecs.names() and "zstd" in regs.codecs.names()
    with pytest.raises(UnknownPluginError, match="unknown backend 's3' \\(disabled by LMCACHE_DISABLED_PLUGINS\\)"):
        regs.backends.entry("s3")


def test_policy_registry_errors_say_policies():
    with pytest.raises(UnknownPluginError, match="registered policies: "):
        Registries(create_plugin_manager(autoload=False)).policies.entry("mru-typo")


class _Wrapper:
    calls: list[str] = []

    @hookimpl(wrapper=True)
    def lmcache_register_backends(self, registry):
        _Wrapper.calls.append("before")
        yield
        _Wrapper.calls.append("after")


def test_hooks_are_called_through_pluggy_so_wrappers_apply():
    pm = create_plugin_manager(autoload=False)
    pm.register(_Wrapper(), name="wrapper")
    _Wrapper.calls.clear()
    Registries(pm)
    assert _Wrapper.calls == ["before", "after"]


_CAPPED = '''
from lmcache import hookimpl
from lmcache.errors import ConfigError
from lmcache.backends.cpu import CPUBackend


class Capped(CPUBackend):
    """A store that holds at most 1 MiB."""

    @classmethod
    def check_options(cls, options, capacity=None):
        opts = super().check_options(options)
        if capacity is not None and capacity > 1 << 20:
            raise ConfigError("capacity", f"this store holds at most 1MiB, not {capacity} bytes")
        return opts


@hookimpl
def lmcache_register_backends(registry):
    registry.add("capped", Capped)
'''


def test_check_options_sees_the_tier_capacity_at_validation(tmp_path):
    """Before, ``check_options`` got only the backend keys, so a check against the
    capacity passed ``lmcache config validate`` and failed when the engine started."""
    import os
    import subprocess
    import sys

    _install_plugin(tmp_path / "site", "capped-kv", "capped_kv_plugin", _CAPPED)
    cfg = tmp_path / "c.yaml"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    for capacity, ok in (("512KiB", True), ("4MiB", False)):
        cfg.write_text(f"chunk_size: 16\ntiers:\n  - backend: capped\n    capacity: {capacity}\n")
        proc = subprocess.run([sys.executable, "-m", "lmcache.cli.main", "config", "validate", str(cfg)],
                              capture_output=True, text=True, env=env, timeout=120)
        assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
        if not ok:
            assert "tiers[0].capacity" in proc.stderr and "at most 1MiB" in proc.stderr, proc.stderr


def test_builtin_layouts_come_through_the_hook():
    """The kernels' layouts are registered by a plugin (lmcache.kernels.builtin), not at import."""
    from lmcache.kernels import get_layout
    from lmcache.plugin_manager import get_registries

    regs = get_registries()
    assert regs.layouts.entry("mla").plugin == "lmcache.kernels.builtin"
    assert get_layout("flashinfer_hnd") is regs.layouts.load("flashinfer_hnd")
    assert {"vllm_flash_attn", "blocks_first", "contiguous"} <= set(regs.layouts.names())


class _LazyClientBackend(BytesBackend):
    """A backend that imports its client library in ``__init__`` (lazily), as many do. Its
    verbs are never reached (``__init__`` fails), but a store class must declare them."""

    def __init__(self, context):
        import lmcache_client_missing_for_tests  # noqa: F401

    def get(self, keys, on_ready=None):
        raise AssertionError("never opened")

    put = exists = delete = keys = get


class _LazyPlugin:
    @hookimpl
    def lmcache_register_backends(self, registry):
        registry.add("lazy", _LazyClientBackend, requires="lazy-kv>=2.0")


def test_a_client_imported_lazily_still_gets_the_install_hint(tmp_path):
    """Before: ``requires=`` fired only when the target module's import failed; a backend
    importing its client in ``__init__`` surfaced a bare "No module named ..." with no hint."""
    from lmcache.config import load_config
    from lmcache.errors import ConfigError
    from lmcache.tier_setup import build_tier

    pm = create_plugin_manager(autoload=False)
    pm.register(_LazyPlugin(), name="lazy-kv-plugin")
    cfg = load_config({"tiers": [{"backend": "cpu", "capacity": 1 << 20}, {"backend": "lazy", "capacity": 1 << 20}]},
                      environ={})
    with pytest.raises(ConfigError) as info:
        build_tier(1, cfg.tiers[1], registries=Registries(pm))
    msg = str(info.value)
    assert "tiers[1].backend" in msg and "lmcache_client_missing_for_tests" in msg, msg
    assert msg.endswith("install it with: pip install 'lazy-kv>=2.0'"), msg
    assert len(msg.splitlines()) == 1
