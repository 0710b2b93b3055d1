"""Fault harnesses for networked backends: a store that hangs (SIGSTOP) or dies (SIGKILL)
under a workload. The stores are started by :mod:`lmcache.testing.stores`."""

from __future__ import annotations

import pytest
import torch

from .conformance import make_key
from .stores import wait_stopped

__all__ = ["assert_hang_times_out", "assert_survives_outage", "wait_stopped"]


def assert_hang_times_out(backend, server, match: str) -> None:
    """A networked backend whose ``server`` hangs fails fast and recovers.

    ``backend`` is an open backend object, ``server`` the :class:`~lmcache.testing.stores.Store`
    (or one :class:`~lmcache.testing.stores.LocalServer` of it) it talks to, and key
    ``make_key(1)`` must be stored in it first. The server is frozen (SIGSTOP); then
    ``backend.get`` and ``backend.exists`` must each raise ``BackendError`` whose message
    matches the regular expression ``match`` within the backend's timeout (a 5 s hang
    guard); the server is thawed (SIGCONT) and the same backend object must find the key
    again (it reconnects)."""
    import time

    from ..errors import BackendError

    server.freeze()
    try:
        for call in (lambda: backend.get([make_key(1)]), lambda: backend.exists([make_key(1)])):
            t0 = time.monotonic()
            with pytest.raises(BackendError, match=match):
                call()
            assert time.monotonic() - t0 < 5  # a hang guard, not a performance bound
    finally:
        server.thaw()
    assert backend.exists([make_key(1)]) == [True]  # the same backend, reconnected


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
