"""The controller's index in Valkey, served by several controller replicas, under faults,
with every part on a host of its own (issue 35 item 4; the cluster: ``_cluster.py``).

The tests share one cluster and run in file order: each fault leaves the cluster serving
(a killed controller is started again; the Valkey primary is killed last). Each prints
what it measured (``make test-multihost`` shows it)."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest
from _cluster import HEARTBEAT, INSTANCE_TIMEOUT, MODEL, PROMPT, start

from _missing import missing
from lmcache.errors import AdminError, NotFoundError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(make_hosts):
    from lmcache.testing.stores import ServerUnavailable, ensure_binary

    try:
        valkey = ensure_binary("valkey-server", apt_package="valkey-server", suite="bookworm-backports")
        cli = ensure_binary("valkey-cli", apt_package="valkey-tools", suite="bookworm-backports")
    except ServerUnavailable as exc:
        missing(str(exc))
    hosts = make_hosts(10, "ha")
    with tempfile.TemporaryDirectory(prefix="lmcache-multihost-") as d:
        c = None
        try:
            c = start(hosts, Path(d), valkey, cli)
            yield c
        finally:
            if c is not None:
                c.stop_all()
            hosts.close()


def test_every_replica_answers_every_engine_s_hits(cluster):
    """Three engines registered through whichever replica answered them; each replica
    answers every engine's hits (a session is valid on every replica)."""
    for name in ("c0", "c1", "c2"):
        with cluster.client(name) as c:
            assert cluster.hits(c) == cluster.held
            assert {i["instance_id"] for i in c.instances() if i["healthy"]} >= set(cluster.held)


def test_a_controller_replica_started_late_answers_at_once(cluster):
    """No initial sync to wait for: the first lookup a late replica answers is complete."""
    cluster.start_controller("c3")
    try:
        with cluster.client("c3") as c:
            assert cluster.hits(c) == cluster.held
            assert {i["instance_id"] for i in c.instances() if i["healthy"]} >= set(cluster.held)
    finally:
        cluster.kill("c3")


def test_a_stale_resync_is_refused(cluster):
    """An instance registered through c0 and again through c2 (its restart): a re-sync that
    still carries the first session is refused 404 by every replica, and its entries do not
    count; the current session's events do."""
    import lmcache

    cfg = cluster.engine_config("stale")
    del cfg["controller"]
    with lmcache.CacheEngine.from_config(cfg) as eng:  # the keys and signature an engine has
        keys = eng.chunk_keys(PROMPT)[1]
        sig = eng.kv_spec.signature
    info = {"instance_id": "stale-0", "namespace": "default", "model": MODEL, "kv_signature": sig, "chunk_size": 16,
            "tiers": ["cpu"]}
    with cluster.client("c0") as c0, cluster.client("c1") as c1, cluster.client("c2") as c2:
        first = c0.register(info)
        c1.events("stale-0", first["session"], [["admit", "cpu", k] for k in keys[:4]])
        second = c2.register(info)
        assert second["session"] != first["session"] and second["epoch"] > first["epoch"], (first, second)
        for c in (c0, c1, c2):
            with pytest.raises(NotFoundError):
                c.events("stale-0", first["session"], [["admit", "cpu", k] for k in keys])
            with pytest.raises(NotFoundError):
                c.heartbeat("stale-0", first["session"])
            assert "stale-0" not in cluster.hits(c)  # the first session's 64 tokens do not count
        c1.events("stale-0", second["session"], [["admit", "cpu", keys[0]]])

        def counted() -> bool:
            c0.heartbeat("stale-0", second["session"])  # the lease is short: renew it before looking
            return cluster.hits(c2).get("stale-0") == 16

        cluster.wait(counted, "the current session's one chunk counts")
        c1.deregister("stale-0", second["session"])


