"""A read whose timer fired long past its time: the process did not run meanwhile (the host
paused the machine; here SIGSTOP), and its peer, paused with it, answers a moment after both
resume. That read waits once more instead of failing (lmcache.wire.recv_into_exact); a peer
that is merely slow still times the read out."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import socket, sys
from lmcache import wire
wire.LATE_WAKES = int(sys.argv[2])
for _ in range(2):  # a connection per round: a read that timed out leaves its answer behind
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    s.settimeout(0.5)
    s.sendall(b"r")
    buf = bytearray(4)
    try:
        wire.recv_into_exact(s, memoryview(buf))
        print("got", bytes(buf).decode(), flush=True)
    except TimeoutError:
        print("timed out", flush=True)
"""


def _run(late_wakes: int) -> list[str]:
    srv = socket.create_server(("127.0.0.1", 0))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(srv.getsockname()[1]), str(late_wakes)],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        srv.settimeout(60)
        conn, _ = srv.accept()
        conn.settimeout(60)
        # 1. paused: the child waits (0.5 s timeout), is stopped for 3 s, and the answer
        #    comes 0.3 s after it resumes
        assert conn.recv(1) == b"r"
        time.sleep(0.1)  # inside its wait, well before its timer
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.3)
        conn.sendall(b"pong")
        first = child.stdout.readline().strip()
        # 2. not paused, the peer slow: answers 1.5 s after the 0.5 s wait began
        conn, _ = srv.accept()
        conn.settimeout(60)
        assert conn.recv(1) == b"r"
        time.sleep(1.5)
        conn.sendall(b"late")
        second = child.stdout.readline().strip()
        return [first, second]
    finally:
        child.kill()
        child.wait()
        srv.close()


def test_a_read_paused_with_its_peer_waits_again_and_a_slow_peer_still_times_out():
    assert _run(2) == ["got pong", "timed out"]


def test_without_the_second_wait_the_paused_read_fails():
    assert _run(0) == ["timed out", "timed out"]
