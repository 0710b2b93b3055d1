"""The controller and its workers, as separate processes on loopback.

A controller process (``lmcache controller serve --port 0``) and three engine processes
(this file run as a script: an engine with synthetic KV, the instance API and
``controller.url``), each holding a different prefix of one prompt. The tests check what
a router and an operator see: lookups pick the longest hit; evictions reach the index
through the workers' events; commands dispatched through the controller take effect in
the instance (checked through the instance's own API); a killed instance drops out; a
restarted controller is healed by the workers; tokens are enforced.

Lookup latency is measured by ``lmcache bench controller`` (benchmarks/dist.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from _procs import readline, stop, until
from lmcache.testing.procs import serve_until_stdin_closes

ROOT = Path(__file__).resolve().parents[2]
CTL_TOKEN = "ctl-secret"
API_TOKEN = "api-secret"
CHUNK = 16
PROMPT = [(i * 7919 + 13) % 30000 for i in range(128)]
STORED = {"eng-a": 32, "eng-b": 64, "eng-c": 128}
KV_SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}
HANG = 30.0  # a generous guard, not a timing assertion


# ---------------------------------------------------------------- processes
def _controller_cmd() -> list[str]:
    return [sys.executable, "-m", "lmcache.cli.main", "controller"]


def start_controller(port: int = 0, *extra: str, token: str | None = CTL_TOKEN) -> tuple[subprocess.Popen, str]:
    args = [*_controller_cmd(), "serve", "--port", str(port), "--instance-timeout", "1.5", *extra]
    env = dict(os.environ)
    env.pop("LMCACHE_CONTROLLER_TOKEN", None)
    if token:
        env["LMCACHE_CONTROLLER_TOKEN"] = token
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
    url = readline(proc)
    assert url.startswith("http://127.0.0.1:"), url
    return proc, url


def start_engine(tmp: Path, iid: str, ctl_url: str, n_tokens: int, prompt: list[int] = PROMPT,
                 chunk: int = CHUNK) -> tuple[subprocess.Popen, str]:
    cfg = {
        "chunk_size": chunk,
        "model": "org/synthetic",
        "kv_spec": KV_SPEC,
        "tiers": [{"backend": "cpu", "capacity": "8MiB"},
                  {"backend": "disk", "path": str(tmp / iid), "capacity": "64MiB"}],
        "api": {"enabled": True, "token": API_TOKEN, "timeout": 5},
        "controller": {"url": ctl_url, "token": CTL_TOKEN, "instance_id": iid, "heartbeat_interval": 0.2,
                       "timeout": 1.0},
    }
    path = tmp / f"{iid}.json"
    path.write_text(json.dumps({"config": cfg, "tokens": prompt[:n_tokens]}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, __file__, "engine", str(path)], stdin=subprocess.PIPE,  # tests/ for _procs
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
    line = readline(proc, 60)
    assert line.startswith("READY "), line
    return proc, line.split()[1]


# ---------------------------------------------------------------- HTTP helpers
def call(url: str, method: str, path: str, body: Any = None, token: str | None = CTL_TOKEN,
         raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def lookup(url: str, tokens: list[int] = PROMPT) -> dict[str, Any]:
    status, r = call(url, "POST", "/v1/lookup", {"tokens": tokens})
    assert status == 200, r
    return r


def hits(url: str) -> dict[str, int]:
    return {row["instance_id"]: row["hit_tokens"] for row in lookup(url)["results"]}


# ---------------------------------------------------------------- the cluster
class Cluster:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.ctl, self.url = start_controller()
        self.engines: dict[str, subprocess.Popen] = {}
        self.api: dict[str, str] = {}
        for iid, n in STORED.items():
            self.engines[iid], self.api[iid] = start_engine(tmp, iid, self.url, n)

    def close(self) -> None:
        for p in self.engines.values():  # all told at once: they deregister side by side
            if p.stdin:
                p.stdin.close()
        for p in self.engines.values():
            stop(p)
        stop(self.ctl)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("ctl"))
    try:
        until(lambda: len(lookup(c.url)["results"]) == 3, "all three instances indexed")
        yield c
    finally:
        c.close()


def instance_api(cluster: Cluster, iid: str):
    from lmcache.plugins.services.api_client import ApiClient

    return ApiClient(cluster.api[iid], API_TOKEN, timeout=10)


def keys_of(tokens: list[int]) -> list[str]:
    from lmcache.config import KVSpec
    from lmcache.keys import CacheKey, TokenProcessor

    sig = KVSpec(**KV_SPEC).signature
    return [CacheKey("default", "org/synthetic", sig, h).to_string() for h in TokenProcessor(CHUNK).hashes(tokens)]


# ---------------------------------------------------------------- tests (in order: later ones change the cluster)
def test_lookup_picks_the_longest_hit(cluster):
    r = until(lambda: (lambda x: x if all(row["tiers"] == {"cpu": row["hit_tokens"]} for row in x["results"]) else None)(
        lookup(cluster.url)), "every hit served from cpu")
    assert r["best"] == "eng-c"
    assert [(row["instance_id"], row["hit_tokens"], row["tier"]) for row in r["results"]] == [
        ("eng-c", 128, "cpu"), ("eng-b", 64, "cpu"), ("eng-a", 32, "cpu")]
    assert r["results"][0]["api_url"] == cluster.api["eng-c"]
    # a prompt that diverges after 40 tokens: prefix semantics stop at the first chunk not held
    other = PROMPT[:40] + [7] * 88
    assert {row["instance_id"]: row["hit_tokens"] for row in lookup(cluster.url, other)["results"]} == {
        "eng-a": 32, "eng-b": 32, "eng-c": 32}
    # by chunk hashes (what a router that hashes itself sends), and by keys
    from lmcache.keys import TokenProcessor

    hashes = TokenProcessor(CHUNK).hashes(PROMPT)
    status, r2 = call(cluster.url, "POST", "/v1/lookup", {"chunk_hashes": hashes, "num_tokens": 120})
    assert status == 200
    assert [(x["instance_id"], x["hit_tokens"]) for x in r2["results"]] == [("eng-c", 120), ("eng-b", 64), ("eng-a", 32)]
    status, r3 = call(cluster.url, "POST", "/v1/lookup", {"keys": keys_of(PROMPT)[:3]})
    assert [(x["instance_id"], x["hit_tokens"]) for x in r3["results"]] == [("eng-b", 48), ("eng-c", 48), ("eng-a", 32)]
    # filters
    assert lookup_filtered(cluster.url, model="other")["results"] == []
    assert len(lookup_filtered(cluster.url, namespace="default")["results"]) == 3
    # write-through: the disk tier got every chunk too
    rows = {i["instance_id"]: i for i in call(cluster.url, "GET", "/v1/instances")[1]}
    assert set(rows) == set(STORED) and all(i["healthy"] and i["tiers"] == ["cpu", "disk"] for i in rows.values())
    assert rows["eng-c"]["keys"] == 8 and "api_token" not in rows["eng-c"]


def lookup_filtered(url: str, **f: str) -> dict[str, Any]:
    return call(url, "POST", "/v1/lookup", {"tokens": PROMPT, **f})[1]


def test_wrong_or_missing_token_is_401(cluster):
    for token in (None, "wrong", CTL_TOKEN + "x"):
        for method, path, body in (("GET", "/v1/instances", None), ("POST", "/v1/lookup", {"tokens": [1]}),
                                   ("POST", "/v1/register", {}), ("POST", "/v1/clear", {"instance": "eng-a"}),
                                   ("GET", "/openapi.json", None)):
            status, r = call(cluster.url, method, path, body, token=token)
            assert status == 401, (token, path, r)
            assert "token" in r["error"]
    # a worker with the wrong token is refused too (and nothing is registered)
    status, _ = call(cluster.url, "POST", "/v1/events", {"instance_id": "eng-a", "session": "x", "events": []}, token="bad")
    assert status == 401


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/lookup", {}, 400, "exactly one of"),
    ("/v1/lookup", {"tokens": [1], "keys": ["k"]}, 400, "exactly one of"),
    ("/v1/lookup", {"tokens": "1,2"}, 400, "'tokens'"),
    ("/v1/lookup", {"tokens": [1, -2]}, 400, "'tokens'[1]"),
    ("/v1/lookup", {"tokens": [1, True]}, 400, "'tokens'[1]"),
    ("/v1/lookup", {"chunk_hashes": ["zz"]}, 400, "'chunk_hashes'[0]"),
    ("/v1/lookup", {"tokens": [1], "limit": 3}, 400, "unknown field 'limit'"),
    ("/v1/clear", {"tier": "cpu"}, 400, "'instance' is required"),
    ("/v1/clear", {"instance": "nope"}, 404, "unknown instance 'nope'"),
    ("/v1/clear", {"instance": "eng-a", "tier": "tape"}, 404, "no tier 'tape'"),
    ("/v1/clear", {"instance": "eng-a"}, 400, "say what to clear: tier, tokens, keys or all: true"),
    ("/v1/clear", {"instance": "eng-a", "all": False}, 400, "say what to clear"),
    ("/v1/clear", {"instance": "eng-a", "all": True, "keys": ["k"]}, 400, "all cannot be combined"),
    ("/v1/pin", {"instance": "eng-a"}, 400, "'tokens' or 'keys'"),
    ("/v1/compress", {"instance": "eng-a", "tier": "disk"}, 400, "'codec' is required"),
    ("/v1/events", {"instance_id": "eng-a", "session": "forged", "events": []}, 404, "register again"),
    ("/v1/register", {"instance_id": "x y", "namespace": "d", "model": "m", "chunk_size": 16, "tiers": ["cpu"]},
     400, "'instance_id'"),
    ("/v1/move", {"src_instance": "eng-c", "src_tier": "cpu", "dst_instance": "eng-a"}, 400, "'dst_tier' is required"),
    ("/v1/move", {"src_instance": "eng-c", "src_tier": "cpu", "dst_instance": "eng-a", "dst_tier": "cpu",
                  "tokens": PROMPT}, 409, "runs no peer endpoint"),
    ("/v1/nothing", {}, 404, "no such endpoint"),
])
def test_bad_requests_name_the_field(cluster, path, body, status, needle):
    got, r = call(cluster.url, "POST", path, body)
    assert (got, r["status"]) == (status, status), r
    assert needle in r["error"], r


def test_malformed_bodies_and_methods(cluster):
    assert call(cluster.url, "POST", "/v1/lookup", raw=b"{not json")[0] == 400
    assert call(cluster.url, "POST", "/v1/lookup", raw=b"[1, 2]")[1]["error"] == "body must be a JSON object"
    assert call(cluster.url, "GET", "/v1/lookup")[0] == 405
    assert call(cluster.url, "POST", "/v1/instances", {})[0] == 405
    big = b'{"tokens": [' + b"1," * (1 << 20) + b"1]}"
    try:
        assert call(cluster.url, "POST", "/v1/lookup", raw=big)[0] == 413
    except (urllib.error.URLError, ConnectionError):
        pass  # the server may close before the whole body is sent: also fine, it did not read it
    status, doc = call(cluster.url, "GET", "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.") and "/v1/lookup" in doc["paths"]
    assert call(cluster.url, "GET", "/v1/health")[1]["healthy_instances"] == 3


def test_commands_take_effect_in_the_instance(cluster):
    api = instance_api(cluster, "eng-c")
    keys = keys_of(PROMPT)
    # pin / unpin the first two chunks
    status, r = call(cluster.url, "POST", "/v1/pin", {"instance": "eng-c", "tokens": PROMPT[:32]})
    assert status == 200 and [p["key"] for p in r["result"]["pinned"]] == keys[:2]
    assert {p["key"] for p in api.pins()} == set(keys[:2])
    status, r = call(cluster.url, "POST", "/v1/unpin", {"instance": "eng-c", "tokens": PROMPT[:32]})
    assert status == 200 and api.pins() == []
    # compress / decompress the disk copies of the first 64 tokens
    raw_size = {e["key"]: e["size"] for e in api.keys("disk")["entries"]}
    status, r = call(cluster.url, "POST", "/v1/compress",
                     {"instance": "eng-c", "tier": "disk", "codec": "zstd", "tokens": PROMPT[:64]})
    assert status == 200 and r["result"]["codec"] == "zstd" and r["result"]["skipped"] == [], r
    after = {x["key"]: x["after"] for x in r["result"]["recoded"]}
    assert sorted(after) == sorted(keys[:4])
    # (the entries' sizes tell: the disk backend's listing reports the tier's codec, not the entry's)
    size = {e["key"]: e["size"] for e in api.keys("disk")["entries"]}
    assert [size[k] for k in keys[:5]] == [after[k] for k in keys[:4]] + [raw_size[keys[4]]]
    assert all(after[k] != raw_size[k] for k in keys[:4])
    status, r = call(cluster.url, "POST", "/v1/decompress", {"instance": "eng-c", "tier": "disk", "tokens": PROMPT[:64]})
    assert status == 200 and r["result"]["codec"] == "raw"
    assert {e["key"]: e["size"] for e in api.keys("disk")["entries"]} == raw_size
    # clear the cpu copies of the last 64 tokens: the index follows through the events
    status, r = call(cluster.url, "POST", "/v1/clear", {"instance": "eng-c", "tier": "cpu", "tokens": PROMPT})
    assert status == 200 and r["result"]["bytes"] > 0
    status, r = call(cluster.url, "POST", "/v1/clear", {"instance": "eng-c", "tier": "cpu"})
    assert status == 200
    assert api.keys("cpu")["total"] == 0
    row = until(lambda: next((x for x in lookup(cluster.url)["results"]
                              if x["instance_id"] == "eng-c" and x["tier"] == "disk"), None), "eng-c served from disk")
    assert row["hit_tokens"] == 128 and row["tiers"] == {"disk": 128}
    # a 128-token hit on disk still beats 64 tokens in cpu
    assert lookup(cluster.url)["best"] == "eng-c"


def test_evictions_through_the_instance_reach_the_index(cluster):
    api = instance_api(cluster, "eng-b")
    r = api.evict(None, all=True)  # the instance's own API, not the controller
    assert r["evicted"]
    until(lambda: "eng-b" not in hits(cluster.url), "eng-b out of lookups")
    assert hits(cluster.url) == {"eng-c": 128, "eng-a": 32}
    rows = {i["instance_id"]: i for i in call(cluster.url, "GET", "/v1/instances")[1]}
    assert rows["eng-b"]["keys"] == 0 and rows["eng-b"]["healthy"]


def test_cli_against_the_controller(cluster):
    env = {**os.environ, "LMCACHE_CONTROLLER_TOKEN": CTL_TOKEN, "LMCACHE_CONTROLLER_URL": cluster.url}
    r = subprocess.run([*_controller_cmd(), "lookup", "--tokens", ",".join(map(str, PROMPT)), "--json"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["best"] == "eng-c"
    r = subprocess.run([*_controller_cmd(), "instances", "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert sorted(i["instance_id"] for i in json.loads(r.stdout)) == sorted(STORED)
    r = subprocess.run([*_controller_cmd(), "instances", "--token", "wrong"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("lmcache: error:") and "token" in r.stderr
    r = subprocess.run([*_controller_cmd(), "move", "eng-c", "cpu", "eng-a", "cpu", "--tokens", "1,2"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1 and "runs no peer endpoint" in r.stderr


def test_killed_instance_drops_out_of_lookups(cluster):
    assert "eng-a" in hits(cluster.url)
    cluster.engines["eng-a"].kill()  # SIGKILL: no deregistration, only missing heartbeats
    cluster.engines["eng-a"].wait()
    until(lambda: "eng-a" not in hits(cluster.url), "eng-a out of lookups after the heartbeat timeout")
    rows = {i["instance_id"]: i for i in call(cluster.url, "GET", "/v1/instances")[1]}
    assert rows["eng-a"]["healthy"] is False and rows["eng-c"]["healthy"]
    status, r = call(cluster.url, "POST", "/v1/clear", {"instance": "eng-a"})
    assert status == 409 and "not heartbeating" in r["error"]


def test_controller_restart_heals_the_index(cluster):
    before = hits(cluster.url)
    assert before == {"eng-c": 128}
    port = int(cluster.url.rsplit(":", 1)[1])
    cluster.ctl.kill()
    cluster.ctl.wait()
    # meanwhile an instance changes: its events cannot be delivered (dropped, counted)
    instance_api(cluster, "eng-c").evict("disk", keys=keys_of(PROMPT)[4:])
    cluster.ctl, url = start_controller(port)
    assert url == cluster.url
    # a new controller knows nothing until the workers register again and send their
    # snapshots: eng-c now holds only 64 tokens (and eng-b nothing, but it is registered)
    until(lambda: hits(cluster.url) == {"eng-c": 64}, "index healed with eng-c's current keys")
    rows = until(lambda: (lambda r: r if set(r) == {"eng-b", "eng-c"} else None)(
        {i["instance_id"]: i for i in call(cluster.url, "GET", "/v1/instances")[1]}), "both live workers registered")
    assert rows["eng-c"]["keys"] == 4 and rows["eng-b"]["keys"] == 0


# ---------------------------------------------------------------- in-process: worker and config
def test_worker_resyncs_after_dropping_events(tmp_path):
    import torch

    import lmcache
    from lmcache.plugins.services.controller_client import ControllerClient
    from lmcache.server.controller import ControllerServer

    with ControllerServer(port=0, instance_timeout=5) as ctl:
        cfg = {"chunk_size": CHUNK, "kv_spec": KV_SPEC, "tiers": [{"backend": "cpu", "capacity": "8MiB"}],
               "controller": {"url": ctl.url, "instance_id": "small-queue", "queue_size": 2, "batch_size": 2,
                              "heartbeat_interval": 0.1}}
        with lmcache.CacheEngine.from_config(cfg) as engine:
            w = engine.controller_worker
            until(lambda: w.registered, "registered")
            # 64 admits at once into a queue of 2: the worker cannot drain them all in between
            burst = list(PROMPT) + [7000 + i for i in range(1024 - len(PROMPT))]
            engine.store(burst, torch.zeros(2, 2, len(burst), 2, 8))
            client = ControllerClient(ctl.url)
            # the first admits may get through before the queue overflows; the snapshot sent
            # when the worker registers again is what puts the whole burst into the index
            until(lambda: w.registrations >= 2, "registered again after the overflow")
            until(lambda: [x["hit_tokens"] for x in client.lookup(burst)["results"]] == [len(burst)],
                  "the snapshot after the overflow heals the index")
            assert w.dropped_events > 0
            assert engine.instance_id == "small-queue"
        # a clean close deregisters at once
        assert client.instances() == []


def test_worker_survives_a_controller_that_is_down(tmp_path):
    import torch

    import lmcache
    from lmcache.testing.stores import free_port

    port = free_port()
    cfg = {"chunk_size": CHUNK, "kv_spec": KV_SPEC, "tiers": [{"backend": "cpu", "capacity": "8MiB"}],
           "controller": {"url": f"http://127.0.0.1:{port}", "heartbeat_interval": 0.1, "timeout": 0.5}}
    with lmcache.CacheEngine.from_config(cfg) as engine:
        engine.store(PROMPT, torch.zeros(2, 2, len(PROMPT), 2, 8))  # never blocks on the controller
        assert engine.lookup(PROMPT) == 128
        until(lambda: engine.controller_worker.failed_calls > 0, "tried")
        assert not engine.controller_worker.registered
        from lmcache.plugins.services.controller_client import ControllerClient
        from lmcache.server.controller import ControllerServer

        with ControllerServer(port=port) as ctl:
            until(lambda: ControllerClient(ctl.url).lookup(PROMPT)["results"], "registered with its snapshot")


def test_config_controller_section():
    from lmcache.config import load_config
    from lmcache.errors import ConfigError

    cfg = load_config({"controller": {"url": "http://127.0.0.1:9000/", "heartbeat_interval": 0.5}}, environ={})
    assert cfg.controller.url == "http://127.0.0.1:9000" and cfg.controller.heartbeat_interval == 0.5
    assert cfg.controller.timeout == 2.0 and cfg.controller.token is None
    assert load_config({"controller": "http://h:1"}, environ={}).controller.url == "http://h:1"
    cfg = load_config({"controller": {"url": "http://h:1"}}, environ={"LMCACHE_CONTROLLER_TOKEN": "s3cret"})
    assert cfg.controller.token == "s3cret" and cfg.to_dict(mask_secrets=True)["controller"]["token"] == "***"
    assert cfg.source_of("controller.token") == "env:LMCACHE_CONTROLLER_TOKEN"
    assert load_config({}, environ={}).controller.url is None
    for bad, key in (({"urls": "x"}, "controller.urls"), ({"url": "ftp://x"}, "controller.url"),
                     ({"url": 5}, "controller.url"), ({"heartbeat_interval": 0}, "controller.heartbeat_interval"),
                     ({"timeout": "2"}, "controller.timeout"), ({"queue_size": 0}, "controller.queue_size"),
                     ({"instance_id": "a b"}, "controller.instance_id"), ({"token": " t"}, "controller.token")):
        with pytest.raises(ConfigError) as ei:
            load_config({"controller": bad}, environ={})
        assert ei.value.key == key, (bad, ei.value)
    with pytest.raises(ConfigError):
        load_config({"controller": [1]}, environ={})


def test_hierarchy_listener_reports_admits_and_evictions():
    import torch

    import lmcache

    seen: list[tuple[str, str, str]] = []
    cfg = {"chunk_size": CHUNK, "model": "org/synthetic", "kv_spec": KV_SPEC,
           "tiers": [{"backend": "cpu", "capacity": "8KiB"}]}
    with lmcache.CacheEngine.from_config(cfg) as engine:
        engine.hierarchy.set_listener(lambda op, tier, key: seen.append((op, tier, key)))
        engine.store(PROMPT[:48], torch.zeros(2, 2, 48, 2, 8))  # 3 chunks of 4 KiB into 8 KiB: one evicted
        keys = keys_of(PROMPT[:48])
        assert [(op, k) for op, _, k in seen] == [("admit", keys[0]), ("admit", keys[1]), ("evict", keys[0]),
                                                 ("admit", keys[2])]
        assert sorted(k for k, _ in engine.hierarchy.tiers[0].keys()) == sorted(keys[1:])
        engine.hierarchy.set_listener(None)
        engine.admin.clear(all=True)
        assert len(seen) == 4


# ---------------------------------------------------------------- script modes
def _engine_main(spec_path: str) -> None:
    import torch

    import lmcache

    spec = json.loads(Path(spec_path).read_text())
    tokens = spec["tokens"]
    with lmcache.CacheEngine.from_config(spec["config"]) as engine:
        s = engine.kv_spec
        kv = torch.randn(s.num_layers, 2, len(tokens), s.num_kv_heads, s.head_size)
        engine.store(tokens, kv)
        engine.flush()
        serve_until_stdin_closes(f"READY {engine.api_url} {engine.instance_id}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["engine"]:
        _engine_main(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} engine SPEC.json")


def test_the_openapi_document_in_docs_is_current(tmp_path):
    """docs/controller-openapi.json is what `lmcache controller serve --write-openapi` writes."""
    out = tmp_path / "openapi.json"
    r = subprocess.run(_controller_cmd() + ["serve", "--write-openapi", str(out)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    committed = json.loads((ROOT / "docs" / "controller-openapi.json").read_text())
    assert json.loads(out.read_text()) == committed, (
        "docs/controller-openapi.json is stale: regenerate it with "
        "`lmcache controller serve --write-openapi docs/controller-openapi.json`")
