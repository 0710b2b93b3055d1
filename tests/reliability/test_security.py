"""Security (issue 10, item 8): tenant isolation by namespace, tokens on every service
(required when set, compared in constant time), loopback binds by default, and no
unsafe deserialisation or evaluation anywhere in the product code. Each test prints a
one-line summary of what it checked.
"""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from _kv import wave

import lmcache
from lmcache import wire as proto
from lmcache.config import ApiConfig, P2PConfig, load_config
from lmcache.server.controller import ControllerServer
from lmcache.testing.stores.lm import lm_store

from _procs import readline, stop

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ["lmcache", "backends", "plugins", "kernels", "cli", "benchmarks"]
TOKEN = "sec-token"
KV_SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}
HANG = 10.0


def kv_for(tokens):
    t = torch.as_tensor(list(tokens), dtype=torch.float32)
    base = torch.arange(2 * 2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 2, 8)
    return wave(base * 0.01 + t.reshape(1, 1, -1, 1, 1) * 0.37)


def http(url: str, method: str = "GET", body: dict | None = None, token: str | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=HANG) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def lm_talk(port: int, data: bytes) -> list:
    with socket.create_connection(("127.0.0.1", port), timeout=HANG) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        got = bytearray()
        while True:
            try:
                c = s.recv(65536)
            except ConnectionResetError:
                break
            if not c:
                break
            got += c
    return list(proto.iter_frames(bytes(got), 1 << 30))


# ================================================================ tenants
def _engine(ns: str, tier: dict, api: dict | None = None):
    cfg = {"chunk_size": 16, "namespace": ns, "model": "org/shared-model", "tiers": [tier]}
    if api:
        cfg["api"] = api
    return lmcache.CacheEngine.from_config(cfg)


@pytest.fixture(scope="module")
def shared_lm():
    with lm_store(capacity="64MiB") as s:
        yield s


@pytest.fixture
def fresh_lm():
    """An empty shared store of its own, for tests that list everything in it."""
    with lm_store(capacity="64MiB") as s:
        yield s


def test_engines_of_two_namespaces_on_one_store_never_hit_each_other(shared_lm, tmp_path):
    """Two engines (tenants t1, t2) on one shared lm server and one shared disk
    directory: the same prompt stored by t1 is a miss for t2 (and vice versa), and each
    retrieves exactly its own KV."""
    checked = 0
    for tier in ({"backend": "lm", "capacity": "32MiB", **shared_lm.options},
                 {"backend": "disk", "capacity": "32MiB", "path": str(tmp_path / "shared")}):
        a, b = _engine("t1", tier), _engine("t2", tier)
        try:
            toks = list(range(500, 564))
            a.store(toks, kv_for(toks))
            a.flush()
            for t in b.hierarchy.tiers:
                t.refresh()
            assert b.lookup(toks) == 0
            r = b.retrieve(toks)
            assert r.num_tokens == 0
            other = kv_for(toks) * -1
            b.store(toks, other)
            b.flush()
            ra, rb = a.retrieve(toks), b.retrieve(toks)
            assert ra.num_tokens == 64 and torch.equal(ra.kv, kv_for(toks))
            assert rb.num_tokens == 64 and torch.equal(rb.kv, other)
            ka, kb = a.chunk_keys(toks)[1], b.chunk_keys(toks)[1]
            assert ka and all(":t1:" in k for k in ka) and all(":t2:" in k for k in kb) and not set(ka) & set(kb)
            checked += 1
        finally:
            a.close()
            b.close()
    print(f"tenants/engine: {checked} shared stores (lm, disk), 0 cross-namespace hits, each tenant got its own KV")


ADMIN_TOKEN = "sec-admin"
TENANTS = {"t1": "tok-t1", "t2": ["tok-t2", "tok-t2-next"]}


def _ns_of(key: str) -> str:
    return key.split(":")[1]


