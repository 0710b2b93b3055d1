"""The ``valkey`` index's own guarantees (issue 35), over a loopback Valkey standalone, a
Redis primary behind a Sentinel and a three-master Valkey Cluster: the controller process
holds no index state (two controllers agree, a session from one is valid on the other, a
new controller answers at once), a lapsed lease stops counting with no sweep, a
re-registration refuses the old session, the caps hold, Valkey down is a one-line 503, and
a hostile body is refused before Valkey is asked. Each test prints what it checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _missing import loopback_store
from _procs import until
from lmcache.server.index_valkey import ValkeyIndex, parse_url
from lmcache.server.controller import ControllerServer
from lmcache.errors import ConfigError
from lmcache.server.http import HTTPError
from test_controller import call

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "lmc1:default:m:sig:"
REG = {"namespace": "default", "model": "m", "chunk_size": 16, "tiers": ["cpu", "disk"], "kv_signature": "sig"}
GUARD = 30.0  # a generous guard against a hang, not a timing assertion


def key(i: int, ns: str = "default") -> str:
    return f"lmc1:{ns}:m:sig:{i:032x}"


@pytest.fixture(scope="module", params=["valkey", "redis-sentinel", "valkey-cluster"])
def store(request):
    with loopback_store(request.param) as s:
        yield s


@pytest.fixture
def url(store):
    """The store's URL, emptied for each test."""
    ix = ValkeyIndex(store.options["url"], 5, 300)
    ix.r.flushall()  # on a cluster: every primary
    ix.close()
    return store.options["url"]


def admit(ix, iid: str, session: str, keys: list[str], tier: str = "cpu", tenant=None) -> dict:
    return ix.events({"instance_id": iid, "session": session, "events": [["admit", tier, k] for k in keys]}, tenant)


def hits(ix, keys: list[str]) -> dict[str, int]:
    return {r["instance_id"]: r["hit_tokens"] for r in ix.lookup({"keys": keys})["results"]}


def test_two_controllers_agree_and_share_sessions(url):
    """A worker registered through one controller reports through the other; both answer
    the same lookups, listings and health."""
    with ControllerServer(port=0, index=url, instance_timeout=5) as one, \
            ControllerServer(port=0, index=url, instance_timeout=5) as two:
        s = call(one.url, "POST", "/v1/register", {"instance_id": "a", **REG}, token=None)[1]
        assert s["epoch"] == 1
        body = {"instance_id": "a", "session": s["session"], "events": [["admit", "cpu", key(i)] for i in range(3)]}
        assert call(two.url, "POST", "/v1/events", body, token=None) == (200, {"applied": 3})
        assert call(two.url, "POST", "/v1/heartbeat", {"instance_id": "a", "session": s["session"]}, token=None)[0] == 200
        answers = [call(c.url, "POST", "/v1/lookup", {"keys": [key(i) for i in range(4)]}, token=None)[1]
                   for c in (one, two)]
        assert answers[0] == answers[1] and answers[0]["results"][0]["hit_tokens"] == 48, answers
        lists = [call(c.url, "GET", "/v1/instances", token=None)[1] for c in (one, two)]
        assert [r["keys"] for r in lists[0]] == [r["keys"] for r in lists[1]] == [3]
        health = call(two.url, "GET", "/v1/health", token=None)[1]
        assert health["index"] == "valkey" and health["healthy_instances"] == 1
    print("two controllers: one session valid on both, same lookups and listings")


def test_a_new_controller_answers_at_once(url):
    """Entries registered through a controller that is then closed are answered by a new
    one at its first call, with no worker re-registering."""
    with ControllerServer(port=0, index=url, instance_timeout=5) as first:
        s = first.index.register({"instance_id": "a", **REG})["session"]
        admit(first.index, "a", s, [key(i) for i in range(8)])
        before = first.index.lookup({"keys": [key(i) for i in range(8)]})
    with ControllerServer(port=0, index=url, instance_timeout=5) as second:
        assert second.index.lookup({"keys": [key(i) for i in range(8)]}) == before
        assert before["results"][0]["hit_tokens"] == 128
        # a token lookup needs the instance's chunking, learnt from Valkey on the first call
        from lmcache.keys import TokenProcessor

        toks = list(range(64))
        admit(second.index, "a", s, [PREFIX + h for h in TokenProcessor(16).hashes(toks)])
        assert second.index.lookup({"tokens": toks})["results"][0]["hit_tokens"] == 64
    print("a new controller: the same 8-chunk answer at its first lookup; tokens hashed by the stored chunking")


def test_a_lapsed_lease_stops_counting_without_any_sweep(url):
    """An index with no reaper and no expire() call: the instance's entries stop counting
    once its lease lapses; a heartbeat renews it and they count again."""
    ix = ValkeyIndex(url, 0.3, 300)
    s = ix.register({"instance_id": "a", **REG})["session"]
    admit(ix, "a", s, [key(0)])
    assert hits(ix, [key(0)]) == {"a": 16}
    until(lambda: hits(ix, [key(0)]) == {}, "the lease lapsed", GUARD)
    assert ix.list()[0]["healthy"] is False and ix.list()[0]["keys"] == 1
    with pytest.raises(HTTPError) as e:
        ix.target("a")
    assert e.value.status == 409
    ix.heartbeat({"instance_id": "a", "session": s})
    assert hits(ix, [key(0)]) == {"a": 16}
    ix.close()
    print("lease: entries out of lookups after it lapsed with no sweep; back after a heartbeat")


