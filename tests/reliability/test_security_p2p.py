"""Security of peer-to-peer transfers (issue 29, item 1): the outside review obtained the
cluster's P2P token as a tenant, then read and poisoned another tenant's KV.

Each attack path of the review runs here against real engines (each with its instance
API, peer endpoint and controller worker), a real controller with tenant tokens, and an
attacker's listener on loopback (:class:`FakePeer`: it answers every frame as a server
without a token would, and serves forged chunks filled with -666.0) or a relay to a real
peer. What the attacker captured is then used against team-b's real endpoint (list its
keys, read a chunk, put forged chunks under keys of a prompt team-b has not sent yet),
as the review did. Each test prints a one-line summary of what it checked.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import torch

import lmcache
from lmcache import payload
from lmcache import wire as proto
from lmcache.encoded import open_objects
from lmcache.errors import BackendError
from lmcache.memory import MemoryPool
from lmcache.server.cache import CacheServer
from lmcache.storage import BackendContext

from test_security import http, lm_talk  # noqa: E402 - the same folder's helpers

HANG = 20.0  # a guard against hangs, not a timing assertion
P2P_TOKEN = "peer-secret-29"
CTL_ADMIN, CTL_TENANTS = "ctl-admin", {"team-a": ("ctl-a",), "team-b": ("ctl-b",)}
API_ADMIN, API_TENANTS = "api-admin", {"team-a": "api-a", "team-b": "api-b"}
KV_SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}
MODEL = "org/shared-model"
CHUNK = 16
FORGED = -666.0


def kv_for(tokens: list[int]) -> torch.Tensor:
    t = torch.as_tensor(tokens, dtype=torch.float32)
    return (torch.arange(2 * 2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 2, 8) * 0.01
            + t.reshape(1, 1, -1, 1, 1) * 0.37)


def read_frame(sock: socket.socket) -> tuple[proto.Frame, bytes, bytes]:
    f = proto.parse_header(proto.recv_exact(sock, proto.HEADER_SIZE), 1 << 27)
    body = bytes(proto.recv_exact(sock, f.key_len + f.value_len))
    return f, body[: f.key_len], body[f.key_len :]


class Listener:
    """A loopback listener handing each connection to :meth:`serve` on a thread."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"lm://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.sock.close()


class FakePeer(Listener):
    """An attacker's listener: records every frame it is sent; answers AUTH and PUT with
    OK (as a server without a token does), GET with a forged payload where it has one."""

    def __init__(self, forged: dict[str, bytes] | None = None):
        self.forged = forged or {}
        self.frames: list[tuple[int, bytes, bytes]] = []
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        conn.settimeout(HANG)
        with conn:
            try:
                while True:
                    f, key, value = read_frame(conn)
                    self.frames.append((f.op, key, value))
                    data = self.forged.get(key.decode(errors="replace")) if f.op == proto.GET else b""
                    status = proto.NOT_FOUND if f.op == proto.GET and data is None else proto.OK
                    conn.sendall(proto.encode(f.op, f.seq, b"", data or b"", status=status))
            except (OSError, proto.ProtocolError):
                return

    def auth_values(self) -> list[bytes]:
        return [v for op, _, v in self.frames if op == proto.AUTH]

    def saw_token(self) -> bool:
        return any(P2P_TOKEN.encode() in k + v for _, k, v in self.frames)