def test_a_tenant_token_reaches_its_own_namespace_only_through_the_instance_api(fresh_lm):
    """t2's instance API over a store shared with t1 (api.tenants): with t2's token the
    listings, pins, tiers and every change cover t2's entries only; naming a t1 key or
    namespace is 403; engine-wide endpoints need the admin token; the admin token sees
    both; t1's entries survive everything t2 does."""
    tier = {"backend": "lm", "capacity": "32MiB", **fresh_lm.options}
    a = _engine("t1", tier)
    b = _engine("t2", tier, {"enabled": True, "token": ADMIN_TOKEN, "tenants": TENANTS})
    refused = 0
    try:
        t1_toks, t2_toks = list(range(900, 964)), list(range(1900, 1932))
        a.store(t1_toks, kv_for(t1_toks))
        a.flush()
        b.store(t2_toks, kv_for(t2_toks))
        b.flush()
        t1_keys, t2_keys = a.chunk_keys(t1_toks)[1], b.chunk_keys(t2_toks)[1]
        assert len(t1_keys) == 4 and len(t2_keys) == 2
        url = b.api_url

        def keys_seen(token, query=""):
            status, page = http(url + "/v1/keys" + query, token=token)
            assert status == 200, page
            return sorted(e["key"] for e in page["entries"])

        # listings: the admin sees both namespaces, each tenant token its own
        assert keys_seen(ADMIN_TOKEN) == sorted(t1_keys + t2_keys)
        for tok in TENANTS["t2"]:
            assert keys_seen(tok) == sorted(t2_keys)
        assert keys_seen("tok-t1") == sorted(t1_keys)  # t1's token on t2's instance: t1's entries in the shared store
        assert keys_seen("tok-t2", "?namespace=t2") == sorted(t2_keys)
        status, tiers = http(url + "/v1/tiers", token="tok-t2")
        assert status == 200 and tiers[0]["entries"] == 2 and tiers[0]["namespace"] == "t2", tiers
        assert "hits" not in tiers[0] and "capacity" not in tiers[0]

        # everything that names t1 (a key or the namespace) or covers all namespaces: 403
        forbidden = [
            ("GET", "/v1/keys?namespace=t1", None),
            ("GET", "/v1/stats", None),
            ("GET", "/v1/config", None),
            ("GET", "/metrics", None),
            ("POST", "/v1/evict", {"all": True, "namespace": "t1"}),
            ("POST", "/v1/evict", {"keys": [t1_keys[0]]}),
            ("POST", "/v1/evict", {"keys": [t2_keys[0], t1_keys[1]], "dry_run": True}),
            ("POST", "/v1/clear", {"namespace": "t1"}),
            ("POST", "/v1/pin", {"key": t1_keys[0]}),
            ("POST", "/v1/unpin", {"key": t1_keys[0]}),
            ("POST", "/v1/recode", {"tier": "lm", "codec": "zstd", "namespace": "t1"}),
            ("POST", "/v1/recode", {"tier": "lm", "codec": "zstd", "keys": [t1_keys[0]]}),
            ("POST", "/v1/push", {"target": "lm://127.0.0.1:1", "keys": [t1_keys[0]]}),
        ]
        for method, path, body in forbidden:
            status, err = http(url + path, method, body, token="tok-t2")
            assert status == 403 and "namespace" in err["error"] + path, (method, path, status, err)
            refused += 1
        status, _ = http(url + "/v1/health", token="tok-t2")
        assert status == 200

        # what t2 may do acts on t2's entries only
        status, pin = http(url + "/v1/pin", "POST", {"key": t2_keys[0]}, token="tok-t2")
        assert status == 200 and pin["pinned"], pin
        status, pins = http(url + "/v1/pins", token="tok-t2-next")
        assert status == 200 and [p["key"] for p in pins] == [t2_keys[0]]
        status, pins = http(url + "/v1/pins", token="tok-t1")
        assert status == 200 and pins == []
        status, ev = http(url + "/v1/evict", "POST", {"all": True, "dry_run": True}, token="tok-t2")
        assert status == 200 and {_ns_of(v["key"]) for v in ev["evicted"]} == {"t2"}
        status, cl = http(url + "/v1/clear", "POST", {"all": True}, token="tok-t2")
        assert status == 200, cl
        assert sorted(v["key"] for v in cl["evicted"]) == sorted(t2_keys)
        assert keys_seen(ADMIN_TOKEN) == sorted(t1_keys)
        assert b.lookup(t2_toks) == 0
        for t in a.hierarchy.tiers:
            t.refresh()
        r = a.retrieve(t1_toks)
        assert r.num_tokens == 64 and torch.equal(r.kv, kv_for(t1_toks)), "t2's clear touched t1's entries"

        # tokens: none or a wrong one is 401 with tenants configured
        for tok in (None, "", "tok-t", "tok-t2x", ADMIN_TOKEN + "x"):
            assert http(url + "/v1/keys", token=tok)[0] == 401
            refused += 1
    finally:
        a.close()
        b.close()
    print(f"tenants/api: t2's token saw {len(t2_keys)} of {len(t1_keys) + len(t2_keys)} keys, "
          f"{refused} requests refused (403/401), its clear removed t2's {len(t2_keys)} entries and none of t1's")


