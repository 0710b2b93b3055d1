"""Review 3, items 10 and 11: what a web page or a tenant can make the controller and the
instance API do.

Item 10 (DNS rebinding): a page on a name the attacker re-points at 127.0.0.1 sends
``Host: attacker.example:PORT``; a page of another origin sends its ``Origin``. Real
requests with those headers against a real controller and a real engine's instance API
on loopback are refused (403) and change nothing: the engine's entries are still there.
Our own clients (addresses, ``localhost``, a configured name; a same-origin page) still
work, and with a token set any name is answered (the token is the guard: Service and
Ingress names keep working).

Item 11 (SSRF): a tenant registers an ``api_url`` pointing at a loopback-only "secret"
HTTP server started here. From another address the registration is refused; from the
same address (the only case the default policy allows) every dispatch answers the same
one line, and the secret text never appears in any answer; the answer for a closed port
and for an open one is the same (no port scanner).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch
from _kv import wave
from _procs import until

import lmcache
from lmcache.server.controller import ControllerServer

HANG = 10.0
ATTACKER = "attacker.example"
SECRET = "TOP-SECRET-3f9a1c"
KV_SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}
TOKENS = list(range(300, 364))  # 4 chunks of 16


def kv_for(tokens: list[int]) -> torch.Tensor:
    t = torch.as_tensor(tokens, dtype=torch.float32)
    base = torch.arange(2 * 2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 2, 8)
    return wave(base * 0.01 + t.reshape(1, 1, -1, 1, 1) * 0.37)


def raw(port: int, method: str, path: str, body: Any = None, *, host: str | None = None,
        headers: dict[str, str] | None = None, token: str | None = None,
        source: str | None = None) -> tuple[int, str]:
    """One real request to 127.0.0.1:``port`` with exactly the Host (and other headers)
    given; ``source``: the local address to connect from."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG,
                                      source_address=(source, 0) if source else None)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", host if host is not None else f"127.0.0.1:{port}")
        hs = dict(headers or {})
        if token:
            hs["Authorization"] = f"Bearer {token}"
        if data is not None:
            hs.setdefault("Content-Type", "application/json")
            hs["Content-Length"] = str(len(data))
        for k, v in hs.items():
            conn.putheader(k, v)
        conn.endheaders(data)
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        conn.close()


@pytest.fixture
def cluster():
    """A controller without a token (the default, loopback) and an engine with its
    instance API (no token), registered by its worker, holding 4 chunks."""
    ctl = ControllerServer("127.0.0.1", 0, instance_timeout=5.0)
    eng = lmcache.CacheEngine.from_config({
        "chunk_size": 16, "model": "org/web", "kv_spec": KV_SPEC, "tiers": [{"backend": "cpu", "capacity": "8MiB"}],
        "api": {"enabled": True}, "controller": {"url": ctl.url, "instance_id": "eng-1", "heartbeat_interval": 0.2},
    })
    try:
        eng.store(TOKENS, kv_for(TOKENS))
        eng.flush()
        until(lambda: any(i["instance_id"] == "eng-1" and i["keys"] == 4 for i in ctl.index.list(None)),
              "the engine registered with its 4 chunks")
        yield ctl, eng
    finally:
        eng.close()
        ctl.close()


def entries(eng: Any) -> int:
    return len(eng.admin.keys()["entries"])


# ================================================================ item 10: Host and Origin
def test_a_rebound_host_is_refused_by_the_controller_and_the_instance_api(cluster):
    """``Host: attacker.example:PORT`` (what a page on a rebound name sends): every GET and
    POST is 403 on both servers and nothing changes; the same requests with the address or
    ``localhost`` are answered. Before the fix: ``GET /v1/instances`` 200 and
    ``POST /v1/clear {all: true}`` cleared the engine (4 -> 0 entries)."""
    ctl, eng = cluster
    api_port = eng.api.port
    refused = []
    for port, method, path, body in (
        (ctl.port, "GET", "/v1/instances", None),
        (ctl.port, "GET", "/v1/entries?instance=eng-1", None),
        (ctl.port, "POST", "/v1/clear", {"instance": "eng-1", "all": True}),
        (api_port, "GET", "/v1/keys", None),
        (api_port, "POST", "/v1/clear", {"all": True}),
        (api_port, "POST", "/v1/evict", {"all": True}),
    ):
        status, text = raw(port, method, path, body, host=f"{ATTACKER}:{port}")
        assert status == 403 and "DNS rebinding" in text, (port, method, path, status, text)
        assert "eng-1" not in text and ":org/web:" not in text
        refused.append(status)
    assert entries(eng) == 4  # nothing was cleared
    for host in (f"127.0.0.1:{ctl.port}", f"localhost:{ctl.port}", "localhost", f"app.localhost:{ctl.port}"):
        status, text = raw(ctl.port, "GET", "/v1/instances", host=host)
        assert status == 200 and "eng-1" in text, (host, status, text)
    status, text = raw(api_port, "GET", "/v1/keys", host=f"[::1]:{api_port}")
    assert status == 200 and len(json.loads(text)["entries"]) == 4
    for bad in ("evil@127.0.0.1", "127.0.0.1/x", ""):
        assert raw(ctl.port, "GET", "/v1/instances", host=bad)[0] in (400, 403), bad
    print(f"rebinding: {len(refused)} requests with Host {ATTACKER} refused (403), entries still 4; "
          "address/localhost hosts answered")


