"""The engine's services: started in order, closed in reverse, unwound on a failed start."""

from __future__ import annotations

import socket

import pytest

import lmcache
from lmcache import hookimpl
from lmcache.config import load_config
from lmcache.errors import ConfigError
from lmcache.plugin_manager import Registries, create_plugin_manager
from lmcache.services import EngineView

CFG = {"chunk_size": 16, "tiers": [{"backend": "cpu", "capacity": "4MiB"}],
       "kv_spec": {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}}


class _Recorder:
    """A service that records its start and close in ``log``."""

    log: list[str] = []
    fail_at: str | None = None
    name = ""

    @staticmethod
    def enabled(config):
        return True

    def __init__(self, view):
        assert isinstance(view, EngineView) and not isinstance(view, lmcache.CacheEngine)
        if self.name == self.fail_at:
            raise RuntimeError(f"{self.name} cannot start")
        self.log.append(f"start {self.name}")

    def info(self):
        return {"name": self.name}

    def close(self):
        self.log.append(f"close {self.name}")


def _registries(log, fail_at=None, enabled=True):
    """The process's plugins plus one that registers three recording services."""
    classes = [type(n, (_Recorder,), {"name": n, "log": log, "fail_at": fail_at,
                                      "enabled": staticmethod(lambda c: enabled)}) for n in ("first", "second", "third")]

    class Plugin:
        @hookimpl
        def lmcache_register_services(self, registry):
            for c in classes:
                registry.add(c.name, c, description="a test service")

    pm = create_plugin_manager()
    pm.register(Plugin(), name="test-services")
    return Registries(pm)


def _engine(regs):
    return lmcache.CacheEngine(load_config(CFG), registries=regs)


def test_services_are_plugins_started_in_order_closed_in_reverse_and_reported_in_stats():
    log: list[str] = []
    regs = _registries(log)
    assert [e.name for e in regs.services.in_order()][:4] == ["api", "p2p", "controller", "kv_events"]  # the built-ins first
    with _engine(regs) as e:
        assert list(e.services) == ["first", "second", "third"]  # the built-ins are off in CFG
        assert e.stats()["second"] == {"name": "second"}
    assert log == ["start first", "start second", "start third", "close third", "close second", "close first"]


def test_a_service_that_fails_to_start_unwinds_those_before_it():
    log: list[str] = []
    with pytest.raises(RuntimeError, match="third cannot start"):
        _engine(_registries(log, fail_at="third"))
    assert log == ["start first", "start second", "close second", "close first"]


def test_a_service_its_config_does_not_enable_is_not_started():
    log: list[str] = []
    with _engine(_registries(log, enabled=False)) as e:
        assert e.services == {}
    assert log == []


def test_a_disabled_service_plugin_name_is_not_started(monkeypatch):
    monkeypatch.setenv("LMCACHE_DISABLED_PLUGINS", "service:api")
    regs = Registries(create_plugin_manager())
    assert "api" not in regs.services
    with lmcache.CacheEngine(load_config({**CFG, "api": {"enabled": True, "port": 0}}), registries=regs) as e:
        assert e.api is None and "p2p" not in e.services


def test_a_failed_p2p_start_closes_the_instance_api():
    """The built-ins through the same stack: the API is up when the P2P endpoint cannot
    bind its port; the engine's failure leaves no listening API behind."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        api_port = _free_port()
        cfg = {**CFG, "api": {"enabled": True, "port": api_port},
               "p2p": {"enabled": True, "port": port}}
        with pytest.raises(ConfigError, match="p2p.port"):  # raised while starting the P2P endpoint
            lmcache.CacheEngine.from_config(cfg)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", api_port)) != 0, "the instance API outlived the failed engine"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