def test_recode_with_an_empty_or_foreign_key_list_never_reaches_another_tenant(tmp_path):
    """The outside review's bypass: t2's instance API over an fs tier shared with t1;
    ``POST /v1/recode {"keys": []}`` with t2's token re-encoded every entry, t1's too (an
    empty list meant "everything" and the namespace narrowing was dropped beside keys). An
    empty list now selects nothing, for the admin too; a tenant's selection, keys or not,
    stays in its namespace; t1's entries come back bit-exact."""
    tier = {"backend": "fs", "url": f"file://{tmp_path / 'shared'}", "capacity": "64MiB"}
    a = _engine("t1", tier)
    b = _engine("t2", tier, {"enabled": True, "token": ADMIN_TOKEN, "tenants": TENANTS})
    try:
        t1_toks, t2_toks = list(range(700, 764)), list(range(1700, 1732))
        a.store(t1_toks, kv_for(t1_toks))
        b.store(t2_toks, kv_for(t2_toks))
        a.flush()
        b.flush()
        t2_keys = b.chunk_keys(t2_toks)[1]
        url = b.api_url
        for body, token in (({"keys": []}, "tok-t2"), ({"keys": [], "dry_run": True}, "tok-t2"),
                            ({"keys": []}, ADMIN_TOKEN)):
            status, got = http(url + "/v1/recode", "POST", {"tier": "fs", "codec": "int4", **body}, token=token)
            assert status == 200 and got["recoded"] == [], (body, got)
        # a tenant's own keys: exactly those; no keys: its namespace only
        status, got = http(url + "/v1/recode", "POST", {"tier": "fs", "codec": "zstd", "keys": t2_keys[:1]}, token="tok-t2")
        assert status == 200 and [r["key"] for r in got["recoded"]] == t2_keys[:1], got
        status, got = http(url + "/v1/recode", "POST", {"tier": "fs", "codec": "zstd", "dry_run": True}, token="tok-t2")
        assert status == 200 and {_ns_of(r["key"]) for r in got["recoded"]} == {"t2"}, got
        for t in a.hierarchy.tiers:
            t.refresh()
        r = a.retrieve(t1_toks)
        assert r.num_tokens == 64 and torch.equal(r.kv, kv_for(t1_toks)), "t2 re-encoded t1's entries"
    finally:
        b.close()
        a.close()


