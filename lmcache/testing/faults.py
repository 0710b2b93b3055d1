"""Fault harnesses for networked backends: a store that hangs (SIGSTOP) or dies (SIGKILL)
under a workload. The stores are started by :mod:`lmcache.testing.stores`."""

from __future__ import annotations

import pytest
import torch

from .conformance import make_key


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Wait until every thread of ``pid`` is stopped (after a SIGSTOP).

    ``kill(pid, SIGSTOP)`` wakes one thread of the process, which then stops the others;
    until it has run, the other threads go on (on a loaded machine, a connection thread of
    a "stopped" server answered a request: 2 in 200 tries under 6 CPU burners)."""
    import glob
    import time

    deadline = time.monotonic() + timeout
    while True:
        states = []
        for path in glob.glob(f"/proc/{pid}/task/*/stat"):
            try:
                with open(path) as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                continue  # a thread that exited meanwhile
        if states and all(s in ("T", "t") for s in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop within {timeout}s (thread states {states})")
        time.sleep(0.001)


def assert_hang_times_out(backend, server, match: str) -> None:
    """A networked backend whose ``server`` (a :class:`lmcache.testing.stores.LocalServer`)
    hangs (SIGSTOP) fails ``get``/``contains`` with ``BackendError`` matching ``match``
    within its timeout, and the same backend object serves again once the server
    continues (key ``make_key(1)`` must be stored first)."""
    import os
    import signal
    import time

    from ..errors import BackendError

    pid = server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_stopped(pid)
        for call in (lambda: backend.get([make_key(1)]), lambda: backend.contains([make_key(1)])):
            t0 = time.monotonic()
            with pytest.raises(BackendError, match=match):
                call()
            assert time.monotonic() - t0 < 5  # a hang guard, not a performance bound
    finally:
        os.kill(pid, signal.SIGCONT)
    assert backend.contains([make_key(1)]) == [True]  # the same backend, reconnected


def assert_survives_outage(e, store, tier: str, toks, kv_for, caplog) -> None:
    """The fault check of a networked backend: an engine ``e`` whose tier ``tier`` lives
    in ``store`` (a :class:`lmcache.testing.stores.Store`; the tier's timeout 0.5 s) and holds
    ``toks`` keeps serving while a workload runs and the store is SIGKILLed: calls return
    misses, never raise, stay under a hang guard, and the outage is logged once; after a
    restart (the store comes back empty) hits resume in the same engine. ``kv_for(tokens)``
    gives the KV stored for ``tokens``; ``caplog`` is pytest's fixture."""
    import logging
    import threading
    import time

    errors: list[BaseException] = []
    seen: list[int] = []
    slowest = [0.0]
    stop = threading.Event()

    def workload():
        i = 0
        while not stop.is_set():
            i += 1
            other = list(range(1000 * i, 1000 * i + 32))
            t0 = time.monotonic()
            try:
                e.store(other, kv_for(other))
                seen.append(e.lookup(toks))
                e.retrieve(toks)
            except BaseException as exc:  # noqa: BLE001 - the assertion below reports it
                errors.append(exc)
            slowest[0] = max(slowest[0], time.monotonic() - t0)
            time.sleep(0.01)

    worker = threading.Thread(target=workload)
    worker.start()
    try:
        time.sleep(0.3)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lmcache.hierarchy"):
            store.kill()
            time.sleep(0.5)
            t0 = time.monotonic()
            assert e.lookup(toks) == 0
            assert e.retrieve(toks).num_tokens == 0
            e.store(list(range(5000, 5040)), kv_for(range(5000, 5040)))
            assert time.monotonic() - t0 < 5  # a hang guard (timeout 0.5 s)
            outage_logs = [r for r in caplog.records if "serving misses" in r.getMessage()]
    finally:
        stop.set()
        worker.join(30)
    assert not errors, errors
    assert slowest[0] < 5
    assert 0 in seen  # the workload saw misses, not exceptions
    assert len(outage_logs) == 1, [r.getMessage() for r in outage_logs]  # once per outage

    store.restart()
    fresh_toks = list(range(10**6, 10**6 + 64))  # the store restarted empty: new chunks
    deadline = time.monotonic() + 15
    while True:
        e.store(fresh_toks, kv_for(fresh_toks))
        if e.lookup(fresh_toks) == 64:
            break
        assert time.monotonic() < deadline, "hits did not resume within 15 s of the restart"
        time.sleep(0.2)
    res = e.retrieve(fresh_toks)
    assert res.tiers == [tier] * 4 and torch.equal(res.kv, kv_for(fresh_toks))
    assert e.stats()["tiers"][tier]["errors"] > 0
