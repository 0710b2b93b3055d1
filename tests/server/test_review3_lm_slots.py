"""``lmcache server``'s connection slots: idle sockets never starve a real ``lm`` tier
(issue 44, item 8).

Before: with ``--token``, 32 idle sockets (reopened at each auth timeout) held every
slot for connections waiting to authenticate, and a real tier's new connection was
refused FATAL; without a token nothing timed out and ``max_connections`` idle sockets
refused everyone. Now a connection that has not authenticated (or, without a token, has
sent no complete frame) has ``auth_timeout`` to do so, such connections have a budget of
their own in which a newcomer closes the oldest (from the address holding the most), and
with every slot taken a newcomer closes the connection idle the longest; the ``lm``
backend reconnects quietly when the server closed its pooled connection.

Real server processes on loopback; the squatters are real sockets (from 127.0.0.2 where
they stand for another host), the tier is the real ``lm`` backend."""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest
import torch
from _procs import readline, until

from lmcache import wire as proto
from lmcache.errors import BackendError
from lmcache.storage import BackendContext
from lmcache.encoded import open_objects
from lmcache.testing import make_key, make_obj

TOKEN = "s3cret-slots"
ATTEMPTS = 12


@contextlib.contextmanager
def serve(*args: str, token: str | None = None) -> Iterator[int]:
    """An ``lmcache server`` process on 127.0.0.1 (port 0); its port."""
    argv = [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", "0",
            "--capacity", "64MiB", *args]
    env = {k: v for k, v in os.environ.items() if k != "LMCACHE_SERVER_TOKEN"}
    if token:
        env["LMCACHE_SERVER_TOKEN"] = token
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = readline(p)
        assert first.startswith("LISTENING"), first + (p.stderr.read() if p.poll() is not None else "")
        yield int(first.rsplit(":", 1)[1])
    finally:
        p.terminate()
        try:
            p.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a hang guard
            p.kill()
            p.communicate()


