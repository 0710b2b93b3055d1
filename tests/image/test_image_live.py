"""The image (`make image`) started as users start it: `podman run --init`, the demo model
mounted read-only, vLLM's built-in LMCacheConnectorV1 configured by LMCache's variables or
a read-only LMCACHE_CONFIG_FILE, requests through the published port. Greedy answers are
compared with the same image serving without lmcache.

Run: make test-image  (or LMCACHE_IMAGE_TESTS=1 .venv/bin/python -m pytest tests/image)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from _missing import missing  # noqa: E402
from _podman import IMAGE, UPSTREAM_KV, Container, VllmContainer, podman, podman_problem, readable_model  # noqa: E402

from lmcache.errors import LMCacheError  # noqa: E402

CHUNK = 256
MAX_TOKENS = 12
SEEDS = (1, 2)


def questions(seed: int) -> list[str]:
    """Two questions about one handbook (about 600 tokens: two whole 256-token chunks and more)."""
    from lmcache.benchmarks.handbook import handbook_text, key_facts

    facts = key_facts(seed)
    doc = handbook_text(14, seed, facts)
    return [f"{doc}\n\nQuestion: {f.question}" for f in facts[:2]]


def chat(srv: VllmContainer, content: str) -> str:
    """A greedy chat completion through the container's published port."""
    body = {"model": srv.name, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0.0}
    status, raw = srv._request("POST", "/v1/chat/completions", body, timeout=300.0)
    if status != 200:
        raise LMCacheError(f"chat completion answered {status}: {raw[:300]!r}")
    return json.loads(raw)["choices"][0]["message"]["content"]


def hits(srv: VllmContainer) -> float:
    return srv.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)


@pytest.fixture(scope="module")
def image() -> str:
    problem = podman_problem()
    if problem:
        missing(problem)
    return IMAGE


@pytest.fixture(scope="module")
def model(image, tmp_path_factory) -> Path:
    from lmcache.plugins.connectors.hf_models import smollm2_checkpoint

    return readable_model(smollm2_checkpoint(), tmp_path_factory.mktemp("model") / "smollm2")


@pytest.fixture(scope="module")
def reference(model) -> dict[str, str]:
    """Greedy answers of the same image's `vllm serve` without lmcache."""
    srv = VllmContainer(model)
    try:
        return {q: chat(srv, q) for seed in SEEDS for q in questions(seed)}
    finally:
        srv.close()


