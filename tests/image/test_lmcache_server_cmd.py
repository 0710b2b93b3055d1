"""`lmcache_server HOST PORT [OPTIONS]`, the cache-server command of LMCache's deployments
(the production stack runs `/opt/venv/bin/lmcache_server 0.0.0.0 <port>`), runs our
`lmcache server`; bad arguments are one line and exit 2, before anything binds."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

CMD = [sys.executable, "-m", "lmcache.cli.legacy_server"]


@pytest.mark.parametrize("args, problem", [
    ([], "expected HOST and PORT"),
    (["0.0.0.0"], "expected HOST and PORT"),
    (["--host", "0.0.0.0"], "expected HOST and PORT"),
    (["0.0.0.0", "http"], "PORT must be a number from 0 to 65535, not 'http'"),
    (["0.0.0.0", "70000"], "PORT must be a number from 0 to 65535, not '70000'"),
])
def test_bad_arguments_are_one_line_and_exit_2(args, problem):
    p = subprocess.run(CMD + args, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and p.stderr.startswith(f"lmcache_server: error: {problem}"), p.stderr


def test_host_and_port_serve_until_sigterm():
    proc = subprocess.Popen(CMD + ["127.0.0.1", "0", "--capacity", "64MiB"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("LISTENING 127.0.0.1:"), (line, proc.stderr.read() if proc.poll() is not None else "")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait(10)