class Relay(Listener):
    """An attacker's relay to a real endpoint: forwards bytes both ways and keeps what
    the client sent."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.sent = bytearray()
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        s = socket.create_connection(("127.0.0.1", self.target_port), timeout=HANG)
        threading.Thread(target=self._pump, args=(s, conn, False), daemon=True).start()
        self._pump(conn, s, True)

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def client_frames(self) -> list[tuple[proto.Frame, bytes, bytes]]:
        return list(proto.iter_frames(bytes(self.sent)))


def forged_payload(engine: Any, key: str) -> bytes:
    obj = MemoryPool.allocate_unpooled(engine.kv_spec.chunk_shape(CHUNK), torch.float32)
    obj.tensor.fill_(FORGED)
    return b"".join(bytes(b) for b in payload.encode(key, obj, engine.hierarchy.codec("raw")))


def attack_endpoint(engine: Any, auth_values: list[bytes], victim_tokens: list[int]) -> dict[str, int]:
    """What the review did with the captured token against team-b's endpoint: for each
    captured AUTH value, authenticate with it, LIST team-b's keys, GET one, PUT forged
    chunks under the keys of ``victim_tokens``. Counts the requests that were served."""
    port = engine.p2p.endpoint.server.address[1]
    own = sorted(engine.p2p.endpoint.store.snapshot())[0][0]
    victim_keys = engine.chunk_keys(victim_tokens)[1]
    served = {"list": 0, "get": 0, "put": 0}
    for value in auth_values or [b""]:
        data = proto.encode(proto.AUTH, 1, b"", value) + proto.encode(proto.LIST, 2) + \
            proto.encode(proto.GET, 3, own.encode())
        data += b"".join(proto.encode(proto.PUT, 4 + i, k.encode(), forged_payload(engine, k))
                         for i, k in enumerate(victim_keys))
        for f, _, _ in lm_talk(port, data):
            if f.status == proto.OK and f.op in (proto.LIST, proto.GET, proto.PUT):
                served[proto.OP_NAMES[f.op].lower()] += 1
    return served


def assert_not_poisoned(engine: Any, tokens: list[int]) -> None:
    r = engine.retrieve(tokens)
    assert r.num_tokens == 0 or not bool((r.kv == FORGED).any()), f"{engine.instance_id} retrieved forged KV"


# ---------------------------------------------------------------- the cluster
@pytest.fixture(scope="module")
def cluster():
    """A controller with tenant tokens; team-a's instances a1 and a2 and team-b's b1,
    each with an instance API (admin + tenant tokens), a peer endpoint (the cluster's
    P2P token) and a worker using its tenant's controller token."""
    from lmcache.server.controller import ControllerServer

    with ControllerServer("127.0.0.1", 0, token=CTL_ADMIN, tenants=CTL_TENANTS, instance_timeout=5) as ctl:
        engines: dict[str, Any] = {}
        try:
            for iid, ns in (("a1", "team-a"), ("a2", "team-a"), ("b1", "team-b")):
                engines[iid] = lmcache.CacheEngine.from_config({
                    "chunk_size": CHUNK, "namespace": ns, "model": MODEL, "kv_spec": KV_SPEC,
                    "tiers": [{"backend": "cpu", "capacity": "64MiB"}],
                    "api": {"enabled": True, "token": API_ADMIN, "tenants": API_TENANTS},
                    "p2p": {"enabled": True, "token": P2P_TOKEN, "timeout": 2.0},
                    "controller": {"url": ctl.url, "token": CTL_TENANTS[ns][0], "instance_id": iid,
                                   "heartbeat_interval": 0.1, "timeout": 2.0},
                })
            deadline = time.monotonic() + HANG
            while len([i for i in http(ctl.url + "/v1/instances", token=CTL_ADMIN)[1] if i.get("peer_url")]) < 3:
                assert time.monotonic() < deadline, "instances did not register"
                time.sleep(0.05)
            a1, b1 = engines["a1"], engines["b1"]
            a1.store(list(range(100, 164)), kv_for(list(range(100, 164))))
            b1.store(list(range(200, 264)), kv_for(list(range(200, 264))))
            yield ctl, engines
        finally:
            for e in engines.values():
                e.close()


