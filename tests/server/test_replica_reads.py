"""Issue 45 item 2: lookups through a Valkey primary's SIGKILL, on loopback.

Real parts: a Valkey primary, its replica and a Sentinel (``sentinel_pair`` of
test_review3_valkey_stale: quorum 1, down-after 1.5 s), two controller replicas over
``valkey+sentinel://``, and two engines in this process whose controller workers heartbeat
every 0.2 s. Four lookup threads (two per controller) run through the kill, Sentinel's
promotion and after it; each answer is counted failed (not 200), incomplete (a live
engine's entries missing) or complete, and stale-marked or not. The leases (1 s) are
shorter than the promotion, so the replica's copy holds leases that ran out on Valkey's
clock while the primary was gone: they count, as index_outage's rule says."""

from __future__ import annotations

import threading
import time
from typing import Any

from _procs import until
from lmcache.server.controller import ControllerServer
from test_controller import call
import test_review3_valkey_stale as stale
from test_review3_valkey_stale import GUARD, REG, engine, key, ok, raw, sentinel_pair

store, url = stale.store, stale.url  # its fixtures: a loopback Valkey, emptied for each test


def test_a_primary_sigkill_fails_no_lookup(tmp_path):
    """Before (no replica reads): 503s from the kill until the promotion was noticed
    (loopback run: 1,565 of 2,317 answers failed over 2.72 s). After: 0 failed, 0
    incomplete, the answers while the primary was gone marked stale; the events an engine
    sent while it was gone reach the index (the worker kept its session and its batch)."""
    with sentinel_pair() as sp, \
            ControllerServer(port=0, index=sp["url"], instance_timeout=1.0, index_timeout=0.5) as one, \
            ControllerServer(port=0, index=sp["url"], instance_timeout=1.0, index_timeout=0.5) as two:
        worker = {"url": f"{one.url},{two.url}", "heartbeat_interval": 0.2, "timeout": 1.0}
        with engine(tmp_path, "a", "tok-a", {**worker, "instance_id": "a"}) as a, \
                engine(tmp_path, "bb", "tok-b", {**worker, "instance_id": "b"}) as b:
            def hits(r: dict[str, Any]) -> dict[str, int]:
                return {row["instance_id"]: row["hit_tokens"] for row in r.get("results", ())}

            # each engine holds its own 64-token prompt (the name's length salts it)
            asks = [({"keys": a.test_keys}, {"a": 64}), ({"keys": b.test_keys}, {"b": 64})]
            until(lambda: all(hits(call(c.url, "POST", "/v1/lookup", q, token=None)[1]) == w
                              for c in (one, two) for q, w in asks),
                  "both controllers answer both engines' entries", GUARD)
            primary = raw(f"redis://127.0.0.1:{sp['ports'][0]}")  # its first sync waits repl-diskless-sync-delay
            until(lambda: primary.wait(1, 100) == 1, "the replica has caught up", GUARD)
            log: list[tuple[float, float, int, str, bool]] = []  # (sent, answered, status, outcome, stale)
            stop = threading.Event()

            def storm(ctl: ControllerServer, q: dict[str, Any], w: dict[str, int]) -> None:
                while not stop.is_set():
                    t0 = time.monotonic()
                    try:
                        status, r = call(ctl.url, "POST", "/v1/lookup", q, token=None)
                    except Exception as exc:  # noqa: BLE001 - counted: a thread that died would hide failures
                        status, r = 0, {"error": f"{type(exc).__name__}: {exc}"}
                    outcome = ("ok" if hits(r) == w else f"incomplete {hits(r)}") if status == 200 else \
                        f"{status} {r.get('error', '')[:120]}"
                    log.append((t0, time.monotonic(), status, outcome, bool(r.get("stale"))))

            threads = [threading.Thread(target=storm, args=(c, q, w), daemon=True)
                       for c in (one, two) for q, w in asks]
            for t in threads:
                t.start()
            time.sleep(0.5)
            t_kill = time.monotonic()
            sp["primary"].kill()
            # a writes while the primary is gone: its events wait in its worker (503) and land after
            import torch

            more = [(i * 104729 + 5) % 30000 for i in range(32)]
            s = a.kv_spec
            a.store(more, torch.randn(s.num_layers, 2, len(more), s.num_kv_heads, s.head_size))
            a.flush()
            more_keys = a.chunk_keys(more)[1]
            try:
                until(lambda: sp["master"]() not in (None, sp["ports"][0]), "Sentinel promoted the replica", GUARD)
                promoted = time.monotonic()
                until(lambda: sum(1 for x in log if x[0] > promoted + 1.0) >= 200,
                      "200 lookups more than 1 s after the promotion", GUARD)
            finally:
                stop.set()
                for t in threads:
                    t.join(timeout=GUARD)
            after = [x for x in log if x[1] >= t_kill]
            failed = [x for x in after if x[2] != 200]
            incomplete = [x for x in after if x[2] == 200 and x[3] != "ok"]
            stale = [x for x in after if x[4]]
            span = (max(x[1] for x in failed) - t_kill) if failed else 0.0
            landed = until(lambda: hits(call(two.url, "POST", "/v1/lookup", {"keys": more_keys}, token=None)[1])
                           == {"a": 32}, "the events a sent while the primary was gone are in the index", GUARD)
            listed = {i["instance_id"]: (i["healthy"], i["dropped_events"])
                      for i in call(one.url, "GET", "/v1/instances", token=None)[1]}
            print(f"Valkey primary SIGKILLed under 4 lookup threads (2 controllers, lease 1 s, down-after 1.5 s): "
                  f"promoted {promoted - t_kill:.2f}s after the kill; {len(after)} answers since the kill: "
                  f"{len(failed)} failed (over {span:.2f}s, e.g. {[x[3] for x in failed[:1]]}), {len(incomplete)} "
                  f"incomplete (e.g. {[x[3] for x in incomplete[:1]]}), {len(stale)} marked stale (last one "
                  f"{max((x[1] for x in stale), default=t_kill) - t_kill:.2f}s after the kill); before the kill "
                  f"{sum(1 for x in log if x[1] < t_kill)} answers, {sum(1 for x in log if x[1] < t_kill and x[4])} "
                  f"stale; events sent during the outage landed: {bool(landed)}; instances {listed}")
            assert failed == [] and incomplete == [], (failed[:3], incomplete[:3])
            assert stale, "no answer from the replica while the primary was gone"
            assert not [x for x in log if x[1] < t_kill and x[4]], "a stale answer while the primary was up"
            assert listed == {"a": (True, 0), "b": (True, 0)}, listed