def test_a_tenant_token_reaches_its_own_namespace_only_through_the_controller(fresh_lm):
    """A controller with tenant tokens and two engines whose workers use them (t1 and
    t2, on one shared lm store): instances, health, lookups and commands with t2's token
    cover t2's instance only; t1's instance is unknown to it; a t2 worker cannot
    register as t1 or take t1's instance id, and its events about t1's keys are ignored;
    a clear dispatched with t2's token leaves t1's entries in the shared store."""
    tier = {"backend": "lm", "capacity": "32MiB", **fresh_lm.options}
    tenants = {"t1": ("tok-t1",), "t2": ("tok-t2",)}
    refused = 0
    with ControllerServer("127.0.0.1", 0, token=ADMIN_TOKEN, tenants=tenants, instance_timeout=5) as ctl:
        def eng(ns):
            return lmcache.CacheEngine.from_config({
                "chunk_size": 16, "namespace": ns, "model": "org/shared-model", "kv_spec": KV_SPEC, "tiers": [tier],
                "api": {"enabled": True, "token": ADMIN_TOKEN},
                "controller": {"url": ctl.url, "token": f"tok-{ns}", "instance_id": f"{ns}-inst",
                               "heartbeat_interval": 0.1, "timeout": 2.0},
            })

        a, b = eng("t1"), eng("t2")
        try:
            toks = list(range(3000, 3064))
            a.store(toks, kv_for(toks))
            b.store(toks[:32], kv_for(toks[:32]))
            a.flush()
            b.flush()
            t1_keys = a.chunk_keys(toks)[1]

            def indexed():
                status, inst = http(ctl.url + "/v1/instances", token=ADMIN_TOKEN)
                return {i["instance_id"]: i["keys"] for i in inst} == {"t1-inst": 4, "t2-inst": 2} or None

            deadline = time.monotonic() + HANG
            while not indexed():
                assert time.monotonic() < deadline, http(ctl.url + "/v1/instances", token=ADMIN_TOKEN)
                time.sleep(0.05)

            status, inst = http(ctl.url + "/v1/instances", token="tok-t2")
            assert status == 200 and [i["instance_id"] for i in inst] == ["t2-inst"]
            status, health = http(ctl.url + "/v1/health", token="tok-t2")
            assert status == 200 and health["instances"] == 1
            status, res = http(ctl.url + "/v1/lookup", "POST", {"tokens": toks}, token="tok-t2")
            assert status == 200 and [r["instance_id"] for r in res["results"]] == ["t2-inst"], res
            assert res["results"][0]["hit_tokens"] == 32 and res["instances_considered"] == 1
            status, res = http(ctl.url + "/v1/lookup", "POST", {"tokens": toks}, token=ADMIN_TOKEN)
            assert [r["instance_id"] for r in res["results"]] == ["t1-inst", "t2-inst"]

            forbidden = [
                ("/v1/lookup", {"tokens": toks, "namespace": "t1"}, 403),
                ("/v1/lookup", {"keys": t1_keys}, 403),
                ("/v1/clear", {"instance": "t1-inst"}, 404),
                ("/v1/pin", {"instance": "t1-inst", "tokens": toks}, 404),
                ("/v1/compress", {"instance": "t1-inst", "tier": "lm", "codec": "zstd"}, 404),
                ("/v1/clear", {"instance": "t2-inst", "keys": [t1_keys[0]]}, 403),
                ("/v1/move", {"src_instance": "t1-inst", "src_tier": "lm", "dst_instance": "t2-inst",
                              "dst_tier": "lm", "tokens": toks}, 404),
                ("/v1/register", {"instance_id": "t2-as-t1", "namespace": "t1", "model": "m", "chunk_size": 16,
                                  "tiers": ["lm"]}, 403),
                ("/v1/register", {"instance_id": "t1-inst", "namespace": "t2", "model": "m", "chunk_size": 16,
                                  "tiers": ["lm"]}, 409),
                ("/v1/heartbeat", {"instance_id": "t1-inst", "session": "0" * 16}, 404),
            ]
            for path, body, want in forbidden:
                status, err = http(ctl.url + path, "POST", body, token="tok-t2")
                assert status == want, (path, status, err)
                refused += 1
            # a t2 worker's events about t1's keys are ignored
            status, reg = http(ctl.url + "/v1/register", "POST", {
                "instance_id": "t2-extra", "namespace": "t2", "model": "org/shared-model", "chunk_size": 16,
                "tiers": ["lm"]}, token="tok-t2")
            assert status == 200
            status, ev = http(ctl.url + "/v1/events", "POST", {
                "instance_id": "t2-extra", "session": reg["session"], "events": [["admit", "lm", k] for k in t1_keys]},
                token="tok-t2")
            assert status == 200 and ev == {"applied": 0, "ignored": 4}, ev

            # a compress whose selection is empty (tokens of no whole chunk, keys: []) re-encodes
            # nothing, for a tenant and for the admin; without a selection, t2's entries only
            for body, tok in (({"tokens": toks[:5]}, "tok-t2"), ({"keys": []}, "tok-t2"), ({"keys": []}, ADMIN_TOKEN)):
                status, res = http(ctl.url + "/v1/compress", "POST",
                                   {"instance": "t2-inst", "tier": "lm", "codec": "zstd", **body}, token=tok)
                assert status == 200 and res["result"]["recoded"] == [], (body, res)
            status, res = http(ctl.url + "/v1/compress", "POST", {"instance": "t2-inst", "tier": "lm", "codec": "zstd"},
                               token="tok-t2")
            assert status == 200 and {_ns_of(r["key"]) for r in res["result"]["recoded"]} == {"t2"}, res
            status, res = http(ctl.url + "/v1/decompress", "POST", {"instance": "t2-inst", "tier": "lm"}, token="tok-t2")
            assert status == 200 and len(res["result"]["recoded"]) == 2, res

            # a clear with t2's token, dispatched to t2's instance over the shared store: t2's entries only
            status, cl = http(ctl.url + "/v1/clear", "POST", {"instance": "t2-inst", "all": True}, token="tok-t2")
            assert status == 200, cl
            assert len(cl["result"]["evicted"]) == 2
            assert all(_ns_of(v["key"]) == "t2" for v in cl["result"]["evicted"])
            for t in a.hierarchy.tiers:
                t.refresh()
            r = a.retrieve(toks)
            assert r.num_tokens == 64 and torch.equal(r.kv, kv_for(toks))
            for tok in (None, "tok-t3", "tok-t2 "):
                assert http(ctl.url + "/v1/instances", token=tok)[0] == (200 if tok == "tok-t2 " else 401)
        finally:
            a.close()
            b.close()
    print(f"tenants/controller: t2's token saw 1 of 2 instances, {refused} requests refused (403/404/409), "
          "4 foreign events ignored, its clear kept t1's 4 entries")