def register_fake(ctl: Any, iid: str, peer_url: str, keys: list[str] = ()) -> None:
    """A team-a tenant token registers a made-up instance whose peer endpoint is the
    attacker's, and says it holds ``keys``."""
    status, reg = http(ctl.url + "/v1/register", "POST", {
        "instance_id": iid, "namespace": "team-a", "model": MODEL, "chunk_size": CHUNK, "tiers": ["cpu"],
        "peer_url": peer_url}, token="ctl-a")
    assert status == 200, reg
    if keys:
        status, ev = http(ctl.url + "/v1/events", "POST", {"instance_id": iid, "session": reg["session"],
                                                           "events": [["admit", "cpu", k] for k in keys]}, token="ctl-a")
        assert status == 200 and ev["applied"] == len(keys), ev


# ---------------------------------------------------------------- the wire
def test_the_lm_client_proves_the_token_and_never_sends_it():
    """A client with a token against a listener that answers anything: the listener gets
    a hello and nothing else (no token, no request), the client says the server did not
    prove it knows the token. Against a real server the handshake works; a captured
    handshake replayed on a new connection is refused; a client that expects a peer id
    refuses a server announcing another, also through a relay."""
    from lmcache.backends.lm import LMBackend

    fake = FakePeer()
    try:
        b = LMBackend(BackendContext.standalone({"url": fake.url, "token": P2P_TOKEN}))
        with pytest.raises(BackendError, match="did not prove it knows the token"):
            b.exists(["lmc1:ns:m:sig:00"])
        b.close()
        assert not fake.saw_token(), "the token went to a listener that does not know it"
        assert [op for op, _, _ in fake.frames] == [proto.AUTH], fake.frames
    finally:
        fake.close()

    srv = CacheServer(token=P2P_TOKEN, identity="peer-x", legacy_auth=False).start()
    relay = Relay(srv.address[1])
    try:
        url = f"lm://127.0.0.1:{srv.address[1]}"
        for opts in ({"url": url}, {"url": url, "peer_id": "peer-x"}, {"url": relay.url}):
            b = LMBackend(BackendContext.standalone({**opts, "token": P2P_TOKEN}))
            assert b.exists(["k"]) == [False]
            b.close()
        # what a listener saw of a complete handshake is of no use on a new connection
        captured = [v for f, _, v in relay.client_frames() if f.op == proto.AUTH]
        assert len(captured) == 2 and not any(P2P_TOKEN.encode() in v for v in captured)
        with socket.create_connection(srv.address, timeout=HANG) as s:
            s.sendall(b"".join(proto.encode(proto.AUTH, i, b"", v) for i, v in enumerate(captured))
                      + proto.encode(proto.HEALTH, 9))
            statuses = []
            try:
                while True:
                    statuses.append(read_frame(s)[0].status)
            except (ConnectionError, OSError):
                pass
        assert statuses[-1] == proto.FATAL and proto.OK not in statuses[1:], statuses
        for opts, why in (({"url": url, "peer_id": "peer-y"}, "not the expected 'peer-y'"),
                          ({"url": relay.url, "peer_id": "peer-y"}, "not the expected 'peer-y'"),
                          ({"url": url, "token": "other"}, "wrong token")):
            b = LMBackend(BackendContext.standalone({"token": P2P_TOKEN, **opts}))
            with pytest.raises(BackendError, match=why):
                b.exists(["k"])
            b.close()
        # a peer endpoint takes no token sent in clear (lmcache server still does, for old clients)
        with socket.create_connection(srv.address, timeout=HANG) as s:
            s.sendall(proto.encode(proto.AUTH, 1, b"", P2P_TOKEN.encode()))
            assert read_frame(s)[0].status == proto.FATAL
    finally:
        relay.close()
        srv.close()
    print("wire: a listener got 1 hello and no token; a replayed handshake and a relay to another peer id refused")