def test_registering_again_refuses_the_old_session(url):
    """A restarted instance registers again (epoch 2): the old session's events,
    heartbeats and deregistration are 404, its old keys do not count; the new session works."""
    ix = ValkeyIndex(url, 5, 300)
    old = ix.register({"instance_id": "a", **REG})
    admit(ix, "a", old["session"], [key(0), key(1)])
    new = ix.register({"instance_id": "a", **REG})
    assert (old["epoch"], new["epoch"]) == (1, 2) and old["session"] != new["session"]
    assert hits(ix, [key(0)]) == {}
    for call_ in (lambda: admit(ix, "a", old["session"], [key(5)]),
                  lambda: ix.heartbeat({"instance_id": "a", "session": old["session"]}),
                  lambda: ix.deregister({"instance_id": "a", "session": old["session"]})):
        with pytest.raises(HTTPError) as e:
            call_()
        assert e.value.status == 404 and "register again" in e.value.message
    assert hits(ix, [key(5)]) == {}
    admit(ix, "a", new["session"], [key(0)])
    assert hits(ix, [key(0), key(1)]) == {"a": 16}
    ix.close()
    print("re-register: epoch 1 -> 2, the old session's stale re-sync 404 and not counted")


def retried_registration(ix) -> str:
    """A worker's register answered late (its client gave up and asked another replica,
    with the same worker-chosen session): the second call is the same registration, with
    the same epoch, session and keys; a new session is a new epoch; a malformed one is 400."""
    sess = "ab" * 16
    first = ix.register({"instance_id": "a", **REG, "session": sess})
    admit(ix, "a", sess, [key(0), key(1)])
    again = ix.register({"instance_id": "a", **REG, "session": sess})
    assert (first["epoch"], again["epoch"]) == (1, 1) and first["session"] == again["session"] == sess
    assert hits(ix, [key(0), key(1)]) == {"a": 32}  # its keys kept
    admit(ix, "a", sess, [key(2)])  # the session still valid
    other = ix.register({"instance_id": "a", **REG, "session": "cd" * 16})
    assert other["epoch"] == 2 and hits(ix, [key(0)]) == {}
    for bad in ("short", "AB" * 16, "zz" * 16, "a" * 65):
        with pytest.raises(HTTPError) as e:
            ix.register({"instance_id": "b", **REG, "session": bad})
        assert e.value.status == 400 and "'session'" in e.value.message
    return "a register repeated with the same session: epoch 1 twice, keys kept; another session: epoch 2"


def test_a_retried_registration_is_the_same_registration(url):
    ix = ValkeyIndex(url, 5, 300)
    try:
        print(retried_registration(ix))
    finally:
        ix.close()


def test_a_tenant_churning_instance_ids_leaves_nothing_behind(url):
    """A tenant registers ever new instance ids (one deregistered, one gone silent, one
    re-registered): once ``expire_after`` has passed with no call, no key of theirs is left
    in Valkey but the namespace's name and its refusal counters, so the
    index cannot be grown without bound; an id re-registered right after its deregistration
    still counts its epoch on. Before: an owner key and an epoch per id ever used stayed."""
    ix = ValkeyIndex(url, 0.2, 1.0)
    reg = {**REG, "namespace": "churn"}
    s0 = ix.register({"instance_id": "c0", **reg}, "churn")["session"]
    ix.deregister({"instance_id": "c0", "session": s0}, "churn")
    assert ix.register({"instance_id": "c0", **reg}, "churn")["epoch"] == 2
    for i in range(1, 6):
        s = ix.register({"instance_id": f"c{i}", **reg}, "churn")["session"]
        admit(ix, f"c{i}", s, [key(i, "churn")], tenant="churn")

    def left() -> list[str]:
        nodes = ix.r.get_primaries() if hasattr(ix.r, "get_primaries") else [None]
        found = []
        for node in nodes:
            found += ix.r.keys("lmc:*", target_nodes=node) if node is not None else ix.r.keys("lmc:*")
        return sorted(k for k in found if k not in ("lmc:namespaces", "lmc:{churn}:stats"))

    assert len(left()) > 6
    until(lambda: left() == [], "every per-id key expired", GUARD)
    ix.close()
    print("churn: nothing per id left after expire_after")