def test_a_cross_origin_write_is_refused_and_a_same_origin_one_is_served(cluster):
    """A POST whose ``Origin`` is another site (or ``null``), or whose ``Sec-Fetch-Site``
    says cross-site, is 403 on both servers even with a correct Host, and clears
    nothing; the page's own origin is served."""
    ctl, eng = cluster
    api_port = eng.api.port
    for port, path, body in ((ctl.port, "/v1/clear", {"instance": "eng-1", "all": True}),
                             (api_port, "/v1/clear", {"all": True})):
        for hs in ({"Origin": f"http://{ATTACKER}:{port}"}, {"Origin": f"http://{ATTACKER}"}, {"Origin": "null"},
                   {"Origin": f"http://127.0.0.1:{port + 1}"}, {"Sec-Fetch-Site": "cross-site"},
                   {"Origin": f"http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-site"}):
            status, text = raw(port, "POST", path, body, headers=hs)
            assert status == 403 and "refused" in text, (port, hs, status, text)
    assert entries(eng) == 4
    same = {"Origin": f"http://127.0.0.1:{ctl.port}", "Sec-Fetch-Site": "same-origin"}
    status, text = raw(ctl.port, "POST", "/v1/lookup", {"tokens": TOKENS}, headers=same)
    assert status == 200 and json.loads(text)["best"] == "eng-1", text
    status, text = raw(api_port, "POST", "/v1/evict", {"all": True, "dry_run": True},
                       headers={"Origin": f"http://localhost:{api_port}"}, host=f"localhost:{api_port}")
    assert status == 200 and len(json.loads(text)["evicted"]) == 4, text
    # a no-referrer fetch of the page itself: Origin null, but the browser says same-origin
    status, _ = raw(ctl.port, "POST", "/v1/lookup", {"tokens": TOKENS},
                    headers={"Origin": "null", "Sec-Fetch-Site": "same-origin"})
    assert status == 200
    assert entries(eng) == 4
    print("origin: 12 cross-origin writes refused (403), entries still 4; same-origin writes served")


def test_with_a_token_any_name_is_answered_unless_allowed_hosts_are_configured():
    """With a token (e.g. the Kubernetes manifests: bound to 0.0.0.0, reached as
    ``lmcache-controller:9000`` or a pod IP) a Service name is answered: a rebound page has
    no token. Given ``allowed_hosts``, only those names (and addresses) are."""
    with ControllerServer("127.0.0.1", 0, token="ctl-tok") as ctl:
        assert raw(ctl.port, "GET", "/v1/health", host="lmcache-controller:9000", token="ctl-tok")[0] == 200
        assert raw(ctl.port, "GET", "/v1/health", host=f"{ATTACKER}:9000")[0] == 401  # no token: nothing
    with ControllerServer("127.0.0.1", 0, token="ctl-tok", allowed_hosts=("lmcache-controller", ".svc.local")) as ctl:
        for host, want in (("lmcache-controller:9000", 200), ("a.b.svc.local", 200), ("10.1.2.3:9000", 200),
                           (f"{ATTACKER}:9000", 403)):
            assert raw(ctl.port, "GET", "/v1/health", host=host, token="ctl-tok")[0] == want, host
    eng = lmcache.CacheEngine.from_config({"chunk_size": 16, "tiers": [{"backend": "cpu", "capacity": "1MiB"}],
                                           "api": {"enabled": True, "allowed_hosts": ["vllm-lmcache"]}})
    try:  # the instance API's own allow-list (api.allowed_hosts), no token
        port = eng.api.port
        for host, want in ((f"vllm-lmcache:{port}", 200), (f"{ATTACKER}:{port}", 403), (f"localhost:{port}", 200)):
            assert raw(port, "GET", "/v1/health", host=host)[0] == want, host
    finally:
        eng.close()
    print("token: Service names answered; with allowed_hosts only those (controller and api.allowed_hosts)")


