"""Security (issue 10, item 8): tenant isolation by namespace, tokens on every service
(required when set, compared in constant time), loopback binds by default, and no
unsafe deserialisation or evaluation anywhere in the product code. Each test prints a
one-line summary of what it checked.
"""

from __future__ import annotations

import ast
import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

import lmcache
from lmcache import server as proto
from lmcache.config import ApiConfig, P2PConfig, load_config
from lmcache.controller.service import ControllerServer
from lmcache.loopback.lm import lm_store

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ["lmcache", "backends", "plugins", "kernels", "cli"]
TOKEN = "sec-token"
KV_SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}
HANG = 10.0


def kv_for(tokens):
    t = torch.as_tensor(list(tokens), dtype=torch.float32)
    base = torch.arange(2 * 2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 2, 8)
    return torch.sin(base * 0.01 + t.reshape(1, 1, -1, 1, 1) * 0.37)


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


@pytest.mark.xfail(strict=True, reason=(
    "no tenant scoping on the instance API: one api.token per instance, and Admin.keys/evict/clear "
    "(lmcache/admin.py) list and evict every namespace in a shared tier; a tenant-scoped token "
    "(e.g. api.tenants: {token: namespace}) is not implemented"))
def test_a_tenant_cannot_list_or_evict_another_namespace_through_the_instance_api(shared_lm):
    """t2's instance API over a store shared with t1: what t2's operator can see and
    evict through its API must be t2's entries only."""
    tier = {"backend": "lm", "capacity": "32MiB", **shared_lm.options}
    a = _engine("t1", tier)
    b = _engine("t2", tier, {"enabled": True, "token": TOKEN})
    try:
        toks = list(range(900, 932))
        a.store(toks, kv_for(toks))
        a.flush()
        status, page = http(b.api_url + "/v1/keys", token=TOKEN)
        assert status == 200
        seen = [e["key"] for e in page["entries"]]
        print(f"tenants/api: t2's API lists {len(seen)} keys, {sum(':t1:' in k for k in seen)} of them t1's")
        assert not any(":t1:" in k for k in seen), "t2's API lists t1's entries"
        status, ev = http(b.api_url + "/v1/evict", "POST", {"all": True, "namespace": "t1"}, token=TOKEN)
        assert status in (403, 404) or not ev.get("evicted"), "t2's API evicts t1's entries"
    finally:
        a.close()
        b.close()


@pytest.mark.xfail(strict=True, reason=(
    "no tenant scoping on the controller: one controller.token; /v1/lookup with keys or tokens and "
    "/v1/instances answer across namespaces for any holder of it (lmcache/controller/service.py)"))
def test_a_tenant_cannot_look_up_another_namespace_through_the_controller():
    with ControllerServer("127.0.0.1", 0, token=TOKEN) as ctl:
        status, reg = http(ctl.url + "/v1/register", "POST", {
            "instance_id": "t1-inst", "api_url": "http://127.0.0.1:1", "namespace": "t1", "model": "m",
            "chunk_size": 16, "tiers": [],
        }, token=TOKEN)
        assert status == 200, reg
        status, inst = http(ctl.url + "/v1/instances", token=TOKEN)
        # a tenant t2 credential distinct from the admin token does not exist: the only token sees t1
        assert status == 200 and not any(i.get("namespace") == "t1" for i in inst)


# ================================================================ tokens
def test_tokens_are_required_on_every_service(shared_lm, tmp_path):
    """Instance API and controller: 401 without or with a wrong token; lm server and
    the p2p peer endpoint: FATAL and closed unless the first frame is AUTH with it."""
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
                fr = lm_talk(port, proto.encode(proto.AUTH, 1, b"", TOKEN.encode()) + proto.encode(proto.HEALTH, 2))
                assert [f.status for f, _, _ in fr] == [proto.OK, proto.OK], name
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
    from lmcache.server import CacheServer

    assert ApiConfig().host == "127.0.0.1" and P2PConfig().host == "127.0.0.1"
    assert load_config({}, environ={}).api.host == "127.0.0.1"
    assert inspect.signature(CacheServer).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(ControllerServer).parameters["host"].default == "127.0.0.1"
    assert "127.0.0.1" in inspect.getsource(server_cmd) and "127.0.0.1" in inspect.getsource(controller_cmd)
    src = (ROOT / "lmcache" / "server.py").read_text()
    assert 'add_argument("--host", default="127.0.0.1")' in src
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
