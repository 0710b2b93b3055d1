"""The controller's caps (issue 29, item 10): one tenant instance reported 540k made-up
keys in 6 s and the controller grew from 53 to 404 MiB. Keys per instance and instances
per tenant are capped (``--max-keys-per-instance``, ``--max-instances-per-tenant``);
over a cap a call is answered 429, counted and logged, and nothing of it is applied.
Each test prints a one-line summary of what it checked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _procs import readline, stop, until
from test_controller import CHUNK, KV_SPEC, call

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "ctl-admin"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def made_up(i: int) -> str:
    return f"lmc1:team-a:m:float32-L2-H2-D8-lt2hd-tp0of1:{i:032x}"


def test_a_tenant_instance_cannot_grow_the_index_past_the_caps(tmp_path):
    """A controller process with ``--max-keys-per-instance 10000
    --max-instances-per-tenant 2`` and a tenant token: an instance reporting 200k
    made-up keys in batches of 1000 gets its first 10k in and 429 for the rest (the
    controller's RSS grows by less than the 200k keys would take), evictions still pass
    at the cap, a third instance of the tenant is 429 while re-registering one is not,
    admin registrations are not counted, and each refusal is counted and logged."""
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("team-a: tok-a\n")
    log = tmp_path / "ctl.log"
    env = {**os.environ, "LMCACHE_CONTROLLER_TOKEN": ADMIN}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "lmcache.cli.main", "controller", "serve", "--port", "0",
                                 "--tenants-file", str(tenants), "--max-keys-per-instance", "10000",
                                 "--max-instances-per-tenant", "2"],
                                stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, env=env)
    try:
        url = readline(proc)
        reg = {"namespace": "team-a", "model": "m", "chunk_size": CHUNK, "tiers": ["cpu"]}
        status, r = call(url, "POST", "/v1/register", {"instance_id": "flood", **reg}, token="tok-a")
        assert status == 200, r
        session = r["session"]
        rss0 = rss_mib(proc.pid)
        statuses = []
        for b in range(200):
            events = [["admit", "cpu", made_up(b * 1000 + i)] for i in range(1000)]
            status, r = call(url, "POST", "/v1/events", {"instance_id": "flood", "session": session, "events": events},
                             token="tok-a")
            statuses.append(status)
            if status == 429:
                assert "over the cap of 10000 keys per instance" in r["error"], r
        grew = rss_mib(proc.pid) - rss0
        assert statuses.count(200) == 10 and statuses.count(429) == 190, statuses
        status, inst = call(url, "GET", "/v1/instances", token="tok-a")
        assert inst[0]["keys"] == 10000 and inst[0]["refused_events"] == 190_000, inst
        # 200k keys would take well over 100 MiB (about 650 bytes each); the cap keeps it to 10k
        assert grew < 60, f"controller RSS grew {grew:.0f} MiB"
        # at the cap, a batch that evicts one key and admits another passes; one more key does not
        swap = [["evict", "cpu", made_up(0)], ["admit", "cpu", made_up(10**7)]]
        assert call(url, "POST", "/v1/events", {"instance_id": "flood", "session": session, "events": swap},
                    token="tok-a")[0] == 200
        one_more = [["admit", "cpu", made_up(10**7 + 1)]]
        assert call(url, "POST", "/v1/events", {"instance_id": "flood", "session": session, "events": one_more},
                    token="tok-a")[0] == 429

        # instances per tenant: 2 registered (flood, second); a third is 429; re-registering is not
        assert call(url, "POST", "/v1/register", {"instance_id": "second", **reg}, token="tok-a")[0] == 200
        status, r = call(url, "POST", "/v1/register", {"instance_id": "third", **reg}, token="tok-a")
        assert status == 429 and "--max-instances-per-tenant" in r["error"], r
        assert call(url, "POST", "/v1/register", {"instance_id": "second", **reg}, token="tok-a")[0] == 200
        assert call(url, "POST", "/v1/register", {"instance_id": "by-admin", **reg}, token=ADMIN)[0] == 200
        status, health = call(url, "GET", "/v1/health", token=ADMIN)
        assert health["refused_events"] == 190_001 and health["refused_registrations"] == 1, health
        status, health = call(url, "GET", "/v1/health", token="tok-a")
        assert "refused_events" not in health  # counts over every namespace are the admin's
    finally:
        stop(proc)
    text = log.read_text()
    assert "over the cap of 10000 (--max-keys-per-instance)" in text, text[-2000:]
    assert "the cap (--max-instances-per-tenant 2)" in text, text[-2000:]
    print(f"caps: 10 of 200 batches of made-up keys taken, 190 answered 429; controller RSS +{grew:.1f} MiB; "
          "a third tenant instance 429; refusals counted and logged")


def test_a_worker_over_the_key_cap_drops_events_without_resyncing():
    """An engine whose tiers hold more keys than the controller's cap: its worker
    registers once, the batches over the cap are dropped and counted (no resync loop
    resending a snapshot that would be refused again), and the engine keeps serving."""
    import torch

    import lmcache
    from lmcache.server.controller import ControllerServer

    with ControllerServer(port=0, instance_timeout=5, max_keys_per_instance=4) as ctl:
        cfg = {"chunk_size": CHUNK, "kv_spec": KV_SPEC, "tiers": [{"backend": "cpu", "capacity": "8MiB"}],
               "controller": {"url": ctl.url, "instance_id": "big", "batch_size": 2, "heartbeat_interval": 0.05}}
        with lmcache.CacheEngine.from_config(cfg) as engine:
            w = engine.controller_worker
            until(lambda: w.registered, "registered")
            toks = list(range(1000, 1000 + 8 * CHUNK))
            engine.store(toks, torch.zeros(2, 2, len(toks), 2, 8))
            until(lambda: w.dropped_events >= 4, "the events over the cap dropped")
            until(lambda: ctl.index.list()[0]["keys"] == 4, "the index holds the cap")
            st = w.stats()
            until(lambda: w.failed_calls == 0 and w.registrations == 1 and w.registered, "still registered once")
            assert engine.retrieve(toks).num_tokens == len(toks)
    print(f"worker: 4 of 8 keys indexed, {st['dropped_events']} events dropped, 1 registration")