# ---------------------------------------------------------------- review path 1: /v1/push
def test_a_tenant_push_cannot_name_an_address_and_the_token_never_leaks(cluster):
    """The review's first path: team-a's tenant token on a1's API pushed to an address of
    its own (``target: lm://attacker``), a1 sent the P2P token there, and with it the
    reviewer listed, read and poisoned team-b's KV on b1's endpoint. Now a tenant may
    push only to an instance id of its namespace (an address is 403, b1 is unknown to
    it); an admin push to the address fails without sending the token; whatever the
    listener captured opens nothing on b1's endpoint, and b1 never retrieves forged KV."""
    ctl, e = cluster
    a1, b1 = e["a1"], e["b1"]
    keys = a1.chunk_keys(list(range(100, 164)))[1]
    victim = list(range(5000, 5048))  # a prompt team-b has not sent yet
    fake = FakePeer()
    try:
        status, err = http(a1.api_url + "/v1/push", "POST", {"target": fake.url, "keys": keys}, token="api-a")
        status_admin, err_admin = http(a1.api_url + "/v1/push", "POST", {"target": fake.url, "keys": keys},
                                       token=API_ADMIN)
        served = attack_endpoint(b1, fake.auth_values(), victim)
        assert not fake.saw_token(), "a1 sent the P2P token to the attacker's listener"
        assert served == {"list": 0, "get": 0, "put": 0}, served
        assert_not_poisoned(b1, victim)
        assert status == 403 and "instance id" in err["error"], (status, err)
        assert status_admin == 502 and "did not prove" in err_admin["error"], (status_admin, err_admin)
        # a tenant pushes to its own namespace's instances by id; team-b's is unknown to it
        status, ok = http(a1.api_url + "/v1/push", "POST", {"target": "a2", "keys": keys}, token="api-a")
        assert status == 200 and ok["pushed"] == keys, ok
        status, err = http(a1.api_url + "/v1/push", "POST", {"target": "b1", "keys": keys}, token="api-a")
        assert status == 404 and "unknown instance" in err["error"], (status, err)
    finally:
        fake.close()
    print(f"push: tenant address 403, admin address 502 with no token sent, {len(fake.auth_values())} captured "
          "AUTH values opened nothing on b1's endpoint, push by id within team-a ok, b1 unknown (404)")


# ---------------------------------------------------------------- review path 2: /v1/move
def test_a_fake_instance_registered_by_a_tenant_gets_no_token_from_a_move(cluster):
    """The review's second path: team-a's controller token registers a made-up instance
    whose ``peer_url`` is the attacker's listener and asks ``POST /v1/move`` from a1 to
    it; the controller calls a1's ``/v1/push`` with its admin token and a1 sent the P2P
    token to the listener. Now the move fails (the listener cannot prove the token), the
    listener gets a hello only; a relay to b1's real endpoint is refused by the announced
    instance id and never gets a1's proof."""
    ctl, e = cluster
    b1 = e["b1"]
    victim = list(range(6000, 6048))
    fake = FakePeer()
    relay = Relay(b1.p2p.endpoint.server.address[1])
    try:
        register_fake(ctl, "evil", fake.url)
        register_fake(ctl, "evil-relay", relay.url)
        body = {"src_instance": "a1", "src_tier": "cpu", "dst_tier": "cpu", "tokens": list(range(100, 164))}
        status, err = http(ctl.url + "/v1/move", "POST", {**body, "dst_instance": "evil"}, token="ctl-a")
        status_r, err_r = http(ctl.url + "/v1/move", "POST", {**body, "dst_instance": "evil-relay"}, token="ctl-a")
        captured = fake.auth_values() + [v for f, _, v in relay.client_frames() if f.op == proto.AUTH]
        served = attack_endpoint(b1, captured, victim)
        assert not fake.saw_token() and P2P_TOKEN.encode() not in bytes(relay.sent), "the P2P token leaked"
        assert served == {"list": 0, "get": 0, "put": 0}, served
        assert_not_poisoned(b1, victim)
        assert status == 502 and "did not prove" in err["error"], (status, err)
        assert status_r == 502 and "not the expected 'evil-relay'" in err_r["error"], (status_r, err_r)
        assert [f.op for f, _, _ in relay.client_frames()] == [proto.AUTH], "a1 went past the hello through a relay"
        # the real move within team-a still works
        status, ok = http(ctl.url + "/v1/move", "POST", {**body, "dst_instance": "a2"}, token="ctl-a")
        assert status == 200 and len(ok["result"]["pushed"]) == 4, (status, ok)
    finally:
        fake.close()
        relay.close()
    print("move: to a tenant-registered listener 502 (no proof), to a relay of b1 502 (peer id), no token "
          "leaked, b1 not poisoned; a1 -> a2 moved 4 chunks")


