"""Peer-to-peer: fetch on miss from a peer, prefill -> decode push, and the controller's move.

Instance A is a separate process (this file run as a script: the real SmolLM2 model
through the transformers connector, ``p2p.enabled``, registered with a controller);
instance B is this process. The model tests check the issue's promise: B's prefill is
skipped (the connector reports the hit tokens) and its greedy output equals a run
without any cache. The synthetic tests (engines with random KV, in this process, each
with its own real endpoint, API and the controller on loopback) check move, a peer that
is down or silent, and tokens.

Fetch throughput next to raw loopback TCP is measured by ``lmcache bench p2p``
(benchmarks/dist.py, across two processes; tests/benchmarks/test_bench_dist.py runs it small).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))  # the helpers, also when this file runs as a child script
from _procs import readline, stop, until  # noqa: E402

CTL_TOKEN = "ctl-secret"
P2P_TOKEN = "peer-secret"
API_TOKEN = "api-secret"
HANG = 60.0  # a generous guard, not a timing assertion
MCHUNK = 64
DOC = " ".join(f"Fact {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7} marbles." for i in range(30))
PROMPT_TEXT = DOC + "\nQuestion: how many marbles does box 12 hold?\nAnswer:"
SCHUNK = 16
SPROMPT = [(i * 7919 + 13) % 30000 for i in range(128)]
KV_SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}


def p2p_cfg(ctl_url: str | None, iid: str, *, fetch: bool = True, token: str = P2P_TOKEN, timeout: float = 2.0,
            chunk: int = SCHUNK, tiers: list | None = None, api: bool = False, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "chunk_size": chunk,
        "tiers": tiers or [{"backend": "cpu", "capacity": "256MiB"}],
        "p2p": {"enabled": True, "token": token, "fetch": fetch, "timeout": timeout},
        **extra,
    }
    if ctl_url:
        cfg["controller"] = {"url": ctl_url, "token": CTL_TOKEN, "instance_id": iid, "heartbeat_interval": 0.2,
                             "timeout": 2.0}
    if api:
        cfg["api"] = {"enabled": True, "token": API_TOKEN}
    return cfg


@pytest.fixture(scope="module")
def controller():
    from lmcache.plugins.services.controller_client import ControllerClient
    from lmcache.server.controller import ControllerServer

    with ControllerServer(port=0, token=CTL_TOKEN, instance_timeout=5) as ctl:
        yield ctl, ControllerClient(ctl.url, CTL_TOKEN, 5)


def registered(client, iid: str) -> dict | None:
    return next((i for i in client.instances() if i["instance_id"] == iid and i.get("peer_url")), None)


# ====================================================================== the real model
@pytest.fixture(scope="module")
def instance_a(controller, tmp_path_factory, smollm2):
    """Instance A: a separate process that ran PROMPT_TEXT through the model and stored its KV."""
    ctl, client = controller
    spec = tmp_path_factory.mktemp("p2p") / "a.json"
    spec.write_text(json.dumps({"config": p2p_cfg(ctl.url, "eng-a", chunk=MCHUNK), "prompt": PROMPT_TEXT}))
    proc = subprocess.Popen([sys.executable, __file__, "model-engine", str(spec)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    try:
        line = readline(proc, 180)
        assert line.startswith("READY "), line
        until(lambda: registered(client, "eng-a"), "eng-a registered with its peer endpoint")
        yield proc, line.split()[1]
    finally:
        stop(proc)


def model_engine(smollm2, ctl_url: str, iid: str, **kw: Any):
    import lmcache
    from lmcache.plugins.connectors.hf import TransformersConnector, kv_spec_of

    model, tok = smollm2
    eng = lmcache.CacheEngine.from_config(p2p_cfg(ctl_url, iid, chunk=MCHUNK, **kw), kv_spec=kv_spec_of(model))
    return TransformersConnector(model, tok, eng)


def assert_same(base, hit):
    assert hit.tokens == base.tokens, (hit.text, base.text)
    assert torch.allclose(hit.first_logits, base.first_logits, atol=1e-4, rtol=0)


def test_p2p_hit_skips_the_prefill_with_identical_output(smollm2, controller, instance_a):
    ctl, client = controller
    conn = model_engine(smollm2, ctl.url, "eng-b")
    try:
        ids = conn.encode(PROMPT_TEXT)
        base = conn.generate(ids, max_new_tokens=10, use_cache=False, store=False)
        hit = conn.generate(ids, max_new_tokens=10)
        assert hit.cached_tokens == len(ids) - 1  # everything but the last token came from A
        assert_same(base, hit)
        p2p = conn.engine.stats()["p2p"]
        assert p2p["fetched_chunks"] == -(-len(ids) // MCHUNK) and p2p["failed_fetches"] == 0
        # now cached locally: a second run asks nobody
        lookups = p2p["lookups"]
        again = conn.generate(ids, max_new_tokens=10)
        assert again.cached_tokens == len(ids) - 1 and conn.engine.stats()["p2p"]["lookups"] == lookups
        assert_same(base, again)
    finally:
        conn.close()


def test_prefill_pushes_to_decode_with_identical_output(smollm2, controller, instance_a):
    ctl, client = controller
    proc, _ = instance_a
    conn = model_engine(smollm2, ctl.url, "eng-decode", fetch=False)  # only what is pushed can hit
    try:
        ids = conn.encode(PROMPT_TEXT)
        assert conn.engine.lookup(ids) == 0
        until(lambda: registered(client, "eng-decode"), "the decode instance registered")
        proc.stdin.write("PUSH eng-decode\n")  # by instance id, resolved through the controller
        proc.stdin.flush()
        r = json.loads(readline(proc))
        assert len(r["pushed"]) == -(-len(ids) // MCHUNK) and r["missing"] == [] and r["target"] == conn.engine.peer_url
        assert conn.engine.lookup(ids) == len(ids)
        base = conn.generate(ids, max_new_tokens=10, use_cache=False, store=False)
        hit = conn.generate(ids, max_new_tokens=10)
        assert hit.cached_tokens == len(ids) - 1 and set(hit.tiers) == {"cpu"}
        assert_same(base, hit)
        assert conn.engine.stats()["p2p"]["endpoint"]["received_chunks"] == len(r["pushed"])
    finally:
        conn.close()


# ====================================================================== synthetic engines
def synthetic(ctl_url: str | None, iid: str, **kw: Any):
    import lmcache

    return lmcache.CacheEngine.from_config({**p2p_cfg(ctl_url, iid, **kw), "kv_spec": KV_SPEC})


def kv_for(tokens: list[int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, len(tokens), 2, 8, generator=g)


def test_move_between_instances(controller, tmp_path):
    ctl, client = controller
    # neither fetches from peers: the lookups below see each instance's own tiers (a source
    # that fetched would, once the controller knows the destination's copies, find them there)
    src = synthetic(ctl.url, "mv-src", api=True, fetch=False)
    dst = synthetic(ctl.url, "mv-dst", api=True, fetch=False,
                    tiers=[{"backend": "cpu", "capacity": "64MiB"}, {"backend": "disk", "path": str(tmp_path / "d"), "capacity": "64MiB"}])
    try:
        kv = kv_for(SPROMPT)
        src.store(SPROMPT, kv)
        until(lambda: registered(client, "mv-src") and registered(client, "mv-dst"), "both registered")
        keys = src.chunk_keys(SPROMPT)[1]
        # copy into the destination's disk tier: the source keeps its entries
        r = client.command("move", src_instance="mv-src", src_tier="cpu", dst_instance="mv-dst", dst_tier="disk",
                           tokens=SPROMPT)
        assert r["result"]["pushed"] == keys and r["result"]["removed"] == []
        assert sorted(k for k, _ in dst.hierarchy.tier("disk").keys()) == sorted(keys)
        assert [k for k, _ in dst.hierarchy.tier("cpu").keys()] == []
        assert src.lookup(SPROMPT) == 128
        got = dst.retrieve(SPROMPT)
        assert got.num_tokens == 128 and torch.equal(got.kv, kv)
        # move the first half into the destination's cpu tier, removing it from the source
        r = client.command("move", src_instance="mv-src", src_tier="cpu", dst_instance="mv-dst", dst_tier="cpu",
                           keys=keys[:4], remove_source=True)
        assert r["result"]["removed"] == sorted(keys[:4])
        assert sorted(k for k, _ in src.hierarchy.tier("cpu").keys()) == sorted(keys[4:])
        assert src.lookup(SPROMPT) == 0
        # a destination without an endpoint, or an unknown tier, is refused with a clear error
        from lmcache.errors import AdminError

        with pytest.raises(AdminError, match="no tier 'tape'"):
            client.command("move", src_instance="mv-src", src_tier="cpu", dst_instance="mv-dst", dst_tier="tape",
                           tokens=SPROMPT)
    finally:
        src.close()
        dst.close()


def test_peer_down_or_silent_is_a_miss(controller):
    ctl, client = controller
    holder = synthetic(ctl.url, "down-holder")
    holder.store(SPROMPT, kv_for(SPROMPT))
    until(lambda: registered(client, "down-holder") and client.lookup(keys=holder.chunk_keys(SPROMPT)[1])["results"],
          "holder indexed")
    fetcher = synthetic(ctl.url, "down-fetcher", timeout=0.5)
    try:
        host, port = holder.p2p.endpoint.server.address
        holder.p2p.endpoint.close()
        # silent: a socket that accepts connections and never answers
        silent = socket.socket()
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        silent.bind((host, port))
        silent.listen(16)
        try:
            t0 = time.monotonic()
            assert fetcher.lookup(SPROMPT) == 0  # a miss, no exception
            assert time.monotonic() - t0 < HANG
            assert fetcher.stats()["p2p"]["failed_fetches"] == 1
            assert fetcher.retrieve(SPROMPT).num_tokens == 0  # backing off: not asked again
            assert fetcher.stats()["p2p"]["failed_fetches"] == 1
        finally:
            silent.close()
        # refused: nothing listens any more
        fetcher.p2p.peers._health.clear()
        assert fetcher.lookup(SPROMPT) == 0
        assert fetcher.stats()["p2p"]["failed_fetches"] == 2
    finally:
        fetcher.close()
        holder.close()


def test_tokens_and_foreign_chunks_are_refused(controller):
    from lmcache import payload
    from lmcache.backends.lm import LMBackend
    from lmcache.encoded import open_objects
    from lmcache.errors import BackendError
    from lmcache.storage import BackendContext

    ctl, client = controller
    holder = synthetic(None, "tok-holder")
    holder.store(SPROMPT, kv_for(SPROMPT))
    keys = holder.chunk_keys(SPROMPT)[1]
    try:
        url = holder.peer_url

        def peer(token: str | None):
            """The peer endpoint as a tier sees it (the lm store through its object view)."""
            return open_objects(LMBackend(BackendContext.standalone({"url": url, "token": token, "timeout": 2.0})))

        for token in (None, "wrong", P2P_TOKEN + "x"):
            with pytest.raises(BackendError, match="wrong token|authentication required"):
                peer(token).get(keys[:1])
        good = peer(P2P_TOKEN)
        objs = good.get(keys)
        assert all(o is not None for o in objs) and good.exists(keys[:2]) == [True, True]
        # a PUT of KV of another shape, another namespace, or a key that is not ours: ERROR, connection kept
        from lmcache.keys import CacheKey

        k0 = CacheKey.parse(keys[0])
        for bad_key in (CacheKey("other", k0.model, k0.signature, k0.chunk_hash).to_string(),
                        CacheKey(k0.namespace, k0.model, "float16-L9-H9-D9-lt2hd-tp0of1", k0.chunk_hash).to_string(),
                        "not-a-key"):
            with pytest.raises(BackendError, match="refused"):
                good.put([(bad_key, objs[0])])
        wrong_shape = torch.zeros(2, 2, 4, 3, 8)
        from lmcache.memory import MemoryPool

        obj = MemoryPool.allocate_unpooled(wrong_shape.shape, torch.float32)
        bufs = payload.encode(keys[0], obj, good.context.codec)
        with pytest.raises(BackendError, match="not KV of"):
            good.raw.put_one(keys[0], bufs)  # the payload's bytes as they are, past our own checks
        assert good.delete_one(keys[0]) is False  # peers never delete
        assert holder.lookup(SPROMPT) == 128
        for o in objs:
            o.unref()
        good.close()
        # an engine with the wrong token fetches nothing, and does not fail
        fetcher = synthetic(None, "tok-fetcher", token="wrong")
        try:
            chunks, fkeys = fetcher.chunk_keys(SPROMPT)
            assert fetcher.p2p._fetch_from(url, chunks, fkeys) == 0
            assert fetcher.stats()["p2p"]["failed_fetches"] == 1 and fetcher.lookup(SPROMPT) == 0
        finally:
            fetcher.close()
    finally:
        holder.close()


def test_push_by_address_and_config_checks():
    from lmcache.config import load_config
    from lmcache.errors import ConfigError

    a, b = synthetic(None, "push-a"), synthetic(None, "push-b", fetch=False)
    try:
        kv = kv_for(SPROMPT, 3)
        a.store(SPROMPT[:72], kv[:, :, :72])  # 4 full chunks and a partial one
        r = a.push(SPROMPT, b.peer_url)  # the cached prefix only (the partial chunk's hash differs)
        assert len(r["pushed"]) == 4 and len(r["missing"]) == 4
        assert b.lookup(SPROMPT) == 64
        r = a.push(SPROMPT[:72], b.peer_url)
        assert len(r["pushed"]) == 5 and r["missing"] == []
        got = b.retrieve(SPROMPT[:72])
        assert got.num_tokens == 72 and torch.equal(got.kv, kv[:, :, :72])
    finally:
        a.close()
        b.close()
    cfg = load_config({"p2p": True}, environ={"LMCACHE_P2P_TOKEN": "s3cret"})
    assert cfg.p2p.enabled and cfg.p2p.token == "s3cret" and cfg.to_dict(mask_secrets=True)["p2p"]["token"] == "***"
    for bad, key in (({"port": 70000}, "p2p.port"), ({"timeout": 0}, "p2p.timeout"), ({"fetch": "yes"}, "p2p.fetch"),
                     ({"token": " t"}, "p2p.token"), ({"peers": []}, "p2p.peers")):
        with pytest.raises(ConfigError) as ei:
            load_config({"p2p": bad}, environ={})
        assert ei.value.key == key


# ====================================================================== script modes
def _model_engine_main(spec_path: str) -> None:
    """Instance A: load the model, run the prompt (storing its KV), serve; on stdin
    ``PUSH TARGET`` push the prompt's KV to TARGET and print the result as JSON."""
    import threading

    import lmcache
    from lmcache.plugins.connectors.hf import TransformersConnector, kv_spec_of
    from model_fixtures import require_model

    spec = json.loads(Path(spec_path).read_text())
    model, tok = require_model()
    stop_ev = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop_ev.set())
    eng = lmcache.CacheEngine.from_config(spec["config"], kv_spec=kv_spec_of(model))
    conn = TransformersConnector(model, tok, eng)
    try:
        ids = conn.encode(spec["prompt"])
        conn.generate(ids, max_new_tokens=1)
        print(f"READY {eng.peer_url} {eng.instance_id}", flush=True)

        def commands() -> None:
            try:
                for line in sys.stdin:
                    parts = line.split()
                    if parts[:1] == ["PUSH"]:
                        try:
                            r = eng.push(ids, parts[1])
                        except Exception as exc:  # reported to the test
                            r = {"error": f"{type(exc).__name__}: {exc}"}
                        print(json.dumps(r), flush=True)
            except (OSError, ValueError):
                pass
            stop_ev.set()

        threading.Thread(target=commands, daemon=True).start()
        stop_ev.wait()
    finally:
        conn.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["model-engine"]:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        _model_engine_main(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} model-engine SPEC.json")
