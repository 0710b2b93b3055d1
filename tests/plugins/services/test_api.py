"""The instance API (lmcache.plugins.services.api): routes, tokens, errors, timeouts, /metrics, lifecycle;
and the client the CLI uses against it (lmcache.plugins.services.api_client)."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest
import torch
from _kv import wave

import lmcache
from lmcache.plugins.services.api_client import ApiClient
from lmcache.errors import AdminError, AuthError, ConfigError, NotFoundError, UnreachableError

TOKEN = "s3cret-token"


def kv_for(tokens):
    t = torch.as_tensor(list(tokens), dtype=torch.float32)
    base = torch.arange(2 * 2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 2, 8)
    return wave(base * 0.01 + t.reshape(1, 1, -1, 1, 1) * 0.37)


def start(tmp_path, **api):
    cfg = {
        "chunk_size": 16,
        "tiers": [
            {"backend": "cpu", "capacity": "1MiB"},
            {"backend": "disk", "path": str(tmp_path / "kv"), "capacity": "4MiB"},
        ],
        "api": {"enabled": True, **api},
    }
    e = lmcache.CacheEngine.from_config(cfg)
    toks = list(range(64))
    e.store(toks, kv_for(toks))
    e.flush()
    e.retrieve(toks)
    return e


@pytest.fixture
def engine(tmp_path):
    e = start(tmp_path, token=TOKEN, timeout=1.0)
    yield e
    e.close()


def call(url, path, body=None, *, token=TOKEN, method=None, raw=None, headers=None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    h = dict(headers or {})
    if data is not None:
        h.setdefault("Content-Type", "application/json")  # the API reads JSON bodies only (415 otherwise)
    if token:
        h["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url + path, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            ctype = r.headers["Content-Type"]
            text = r.read().decode()
            return r.status, (json.loads(text) if "json" in ctype else text)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_disabled_by_default(tmp_path):
    with lmcache.CacheEngine.from_config({"tiers": [{"backend": "cpu", "capacity": "1MiB"}]}) as e:
        assert e.api is None and e.api_url is None


def test_serves_tiers_keys_stats_config_on_loopback(engine):
    url = engine.api_url
    assert url.startswith("http://127.0.0.1:") and engine.api.port > 0
    status, tiers = call(url, "/v1/tiers")
    assert status == 200 and [t["name"] for t in tiers] == ["cpu", "disk"]
    assert tiers[0]["entries"] == 4 and tiers[0]["hits"] == 4 and tiers[0]["hit_rate"] == 1.0
    status, page = call(url, "/v1/keys?tier=disk&limit=3")
    assert status == 200 and page["total"] == 4 and len(page["entries"]) == 3 and page["next_offset"] == 3
    status, stats = call(url, "/v1/stats")
    assert stats["live"] is True and stats["tiers"]["cpu"]["bytes_out"] == 4 * 4096 and stats["pool"]["used"] > 0
    status, conf = call(url, "/v1/config")
    assert conf["values"]["api"]["token"] == "***" and conf["sources"]["api.token"] == "mapping"
    assert TOKEN not in json.dumps(conf)
    assert call(url, "/v1/health")[1]["status"] == "ok"


def test_evict_pin_unpin_clear(engine):
    url = engine.api_url
    key = call(url, "/v1/keys?tier=cpu&limit=1")[1]["entries"][0]["key"]
    assert call(url, "/v1/pin", {"key": key}) == (200, {"key": key, "pinned": ["cpu", "disk"]})
    assert call(url, "/v1/pins")[1] == [{"tier": "cpu", "key": key}, {"tier": "disk", "key": key}]
    status, res = call(url, "/v1/evict", {"tier": "cpu", "all": True, "dry_run": True})
    assert status == 200 and res["dry_run"] and len(res["evicted"]) == 3 and res["skipped"][0]["reason"] == "pinned"
    assert engine.stats()["tiers"]["cpu"]["entries"] == 4
    status, res = call(url, "/v1/evict", {"tier": "cpu", "bytes": "4KiB"})
    assert len(res["evicted"]) == 1 and engine.stats()["tiers"]["cpu"]["evictions"] == 1
    assert call(url, "/v1/unpin", {"key": key, "tier": "cpu"})[1]["unpinned"] == ["cpu"]
    status, res = call(url, "/v1/clear", {"all": True})
    assert status == 200 and len(res["evicted"]) == 3 + 4 and res["skipped"] == []
    assert engine.stats()["tiers"]["disk"]["entries"] == 0


@pytest.mark.parametrize(
    "path,body,raw,fragment",
    [
        ("/v1/evict", None, b"{not json", "body is not valid JSON"),
        ("/v1/evict", None, b"[1, 2]", "body must be a JSON object"),
        ("/v1/evict", {"al": True}, None, "unknown field 'al'"),
        ("/v1/evict", {"all": "yes"}, None, "field 'all' must be true/false"),
        ("/v1/evict", {"bytes": True, "tier": "cpu"}, None, "field 'bytes' must be an integer or a string"),
        ("/v1/evict", {}, None, "say what to evict"),
        ("/v1/evict", {"tier": "cpu", "bytes": "lots"}, None, "cannot read 'lots' as a size"),
        ("/v1/evict", {"keys": ["lmc1:x"]}, None, "not an lmcache key"),
        ("/v1/evict", {"keys": [5]}, None, "a key must be a string"),
        ("/v1/pin", {}, None, "field 'key' is required"),
        ("/v1/pin", {"key": "nope"}, None, "not an lmcache key"),
        ("/v1/keys?limit=many", None, None, "'limit' must be an integer"),
        ("/v1/keys?limit=-1", None, None, "'limit' must be >= 0"),
        ("/v1/keys?colour=red", None, None, "unknown query parameter 'colour'"),
        ("/v1/keys?tier=cpu&tier=disk", None, None, "given 2 times"),
    ],
)
def test_malformed_requests_are_400_naming_the_problem(engine, path, body, raw, fragment):
    status, err = call(engine.api_url, path, body, raw=raw, method="POST" if (body is not None or raw) else "GET")
    assert status == 400, err
    assert fragment in err["error"] and err["status"] == 400


def test_unknown_tier_key_and_path_are_404(engine):
    url = engine.api_url
    status, err = call(url, "/v1/keys?tier=ssd")
    assert status == 404 and "unknown tier 'ssd'; tiers: cpu, disk" in err["error"]
    assert call(url, "/v1/evict", {"tier": "ssd", "all": True})[0] == 404
    missing = lmcache.CacheKey("default", "default", "x", "0" * 32).to_string()
    status, err = call(url, "/v1/pin", {"key": missing})
    assert status == 404 and "not in any tier" in err["error"]
    assert call(url, "/v1/nothing")[0] == 404
    status, err = call(url, "/v1/tiers", {}, method="POST")
    assert status == 405 and "takes GET" in err["error"]
    assert call(url, "/v1/evict", method="GET")[0] == 405


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""])
def test_wrong_or_missing_token_is_401_on_every_route(engine, token):
    for path in ("/v1/tiers", "/v1/keys", "/v1/stats", "/metrics", "/v1/nothing"):
        status, err = call(engine.api_url, path, token=token)
        assert status == 401, path
        assert "token" in err["error"]
    status, _ = call(engine.api_url, "/v1/clear", {}, token=token)
    assert status == 401 and engine.stats()["tiers"]["cpu"]["entries"] == 4
    # a non-bearer scheme with the right secret is refused too
    assert call(engine.api_url, "/v1/tiers", token=None, headers={"Authorization": f"Basic {TOKEN}"})[0] == 401


def test_body_too_large_is_413(engine):
    # refused on its Content-Length, before any of the body is read
    with socket.create_connection(("127.0.0.1", engine.api.port), timeout=10) as s:
        s.sendall(
            f"POST /v1/evict HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Length: {(1 << 20) + 1}\r\n\r\n".encode()
        )
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 413") and b"larger than 1048576 bytes" in body


def test_a_client_that_stalls_is_disconnected(engine):
    host, port = "127.0.0.1", engine.api.port
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"GET /v1/tiers HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
        t0 = time.monotonic()
        s.settimeout(10)
        data = s.recv(1024)
        while data:
            data = s.recv(1024)
        assert time.monotonic() - t0 < 5  # api.timeout is 1s
    assert call(engine.api_url, "/v1/health")[0] == 200  # the server still serves


def test_metrics_are_prometheus_text_from_a_per_engine_registry(tmp_path, engine):
    status, text = call(engine.api_url, "/metrics")
    assert status == 200
    assert '# TYPE lmcache_tier_hits_total counter' in text
    assert 'lmcache_tier_hits_total{backend="cpu",tier="cpu"} 4.0' in text
    assert 'lmcache_tier_entries{backend="disk",tier="disk"} 4.0' in text
    for name in ("lmcache_tier_bytes_in_total", "lmcache_tier_bytes_out_total", "lmcache_tier_evictions_total",
                 "lmcache_tier_misses_total", "lmcache_tier_capacity_bytes", "lmcache_pool_used_bytes",
                 "lmcache_dropped_writes_total", "lmcache_deferred_writes_total", "lmcache_tier_lost_total"):
        assert name in text
    from prometheus_client import REGISTRY, generate_latest

    assert b"lmcache_" not in generate_latest(REGISTRY)  # not the global registry
    other = start(tmp_path / "b")  # a second engine has its own numbers
    try:
        text2 = call(other.api_url, "/metrics", token=None)[1]
        assert 'lmcache_tier_hits_total{backend="cpu",tier="cpu"} 4.0' in text2
        engine.retrieve(list(range(64)))
        assert 'lmcache_tier_hits_total{backend="cpu",tier="cpu"} 8.0' in call(engine.api_url, "/metrics")[1]
        assert 'lmcache_tier_hits_total{backend="cpu",tier="cpu"} 4.0' in call(other.api_url, "/metrics", token=None)[1]
    finally:
        other.close()


def test_close_stops_the_server(tmp_path):
    e = start(tmp_path)
    url = e.api_url
    assert call(url, "/v1/health", token=None)[0] == 200
    e.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/v1/health", timeout=2)


def test_a_taken_port_is_a_config_error_naming_api_port(tmp_path, engine):
    with pytest.raises(ConfigError) as ei:
        start(tmp_path / "b", port=engine.api.port)
    assert ei.value.key == "api.port" and "cannot listen on 127.0.0.1" in str(ei.value)


# ------------------------------------------------------------------ the client


def test_client_mirrors_admin(engine):
    c = ApiClient(engine.api_url, TOKEN, timeout=5)
    assert [t["name"] for t in c.tiers()] == [t["name"] for t in engine.admin.tiers()]
    assert [e["key"] for e in c.keys("disk", limit=2)["entries"]] == [
        e["key"] for e in engine.admin.keys("disk", limit=2)["entries"]
    ]
    plan = c.plan_evict("cpu", all=True)
    assert len(plan["evict"]) == 4 and engine.stats()["tiers"]["cpu"]["entries"] == 4
    done, skipped = c.evict_entries([(v["tier"], v["key"]) for v in plan["evict"][:2]])
    assert len(done) == 2 and skipped == [] and engine.stats()["tiers"]["cpu"]["entries"] == 2
    assert "lmcache_tier_hits_total" in c.metrics()


def test_client_errors(engine):
    with pytest.raises(AuthError, match="missing or wrong token"):
        ApiClient(engine.api_url, "nope").tiers()
    with pytest.raises(NotFoundError, match="unknown tier"):
        ApiClient(engine.api_url, TOKEN).keys("ssd")
    with pytest.raises(AdminError, match="say what to evict") as ei:
        ApiClient(engine.api_url, TOKEN).evict()
    assert ei.value.status == 400
    with pytest.raises(AdminError, match="expected http://HOST:PORT"):
        ApiClient("localhost:8000")


def test_client_times_out_and_reports_refused_connections():
    # a listening socket that never accepts: the connection is made, no answer comes
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(UnreachableError, match=r"no answer from .* within 0.3s"):
            ApiClient(url, timeout=0.3).tiers()
        assert time.monotonic() - t0 < 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(UnreachableError, match="cannot reach"):
        ApiClient(f"http://127.0.0.1:{port}", timeout=2).tiers()


def test_an_answer_cut_off_midway_is_no_answer():
    """A server that dies while answering (headers sent, the body short) is
    UnreachableError like one that never answered, so callers fail over or report it;
    before, http.client's IncompleteRead escaped the client's error contract."""
    import threading

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)

        def answer_half() -> None:
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 76\r\n\r\n{\"tie")

        t = threading.Thread(target=answer_half, daemon=True)
        t.start()
        with pytest.raises(UnreachableError, match="stopped in the middle of its answer"):
            ApiClient(f"http://127.0.0.1:{srv.getsockname()[1]}", timeout=5).tiers()
        t.join(timeout=5)


def test_client_ignores_proxy_settings(engine, monkeypatch):
    # the token must never go to a proxy; the instance is reached directly
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:1")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:1")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert len(ApiClient(engine.api_url, TOKEN).tiers()) == 2