def test_a_tenant_token_through_the_cli(fresh_lm, tmp_path):
    """`lmcache ls`/`evict` with a tenant's token list and evict that tenant's entries
    only; `lmcache controller serve --tenants-file` scopes `controller instances`."""
    tier = {"backend": "lm", "capacity": "32MiB", **fresh_lm.options}
    a = _engine("t1", tier)
    b = _engine("t2", tier, {"enabled": True, "token": ADMIN_TOKEN, "tenants": TENANTS})
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}

    def cli(*args, token):
        p = subprocess.run([sys.executable, "-m", "lmcache.cli.main", *args], capture_output=True, text=True,
                           env={**env, "LMCACHE_API_TOKEN": token, "LMCACHE_CONTROLLER_TOKEN": token}, timeout=60)
        return p

    try:
        toks = list(range(4000, 4032))
        a.store(toks, kv_for(toks))
        b.store(toks, kv_for(toks))
        a.flush()
        b.flush()
        p = cli("ls", "--url", b.api_url, "--json", token="tok-t2")
        assert p.returncode == 0, p.stderr
        assert {_ns_of(r["key"]) for r in json.loads(p.stdout)} == {"t2"}
        p = cli("evict", "--url", b.api_url, "--namespace", "t1", "--all", "--yes", token="tok-t2")
        assert p.returncode != 0 and "t2" in p.stderr, (p.stdout, p.stderr)
        p = cli("evict", "--url", b.api_url, "--all", "--yes", "--json", token="tok-t2")
        assert p.returncode == 0, p.stderr
        assert {_ns_of(r["key"]) for r in json.loads(p.stdout)["evicted"]} == {"t2"}
        p = cli("ls", "--url", b.api_url, "--json", token=ADMIN_TOKEN)
        assert {_ns_of(r["key"]) for r in json.loads(p.stdout)} == {"t1"}
    finally:
        a.close()
        b.close()

    tf = tmp_path / "tenants.yaml"
    tf.write_text("t1: tok-t1\nt2: [tok-t2]\n")
    ctl = subprocess.Popen([sys.executable, "-m", "lmcache.cli.main", "controller", "serve", "--port", "0",
                            "--tenants-file", str(tf)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True, env={**env, "LMCACHE_CONTROLLER_TOKEN": ADMIN_TOKEN})
    try:
        url = readline(ctl)
        for ns in ("t1", "t2"):
            status, _ = http(url + "/v1/register", "POST", {"instance_id": f"{ns}-i", "namespace": ns, "model": "m",
                                                             "chunk_size": 16, "tiers": ["cpu"]}, token=f"tok-{ns}")
            assert status == 200
        p = cli("controller", "instances", "--url", url, "--json", token="tok-t1")
        assert p.returncode == 0, p.stderr
        assert [i["instance_id"] for i in json.loads(p.stdout)] == ["t1-i"]
        p = cli("controller", "instances", "--url", url, "--json", token="nope")
        assert p.returncode != 0 and "token" in p.stderr
    finally:
        stop(ctl)
    bad = tmp_path / "bad.yaml"
    bad.write_text("t1: tok-x\nt2: tok-x\n")
    p = cli("controller", "serve", "--port", "0", "--tenants-file", str(bad), token=ADMIN_TOKEN)
    assert p.returncode != 0 and "each token serves one tenant" in p.stderr
    print("tenants/cli: ls and evict with t2's token covered t2's entries only; controller instances with t1's token "
          "listed t1's instance only; a token given to two tenants refused at start")


def test_tenant_config_is_checked_and_masked():
    """api.tenants: a mapping of namespace to token(s); errors name the key; a token
    serves one tenant and is never the admin token; `lmcache config` masks them."""
    cases = [
        ({"tenants": ["a"]}, "api.tenants"),
        ({"tenants": {"bad ns": "x"}}, "api.tenants"),
        ({"tenants": {"t1": ""}}, "api.tenants.t1"),
        ({"tenants": {"t1": []}}, "api.tenants.t1"),
        ({"tenants": {"t1": " x"}}, "api.tenants.t1"),
        ({"tenants": {"t1": "x", "t2": ["y", "x"]}}, "api.tenants.t2"),
        ({"token": "adm", "tenants": {"t1": "adm"}}, "api.tenants.t1"),
    ]
    for api, key in cases:
        with pytest.raises(lmcache.ConfigError) as ei:
            load_config({"api": api}, environ={})
        assert ei.value.key == key, (api, ei.value)
    cfg = load_config({"api": {"enabled": True, "token": "adm", "tenants": {"t1": "x", "t2": ["y", "z"]}}}, environ={})
    assert cfg.api.tenants == {"t1": ("x",), "t2": ("y", "z")}
    masked = cfg.to_dict(mask_secrets=True)["api"]
    assert masked["tenants"] == {"t1": ["***"], "t2": ["***", "***"]} and masked["token"] == "***"
    with pytest.raises(lmcache.ConfigError) as ei:  # the admin token set later (e.g. from the environment)
        load_config({"api": {"tenants": {"t1": "adm"}}}, environ={"LMCACHE_API_TOKEN": "adm"})
    assert ei.value.key == "api.tenants.t1"
    print(f"tenants/config: {len(cases) + 1} bad tenant configs refused naming the key; tokens masked")


# ================================================================ tokens
def test_tokens_are_required_on_every_service(shared_lm, tmp_path):
    """Instance API and controller: 401 without or with a wrong token; lm server and
    the p2p peer endpoint: FATAL and closed unless the connection starts with AUTH (the
    handshake; the lm server also takes the token itself)."""
    n = 0
    e = lmcache.CacheEngine.from_config({
        "chunk_size": 16, "kv_spec": KV_SPEC, "tiers": [{"backend": "cpu", "capacity": "4MiB"}],
        "api": {"enabled": True, "token": TOKEN}, "p2p": {"enabled": True, "token": TOKEN, "port": 0},
    })
    ctl = ControllerServer("127.0.0.1", 0, token=TOKEN)
    try:
        for base, paths in ((e.api_url, ["/v1/health", "/v1/keys", "/v1/tiers", "/v1/stats", "/v1/config"]),
                            (ctl.url, ["/v1/health", "/v1/instances", "/openapi.json"])):
            for p in paths:
                for tok in (None, "", "wrong", TOKEN + "x", TOKEN[:-1]):
                    status, body = http(base + p, token=tok)
                    assert status == 401 and "token" in body["error"], (base, p, tok, status)
                    n += 1
                assert http(base + p, token=TOKEN)[0] == 200
            status, _ = http(base + "/v1/clear", "POST", {}, token="wrong")
            assert status == 401
            n += 1
        # the binary protocol: lm server and p2p endpoint
        with lm_store(capacity="8MiB", token=TOKEN) as s:
            ports = [("lm server", s.servers[0].port), ("p2p", e.p2p.endpoint.server.address[1])]
            for name, port in ports:
                for first in (proto.encode(proto.GET, 1, b"k"), proto.encode(proto.AUTH, 1, b"", b"wrong"),
                              proto.encode(proto.AUTH, 1, b"", TOKEN.encode() + b"x"), proto.encode(proto.HEALTH, 1)):
                    fr = lm_talk(port, first + proto.encode(proto.HEALTH, 2))
                    assert len(fr) == 1 and fr[0][0].status == proto.FATAL, (name, first, fr)
                    n += 1
                # the token in clear: lmcache server accepts it from clients older than the
                # handshake; a peer endpoint only takes the mutual handshake (test_security_p2p.py)
                fr = lm_talk(port, proto.encode(proto.AUTH, 1, b"", TOKEN.encode()) + proto.encode(proto.HEALTH, 2))
                want = [proto.OK, proto.OK] if name == "lm server" else [proto.FATAL]
                assert [f.status for f, _, _ in fr] == want, name
    finally:
        ctl.close()
        e.close()
    print(f"tokens: {n} unauthenticated/wrong-token requests refused (instance API, controller, lm server, p2p)")


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _product_files():
    for d in PRODUCT:
        yield from sorted((ROOT / d).rglob("*.py"))


def test_every_token_comparison_is_constant_time():
    """No ``==``/``!=`` on a token, secret or password anywhere in the product code;
    ``hmac.compare_digest`` is used where they are checked."""
    secretish = ("token", "secret", "password", "session")
    bad, digests = [], 0
    for f in _product_files():
        tree = ast.parse(f.read_text(), str(f))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                for side in [node.left, *node.comparators]:
                    called = {id(c.func) for c in _calls(side)}  # a function named *token* is not a secret
                    names = {n.id for n in ast.walk(side) if isinstance(n, ast.Name) and id(n) not in called} | \
                            {n.attr for n in ast.walk(side) if isinstance(n, ast.Attribute) and id(n) not in called}
                    # a secret is a value named like one; token *ids* and counts are not secrets
                    hit = [x for x in names if any(s in x.lower() for s in secretish)
                           and not any(w in x.lower() for w in ("tokens", "tokenizer", "token_id", "num_", "_len"))]
                    if hit and not any(isinstance(c, ast.Constant) and c.value is None for c in node.comparators):
                        bad.append(f"{f.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
        digests += sum(1 for c in _calls(tree) if ast.unparse(c.func).endswith("compare_digest"))
    assert not bad, "secrets compared with ==/!=:\n" + "\n".join(bad)
    assert digests >= 4  # instance API, controller (token and session), lm server
    print(f"constant time: {sum(1 for _ in _product_files())} files parsed, {digests} compare_digest calls, 0 ==/!= on secrets")


# ================================================================ loopback
def test_every_service_binds_loopback_by_default(tmp_path):
    import inspect

    from cli import controller_cmd, server_cmd
    from lmcache.server.cache import CacheServer

    assert ApiConfig().host == "127.0.0.1" and P2PConfig().host == "127.0.0.1"
    assert load_config({}, environ={}).api.host == "127.0.0.1"
    assert inspect.signature(CacheServer).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(ControllerServer).parameters["host"].default == "127.0.0.1"
    assert "127.0.0.1" in inspect.getsource(server_cmd) and "127.0.0.1" in inspect.getsource(controller_cmd)
    # started services: the socket's own address
    e = lmcache.CacheEngine.from_config({"chunk_size": 16, "kv_spec": KV_SPEC,
                                         "tiers": [{"backend": "cpu", "capacity": "4MiB"}],
                                         "api": {"enabled": True}, "p2p": {"enabled": True, "port": 0}})
    ctl = ControllerServer(port=0)
    srv = CacheServer(port=0).bind()
    try:
        addrs = {"api": e.api.server.server_address[0], "p2p": e.p2p.endpoint.server.address[0],
                 "controller": ctl.server.server_address[0], "lm server": srv.address[0]}
    finally:
        srv._sock.close()
        ctl.close()
        e.close()
    assert set(addrs.values()) == {"127.0.0.1"}, addrs
    print(f"loopback: defaults and started sockets all 127.0.0.1: {addrs}")


# ================================================================ static checks
BANNED_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle", "joblib"}


def test_no_pickle_eval_exec_or_unsafe_yaml_in_product_code():
    bad: list[str] = []
    n = 0
    for f in _product_files():
        n += 1
        tree = ast.parse(f.read_text(), str(f))
        rel = f.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bad += [f"{rel}:{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES:
                bad.append(f"{rel}:{node.lineno}: from {node.module} import")
            elif isinstance(node, ast.Call):
                fn = ast.unparse(node.func)
                if fn in ("eval", "exec", "compile", "__import__") or fn.endswith(".loads") and fn.split(".")[0] in BANNED_MODULES:
                    bad.append(f"{rel}:{node.lineno}: {fn}(...)")
                if fn in ("torch.load",) and not any(k.arg == "weights_only" and getattr(k.value, "value", None) is True
                                                     for k in node.keywords):
                    bad.append(f"{rel}:{node.lineno}: torch.load without weights_only=True")
                if fn.endswith("yaml.load") or fn.endswith("yaml.load_all") or fn in ("load_all",):
                    loader = [k for k in node.keywords if k.arg == "Loader"] or node.args[1:2]
                    if not loader or "Safe" not in ast.unparse(loader[0] if isinstance(loader[0], ast.AST) else loader[0].value):
                        bad.append(f"{rel}:{node.lineno}: {fn} without a SafeLoader")
                if fn.endswith("yaml.unsafe_load") or fn.endswith("yaml.full_load"):
                    bad.append(f"{rel}:{node.lineno}: {fn}")
    assert not bad, "\n".join(bad)
    print(f"static: {n} product files parsed, no pickle/marshal/shelve, eval/exec, unsafe yaml or torch.load")