@pytest.mark.timeout(1500)  # a hang guard: a container's vllm serve starts in 1-3 min here
def test_vllm_serve_container_hits_its_cpu_tier_and_stops_on_sigterm(model, reference, tmp_path):
    """LMCACHE_CONFIG_FILE (LMCache's keys, mounted read-only) with a CPU tier: the second
    chat about a document hits its chunks (vLLM's external_prefix_cache_hits and lmcache's
    num_hit_tokens in vLLM's /metrics agree), answers equal the image without lmcache; then
    SIGTERM (`podman stop`) stops it without SIGKILL and leaves no process behind."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "lmcache.yaml").write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 0.5\n")
    conf.chmod(0o755)
    (conf / "lmcache.yaml").chmod(0o644)
    env = {"LMCACHE_CONFIG_FILE": "/etc/lmcache/lmcache.yaml", "PROMETHEUS_MULTIPROC_DIR": "/tmp"}
    srv = VllmContainer(model, env=env, volumes=[f"{conf}:/etc/lmcache:ro"], kv_transfer_config=UPSTREAM_KV)
    try:
        got_hits = []
        for seed in SEEDS:
            first, second = questions(seed)
            assert chat(srv, first) == reference[first]
            before = hits(srv)
            assert chat(srv, second) == reference[second]
            got = hits(srv) - before
            assert got >= CHUNK and got % CHUNK == 0, got
            got_hits.append(got)
        m = srv.metrics()
        print("hits per second question:", got_hits,
              {k: v for k, v in sorted(m.items()) if k.startswith("lmcache:num_") and "bucket" not in k})
        assert m["lmcache:num_hit_tokens_total"] == m["vllm:external_prefix_cache_hits_total"] == sum(got_hits)
        pids = srv.container.host_pids()
        assert len(pids) >= 3, pids  # the init, vllm's API server, engine core and worker
        took, code = srv.container.stop(timeout=60)
        print(f"podman stop (SIGTERM): {took:.1f} s, exit code {code}; logs:\n{srv.container.logs(8)}")
        assert code != 137, f"SIGKILLed after the 60 s grace period: {srv.container.logs()}"
        assert not srv.container.running()
        assert [p for p in pids if Path(f"/proc/{p}").exists()] == []
    finally:
        srv.close()


def _listening(server: Container, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "LISTENING" in server.logs():
            return
        if not server.running():
            raise LMCacheError(f"lmcache_server exited: {server.logs()}")
        time.sleep(0.5)
    raise LMCacheError(f"lmcache_server not listening within {timeout:g}s: {server.logs()}")


#: the production stack's liveness probe and init-container command, as its chart writes them
PROBE = ["/opt/venv/bin/python3", "/workspace/LMCache/examples/kubernetes/health_probe.py"]


def _server_pid(server: Container) -> int:
    rows = podman("top", server.name, "hpid", "args").stdout.splitlines()[1:]
    # the server's own process, not the init (`podman run --init`) that started it
    pids = [int(r.split()[0]) for r in rows
            if "lmcache_server" in r and r.split()[0].isdigit() and "init" not in r.split()[1]]
    assert len(pids) == 1, rows
    return pids[0]


def test_production_stacks_cache_server_probe_and_init_container(image):
    """production-stack's cache-server pod on our image: `lmcache_server 0.0.0.0 PORT`, its
    liveness probe (`python3 .../health_probe.py 127.0.0.1 PORT`, timeout 5 s) exec'd in
    the container and the vLLM pods' init container looping on the same script against
    the server's address. Before: the probe exited 2 ("can't open file"), so the pod
    would be restarted every ~30 s and the vLLM pods would never start."""
    server = Container(["--entrypoint", "/opt/venv/bin/lmcache_server", image, "0.0.0.0", "7171"])
    init = None
    try:
        _listening(server)
        ok = podman("exec", server.name, *PROBE, "127.0.0.1", "7171", check=False, timeout=60)
        assert ok.returncode == 0 and ok.stdout.startswith("healthy"), (ok.stdout, ok.stderr)
        init = Container(["--entrypoint", "sh", image, "-c",
                          f"until {' '.join(PROBE)} {server.ip()} 7171; do sleep 1; done"])
        code = podman("wait", init.name, timeout=120).stdout.strip()
        assert code == "0", (code, init.logs())
        pid = _server_pid(server)
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            bad = podman("exec", server.name, *PROBE, "127.0.0.1", "7171", check=False, timeout=60)
            took = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        print(f"probe: green; init container: done; stopped server: red after {took:.1f} s ({bad.stderr.strip()})")
        assert bad.returncode == 1 and "no answer" in bad.stderr, (bad.stdout, bad.stderr)
        assert took < 5 + 30, took  # a hang guard (the probe's own timeout is 5 s; podman exec adds its start)
        again = podman("exec", server.name, *PROBE, "127.0.0.1", "7171", check=False, timeout=60)
        assert again.returncode == 0, again.stderr
    finally:
        if init is not None:
            init.remove()
        server.remove()


@pytest.mark.timeout(1500)
def test_restarted_vllm_container_hits_what_the_first_stored_in_an_lm_server_container(model, reference):
    """The production stack's cache server (`/opt/venv/bin/lmcache_server 0.0.0.0 PORT`) in
    one container; `vllm serve` with the production stack's variables (LMCACHE_REMOTE_URL
    lm://, no local CPU tier) in another. After that one is stopped, a new `vllm serve`
    container's first question about the same document loads its chunks from the server."""
    server = Container(["--entrypoint", "/opt/venv/bin/lmcache_server", IMAGE, "0.0.0.0", "7171", "--capacity", "1GiB"])
    try:
        _listening(server)
        env = {"LMCACHE_USE_EXPERIMENTAL": "True", "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "False",
               "LMCACHE_REMOTE_URL": f"lm://{server.ip()}:7171", "LMCACHE_REMOTE_SERDE": "naive",
               "PROMETHEUS_MULTIPROC_DIR": "/tmp"}
        first, second = questions(SEEDS[0])
        a = VllmContainer(model, env=env, kv_transfer_config=UPSTREAM_KV)
        try:
            assert chat(a, first) == reference[first]
            assert hits(a) == 0
            _, code = a.container.stop(timeout=60)  # its writes to the server are flushed on exit
            assert code != 137
        finally:
            a.close()
        b = VllmContainer(model, env=env, kv_transfer_config=UPSTREAM_KV)
        try:
            assert chat(b, second) == reference[second]
            m = b.metrics()
            print("restarted container:", {k: v for k, v in sorted(m.items())
                                           if k.startswith(("lmcache:num_", "vllm:external")) and "bucket" not in k})
            got = m.get("vllm:external_prefix_cache_hits_total", 0.0)
            assert got >= CHUNK and got % CHUNK == 0, got
            assert m["lmcache:num_hit_tokens_total"] == got
        finally:
            b.close()
        took, code = server.stop(timeout=30)
        print(f"lmcache_server stop (SIGTERM): {took:.1f} s, exit code {code}")
        assert code != 137
    finally:
        server.remove()