def test_a_replica_read_counts_the_leases_a_resume_would_keep(url):
    """The read-only lookup a replica runs cannot resume the leases (index_outage's RESUME
    writes); it must count the same ones. One Valkey stands for both sides: 'live' beats,
    'dead' stopped at registration and lapsed while 'live' beat on; then nothing lands for
    longer than the lease (1 s), and the controller's last call that reached the index is
    taken as before 'dead' lapsed. The replica read counts 'live' only (the landed beats
    show the index was there when 'dead' lapsed), marked stale; the resume on the primary
    then answers the same."""
    with ControllerServer(port=0, index=url, instance_timeout=1.0, index_timeout=0.5) as ctl:
        ctl._stop.set()  # no probe: this test opens and closes the outage itself
        ix = ctl.index
        since = time.monotonic()
        sess = {i: ok(ctl.url, "/v1/register", {"instance_id": i, **REG, "tiers": ["cpu"]})["session"]
                for i in ("live", "dead")}
        for i, s in sess.items():
            ok(ctl.url, "/v1/events", {"instance_id": i, "session": s, "events": [["admit", "cpu", key(0)]]})

        def dead_lapsed() -> bool:
            ok(ctl.url, "/v1/heartbeat", {"instance_id": "live", "session": sess["live"]})
            time.sleep(0.1)
            return _ids(ix.lookup({"keys": [key(0)]})) == {"live"}

        until(dead_lapsed, "the dead instance's lease lapsed while the live one beat", GUARD)
        ok(ctl.url, "/v1/heartbeat", {"instance_id": "live", "session": sess["live"]})
        time.sleep(1.3)  # 'live''s lease ran out too on Valkey's clock: nothing landed
        ix._sentinel, ix._replica = True, raw(url)  # the "replica": the same server, read-only
        ix._guard.since = since  # as if the controller had not reached the primary since then
        stale = ix.lookup({"keys": [key(0)]})
        ix._sentinel = False
        resumed = ix.lookup({"keys": [key(0)]})  # the primary path: RESUME first, then the lookup
        print(f"replica read: {sorted(_ids(stale))} (stale {stale.get('stale')}, {stale.get('stale_s')} s); "
              f"after the resume on the primary: {sorted(_ids(resumed))} (stale {resumed.get('stale')}); "
              f"leases moved {ix._guard.moved}")
        assert _ids(stale) == _ids(resumed) == {"live"}
        assert stale["stale"] is True and 1.0 <= stale["stale_s"] < GUARD and "stale" not in resumed


def _ids(r: dict[str, Any]) -> set[str]:
    return {row["instance_id"] for row in r["results"]}
