"""What a tenant can make the controller's registry do (issue 44, items 4, 5 and 6), on the
real controller on loopback with each index: the memory index and a loopback Valkey.

4. Two tenants registering one new instance id at the same moment: one gets it, the other
   409 (the check was a read before the write: 62 of 100 attempts both got 200 over Valkey).
5. Every registered string is bounded, and a lookup builds no per-chunk string from them:
   one lookup with a 200 KiB model and 1,500 hashes grew a memory-index controller by
   293 MiB, and took 443 MB of Lua memory in Valkey.
6. The per-chunking state follows the live instances: 1,500 re-registrations with new
   chunk sizes made every admin lookup hash the tokens 1,500 times.

Each test prints what it measured."""

from __future__ import annotations

import threading
import tracemalloc

import pytest

from _missing import loopback_store
from lmcache.server.index_valkey import ValkeyIndex
from lmcache.server.limits import MAX_CHUNKINGS, MAX_MODEL_LEN
from lmcache.server.controller import ControllerServer
from test_controller import call

ADMIN = "adm-tok"
TENANTS = {"team-a": ("tok-a",), "team-b": ("tok-b",)}
SIG = "sig"
MiB = 1 << 20


@pytest.fixture(scope="module")
def valkey_url():
    with loopback_store("valkey") as s:
        yield s.options["url"]


@pytest.fixture(params=["memory", "valkey"])
def index(request):
    """``"memory"`` or the loopback Valkey's URL, emptied."""
    if request.param == "memory":
        return "memory"
    url = request.getfixturevalue("valkey_url")
    ix = ValkeyIndex(url, 5, 300)
    ix.r.flushall()
    ix.close()
    return url


def serve(index: str, **kw) -> ControllerServer:
    return ControllerServer(port=0, token=ADMIN, tenants=TENANTS, index=index, instance_timeout=30, **kw)


def reg(ns: str, model: str = "m", chunk_size: int = 16, **extra) -> dict:
    return {"namespace": ns, "model": model, "chunk_size": chunk_size, "tiers": ["cpu"], "kv_signature": SIG, **extra}


def hexkey(i: int) -> str:
    return f"{i:032x}"