#: the decode pod's LMCache variables in deploy/kubernetes/overlays/pd (production-stack's names)
PD_DECODE_ENV = {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0", "LMCACHE_ENABLE_PD": "True",
                 "LMCACHE_TRANSFER_CHANNEL": "nixl", "LMCACHE_PD_ROLE": "receiver", "LMCACHE_PD_PEER_HOST": "0.0.0.0",
                 "LMCACHE_PD_PEER_INIT_PORT": "7300", "LMCACHE_PD_PEER_ALLOC_PORT": "7400",
                 "LMCACHE_PD_BUFFER_SIZE": "67108864", "LMCACHE_PD_BUFFER_DEVICE": "cuda"}

_PD_SCRIPT = """
import os, subprocess, sys
import lmcache
kv = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}
dec = lmcache.CacheEngine.from_config(None, kv_spec=kv, chunk_size=16)  # the pod's LMCACHE_* variables
sender = '''
import lmcache, torch
pre = lmcache.CacheEngine.from_config(None, kv_spec=%r, chunk_size=16, transfer_channel="nixl")
toks = list(range(64))
pre.store(toks, torch.randn(2, 2, 64, 2, 8))
print(pre.services["transfer"].push(pre.chunk_keys(toks)[1], "127.0.0.1:7300", "req-1")["committed"])
''' % kv
clean = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
out = subprocess.run([sys.executable, "-c", sender], env=clean, capture_output=True, text=True, timeout=120)
assert out.returncode == 0, out.stderr[-2000:]
print(dec.services["transfer"].endpoint.name, dec.services["transfer"].url, out.stdout.split()[-1], dec.lookup(list(range(64))))
"""


def test_the_pd_overlays_decode_settings_open_a_nixl_endpoint_in_the_image(image):
    """The pd overlay's decode pod's variables, in the image: NIXL is installed, the endpoint
    listens on pd_peer_init_port, and a sender's push over NIXL lands as a local hit."""
    env = [a for k, v in PD_DECODE_ENV.items() for a in ("-e", f"{k}={v}")]
    r = podman("run", "--rm", "--network=none", *env, "--entrypoint", "/opt/venv/bin/python", image, "-c", _PD_SCRIPT,
               check=False, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-4:] == ["nixl", "0.0.0.0:7300", "4", "64"], r.stdout