def test_the_caps_hold_in_valkey(url):
    """Over the key cap a whole batch is 429 and nothing applied (an eviction + admit at
    the cap passes); a tenant's third instance is 429, re-registering one is not; another
    namespace's instance id is 409 for a tenant; refusals are counted."""
    ix = ValkeyIndex(url, 5, 300, max_keys_per_instance=4, max_instances_per_tenant=2)
    s = ix.register({"instance_id": "a", **REG})["session"]
    with pytest.raises(HTTPError) as e:
        admit(ix, "a", s, [key(i) for i in range(5)])
    assert e.value.status == 429 and "nothing applied" in e.value.message
    assert ix.list()[0]["keys"] == 0 and ix.list()[0]["refused_events"] == 5
    admit(ix, "a", s, [key(i) for i in range(4)])
    ix.events({"instance_id": "a", "session": s, "events": [["evict", "cpu", key(0)], ["admit", "cpu", key(9)]]})
    with pytest.raises(HTTPError) as e:
        admit(ix, "a", s, [key(10)])
    assert e.value.status == 429
    with pytest.raises(HTTPError) as e:
        admit(ix, "a", s, [key(11)], tier="tape")
    assert e.value.status == 400 and "unknown tier 'tape'" in e.value.message
    reg = {**REG, "namespace": "team-a"}
    for iid in ("t1", "t2", "t1"):
        ix.register({"instance_id": iid, **reg}, "team-a")
    with pytest.raises(HTTPError) as e:
        ix.register({"instance_id": "t3", **reg}, "team-a")
    assert e.value.status == 429 and "--max-instances-per-tenant" in e.value.message
    ix.register({"instance_id": "t3", **reg})  # admin registrations are not capped
    with pytest.raises(HTTPError) as e:
        ix.register({"instance_id": "a", **reg}, "team-a")
    assert e.value.status == 409
    assert (ix.refused_events, ix.refused_registrations) == (6, 1)
    ix.close()
    print("caps: 5 keys over a cap of 4 refused whole; 3rd tenant instance 429; foreign id 409; counted")


def test_valkey_down_is_a_one_line_503(store, url):
    """Valkey killed: every index call is answered 503 'index unavailable: ...' on one
    line within the call timeout, health included; a controller started meanwhile
    serves the same 503; once Valkey is back, calls succeed."""
    with ControllerServer(port=0, index=url, instance_timeout=5, index_timeout=0.5) as ctl:
        assert call(ctl.url, "POST", "/v1/register", {"instance_id": "a", **REG}, token=None)[0] == 200
        store.kill()
        try:
            for method, path, body in (("POST", "/v1/lookup", {"keys": [key(0)]}), ("GET", "/v1/health", None),
                                       ("POST", "/v1/register", {"instance_id": "b", **REG}),
                                       ("POST", "/v1/events", {"instance_id": "a", "session": "x", "events": []})):
                status, r = call(ctl.url, method, path, body, token=None)
                assert status == 503 and r["error"].startswith("index unavailable: "), (path, r)
                assert "\n" not in r["error"]
            with ControllerServer(port=0, index=url, index_timeout=0.5) as late:
                assert call(late.url, "POST", "/v1/lookup", {"keys": [key(0)]}, token=None)[0] == 503
        finally:
            store.restart()
        until(lambda: call(ctl.url, "GET", "/v1/health", token=None)[0] == 200, "Valkey back", GUARD)
    print("valkey down: lookup, health, register, events -> 503 one line; back after the restart")


def test_a_hostile_body_is_refused_before_valkey_is_asked(store, url):
    """Valkey frozen (any call to it would time out into a 503): malformed lookups and
    events are still 400, so they were refused before touching Valkey."""
    with ControllerServer(port=0, index=url, instance_timeout=5, index_timeout=0.5) as ctl:
        store.freeze()
        try:
            for path, body, needle in (
                    ("/v1/lookup", {"tokens": [1, -2]}, "'tokens'[1]"),
                    ("/v1/lookup", {"keys": ["x" * 2000]}, "'keys'[0]"),
                    ("/v1/events", {"instance_id": "a", "session": "s", "events": [["drop", "cpu", "k"]]}, "op must be"),
                    ("/v1/events", {"instance_id": "a", "session": "s", "events": [["admit", "cpu", "k" * 2000]]},
                     "1 to 1024"),
                    ("/v1/register", {"instance_id": "x y", **REG}, "'instance_id'")):
                status, r = call(ctl.url, "POST", path, body, token=None)
                assert status == 400 and needle in r["error"], (path, r)
        finally:
            store.thaw()
    print("hostile bodies: 400 with Valkey frozen (never asked)")


def test_bad_index_urls_are_named_and_a_password_never_echoed(tmp_path):
    """``--index`` with a bad URL: one line naming it, exit 2; a password in the URL is
    refused and not printed."""
    for bad in ("valkey://h", "valkey+sentinel://h:1", "valkey+cluster://h:1/0", "mongodb://h:1",
                "valkey://h:1,g:2"):
        with pytest.raises(ConfigError):
            parse_url(bad)
    assert parse_url("valkey+sentinel://a:1,b:2/mymaster/3") == ("sentinel", [("a", 1), ("b", 2)], "mymaster", 3)
    r = subprocess.run([sys.executable, "-m", "lmcache.cli.main", "controller", "serve", "--port", "0", "--index",
                        "valkey://user:hunter2@h:1"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "hunter2" not in r.stderr and "LMCACHE_CONTROLLER_INDEX_PASSWORD" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    print("bad index URLs: named, exit 2, no password echoed")