# ---------------------------------------------------------------- item 4
def test_one_new_id_registered_by_two_tenants_at_once_goes_to_one(index):
    """60 new ids, each registered by team-a and team-b at the same moment (a barrier):
    exactly one 200 and one 409 each, and the id is listed in the winner's namespace only,
    so admin commands reach the instance that won."""
    rounds, doubles, wins = 60, 0, {"team-a": 0, "team-b": 0}
    with serve(index, max_instances_per_tenant=rounds) as ctl:
        for i in range(rounds):
            iid = f"race-{i}"
            gate = threading.Barrier(2)
            got: dict[str, int] = {}

            def go(ns: str, tok: str) -> None:
                gate.wait(timeout=10)
                got[ns] = call(ctl.url, "POST", "/v1/register", {"instance_id": iid, **reg(ns)}, token=tok)[0]

            threads = [threading.Thread(target=go, args=(ns, toks[0])) for ns, toks in TENANTS.items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            oks = [ns for ns, st in got.items() if st == 200]
            doubles += len(oks) == 2
            assert sorted(got.values()) in ([200, 409], [200, 200]), got
            if len(oks) == 1:
                wins[oks[0]] += 1
                listed = [r for r in call(ctl.url, "GET", "/v1/instances", token=ADMIN)[1] if r["instance_id"] == iid]
                assert [r["namespace"] for r in listed] == oks, (iid, listed, got)
                for ns, toks in TENANTS.items():
                    mine = [r["instance_id"] for r in call(ctl.url, "GET", "/v1/instances", token=toks[0])[1]]
                    assert (iid in mine) == (ns == oks[0]), (iid, ns, mine)
    print(f"{index.split(':')[0]}: {rounds} ids registered by two tenants at once: {doubles} double 200s, wins {wins}")
    assert doubles == 0, f"{doubles} of {rounds} ids were given to both tenants"


# ---------------------------------------------------------------- item 5
@pytest.mark.parametrize("field,value", [
    ("model", "m" * (200 * 1024)), ("model", "%" * (MAX_MODEL_LEN // 2)), ("model", "a\nb"),
    ("api_url", "http://127.0.0.1:1/" + "a" * 5000), ("api_token", "t" * 10_000), ("api_token", "a\r\nX: y"),
    ("version", "v" * 1000), ("tiers", ["c" * 1000]), ("pid", 1 << 62), ("heartbeat_interval", 1e300),
    ("chunk_size", 1 << 40), ("peer_url", "lm://h:1" + "/" * 3000), ("namespace", "team-a\n"),
    ("instance_id", "i" * 201), ("kv_signature", "s" * 201),
])
def test_every_registered_string_is_bounded(index, field, value):
    """A registration with an over-long (or control-character) field is one 400 naming the
    field, and nothing is registered."""
    with serve(index) as ctl:
        status, r = call(ctl.url, "POST", "/v1/register", {"instance_id": "big", **reg("team-a"), field: value},
                         token="tok-a")
        assert status == 400, (status, r)
        assert field in r["error"] and "\n" not in r["error"] and len(r["error"]) < 400, r
        assert call(ctl.url, "GET", "/v1/instances", token=ADMIN)[1] == []
    print(f"{field} {str(value)[:20]!r}... ({len(str(value))} chars): 400 {r['error'][:120]!r}")


def _many_instances_with_long_models(ctl: ControllerServer, n_inst: int, n_keys: int) -> list[str]:
    """``n_inst`` tenant instances of the longest model allowed, each holding ``n_keys`` keys."""
    model = "m" * MAX_MODEL_LEN
    from urllib.parse import quote

    prefix = f"lmc1:team-a:{quote(model, safe='-_.~')}:{SIG}:"
    for j in range(n_inst):
        iid = f"long-{j}"
        st, r = call(ctl.url, "POST", "/v1/register", {"instance_id": iid, **reg("team-a", model)}, token="tok-a")
        assert st == 200, r
        events = [["admit", "cpu", prefix + hexkey(i)] for i in range(n_keys)]
        st, r = call(ctl.url, "POST", "/v1/events", {"instance_id": iid, "session": r["session"], "events": events},
                     token="tok-a")
        assert st == 200, r
    return [hexkey(i) for i in range(n_keys)]


def test_a_lookup_builds_no_per_chunk_string_from_the_model_memory():
    """16 instances of the longest model allowed, 1,500 chunks each: one tenant lookup of
    1,500 hashes allocates under 4 MiB at its peak in the memory-index controller (a key
    string per chunk and instance took ~15 MiB with this model, 293 MiB with a 200 KiB one)."""
    with serve("memory", max_keys_per_instance=2000) as ctl:
        hashes = _many_instances_with_long_models(ctl, 16, 1500)
        body = {"chunk_hashes": hashes}
        st, r = call(ctl.url, "POST", "/v1/lookup", body, token="tok-a")  # warm: imports, caches
        assert st == 200 and len(r["results"]) == 16 and r["results"][0]["hit_chunks"] == 1500, r
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            st, r = call(ctl.url, "POST", "/v1/lookup", body, token="tok-a")
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert st == 200 and len(r["results"]) == 16 and r["results"][0]["hit_chunks"] == 1500, r
    print(f"memory index: one lookup of 1500 hashes over 16 instances of a {MAX_MODEL_LEN}-char model: "
          f"peak {peak / MiB:.2f} MiB")
    assert peak < 4 * MiB, f"one lookup allocated {peak / MiB:.1f} MiB"


def _lua_bytes(ix: ValkeyIndex) -> int:
    info = ix.r.info("memory")
    return int(info.get("used_memory_vm_eval", info.get("used_memory_lua", 0)))


def test_a_lookup_builds_no_per_chunk_string_from_the_model_valkey(valkey_url):
    """The same over Valkey: an instance's key hash holds a chunk of its prefix as its
    32-hex hash, under 200 bytes an entry in Valkey's own memory whatever the model (96 on
    Valkey 8.0; a full key per entry took 688 with this model), and the lookup script builds no string
    per chunk from the prefix (it built one per chunk and instance: 443 MB of Lua memory
    with a 200 KiB model); as a guard, one lookup grows Lua memory by under 8 MiB."""
    ix = ValkeyIndex(valkey_url, 5, 300)
    ix.r.flushall()
    try:
        with serve(valkey_url, max_keys_per_instance=2000) as ctl:
            hashes = _many_instances_with_long_models(ctl, 16, 1500)
            per_entry = int(ix.r.memory_usage("lmc:{team-a}:k:long-0", samples=0)) / 1500
            body = {"chunk_hashes": hashes}
            st, r = call(ctl.url, "POST", "/v1/lookup", body, token="tok-a")
            assert st == 200 and len(r["results"]) == 16 and r["results"][0]["hit_chunks"] == 1500, r
            ix.r.script_flush()  # a fresh Lua state: its memory is this lookup's
            before = _lua_bytes(ix)
            st, r = call(ctl.url, "POST", "/v1/lookup", body, token="tok-a")
            grown = _lua_bytes(ix) - before
            assert st == 200 and len(r["results"]) == 16 and r["results"][0]["hit_chunks"] == 1500, r
            st, r = call(ctl.url, "POST", "/v1/lookup", {"keys": [f"lmc1:team-a:x:{SIG}:{h}" for h in hashes[:10]]},
                         token="tok-a")
            assert st == 200 and r["results"] == [], r
    finally:
        ix.close()
    print(f"valkey: one lookup of 1500 hashes over 16 instances of a {MAX_MODEL_LEN}-char model: "
          f"Lua memory +{grown / MiB:.2f} MiB; {per_entry:.0f} bytes per key-hash entry")
    assert per_entry < 200, f"{per_entry:.0f} bytes per entry of an instance's key hash"
    assert grown < 8 * MiB, f"one lookup grew Valkey's Lua memory by {grown / MiB:.1f} MiB"


# ---------------------------------------------------------------- item 6
def test_chunkings_no_live_instance_uses_are_forgotten(index):
    """One instance re-registered 150 times, each time with a new chunk size, an admin
    token lookup after each: the controller keeps state for at most the chunkings of live
    instances (and never more than MAX_CHUNKINGS), not one per chunking ever seen."""
    tokens = list(range(512))
    with serve(index) as ctl:
        for i in range(150):
            st, r = call(ctl.url, "POST", "/v1/register", {"instance_id": "a", **reg("team-a", chunk_size=16 + i)},
                         token="tok-a")
            assert st == 200, r
            st, r = call(ctl.url, "POST", "/v1/lookup", {"tokens": tokens}, token=ADMIN)
            assert st == 200 and r["instances_considered"] == 1, r
        ix = ctl.index
        held = len(ix._processors) + sum(len(v) for v in getattr(ix, "_chunkings", {}).values())
    print(f"{index.split(':')[0]}: 150 chunkings used one after another: {held} per-chunking entries held")
    assert held <= 2 * MAX_CHUNKINGS and sum(len(v) for v in getattr(ix, "_chunkings", {}).values()) <= 1, held


def test_compact_keys_answer_like_full_keys(index):
    """The compact form changes no answer: keys of the instance's prefix, an upper-case
    key (held whole), and keys stored after its signature changed (another prefix) are
    each found by keys, hashes and tokens as before, and never confused (admin calls: a
    tenant's calls refuse upper-case keys)."""
    import numpy as np

    from lmcache.keys import TokenProcessor

    tokens = list(range(64))
    hs = [c.chunk_hash for c in TokenProcessor(16).chunks(np.asarray(tokens, dtype="<i8"))]
    old, new = f"lmc1:team-a:m:{SIG}:", "lmc1:team-a:m:sig2:"
    with serve(index) as ctl:
        st, r = call(ctl.url, "POST", "/v1/register", {"instance_id": "c", **reg("team-a")}, token=ADMIN)
        assert st == 200, r
        sess = r["session"]

        def admit(keys):
            body = {"instance_id": "c", "session": sess, "events": [["admit", "cpu", k] for k in keys]}
            assert call(ctl.url, "POST", "/v1/events", body, token=ADMIN)[0] == 200

        def hit(body) -> int:
            st, r = call(ctl.url, "POST", "/v1/lookup", body, token=ADMIN)
            assert st == 200, r
            return r["results"][0]["hit_chunks"] if r["results"] else 0

        admit([old + h for h in hs[:2]] + [old + hs[2].upper()])
        assert hit({"chunk_hashes": hs}) == 2 and hit({"tokens": tokens}) == 2
        assert hit({"keys": [old + h for h in hs]}) == 2
        assert hit({"keys": [old + hs[0], old + hs[1], old + hs[2].upper()]}) == 3
        assert hit({"keys": [new + hs[0]]}) == 0
        # the signature changes: keys of the new prefix are held whole, found by hashes and tokens
        assert call(ctl.url, "POST", "/v1/heartbeat", {"instance_id": "c", "session": sess, "kv_signature": "sig2"},
                    token=ADMIN)[0] == 200
        assert hit({"chunk_hashes": hs}) == 0
        admit([new + h for h in hs[:3]])
        assert hit({"chunk_hashes": hs}) == 3 and hit({"tokens": tokens}) == 3 and hit({"keys": [new + hs[0]]}) == 1
        assert hit({"keys": [old + h for h in hs[:2]]}) == 2
    print(f"{index.split(':')[0]}: compact keys: same hits by keys, hashes and tokens, across a signature change")


def test_an_id_claim_left_behind_is_taken_over_only_once_stale(valkey_url):
    """Over Valkey, an id's owner key left by a registration that wrote no record (a
    controller that died between the two) blocks other tenants for a grace period only,
    and a registration refused by the tenant cap leaves no claim behind."""
    ix = ValkeyIndex(valkey_url, 5, 300)
    ix.r.flushall()
    try:
        with serve(valkey_url, max_instances_per_tenant=1) as ctl:
            expire = int(ctl.index.expire_after * 1000)
            ix.r.set("lmc:owner:fresh", "team-b", px=expire)  # claimed just now, no record yet
            ix.r.set("lmc:owner:stale", "team-b", px=expire - 60_000)  # claimed 60 s ago, no record
            st, r = call(ctl.url, "POST", "/v1/register", {"instance_id": "fresh", **reg("team-a")}, token="tok-a")
            assert st == 409 and "taken" in r["error"], (st, r)
            st, r = call(ctl.url, "POST", "/v1/register", {"instance_id": "stale", **reg("team-a")}, token="tok-a")
            assert st == 200, r
            assert ix.r.get("lmc:owner:stale") == "team-a"
            # team-a is at its cap (1): a new id is 429 and stays free for team-b
            st, r = call(ctl.url, "POST", "/v1/register", {"instance_id": "next", **reg("team-a")}, token="tok-a")
            assert st == 429, r
            assert ix.r.get("lmc:owner:next") is None
            st, r = call(ctl.url, "POST", "/v1/register", {"instance_id": "next", **reg("team-b")}, token="tok-b")
            assert st == 200, r
    finally:
        ix.close()
    print("valkey: a fresh claim without a record 409, a stale one taken over, a capped registration claims nothing")
