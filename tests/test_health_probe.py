"""The cache server's liveness probe as the vLLM production stack runs it
(``python3 .../health_probe.py 127.0.0.1 PORT``, timeout 5 s): our script at that path
(deploy/image/health_probe.py, copied into the image) against a real ``lmcache_server``
process: green while it serves, red within its timeout once the server is stopped
(SIGSTOP) or gone, red on a wrong token; the production stack's init-container loop
(``until python3 health_probe.py HOST PORT; do sleep 1; done``) ends once the server
listens. The image test (tests/image/test_image_live.py) runs the same in containers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _procs import readline
from lmcache.testing.stores import free_port

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "deploy" / "image" / "health_probe.py"
TIMEOUT = 5.0  # the production stack's timeoutSeconds


def run_probe(port: int, *extra: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(PROBE), "127.0.0.1", str(port), *extra], capture_output=True, text=True,
                       timeout=TIMEOUT + 30, env={**os.environ, **(env or {})})
    return p, time.monotonic() - t0


def start_server(*extra: str, env: dict[str, str] | None = None, port: int = 0) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "lmcache.cli.legacy_server", "127.0.0.1", str(port),
                             "--capacity", "64MiB", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    line = readline(proc)
    assert line.startswith("LISTENING 127.0.0.1:"), line
    return proc, int(line.rsplit(":", 1)[1])


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait(30)


def test_the_probe_is_green_while_the_server_serves_and_red_within_its_timeout_once_stopped():
    proc, port = start_server()
    try:
        ok, took = run_probe(port)
        assert ok.returncode == 0 and ok.stdout.startswith("healthy: 127.0.0.1:"), (ok.stdout, ok.stderr)
        print(f"green in {took:.2f} s: {ok.stdout.strip()}")
        proc.send_signal(signal.SIGSTOP)  # accepted by the kernel, never answered
        bad, took = run_probe(port)
        assert bad.returncode == 1, (bad.stdout, bad.stderr)
        assert bad.stderr.count("\n") == 1 and f"no answer from 127.0.0.1:{port} within 5s" in bad.stderr, bad.stderr
        assert took < TIMEOUT + 10, took  # a guard against a hang: the probe bounds itself by its timeout
        print(f"stopped server: red after {took:.2f} s: {bad.stderr.strip()}")
        proc.send_signal(signal.SIGCONT)
        again, _ = run_probe(port)
        assert again.returncode == 0, again.stderr
    finally:
        stop(proc)
    gone, _ = run_probe(port)
    assert gone.returncode == 1 and "health_probe: unhealthy: " in gone.stderr, gone.stderr


def test_with_a_token_the_probe_proves_it_and_a_wrong_one_is_red():
    proc, port = start_server(env={"LMCACHE_SERVER_TOKEN": "probe-secret"})
    try:
        ok, _ = run_probe(port, env={"LMCACHE_SERVER_TOKEN": "probe-secret"})
        assert ok.returncode == 0, ok.stderr
        for env in ({"LMCACHE_SERVER_TOKEN": "wrong"}, {"LMCACHE_SERVER_TOKEN": ""}):
            bad, _ = run_probe(port, env=env)
            assert bad.returncode == 1 and bad.stderr.count("\n") == 1, bad.stderr
            assert "probe-secret" not in bad.stderr + bad.stdout
    finally:
        stop(proc)


def test_the_init_container_loop_ends_once_the_server_listens():
    """The production stack's vLLM pods wait in an init container running the probe
    against the cache-server Service until it passes."""
    port = free_port()
    loop = subprocess.Popen(["bash", "-c", f'until "{sys.executable}" "{PROBE}" 127.0.0.1 {port}; do sleep 1; done'],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2)
        assert loop.poll() is None  # still waiting: nothing listens yet
        proc, _ = start_server(port=port)
        try:
            assert loop.wait(60) == 0
            assert "healthy" in loop.stdout.read()
        finally:
            stop(proc)
    finally:
        loop.kill()
        loop.wait(10)


@pytest.mark.parametrize("args, code", [([], 2), (["127.0.0.1"], 2), (["127.0.0.1", "http"], 2), (["--help"], 0)])
def test_bad_arguments_are_one_line(args, code):
    p = subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == code, p.stderr
    if code:
        assert p.stderr.count("\n") == 1 and p.stderr.startswith("health_probe: error: "), p.stderr
