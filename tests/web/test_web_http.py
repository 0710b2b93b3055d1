"""The operator page over plain HTTP (issue 33): both servers serve the same files with a
strict policy, nothing else under /static, state changes need a JSON body, and the JSON
endpoints the page uses keep each tenant to its own namespace. Real servers on loopback:
an in-process controller and two engines (namespaces team-a and team-b) with their
instance APIs and controller workers. The page in a real browser: test_web_browser.py."""

from __future__ import annotations

import http.client
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
from _kv import wave
from _procs import until

import lmcache
from lmcache import web
from lmcache.server.controller import ControllerServer

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "admin-secret"
API_TOKEN = "api-secret"
TENANTS = {"team-a": ("tok-a",), "team-b": ("tok-b",)}
PROMPT = list(range(100, 164))  # 4 chunks of 16


def kv_for(tokens: list[int]) -> torch.Tensor:
    t = torch.as_tensor(list(tokens), dtype=torch.float32)
    base = torch.arange(2 * 2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 2, 8)
    return wave(base * 0.01 + t.reshape(1, 1, -1, 1, 1) * 0.37)


def request(url: str, method: str, path: str, body: Any = None, token: str | None = ADMIN,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request with http.client, which sends the path as given (no normalizing)."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    h = {}
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        h["Content-Type"] = "application/json"
    if token:
        h["Authorization"] = f"Bearer {token}"
    h.update(headers or {})
    try:
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def call(url: str, method: str, path: str, body: Any = None, token: str | None = ADMIN) -> tuple[int, Any]:
    status, _, raw = request(url, method, path, body, token)
    return status, json.loads(raw)


class Cluster:
    def __init__(self, tmp: Path):
        self.ctl = ControllerServer(port=0, token=ADMIN, tenants=TENANTS, instance_timeout=5.0)
        self.engines: dict[str, lmcache.CacheEngine] = {}
        try:
            for iid, ns in (("eng-a", "team-a"), ("eng-b", "team-b")):
                cfg = {
                    "chunk_size": 16, "namespace": ns, "model": "org/synthetic",
                    "kv_spec": {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"},
                    "tiers": [{"backend": "cpu", "capacity": "1MiB"},
                              {"backend": "disk", "path": str(tmp / iid), "capacity": "4MiB"}],
                    "api": {"enabled": True, "token": API_TOKEN, "timeout": 5},
                    "controller": {"url": self.ctl.url, "token": ADMIN, "instance_id": iid,
                                   "heartbeat_interval": 0.1, "timeout": 2.0},
                }
                e = self.engines[iid] = lmcache.CacheEngine.from_config(cfg)
                e.store(PROMPT, kv_for(PROMPT))
                e.flush()
            # a toy tokenizer (a character is a token id) stands for a connector's: /v1/tokenize and text lookups
            self.engines["eng-a"].tokenize = lambda text: [100 + ord(c) - ord("a") for c in text]
        except BaseException:
            self.close()
            raise

    def api(self, iid: str) -> str:
        return self.engines[iid].api_url

    def close(self) -> None:
        for e in self.engines.values():
            e.close()
        self.ctl.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("web"))
    try:
        def indexed() -> bool:
            # tier stats come with heartbeats, the keys with events: a stat from before the
            # stores can still be the last one reported when the keys are in
            insts = call(c.ctl.url, "GET", "/v1/instances")[1]
            return len(insts) == 2 and all(
                i["keys"] == 4 and set(i["tier_stats"]) == {"cpu", "disk"}
                and all(st["entries"] == 4 for st in i["tier_stats"].values()) for i in insts)
        until(indexed, "both instances registered with their keys and tier stats after the stores")
        yield c
    finally:
        c.close()


def servers(c: Cluster) -> list[tuple[str, str]]:
    return [("controller", c.ctl.url), ("instance API", c.api("eng-a"))]


# ---------------------------------------------------------------- the page and its files
@pytest.mark.parametrize("which", [0, 1], ids=["controller", "instance-api"])
def test_page_and_static_files_are_served_with_the_policy_and_no_token(cluster, which):
    _, url = servers(cluster)[which]
    for path, name, ctype in (("/", "index.html", "text/html"), ("/static/app.js", "app.js", "text/javascript"),
                              ("/static/app.css", "app.css", "text/css")):
        status, h, body = request(url, "GET", path, token=None)  # public: the page holds no data
        assert status == 200, (path, status, body[:200])
        assert body == (ROOT / "lmcache" / "web" / name).read_bytes()
        assert h["content-type"].startswith(ctype), (path, h["content-type"])
        assert h["content-security-policy"] == web.CSP
        assert "frame-ancestors 'none'" in h["content-security-policy"] and "'unsafe-inline'" not in h["content-security-policy"]
        assert h["x-content-type-options"] == "nosniff"
        assert h["referrer-policy"] == "no-referrer"
        assert h["cache-control"] == "no-store"
    # the data behind it is not public
    assert request(url, "GET", "/v1/tiers" if which else "/v1/instances", token=None)[0] == 401


@pytest.mark.parametrize("which", [0, 1], ids=["controller", "instance-api"])
def test_nothing_but_the_page_files_under_static(cluster, which):
    _, url = servers(cluster)[which]
    for path in ("/static/../lmcache/auth.py", "/static/..%2f..%2fpyproject.toml", "/static/%2e%2e/%2e%2e/pyproject.toml",
                 "/static/app.js/../../pyproject.toml", "/static/index.html", "/static/__init__.py",
                 "/static/./app.js", "/static//etc/passwd", "/static/app.js%00.css", "/static/APP.JS"):
        status, h, body = request(url, "GET", path, token=None)
        assert status in (400, 404), (path, status, body[:200])
        assert b"import" not in body and b"[project]" not in body and b"root:" not in body, path
    assert request(url, "POST", "/static/app.js", {}, token=ADMIN)[0] == 405
    assert request(url, "POST", "/", {}, token=ADMIN)[0] == 405


def test_the_page_has_no_inline_code_and_inserts_no_html():
    html = (ROOT / "lmcache" / "web" / "index.html").read_text()
    assert re.findall(r"<script\b[^>]*>", html) == ['<script src="/static/app.js" defer>']
    assert "<style" not in html and not re.search(r"\sstyle\s*=", html) and not re.search(r"\son[a-z]+\s*=", html)
    assert not re.search(r"https?://", html), "no CDN, no outside address"
    js = (ROOT / "lmcache" / "web" / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                 "localStorage", "?token", "&token"):
        assert sink not in js, sink
    assert "sessionStorage" in js and '"Authorization"' in js


def test_the_page_files_are_package_data():
    """A non-editable install (the wheel, the container image) ships the page."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "lmcache.web" in cfg["packages"]
    shipped = set(cfg["package-data"]["lmcache.web"])
    on_disk = {p.name for p in (ROOT / "lmcache" / "web").iterdir() if p.suffix in (".html", ".js", ".css")}
    assert on_disk <= shipped and set(web.FILES[p][0] for p in web.FILES) <= shipped


# ---------------------------------------------------------------- state changes need a JSON body
@pytest.mark.parametrize("which", [0, 1], ids=["controller", "instance-api"])
def test_a_form_or_text_post_is_refused_and_changes_nothing(cluster, which):
    _, url = servers(cluster)[which]
    token = ADMIN if which == 0 else API_TOKEN
    body = {"instance": "eng-a", "tier": "cpu"} if which == 0 else {"tier": "cpu"}
    raw = json.dumps(body).encode()
    for ctype in ("application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "text/plain", None):
        hs = {"Content-Type": ctype} if ctype else {}
        conn_body = raw
        status, _, reply = _post_raw(url, "/v1/clear", conn_body, token, hs)
        assert status == 415, (ctype, status, reply[:200])
        assert b"application/json" in reply
    # nothing was cleared
    assert call(cluster.api("eng-a"), "GET", "/v1/keys?tier=cpu", token=API_TOKEN)[1]["total"] == 4
    # a JSON body with a charset is fine (a dry run changes nothing)
    status, _, reply = _post_raw(cluster.api("eng-a"), "/v1/evict", b'{"tier": "cpu", "all": true, "dry_run": true}',
                                 API_TOKEN, {"Content-Type": "application/json; charset=utf-8"})
    assert status == 200, reply


def _post_raw(url: str, path: str, body: bytes, token: str, headers: dict[str, str]) -> tuple[int, dict, bytes]:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest("POST", path, skip_accept_encoding=True)
        for k, v in {"Authorization": f"Bearer {token}", "Content-Length": str(len(body)), **headers}.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


# ---------------------------------------------------------------- what the page reads
def test_instances_carry_tier_stats_that_match_the_instance(cluster):
    insts = {i["instance_id"]: i for i in call(cluster.ctl.url, "GET", "/v1/instances")[1]}
    for iid in ("eng-a", "eng-b"):
        own = {t["name"]: t for t in call(cluster.api(iid), "GET", "/v1/tiers", token=API_TOKEN)[1]}
        stats = insts[iid]["tier_stats"]
        assert set(stats) == {"cpu", "disk"}
        for tier, st in stats.items():
            assert st["entries"] == own[tier]["entries"] == 4
            assert st["capacity_bytes"] == own[tier]["capacity_bytes"]
            assert st["used_bytes"] == own[tier]["used_bytes"] > 0
            assert st["retry_in_s"] == 0 and st["available"] is True
            assert set(st) >= {"hit_rate", "evictions", "errors", "refused_writes", "write_refused"}
    assert call(cluster.ctl.url, "GET", "/v1/health")[1]["service"] == "controller"
    h = call(cluster.api("eng-a"), "GET", "/v1/health", token=API_TOKEN)[1]
    assert (h["service"], h["instance_id"], h["model"], h["namespace"]) == ("instance", "eng-a", "org/synthetic", "team-a")


def test_a_tenant_sees_and_acts_on_its_own_instances_only(cluster):
    url = cluster.ctl.url
    insts = call(url, "GET", "/v1/instances", token="tok-a")[1]
    assert [i["instance_id"] for i in insts] == ["eng-a"] and insts[0]["tier_stats"]["cpu"]["entries"] == 4
    assert call(url, "GET", "/v1/health", token="tok-a")[1]["instances"] == 1
    # entries: its own instance's, through the controller
    status, page = call(url, "GET", "/v1/entries?instance=eng-a&tier=cpu", token="tok-a")
    assert status == 200 and page["total"] == 4 and all(":team-a:" in e["key"] for e in page["entries"])
    for path in ("/v1/entries?instance=eng-b&tier=cpu", "/v1/entries?instance=eng-b"):
        status, err = call(url, "GET", path, token="tok-a")
        assert status == 404 and "unknown instance" in err["error"], (status, err)
    # lookups show its own instance only, though eng-b holds the same tokens
    r = call(url, "POST", "/v1/lookup", {"tokens": PROMPT}, token="tok-a")[1]
    assert [x["instance_id"] for x in r["results"]] == ["eng-a"]
    assert sorted(x["instance_id"] for x in call(url, "POST", "/v1/lookup", {"tokens": PROMPT})[1]["results"]) == ["eng-a", "eng-b"]
    # another tenant's instance and keys cannot be acted on
    b_key = call(url, "GET", "/v1/entries?instance=eng-b&tier=cpu")[1]["entries"][0]["key"]
    assert call(url, "POST", "/v1/clear", {"instance": "eng-b", "tier": "cpu"}, token="tok-a")[0] == 404
    assert call(url, "POST", "/v1/pin", {"instance": "eng-a", "keys": [b_key]}, token="tok-a")[0] == 403
    assert call(url, "GET", "/v1/entries?instance=eng-b&tier=cpu", token="tok-b")[1]["total"] == 4
    # bad queries name the parameter
    status, err = call(url, "GET", "/v1/entries?instance=eng-a&limit=x")
    assert status == 400 and "limit" in err["error"]
    status, err = call(url, "GET", "/v1/entries?instance=eng-a&tier=nope")
    assert status == 404 and "nope" in err["error"]
    assert call(url, "GET", "/v1/entries", token=None)[0] == 401


def test_lookup_by_text_is_tokenized_by_an_instance_of_the_model(cluster):
    url = cluster.ctl.url
    text = "".join(chr(ord("a") + t - 100) for t in PROMPT[:40])  # the toy tokenizer's inverse: 2 whole chunks
    r = call(url, "POST", "/v1/lookup", {"text": text}, token="tok-a")[1]
    assert [(x["instance_id"], x["hit_tokens"]) for x in r["results"]] == [("eng-a", 32)] and r["num_tokens"] == 40
    status, tok = call(cluster.api("eng-a"), "POST", "/v1/tokenize", {"text": "abc"}, token=API_TOKEN)
    assert status == 200 and tok == {"tokens": [100, 101, 102], "model": "org/synthetic"}
    status, err = call(cluster.api("eng-b"), "POST", "/v1/tokenize", {"text": "abc"}, token=API_TOKEN)
    assert status == 501 and "tokenizer" in err["error"]
    # team-b's only instance has no tokenizer: a clear refusal, not an empty answer
    status, err = call(url, "POST", "/v1/lookup", {"text": text}, token="tok-b")
    assert status == 409 and "tokenize" in err["error"], err
    status, err = call(url, "POST", "/v1/lookup", {"text": text, "tokens": [1]})
    assert status == 400 and "not both" in err["error"]


def test_the_openapi_documents_the_new_endpoints(cluster):
    doc = call(cluster.ctl.url, "GET", "/openapi.json")[1]
    assert "/v1/entries" in doc["paths"] and "/" in doc["paths"]
    lookup = doc["paths"]["/v1/lookup"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "text" in lookup["properties"]
    assert "tier_stats" in doc["paths"]["/v1/heartbeat"]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert "415" in doc["paths"]["/v1/clear"]["post"]["responses"]
