"""The ha-controller overlay's index run for real, without a cluster: the start scripts of
its ConfigMap ``lmcache-index-scripts`` (as ``kubectl kustomize`` renders them) run in one
network namespace per pod, each with the pod's hostname and an ``/etc/hosts`` that
resolves the StatefulSets' per-pod names (``lmcache-index-0.lmcache-index``, ...) as the
cluster's DNS would; a controller started with the Deployment's own
``LMCACHE_CONTROLLER_INDEX`` in a sixth. Only the scripts' ``/scripts`` and ``/data``
paths are moved into the test's directory.

What it shows: the pods find each other by name (index-1 replicates index-0, the three
Sentinels agree on index-0 and know index-1); the controller serves through the Sentinel URL; the primary
SIGKILLed, the Sentinels promote index-1 and the controller's lookups come back with every
entry; the old primary's pod restarted asks the Sentinels and comes back as a replica of
the new primary, not as a second, empty primary.

Needs root (network namespaces), valkey-server and valkey-cli (Debian: valkey-server and
valkey-tools from bookworm-backports) and kubectl; under CI=true their absence fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _missing import missing  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PODS = ["lmcache-index-0", "lmcache-index-1", "lmcache-index-sentinel-0", "lmcache-index-sentinel-1",
        "lmcache-index-sentinel-2"]
SETTLE = 60.0  # a guard for each wait, not a budget


def _rendered() -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        missing("kubectl is not installed (Debian: apt-get install kubectl; it renders kustomize offline)")
    p = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy/kubernetes/overlays/ha-controller")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return [d for d in yaml.safe_load_all(p.stdout) if d]


def _cli(host, port: int, *args: str) -> str:
    r = host.run(["valkey-cli", "-p", str(port), "--raw", *args], timeout=10)
    return r.stdout.strip()


def _until(what: str, check, timeout: float = SETTLE):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - a server still starting; reported if it never settles
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout:g}s (last: {last!r})")


def _role(host) -> str:
    info = _cli(host, 6379, "info", "replication")
    return next((line.split(":", 1)[1] for line in info.splitlines() if line.startswith("role:")), "")


def _replica_seen(sentinel) -> bool:
    """The Sentinel lists index-1 as a replica, linked and answering (``sentinel replicas``
    prints one replica's fields as name/value lines)."""
    out = _cli(sentinel, 26379, "sentinel", "replicas", "lmcache-index").splitlines()
    fields = dict(zip(out[::2], out[1::2]))
    return fields.get("name", "").startswith("lmcache-index-1.lmcache-index") and fields.get("flags") == "slave"


@pytest.fixture
def pods(tmp_path):
    if os.geteuid() != 0:
        missing("the overlay's live test needs root: one network namespace per pod")
    for tool in ("valkey-server", "valkey-cli"):
        if shutil.which(tool) is None:
            missing(f"{tool} is not installed (Debian: valkey-server/valkey-tools from bookworm-backports; "
                    "bash requirements/install-test-servers.sh)")
    from lmcache.testing.netns import Hosts, NetnsUnavailable

    docs = _rendered()
    scripts = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "lmcache-index-scripts")
    ctl = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "lmcache-controller")
    env = {e["name"]: e.get("value") for e in ctl["spec"]["template"]["spec"]["containers"][0]["env"]}
    try:
        hosts = Hosts(len(PODS) + 1, name="haidx")
    except NetnsUnavailable as exc:
        missing(f"network namespaces: {exc}")
    names = {pod: h for pod, h in zip(PODS, hosts)}
    lines = ["127.0.0.1 localhost"]
    for pod, h in names.items():
        service = pod.rsplit("-", 1)[0]
        lines.append(f"{h.ip} {pod}.{service} {pod}")
    etc = []
    for h in hosts:  # `ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts
        d = Path("/etc/netns") / h.name
        d.mkdir(parents=True, exist_ok=True)
        (d / "hosts").write_text("\n".join(lines) + "\n")
        etc.append(d)
    started = []

    def start(pod: str):
        sdir = tmp_path / pod / "scripts"
        data = tmp_path / pod / "data"
        sdir.mkdir(parents=True, exist_ok=True)
        data.mkdir(parents=True, exist_ok=True)
        for name, text in scripts["data"].items():
            (sdir / name).write_text(text.replace("/scripts/", f"{sdir}/").replace("/data/", f"{data}/"))
        script = "sentinel.sh" if "sentinel" in pod else "valkey.sh"
        log = open(tmp_path / f"{pod}.log", "ab")
        p = names[pod].popen(["unshare", "--uts", "sh", "-c", f"hostname {pod} && exec sh {sdir}/{script}"],
                             stdout=log, stderr=subprocess.STDOUT, cwd=data)
        started.append(p)
        return p

    try:
        yield names, hosts[len(PODS)], start, env, tmp_path
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        hosts.close()
        for d in etc:
            shutil.rmtree(d, ignore_errors=True)