class Squatters:
    """``n`` sockets from ``source`` that never authenticate and send nothing (or, with
    ``health``, one HEALTH frame each and then nothing); every one the server closes is
    reopened after ``pause`` (the attacker of the issue, reopening at each timeout)."""

    def __init__(self, port: int, n: int, *, source: str = "127.0.0.2", health: bool = False, pause: float = 0.05):
        self.port, self.n, self.source, self.health, self.pause = port, n, source, health, pause
        self.opened = self.closed = 0
        self._sel = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="squatters")

    def _open(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((self.source, 0))
            s.settimeout(5)
            s.connect(("127.0.0.1", self.port))
            if self.health:
                s.sendall(proto.encode(proto.HEALTH, 1, b"", b""))
            s.setblocking(False)
        except OSError:
            s.close()
            self.closed += 1
            return
        self.opened += 1
        self._sel.register(s, selectors.EVENT_READ)

    def _run(self) -> None:
        dead = self.n
        while not self._stop.is_set():
            for _ in range(dead):
                self._open()
            dead = 0
            for k, _ in self._sel.select(timeout=0.05):
                s = k.fileobj
                try:
                    data = s.recv(65536)  # type: ignore[union-attr]
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # the server closed it: reopen (after a pause, as an attacker may)
                    self._sel.unregister(s)
                    s.close()  # type: ignore[union-attr]
                    self.closed += 1
                    dead += 1
            if dead:
                time.sleep(self.pause)

    def __enter__(self) -> Squatters:
        self._thread.start()
        deadline = time.monotonic() + 30
        while self.opened < self.n and time.monotonic() < deadline:  # all n held once
            time.sleep(0.01)
        time.sleep(0.2)  # the server accepted them (it reads nothing from them)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for k in list(self._sel.get_map().values()):
            k.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()


def tier(port: int, token: str | None):
    """The ``lm`` backend as a tier opens it (a store of memory objects)."""
    from backends.lm import LMBackend

    opts = {"url": f"lm://127.0.0.1:{port}", "timeout": 5.0}
    if token:
        opts["token"] = token
    return open_objects(LMBackend(BackendContext.standalone(opts)))


def store_and_read(port: int, token: str | None, *, spacing: float, pooled=None) -> list[str]:
    """``ATTEMPTS`` times, ``spacing`` seconds apart: a new tier (or ``pooled``, kept
    between attempts) stores a chunk and reads it back; the failures, one line each."""
    failures: list[str] = []
    for i in range(ATTEMPTS):
        b = pooled if pooled is not None else tier(port, token)
        key, obj = make_key(1000 + i), make_obj(i)
        try:
            b.put([(key, obj)])
            (got,) = b.get([key])
            if got is None or not torch.equal(got.tensor, obj.tensor):
                failures.append(f"attempt {i}: read back {'nothing' if got is None else 'other bytes'}")
        except BackendError as exc:
            failures.append(f"attempt {i}: {exc}")
        finally:
            if pooled is None:
                b.close()
        time.sleep(spacing)
    return failures


@pytest.mark.parametrize("source", ["127.0.0.2", "127.0.0.1"], ids=["other-host", "same-host"])
def test_idle_unauthenticated_sockets_never_refuse_a_real_tier(source):
    """The issue's attack: 32 sockets (the whole budget for connections waiting to
    authenticate) that never authenticate, reopened as soon as the server closes them.
    A real tier with the token stores and reads in every attempt, from another host
    (a newcomer closes the oldest waiting connection of the address holding the most:
    the squatters') or from the same one (the oldest: a squatter's, and the squatters
    stop closing each other once the tier has authenticated)."""
    with serve("--auth-timeout", "1", token=TOKEN) as port:
        with Squatters(port, 32, source=source) as sq:
            failures = store_and_read(port, TOKEN, spacing=0.2)
        print(f"{source}: {len(failures)} of {ATTEMPTS} attempts failed; squatters opened {sq.opened}, "
              f"closed {sq.closed}; {failures[:2]}")
    assert not failures, failures


def test_idle_sockets_without_a_token_never_refuse_a_real_tier():
    """Without a token: as many idle sockets as ``--max-connections``, sending nothing,
    reopened when closed. Each is closed after ``auth_timeout`` without a complete frame,
    at most ``max_unauthenticated`` wait at once, and a tier stores and reads every time."""
    with serve("--auth-timeout", "1", "--max-connections", "64") as port:
        with Squatters(port, 64) as sq:
            failures = store_and_read(port, None, spacing=0.2)
        print(f"no token, silent squatters: {len(failures)} of {ATTEMPTS} failed; opened {sq.opened}, "
              f"closed {sq.closed}; {failures[:2]}")
    assert not failures, failures
    assert sq.closed > 0  # the server closed squatters (before, none: no timeout without a token)


@pytest.mark.parametrize("pooled", [False, True], ids=["new-tier", "pooled"])
def test_idle_established_connections_never_refuse_a_real_tier(pooled):
    """Without a token: every slot held by connections that sent one HEALTH frame and
    then idle, reopened when closed. A newcomer closes the connection idle the longest,
    so a tier gets in every time; a tier whose pooled connection was the one closed
    reconnects quietly (no failed request)."""
    with serve("--auth-timeout", "1", "--max-connections", "16") as port:
        keep = tier(port, None) if pooled else None
        try:
            if keep is not None:
                keep.put([(make_key(1), make_obj(1))])  # its connection is pooled, then idles
            with Squatters(port, 16, health=True) as sq:
                failures = store_and_read(port, None, spacing=0.1, pooled=keep)
        finally:
            if keep is not None:
                keep.close()
        print(f"no token, HEALTH then idle ({'pooled' if pooled else 'new'} tier): {len(failures)} of {ATTEMPTS} "
              f"failed; opened {sq.opened}, closed {sq.closed}; {failures[:2]}")
    assert not failures, failures
    assert sq.closed > 0


def test_a_pooled_connection_closed_by_the_server_is_replaced_quietly():
    """The server closes a tier's idle pooled connection (a newcomer needed its slot):
    the tier's next request runs on a new connection instead of failing."""
    with serve("--max-connections", "1", token=TOKEN) as port:
        b = tier(port, TOKEN)
        try:
            b.put([(make_key(1), make_obj(1))])
            other = tier(port, TOKEN)  # takes the only slot: b's idle connection is closed

            def other_put() -> bool:  # (refused for the moment between b's answer and its going idle)
                try:
                    other.put([(make_key(2), make_obj(2))])
                    return True
                except BackendError:
                    return False

            until(other_put, "another tier to take the slot of b's idle connection")
            other.close()
            got = b.get([make_key(1), make_key(2)])  # b's pooled connection is dead: a new one
            assert [g is not None for g in got] == [True, True]
            assert torch.equal(got[0].tensor, make_obj(1).tensor)
        finally:
            b.close()