# ================================================================ item 11: SSRF
class _Secret(BaseHTTPRequestHandler):
    """A loopback-only service that must never be read through the controller: text on
    every path, and on /v1/keys a JSON document with an 'error' field."""

    def _answer(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        if self.path.startswith("/v1/keys"):
            body, ctype, status = json.dumps({"error": SECRET, "entries": [SECRET]}).encode(), "application/json", 404
        else:
            body, ctype, status = f"{SECRET}\n".encode(), "text/plain", 200
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def secret():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Secret)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


ADMIN = "ssrf-admin"
TENANT = "ssrf-tenant"


def _register(ctl: ControllerServer, iid: str, api_url: str, source: str | None = None) -> tuple[int, str]:
    body = {"instance_id": iid, "namespace": "t1", "model": "org/m", "chunk_size": 16, "tiers": ["cpu"],
            "api_url": api_url, "api_token": "whatever"}
    return raw(ctl.port, "POST", "/v1/register", body, token=TENANT, source=source)


def test_a_tenant_cannot_register_an_address_it_does_not_run_on(secret):
    """A registration from 127.0.0.3 (another host, as far as the controller can tell)
    naming the controller's loopback service is 403 and not registered; with that network
    allowed (``instance_networks``) it is; a wildcard host stands for the sender's address.
    Before the fix every registration was 200."""
    with ControllerServer("127.0.0.1", 0, token=ADMIN, tenants={"t1": (TENANT,)}) as ctl:
        status, text = _register(ctl, "evil", f"http://127.0.0.1:{secret}", source="127.0.0.3")
        assert status == 403 and "api_url" in text and "127.0.0.3" in text, text
        assert [i for i in ctl.index.list(None) if i["instance_id"] == "evil"] == []
        status, text = _register(ctl, "wild", "http://0.0.0.0:8200", source="127.0.0.3")
        assert status == 200, text
        assert [i["api_url"] for i in ctl.index.list(None)] == ["http://127.0.0.3:8200"]
    with ControllerServer("127.0.0.1", 0, token=ADMIN, tenants={"t1": (TENANT,)},
                          instance_networks=("127.0.0.0/30",)) as ctl:
        assert _register(ctl, "ok", f"http://127.0.0.1:{secret}", source="127.0.0.3")[0] == 200
        assert _register(ctl, "no", "http://127.0.0.9:1", source="127.0.0.3")[0] == 403
    print("ssrf/registration: a foreign address refused (403), allowed with --instance-network; 0.0.0.0 -> sender")


def test_no_dispatch_echoes_another_service_and_open_and_closed_ports_answer_alike(secret):
    """A tenant on the controller's host registers its "instance" at a loopback-only
    service (the one case the address policy allows) and at a closed port: every command
    and listing through the controller answers 502 with the same line for both, and the
    service's text never appears. Before the fix ``/v1/clear`` answered the secret text
    word for word (200) and a closed port 'Connection refused'."""
    closed = _closed_port()
    with ControllerServer("127.0.0.1", 0, token=ADMIN, tenants={"t1": (TENANT,)}, dispatch_timeout=5.0) as ctl:
        assert _register(ctl, "open", f"http://127.0.0.1:{secret}")[0] == 200
        assert _register(ctl, "shut", f"http://127.0.0.1:{closed}")[0] == 200
        answers: dict[str, list[tuple[int, str]]] = {"open": [], "shut": []}
        for iid in answers:
            for method, path, body in (
                ("POST", "/v1/clear", {"instance": iid, "all": True}),
                ("POST", "/v1/clear", {"instance": iid, "tier": "cpu"}),
                ("POST", "/v1/pin", {"instance": iid, "tokens": list(range(32))}),
                ("POST", "/v1/compress", {"instance": iid, "tier": "cpu", "codec": "zstd"}),
                ("GET", f"/v1/entries?instance={iid}", None),
            ):
                status, text = raw(ctl.port, method, path, body, token=TENANT)
                assert SECRET not in text, (iid, path, text)
                answers[iid].append((status, text.replace(iid, "ID")))
            status, text = raw(ctl.port, "POST", "/v1/lookup", {"text": "hello"}, token=TENANT)
            assert SECRET not in text and status == 409, text
        assert answers["open"] == answers["shut"], answers
        assert {s for s, _ in answers["open"]} <= {400, 409, 502}, answers["open"]
        assert any(s == 502 and "unreachable" in t for s, t in answers["open"]), answers["open"]
    print(f"ssrf/dispatch: {len(answers['open'])} calls each, open and closed ports answered alike, secret never shown")
