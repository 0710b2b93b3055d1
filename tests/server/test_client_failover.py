"""Several controller URLs: the client, the worker and the CLI fail over between controller
replicas (real controller processes on loopback; one is SIGKILLed under load).

What is checked: a lookup storm through a client given two URLs loses no lookup when the
controller it uses is SIGKILLed; a worker keeps its instance registered and its events
flowing on the other replica; an address that accepts but never answers costs one timeout
once (the client sticks to the URL that answered); 401 is final (the next URL is never
called); 502/503 fail over; a bad URL in the list is a one-line error naming it.
"""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest

from _procs import readline, stop, until

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "failover-secret"
CHUNK = 16
KV_SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}
PROMPT = [(i * 7919 + 13) % 30000 for i in range(128)]


def start_controller(*extra: str, token: str = TOKEN) -> tuple[subprocess.Popen, str]:
    """``lmcache controller serve --port 0`` in its own process (so it can be SIGKILLed)."""
    env = {**os.environ, "LMCACHE_CONTROLLER_TOKEN": token}
    proc = subprocess.Popen([sys.executable, "-m", "lmcache.cli.main", "controller", "serve", "--port", "0",
                             "--instance-timeout", "5", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
    url = readline(proc)
    assert url.startswith("http://127.0.0.1:"), url
    return proc, url


class Listener:
    """A TCP listener that accepts and counts connections and never answers: an address
    that is up but silent (a hung controller), or, counted, proof nothing was sent there."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    lst = Listener()
    yield lst
    lst.close()


@pytest.fixture
def two_controllers() -> Iterator[list[tuple[subprocess.Popen, str]]]:
    procs = [start_controller(), start_controller()]
    yield procs
    for p, _ in procs:
        stop(p)


# ---------------------------------------------------------------- lookups
def test_sigkilled_controller_loses_no_lookup(two_controllers):
    """A storm of lookups through a client with two URLs: the first controller is
    SIGKILLed in the middle; every lookup is answered (by the second from then on)."""
    from lmcache.plugins.services.controller_client import ControllerClient

    (a, url_a), (_, url_b) = two_controllers
    client = ControllerClient(f"{url_a},{url_b}", TOKEN, timeout=2.0)
    done = {"ok": 0, "failed": 0, "after_kill": 0}
    killed = threading.Event()
    stop_storm = threading.Event()
    errors: list[str] = []

    def storm() -> None:
        while not stop_storm.is_set():
            try:
                client.lookup(PROMPT)
                done["ok"] += 1
                if killed.is_set():
                    done["after_kill"] += 1
            except Exception as exc:  # noqa: BLE001 - any kind counts as a failed lookup
                done["failed"] += 1
                errors.append(repr(exc))

    threads = [threading.Thread(target=storm) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        until(lambda: done["ok"] >= 200, "200 lookups before the kill")
        assert client.url == url_a
        a.send_signal(signal.SIGKILL)
        a.wait()
        killed.set()
        until(lambda: done["after_kill"] >= 400, "400 lookups after the kill")
    finally:
        stop_storm.set()
        for t in threads:
            t.join()
    assert done["failed"] == 0, errors[:3]
    assert client.url == url_b


def test_a_silent_first_url_costs_one_timeout_then_is_skipped(two_controllers, listener):
    """The first URL accepts connections and never answers: the first call times out on
    it and is answered by the second URL; later calls go straight to the second."""
    from lmcache.plugins.services.controller_client import ControllerClient

    (_, url), _ = two_controllers
    client = ControllerClient([listener.url, url], TOKEN, timeout=0.5)
    for _ in range(5):
        assert client.lookup(PROMPT)["results"] == []
    assert len(listener.conns) == 1  # tried once, then the client stuck to the URL that answered
    assert client.url == url


def test_401_is_final_and_the_next_url_is_never_called(listener):
    from lmcache.plugins.services.controller_client import ControllerClient
    from lmcache.server.controller import ControllerServer
    from lmcache.errors import AuthError

    with ControllerServer(port=0, token="the-right-one") as ctl:
        client = ControllerClient([ctl.url, listener.url], "a-wrong-one", timeout=1.0)
        with pytest.raises(AuthError):
            client.lookup(PROMPT)
        with pytest.raises(AuthError):
            client.instances()
    assert listener.conns == []


class _Unavailable(http.server.BaseHTTPRequestHandler):
    """A server that answers every request 503 (a replica whose index is unavailable)."""

    def _answer(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(n)
        body = b'{"error": "index unavailable: test"}'
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


def test_503_fails_over_and_all_down_names_every_url():
    from lmcache.plugins.services.controller_client import ControllerClient
    from lmcache.server.controller import ControllerServer
    from lmcache.errors import UnreachableError
    from lmcache.testing.stores import free_port

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unavailable)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    bad = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        with ControllerServer(port=0) as ctl:
            client = ControllerClient(f"{bad}, {ctl.url}", timeout=1.0)
            assert client.health()["status"] in ("ok", "degraded")
            assert client.url == ctl.url
        dead = f"http://127.0.0.1:{free_port()}"
        client = ControllerClient([dead, bad], timeout=1.0)
        with pytest.raises(Exception) as ei:
            client.health()
        assert dead in str(ei.value) and bad in str(ei.value) and ei.value.status == 503
        with pytest.raises(UnreachableError):
            ControllerClient([bad, dead], timeout=1.0).health()  # the last error's kind
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_bad_url_in_the_list_is_named():
    from lmcache.config import load_config
    from lmcache.plugins.services.controller_client import ControllerClient, split_urls
    from lmcache.errors import AdminError, ConfigError

    assert split_urls("http://a:1, http://b:2/,http://a:1") == ["http://a:1", "http://b:2"]
    with pytest.raises(AdminError, match="'ftp://x'"):
        ControllerClient("http://a:1,ftp://x")
    with pytest.raises(AdminError, match="no controller URL"):
        ControllerClient([])
    # the config: one URL, a comma-separated string or a YAML list, kept comma-separated
    for v in ("http://a:1,http://b:2", ["http://a:1", "http://b:2/"], "http://a:1, http://b:2"):
        assert load_config({"controller": {"url": v}}, environ={}).controller.url == "http://a:1,http://b:2"
    assert load_config({"controller": "http://a:1"}, environ={}).controller.url == "http://a:1"
    for bad in ("http://a:1,nope", ["http://a:1", 5], [], "http://a:1,,http://b:2"):
        with pytest.raises(ConfigError) as ei:
            load_config({"controller": {"url": bad}}, environ={})
        assert ei.value.key == "controller.url" and "\n" not in str(ei.value)
    with pytest.raises(ConfigError, match="'nope'"):
        load_config({"controller": {"url": "http://a:1,nope"}}, environ={})


def test_cli_takes_several_urls(two_controllers):
    (a, url_a), (_, url_b) = two_controllers
    a.send_signal(signal.SIGKILL)
    a.wait()
    env = {**os.environ, "LMCACHE_CONTROLLER_TOKEN": TOKEN}
    r = subprocess.run([sys.executable, "-m", "lmcache.cli.main", "controller", "instances", "--json",
                        "--url", f"{url_a},{url_b}"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
    r = subprocess.run([sys.executable, "-m", "lmcache.cli.main", "controller", "instances",
                        "--url", f"{url_b},bogus"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert r.returncode != 0 and "'bogus'" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ---------------------------------------------------------------- the worker
def test_worker_moves_to_the_other_controller(tmp_path):
    """An engine registered through the first of two controllers (memory index): the
    first is SIGKILLed; the worker registers on the second at once, resends its snapshot,
    and its later admits reach the second's index."""
    import torch

    import lmcache
    from lmcache.plugins.services.controller_client import ControllerClient
    from lmcache.server.controller import ControllerServer

    a, url_a = start_controller()
    try:
        with ControllerServer(port=0, token=TOKEN, instance_timeout=5) as b:
            cfg = {"chunk_size": CHUNK, "kv_spec": KV_SPEC, "tiers": [{"backend": "cpu", "capacity": "8MiB"}],
                   "controller": {"url": [url_a, b.url], "token": TOKEN, "instance_id": "mover",
                                  "heartbeat_interval": 0.2, "timeout": 1.0}}
            on_a, on_b = ControllerClient(url_a, TOKEN), ControllerClient(b.url, TOKEN)

            def hits(client: ControllerClient, prompt: list[int]) -> list[int]:
                return [r["hit_tokens"] for r in client.lookup(prompt)["results"]]

            with lmcache.CacheEngine.from_config(cfg) as engine:
                w = engine.controller_worker
                engine.store(PROMPT[:64], torch.zeros(2, 2, 64, 2, 8))
                until(lambda: hits(on_a, PROMPT) == [64], "indexed on the first controller")
                assert hits(on_b, PROMPT) == []
                a.send_signal(signal.SIGKILL)
                a.wait()
                # the next heartbeat or event batch fails over; B answers 404, the worker registers there
                until(lambda: hits(on_b, PROMPT) == [64], "re-registered on the second with its snapshot")
                assert w.registered and w.client.url == b.url and w.stats()["controller"] == b.url
                engine.store(PROMPT, torch.zeros(2, 2, len(PROMPT), 2, 8))
                until(lambda: hits(on_b, PROMPT) == [len(PROMPT)], "later admits reach the second controller")
                assert [i["instance_id"] for i in on_b.instances()] == ["mover"]
    finally:
        stop(a)


def test_worker_session_stays_valid_on_the_other_valkey_replica(tmp_path):
    """Two controller processes over one Valkey index: the one the worker registered
    through is SIGKILLed; the worker's session is valid on the other (no second
    registration) and its later admits reach the shared index."""
    import torch

    import lmcache
    from _missing import loopback_store
    from lmcache.plugins.services.controller_client import ControllerClient

    with loopback_store("valkey") as store:
        index = store.options["url"]
        a, url_a = start_controller("--index", index)
        b, url_b = start_controller("--index", index)
        try:
            cfg = {"chunk_size": CHUNK, "kv_spec": KV_SPEC, "tiers": [{"backend": "cpu", "capacity": "8MiB"}],
                   "controller": {"url": f"{url_a},{url_b}", "token": TOKEN, "instance_id": "shared",
                                  "heartbeat_interval": 0.2, "timeout": 1.0}}
            on_b = ControllerClient(url_b, TOKEN)

            def hits(prompt: list[int]) -> list[int]:
                return [r["hit_tokens"] for r in on_b.lookup(prompt)["results"]]

            with lmcache.CacheEngine.from_config(cfg) as engine:
                w = engine.controller_worker
                engine.store(PROMPT[:64], torch.zeros(2, 2, 64, 2, 8))
                until(lambda: hits(PROMPT) == [64], "indexed (seen through the other replica)")
                assert w.client.url == url_a and w.registrations == 1
                a.send_signal(signal.SIGKILL)
                a.wait()
                engine.store(PROMPT, torch.zeros(2, 2, len(PROMPT), 2, 8))
                until(lambda: hits(PROMPT) == [len(PROMPT)], "later admits reach the index through the other replica")
                assert w.client.url == url_b and w.registered
                assert w.registrations == 1 and w.dropped_events == 0  # same session: no re-registration, nothing lost
        finally:
            stop(a)
            stop(b)


def test_a_worker_keeps_its_session_while_the_valkey_index_is_unavailable(tmp_path, caplog):
    """The index's Valkey frozen for longer than the controller's index timeout (the
    controller answers 503, as while Sentinel promotes a replica): the worker keeps its
    session and the batch it could not send, and sends it when Valkey is back; no second
    registration (a new epoch whose entries would count only after a whole snapshot)
    and no dropped event. Before: it dropped the batch and registered again."""
    import torch

    import lmcache
    from _missing import loopback_store
    from lmcache.plugins.services.controller_client import ControllerClient
    from lmcache.server.controller import ControllerServer

    with loopback_store("valkey") as store:
        with ControllerServer(port=0, token=TOKEN, instance_timeout=30, index=store.options["url"],
                              index_timeout=0.5) as ctl:
            cfg = {"chunk_size": CHUNK, "kv_spec": KV_SPEC, "tiers": [{"backend": "cpu", "capacity": "8MiB"}],
                   "controller": {"url": ctl.url, "token": TOKEN, "instance_id": "steady",
                                  "heartbeat_interval": 0.2, "timeout": 2.0}}
            client = ControllerClient(ctl.url, TOKEN, timeout=5)

            def hits() -> list[int]:
                return [r["hit_tokens"] for r in client.lookup(PROMPT)["results"]]

            with lmcache.CacheEngine.from_config(cfg) as engine:
                w = engine.controller_worker
                engine.store(PROMPT[:64], torch.zeros(2, 2, 64, 2, 8))
                until(lambda: hits() == [64], "indexed")
                failed = w.failed_calls
                store.freeze()
                try:
                    engine.store(PROMPT, torch.zeros(2, 2, len(PROMPT), 2, 8))
                    until(lambda: w.failed_calls > failed + 1, "the worker's calls fail while Valkey is frozen")
                finally:
                    store.thaw()
                until(lambda: hits() == [len(PROMPT)], "the kept batch reaches the index once Valkey answers")
                assert w.registrations == 1 and w.dropped_events == 0, w.stats()
                assert w.registered
                # its log says what it does (before: "dropping events ... then resending a snapshot")
                said = [r.getMessage() for r in caplog.records if r.name == "lmcache.plugins.services.controller"]
                assert any("keeping this session and its unsent events" in m for m in said), said
                assert not any("dropping" in m or "snapshot" in m for m in said), said