def test_the_overlays_index_fails_over_and_the_old_primary_returns_as_a_replica(pods):
    from lmcache.plugins.services.controller_client import ControllerClient

    names, ctl_host, start, env, tmp = pods
    procs = {pod: start(pod) for pod in PODS}
    i0, i1 = names["lmcache-index-0"], names["lmcache-index-1"]
    sentinels = [names[f"lmcache-index-sentinel-{i}"] for i in range(3)]
    _until("index-0 is the primary", lambda: _role(i0) == "master")
    _until("index-1 replicates index-0", lambda: "master_link_status:up" in _cli(i1, 6379, "info", "replication"))
    for s in sentinels:
        _until(f"{s.name} watches index-0 with two other Sentinels",
               lambda s=s: _cli(s, 26379, "sentinel", "get-master-addr-by-name", "lmcache-index").split()[:1]
               == ["lmcache-index-0.lmcache-index"]
               and "num-other-sentinels\n2" in _cli(s, 26379, "sentinel", "master", "lmcache-index"))
        # a failover needs a replica the Sentinels know; they learn it from the primary's INFO,
        # every 10 s, so a primary killed sooner after index-1's sync is never failed over
        _until(f"{s.name} knows index-1 as a replica", lambda s=s: _replica_seen(s))

    # the controller, as the Deployment runs it: its index URL from the rendered manifest
    url = env["LMCACHE_CONTROLLER_INDEX"]
    ctl_log = open(tmp / "controller.log", "ab")
    ctl = ctl_host.popen([sys.executable, "-m", "lmcache.cli.main", "controller", "serve", "--host", ctl_host.ip,
                          "--port", "9000", "--instance-timeout", "60"],
                         env={**os.environ, "LMCACHE_CONTROLLER_INDEX": url}, stdout=subprocess.PIPE, stderr=ctl_log)
    try:
        base = f"http://{ctl_host.ip}:9000"
        client = ControllerClient(base, timeout=3)
        health = _until("the controller answers", lambda: client.health())
        assert health["index"] == "valkey", health
        reg = client.register({"instance_id": "engine-a", "namespace": "team", "model": "m", "kv_signature": "s1",
                               "chunk_size": 16, "tiers": ["cpu"]})
        keys = [f"lmc1:team:m:s1:{i:032x}" for i in range(8)]
        client.events("engine-a", reg["session"], [["admit", "cpu", k] for k in keys])
        assert client.lookup(keys=keys)["results"][0]["hit_chunks"] == 8
        primary_offset = _until("index-1 has caught up", lambda: (
            (o := _cli(i0, 6379, "info", "replication")) and
            next(x.split(":")[1] for x in o.splitlines() if x.startswith("master_repl_offset:")) ==
            next(x.split(":")[1] for x in _cli(i1, 6379, "info", "replication").splitlines()
                 if x.startswith("master_repl_offset:"))))
        assert primary_offset

        procs["lmcache-index-0"].kill()  # the primary's pod dies
        procs["lmcache-index-0"].wait(timeout=10)
        killed = time.monotonic()

        def served():
            client.heartbeat("engine-a", reg["session"])  # 503 while there is no primary
            return client.lookup(keys=keys)["results"][0]["hit_chunks"] == 8

        # a guard: on a loaded machine a Sentinel election can fail and be retried after the
        # overlay's failover-timeout (30 s); the measured gap is printed
        try:
            _until("lookups answered by the promoted primary with every entry", served, timeout=3 * SETTLE)
        except AssertionError as exc:
            views = [_cli(s, 26379, "sentinel", "get-master-addr-by-name", "lmcache-index") for s in sentinels]
            raise AssertionError(f"{exc}; roles: index-1 {_role(i1)!r}; the Sentinels name: {views}") from None
        gap = time.monotonic() - killed
        assert _role(i1) == "master"
        print(f"index primary SIGKILLed: lookups back with all 8 entries after {gap:.1f} s "
              "(down-after-milliseconds 5000)")

        # the old primary's pod restarts: it asks the Sentinels and follows index-1
        # (its first answer already says replica: started as a primary, it would say master
        # until the Sentinels noticed it and turned it, seconds later, empty in between)
        procs["lmcache-index-0"] = start("lmcache-index-0")
        _until("the returning index-0 answers", lambda: _cli(i0, 6379, "ping") == "PONG", timeout=SETTLE)
        assert _role(i0) == "slave", "the returning old primary started as a primary"
        assert "master_host:lmcache-index-1.lmcache-index" in _cli(i0, 6379, "info", "replication")
        for s in sentinels:
            assert _cli(s, 26379, "sentinel", "get-master-addr-by-name", "lmcache-index").split()[0] \
                == "lmcache-index-1.lmcache-index"
        client.events("engine-a", reg["session"], [["evict", "cpu", keys[-1]]])
        assert client.lookup(keys=keys)["results"][0]["hit_chunks"] == 7
        _until("the write reaches the returned replica", lambda: _role(i0) == "slave"
               and "master_link_status:up" in _cli(i0, 6379, "info", "replication"))
    finally:
        ctl.kill()
        ctl.wait(timeout=10)