# ---------------------------------------------------------------- forged data by fetch
def test_a_fake_peer_cannot_feed_forged_kv_to_a_fetch(cluster):
    """A team-a tenant registers a made-up instance that claims the chunks of a prompt
    and whose endpoint serves chunks of -666.0 under their keys. a2 misses the prompt,
    asks the controller, and fetches from it: the fake peer cannot prove the P2P token,
    so the fetch is a miss and a2 never serves the forged KV."""
    ctl, e = cluster
    a2 = e["a2"]
    prompt = list(range(7000, 7048))
    keys = a2.chunk_keys(prompt)[1]
    fake = FakePeer({k: forged_payload(a2, k) for k in keys})
    try:
        register_fake(ctl, "evil-fetch", fake.url, keys)
        r = a2.retrieve(prompt)
        forged = r.num_tokens > 0 and bool((r.kv == FORGED).any())
        assert not forged, f"a2 served {r.num_tokens} tokens of forged KV fetched from a fake peer"
        assert r.num_tokens == 0
        assert not any(op == proto.GET for op, _, _ in fake.frames), "a2 asked the fake peer for chunks"
        assert a2.stats()["p2p"]["failed_fetches"] >= 1
    finally:
        fake.close()
    print(f"fetch: a fake peer claiming {len(keys)} chunks got a hello and no GET; a2 served 0 forged tokens")


# ---------------------------------------------------------------- a shared tier
def test_a_peer_endpoint_serves_its_own_namespace_only_over_a_shared_tier(tmp_path):
    """team-a and team-b engines over one shared fs directory, each with a peer
    endpoint: a client that knows the P2P token asks team-b's endpoint for team-a's
    chunks (GET, EXISTS, LIST) and gets none of them; team-b's own are served."""
    from lmcache.backends.lm import LMBackend

    tier = {"backend": "fs", "url": f"file://{tmp_path / 'shared'}", "capacity": "64MiB"}
    a, b = (lmcache.CacheEngine.from_config({
        "chunk_size": CHUNK, "namespace": ns, "model": MODEL, "kv_spec": KV_SPEC, "tiers": [tier],
        "p2p": {"enabled": True, "token": P2P_TOKEN, "fetch": False}}) for ns in ("team-a", "team-b"))
    try:
        ta, tb = list(range(300, 332)), list(range(400, 432))
        a.store(ta, kv_for(ta))
        b.store(tb, kv_for(tb))
        a.flush()
        b.flush()
        for t in b.hierarchy.tiers:
            t.refresh()
        ka, kb = a.chunk_keys(ta)[1], b.chunk_keys(tb)[1]
        client = open_objects(LMBackend(BackendContext.standalone({"url": b.peer_url, "token": P2P_TOKEN,
                                                                   "peer_id": b.instance_id})))
        try:
            got = client.get(ka + kb)
            assert [o is not None for o in got] == [False] * len(ka) + [True] * len(kb)
            for o in got:
                if o is not None:
                    o.unref()
            assert client.exists(ka) == [False] * len(ka)
            assert sorted(k for k, _ in client.keys()) == sorted(kb)
        finally:
            client.close()
    finally:
        a.close()
        b.close()
    print(f"shared tier: team-b's endpoint served 0 of team-a's {len(ka)} chunks and all {len(kb)} of its own")
