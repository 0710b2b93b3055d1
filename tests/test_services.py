"""The engine's services: started in order, closed in reverse, unwound on a failed start."""

from __future__ import annotations

import socket

import pytest

import lmcache
from lmcache import services
from lmcache.errors import ConfigError
from lmcache.services import ServiceSpec

CFG = {"chunk_size": 16, "tiers": [{"backend": "cpu", "capacity": "4MiB"}],
       "kv_spec": {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}}


class _Recorder:
    def __init__(self, name, log):
        self.name, self.log = name, log
        log.append(f"start {name}")

    def info(self):
        return {"name": self.name}

    def close(self):
        self.log.append(f"close {self.name}")


def _specs(log, fail_at=None):
    def start(name):
        def go(engine):
            if name == fail_at:
                raise RuntimeError(f"{name} cannot start")
            return _Recorder(name, log)
        return go
    return [ServiceSpec(n, lambda c: True, start(n)) for n in ("first", "second", "third")]


def test_services_close_in_reverse_and_report_in_stats(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(services, "SERVICES", _specs(log))
    with lmcache.CacheEngine.from_config(CFG) as e:
        assert list(e.services) == ["first", "second", "third"]
        assert e.stats()["second"] == {"name": "second"}
    assert log == ["start first", "start second", "start third", "close third", "close second", "close first"]


def test_a_service_that_fails_to_start_unwinds_those_before_it(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(services, "SERVICES", _specs(log, fail_at="third"))
    with pytest.raises(RuntimeError, match="third cannot start"):
        lmcache.CacheEngine.from_config(CFG)
    assert log == ["start first", "start second", "close second", "close first"]


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