def test_a_controller_killed_during_a_lookup_storm_fails_no_lookup(cluster):
    """Four threads look up through a client given the three replicas; c0 (the one it
    sticks to) is SIGKILLed under them: no lookup fails, every answer is complete."""
    stop = threading.Event()
    failed: list[str] = []
    wrong: list[dict] = []
    after_kill = [0]
    killed = threading.Event()

    def storm() -> None:
        with cluster.client() as c:
            while not stop.is_set():
                try:
                    got = cluster.hits(c)
                except Exception as exc:  # any: a thread that died would hide the failures after it
                    failed.append(f"{type(exc).__name__}: {exc}")
                    continue
                if got != cluster.held:
                    wrong.append(got)
                if killed.is_set():
                    after_kill[0] += 1

    threads = [threading.Thread(target=storm, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    cluster.kill("c0")
    killed.set()
    cluster.wait(lambda: after_kill[0] >= 200, "200 lookups after the kill", timeout=120)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    print(f"controller c0 SIGKILLed under 4 lookup threads: {after_kill[0]} lookups in "
          f"{time.monotonic() - t0:.2f}s after it, {len(failed)} failed, {len(wrong)} incomplete")
    assert failed == [] and wrong == [], (failed[:3], wrong[:3])
    cluster.start_controller("c0")  # back for the next tests
    with cluster.client("c0") as c:
        assert cluster.hits(c) == cluster.held


def test_an_instance_cut_off_the_network_stops_counting_after_its_lease(cluster):
    """e0's link goes down: its entries leave lookups once its lease lapses, the others'
    stay; its link back up, it registers again and its entries count again."""
    host = cluster.eng_hosts["e0"]
    others = {k: v for k, v in cluster.held.items() if k != "e0"}
    with cluster.client() as c:
        assert cluster.hits(c) == cluster.held
        t0 = time.monotonic()
        host.link_down()
        try:
            cluster.wait(lambda: "e0" not in cluster.hits(c), "e0 drops out of lookups", timeout=INSTANCE_TIMEOUT * 10)
            gone = time.monotonic() - t0
            assert cluster.hits(c) == others
            assert [i["healthy"] for i in c.instances() if i["instance_id"] == "e0"] in ([], [False])
        finally:
            host.link_up()
        t1 = time.monotonic()
        cluster.wait(lambda: cluster.hits(c) == cluster.held, "e0 counted again after its link came back")
        print(f"e0's link down: out of lookups after {gone:.2f}s (lease {INSTANCE_TIMEOUT:g}s, heartbeat "
              f"{HEARTBEAT:g}s); link up: counted again after {time.monotonic() - t1:.2f}s")


def test_a_restarted_instance_s_old_entries_are_ignored(cluster):
    """e2 (128 tokens) crashes and comes back at once under the same id holding 48: its old
    epoch's 80 other tokens are never counted again, although no lease lapsed for them."""
    cluster.ready(cluster.spawn_engine("e2", 48, wait=True), wait=True)  # imports done, engine not opened yet
    cluster.kill("e2")
    t0 = time.monotonic()
    cluster.procs["e2"] = cluster.procs.pop("e2-restarted")
    cluster.held["e2"] = 48
    cluster.go("e2")
    with cluster.client() as c:
        cluster.wait(lambda: cluster.hits(c).get("e2") == 48, "e2 counted with what it holds now")
        registered = time.monotonic() - t0
        answers = [cluster.hits(c) for _ in range(20)]
    print(f"e2 restarted: its new epoch counted {registered:.2f}s after the crash (lease {INSTANCE_TIMEOUT:g}s)")
    assert all(a == cluster.held for a in answers), answers


def test_the_valkey_primary_killed_fails_no_lookup(cluster):
    """SIGKILL the Valkey primary under 4 lookup threads (each a client given the three
    replicas), as the outside fault run did: while the primary is gone the controllers
    answer from its replica, marked ``stale``, so no lookup fails and none misses a live
    engine's entries; after Sentinel's promotion the new primary answers. Prints the counts
    (issue 45 item 2; before, every answer from the kill until the promotion was a 503)."""
    old = cluster.primary()
    assert old == cluster.hosts[0].ip
    log: list[tuple[float, str, bool]] = []  # (answered at, "ok" / "incomplete {...}" / error, stale)
    stop = threading.Event()

    def storm() -> None:
        with cluster.client(timeout=1.0) as c:
            while not stop.is_set():
                stale = False
                try:
                    r = c.lookup(PROMPT, model=MODEL)
                    got = {row["instance_id"]: row["hit_tokens"] for row in r["results"]}
                    outcome, stale = ("ok" if got == cluster.held else f"incomplete {got}"), bool(r.get("stale"))
                except AdminError as exc:
                    outcome = f"{getattr(exc, 'status', None)} {exc}"
                except Exception as exc:  # any: a thread that died would hide the failures after it
                    outcome = f"{type(exc).__name__} {exc}"
                log.append((time.monotonic(), outcome, stale))

    threads = [threading.Thread(target=storm, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    cluster.kill("valkey-primary")
    try:
        promoted = cluster.wait(lambda: cluster.primary() not in ("", old) and time.monotonic(),
                                "Sentinel promotes the replica")
        assert cluster.primary() == cluster.hosts[1].ip
        cluster.wait(lambda: sum(1 for at, _, _ in log if at > promoted + 1.0) >= 200,
                     "200 lookups more than 1 s after the promotion", timeout=120)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    after = [x for x in log if x[0] >= t0]
    failed = [(at, o) for at, o, _ in after if not o.startswith(("ok", "incomplete"))]
    incomplete = [(at, o) for at, o, _ in after if o.startswith("incomplete")]
    stale = [at for at, _, s in after if s]
    last_bad = max((at for at, _ in failed + incomplete), default=None)
    print(f"Valkey primary SIGKILLed under 4 lookup threads: Sentinel promoted the replica after {promoted - t0:.2f}s "
          f"(down-after 1s); {len(after)} lookups since the kill: {len(failed)} failed "
          f"({sorted({o.split()[0] for _, o in failed})}, e.g. {[o[:160] for _, o in failed[:1]]}), "
          f"{len(incomplete)} incomplete (e.g. {[o for _, o in incomplete[:1]]}); "
          + (f"the last of them {last_bad - promoted:+.2f}s from the promotion; " if last_bad else "")
          + f"{len(stale)} answered from the replica (stale), the last {max(stale, default=t0) - promoted:+.2f}s from "
          f"the promotion")
    assert failed == [] and incomplete == [], (failed[:3], incomplete[:3])
    assert stale, "no answer came from the replica while the primary was gone"
    with cluster.client() as c:
        assert cluster.hits(c) == cluster.held  # no entry of a live engine lost
