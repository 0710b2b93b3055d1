"""PD in the vLLM connector (plugins/connectors/vllm/pd.py), its parts against real engines,
real transfer endpoints and a real ZMQ proxy socket: what a request's kv_transfer_params may
name (hostile input), LMCache's push + proxy notification (also when the push fails), vLLM's
named offer and the decoder's bounded pull. The live runs with two `vllm serve` and both
proxies are in test_vllm_pd_live.py.

Run: LMCACHE_ENGINE_TESTS=1 .venv-vllm/bin/python -m pytest tests/engines/test_vllm_pd.py -q
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _missing import missing  # noqa: E402

try:
    import vllm  # noqa: F401
except ImportError as exc:  # pragma: no cover
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

CHUNK = 16
PROMPT = [(i * 7919 + 13) % 30000 for i in range(5 * CHUNK + 7)]  # 5 whole chunks and a partial one
KV_SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}


@pytest.fixture(autouse=True)
def _vllm():
    if _IMPORT_ERROR is not None:
        missing(f"vllm is not importable ({_IMPORT_ERROR}); install it with: make engines")


def engine(role: str, **extra):
    import lmcache

    return lmcache.CacheEngine.from_config({
        "chunk_size": CHUNK, "tiers": [{"backend": "cpu", "capacity": "64MiB"}], "kv_spec": KV_SPEC,
        "transfer_channel": "tcp", "transfer": {"token": "pd-secret", "slot_timeout": 5.0, "alloc_wait": 0.5},
        "pd": {"role": role, **extra.pop("pd", {})}, **extra})


def cfg(role: str, **pd):
    from lmcache.config import load_config

    return load_config(None, chunk_size=CHUNK, kv_spec=KV_SPEC, transfer_channel="tcp", pd={"role": role, **pd})


class Proxy:
    """LMCache's proxy's notification socket: a ZMQ PULL bound on loopback."""

    def __init__(self):
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")

    def recv(self, timeout: float = 5.0) -> dict | None:
        import msgpack

        if not self.sock.poll(int(timeout * 1000)):
            return None
        return msgpack.unpackb(self.sock.recv())

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def test_hostile_kv_transfer_params_are_refused_with_one_line():
    from lmcache.plugins.connectors.vllm.pd import plan_of

    sender, receiver = cfg("sender"), cfg("receiver")
    good = {"req_id": "7", "receiver_host": "10.0.0.2", "receiver_init_port": [7300, 7301],
            "receiver_alloc_port": [7400, 7401]}
    p = plan_of({"ret_first_tok": True, "disagg_spec": good}, sender)
    assert p.target.url(1) == "10.0.0.2:7301" and p.notify_id == "7" and p.ret_first_tok
    for bad, why in [({**good, "receiver_host": "x/y@z"}, "receiver_host"), ({**good, "receiver_host": 7}, "receiver_host"),
                     ({**good, "receiver_init_port": [0]}, "not a port"), ({**good, "receiver_init_port": [70000]}, "not a port"),
                     ({**good, "receiver_init_port": list(range(1000, 1100))}, "1-64 ports"),
                     ({**good, "receiver_init_port": [True]}, "not a port"),
                     ({**good, "req_id": "r" * 300}, "req_id"), ("spec", "mapping")]:
        with pytest.raises(ValueError, match=why):
            plan_of({"disagg_spec": bad}, sender)
    assert plan_of({"disagg_spec": good}, receiver) is None  # a decoder pushes nothing
    p = plan_of({"do_remote_decode": True}, sender)
    assert p.offer.startswith("pd-") and len(p.offer) < 64
    lm = {"offer": "pd-abc", "endpoints": [["127.0.0.1:7300", "id-0"]], "tokens": 87}
    assert plan_of({"do_remote_prefill": True, "lmcache": lm}, receiver).pull["tokens"] == 87
    for bad, why in [({**lm, "offer": "../etc"}, "offer name"), ({**lm, "endpoints": []}, "1-64 endpoints"),
                     ({**lm, "endpoints": [["no-port", "x"]]}, "host:port"), ({**lm, "tokens": -1}, "tokens"),
                     ({**lm, "endpoints": [["h:1"]]}, r"\[url, identity\]")]:
        with pytest.raises(ValueError, match=why):
            plan_of({"do_remote_prefill": True, "lmcache": bad}, receiver)
    assert plan_of({"do_remote_decode": True}, cfg("off")) is None


def test_a_push_lands_in_the_decoder_and_the_proxy_is_told_also_when_it_fails(tmp_path, monkeypatch):
    from lmcache.plugins.connectors.vllm import pd
    from lmcache.plugins.connectors.vllm.metadata import PDSend, PushTarget

    monkeypatch.setenv("LMCACHE_VLLM_SOCKET_DIR", str(tmp_path))
    proxy = Proxy()
    dec = engine("receiver")
    pre = engine("sender", pd={"proxy_host": "127.0.0.1", "proxy_port": proxy.port, "notify_timeout": 1.0})
    w = pd.PDWorker(pre, pre.config, 0, "prefill", 0)
    try:
        kv = torch.randn(2, 2, len(PROMPT), 2, 8, generator=torch.Generator().manual_seed(3))
        pre.store(PROMPT, kv)
        host, port = dec.services["transfer"].endpoint.server.address
        w.send([PDSend("vllm-req-1", PROMPT, None, target=PushTarget(host, [port]), notify_id="17")])
        assert proxy.recv() == {"type": "ProxyNotif", "req_id": "17"}
        assert dec.lookup(PROMPT) == len(PROMPT)  # the partial last chunk too
        assert torch.equal(dec.retrieve(PROMPT).kv, kv)
        # a dead receiver: the push fails at once and the proxy is still told (it waits for it forever)
        t0 = time.monotonic()
        w.send([PDSend("vllm-req-2", PROMPT, None, target=PushTarget("127.0.0.1", [1]), notify_id="18")])
        assert proxy.recv() == {"type": "ProxyNotif", "req_id": "18"} and time.monotonic() - t0 < 5
        w._pool.shutdown(wait=True)  # the counters move just after the message leaves
        assert w.stats["push_failed"] == 1 and w.stats["notified"] == 2
    finally:
        w.close()
        for e in (pre, dec):
            e.close()
        proxy.close()


def test_a_full_decoder_buffer_backs_off_for_a_bounded_time_then_gives_up_and_notifies(tmp_path, monkeypatch):
    from lmcache.plugins.connectors.vllm import pd
    from lmcache.plugins.connectors.vllm.metadata import PDSend, PushTarget

    monkeypatch.setenv("LMCACHE_VLLM_SOCKET_DIR", str(tmp_path))
    proxy = Proxy()
    from lmcache.transfer import ChunkMeta

    dec = engine("receiver", transfer={"token": "pd-secret", "buffer_size": 24000})  # one request in flight
    pre = engine("sender", pd={"proxy_host": "127.0.0.1", "proxy_port": proxy.port})
    w = pd.PDWorker(pre, pre.config, 0, "prefill", 0)
    try:
        kv = torch.randn(2, 2, len(PROMPT), 2, 8)
        pre.store(PROMPT, kv)
        host, port = dec.services["transfer"].endpoint.server.address
        # another request's chunks fill the decoder's buffer
        squat = dec.services["transfer"].endpoint.buffer.reserve(
            "other", [ChunkMeta.of(k, o) for k, o in zip(pre.chunk_keys(PROMPT)[1], [
                h[0] for h in pre.services["transfer"].view.chunks.find(pre.chunk_keys(PROMPT)[1], prefix=False, raw=True)])])
        assert squat is not None
        t0 = time.monotonic()
        w.send([PDSend("r", PROMPT, None, target=PushTarget(host, [port]), notify_id="19")])
        assert proxy.recv() == {"type": "ProxyNotif", "req_id": "19"}
        waited = time.monotonic() - t0
        assert 0.4 < waited < 5, waited  # alloc_wait 0.5 s of backoff, never an endless retry
        time.sleep(0.2)  # the counters move just after the message leaves
        assert w.stats["push_failed"] == 1 and dec.lookup(PROMPT) == 0
        # the buffer frees while a push backs off: it goes through
        w.send([PDSend("r2", PROMPT, None, target=PushTarget(host, [port]), notify_id="20")])
        time.sleep(0.1)
        dec.services["transfer"].endpoint.buffer.abort(squat.id)
        assert proxy.recv() == {"type": "ProxyNotif", "req_id": "20"}
        w._pool.shutdown(wait=True)
        assert w.stats["pushed"] == 1 and torch.equal(dec.retrieve(PROMPT).kv, kv)
        dec.release(PROMPT)
        assert dec.stats()["transfer"]["open_allocations"] == 0
    finally:
        w.close()
        for e in (pre, dec):
            e.close()
        proxy.close()


def test_a_named_offer_is_pulled_by_name_and_a_missing_one_ends_within_recv_timeout(tmp_path, monkeypatch):
    from lmcache.plugins.connectors.vllm import pd
    from lmcache.plugins.connectors.vllm.metadata import LoadSpec, PDSend

    monkeypatch.setenv("LMCACHE_VLLM_SOCKET_DIR", str(tmp_path))
    pre = engine("sender")
    dec = engine("receiver", pd={"recv_timeout": 1.0})
    wp = pd.PDWorker(pre, pre.config, 0, "prefill", 0)
    wd = pd.PDWorker(dec, dec.config, 0, "decode", 0)
    try:
        kv = torch.randn(2, 2, len(PROMPT), 2, 8, generator=torch.Generator().manual_seed(5))
        pre.store(PROMPT, kv)
        wp.send([PDSend("req-a", PROMPT, None, offer="pd-0123abcd")])
        eps = pd.read_endpoints("prefill", 0, 1)
        assert eps == [[wp.url, pre.services["transfer"].endpoint.identity]]
        # what request_finished hands the proxy
        sched = pd.PDScheduler(pre.config, "prefill", 0, 1)

        class Req:
            request_id, prompt_token_ids, output_token_ids, kv_transfer_params = "req-a", PROMPT, [42], {
                "do_remote_decode": True}
        plan = sched.plan(Req)
        plan.offer, plan.sent = "pd-0123abcd", True
        params = sched.finished(Req)
        assert params["do_remote_prefill"] is True and params["lmcache"]["tokens"] == len(PROMPT)
        assert params["lmcache"]["endpoints"] == eps and params["remote_port"] == int(wp.url.rsplit(":", 1)[1])
        pull = pd.plan_of({"do_remote_prefill": True, "lmcache": params["lmcache"]}, dec.config).pull
        spec = LoadSpec("req-a", PROMPT, [], 0, len(PROMPT) // 16 * 16, exact=len(PROMPT), pull=pull)
        wd.pull(spec)
        assert torch.equal(dec.retrieve(PROMPT).kv, kv) and wd.stats["pulled"] == 1
        dec.release(PROMPT)
        assert pre.stats()["transfer"]["open_offers"] == 0  # released once pulled
        # an offer that never comes: the pull gives up after recv_timeout, nothing is held
        t0 = time.monotonic()
        wd.pull(LoadSpec("req-b", PROMPT[:32], [], 0, 32, exact=32, pull={**pull, "offer": "pd-never"}))
        assert 0.9 < time.monotonic() - t0 < 4 and wd.stats["pull_failed"] == 1
        assert dec.stats()["transfer"]["open_allocations"] == 0
    finally:
        wp.close()
        wd.close()
        for e in (pre, dec):
            e.close()
