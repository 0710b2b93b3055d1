"""The Kubernetes manifests (deploy/kubernetes): every overlay rendered by kustomize
(`kubectl kustomize`, offline), every rendered object validated against the Kubernetes API
schemas by kubernetes-validate --strict (unknown fields and wrong types refused), and the
lmcache config the ConfigMap holds checked by `lmcache config validate`. No cluster runs
here: nothing is applied.

Run: make test-image  (or LMCACHE_IMAGE_TESTS=1 .venv/bin/python -m pytest tests/image/test_manifests.py)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _missing import missing  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("cpu-only", "gpu", "ha-controller")
#: what the ha-controller overlay adds to the others' objects
HA_KINDS = ["ConfigMap/lmcache-index-scripts", "NetworkPolicy/lmcache-index", "PodDisruptionBudget/lmcache-controller",
            "Service/lmcache-index", "Service/lmcache-index-sentinel", "StatefulSet/lmcache-index",
            "StatefulSet/lmcache-index-sentinel"]


def _tool(name: str, install: str) -> str:
    found = Path(sys.executable).parent / name
    if found.is_file():
        return str(found)
    path = shutil.which(name)
    if path is None:
        missing(f"{name} is not installed ({install})")
    return path


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Path]:
    kubectl = _tool("kubectl", "Debian: apt-get install kubectl; it renders kustomize offline")
    out = {}
    for overlay in OVERLAYS:
        p = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy/kubernetes/overlays" / overlay)],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        f = tmp_path_factory.mktemp("rendered") / f"{overlay}.yaml"
        f.write_text(p.stdout)
        out[overlay] = f
    return out


def validate(path: Path) -> subprocess.CompletedProcess[str]:
    tool = _tool("kubernetes-validate", "make test-image installs it into .venv: requirements/image-test.txt")
    return subprocess.run([tool, "--strict", str(path)], capture_output=True, text=True, timeout=300)


def objects(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_passes_strict_schema_validation(rendered, overlay):
    docs = objects(rendered[overlay])
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
    assert kinds == sorted(["ConfigMap/lmcache-config", "Deployment/lmcache-controller", "Deployment/vllm-lmcache",
                            "NetworkPolicy/lmcache-valkey", "PersistentVolumeClaim/vllm-models",
                            "Service/lmcache-controller", "Service/lmcache-valkey", "Service/vllm-lmcache",
                            "StatefulSet/lmcache-valkey"] + (HA_KINDS if overlay == "ha-controller" else []))
    p = validate(rendered[overlay])
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count(" passed for resource ") == len(docs), p.stdout


def test_the_validator_refuses_an_unknown_field_and_a_wrong_type(rendered, tmp_path):
    """The strict check is real: the same Deployment with a misspelled field, or a port as a
    word, fails."""
    dep = next(d for d in objects(rendered["cpu-only"]) if d["kind"] == "Deployment" and d["metadata"]["name"] == "vllm-lmcache")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    c["readinessProbe"]["httpGet"]["pathh"] = "/health"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(dep))
    p = validate(bad)
    assert p.returncode != 0 and "pathh" in p.stdout + p.stderr, p.stdout + p.stderr
    del c["readinessProbe"]["httpGet"]["pathh"]
    c["ports"][0]["containerPort"] = "eight thousand"
    bad.write_text(yaml.safe_dump(dep))
    p = validate(bad)
    assert p.returncode != 0, p.stdout + p.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_engine_is_deployed_as_lmcaches_users_deploy_it(rendered, overlay):
    """vLLM's built-in connector, the config from the ConfigMap, probes on /health, the
    metrics port annotated for Prometheus, /dev/shm in memory, resources on every container."""
    docs = {f"{d['kind']}/{d['metadata']['name']}": d for d in objects(rendered[overlay])}
    pod = docs["Deployment/vllm-lmcache"]["spec"]["template"]
    vllm = pod["spec"]["containers"][0]
    assert vllm["image"] == f"localhost/lmcache-vllm:{'gpu' if overlay == 'gpu' else 'cpu'}"
    assert '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}' in vllm["args"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in vllm["env"]}
    assert env["LMCACHE_CONFIG_FILE"] == "/etc/lmcache/lmcache.yaml"
    assert env["PYTHONHASHSEED"] == "123" and env["PROMETHEUS_MULTIPROC_DIR"] == "/tmp/lmcache_prometheus"
    assert env["LMCACHE_CONTROLLER_TOKEN"] == {"secretKeyRef": {"name": "lmcache-secrets", "key": "controller-token"}}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert vllm[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["lmcache-config"]["configMap"]["name"] == "lmcache-config"
    for name, d in docs.items():
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], name
            assert d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True, name
    if overlay == "gpu":
        assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_the_configmaps_lmcache_config_is_valid(rendered, tmp_path):
    cm = next(d for d in objects(rendered["cpu-only"]) if d["kind"] == "ConfigMap")
    f = tmp_path / "lmcache.yaml"
    f.write_text(cm["data"]["lmcache.yaml"])
    p = subprocess.run([sys.executable, "-m", "lmcache.cli.main", "config", "validate", str(f)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "tiers: cpu (cpu, 4.0 GiB), valkey (valkey, 12.0 GiB)" in p.stdout, p.stdout


def test_the_ha_overlay_runs_two_controllers_on_a_sentinel_watched_index(rendered, tmp_path):
    """ha-controller: two controller replicas (spread over nodes, one kept through a drain)
    reading the index from Valkey through the three Sentinels; a primary and a replica;
    only the controllers and the index's own pods may reach the index; the start scripts
    are valid sh and ask the Sentinels for the primary before assuming pod 0."""
    docs = {f"{d['kind']}/{d['metadata']['name']}": d for d in objects(rendered["ha-controller"])}
    ctl = docs["Deployment/lmcache-controller"]
    assert ctl["spec"]["replicas"] == 2
    c = ctl["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    url = env["LMCACHE_CONTROLLER_INDEX"]
    sentinels = [f"lmcache-index-sentinel-{i}.lmcache-index-sentinel:26379" for i in range(3)]
    assert url == f"valkey+sentinel://{','.join(sentinels)}/lmcache-index"
    assert env["LMCACHE_CONTROLLER_TOKEN"] == {"secretKeyRef": {"name": "lmcache-secrets", "key": "controller-token"}}
    spread = ctl["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert spread["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert docs["PodDisruptionBudget/lmcache-controller"]["spec"]["minAvailable"] == 1
    assert docs["StatefulSet/lmcache-index"]["spec"]["replicas"] == 2
    assert docs["StatefulSet/lmcache-index-sentinel"]["spec"]["replicas"] == 3
    for svc in ("lmcache-index", "lmcache-index-sentinel"):  # per-pod names resolve before readiness
        assert docs[f"Service/{svc}"]["spec"]["clusterIP"] == "None"
        assert docs[f"Service/{svc}"]["spec"]["publishNotReadyAddresses"] is True
    ingress = docs["NetworkPolicy/lmcache-index"]["spec"]["ingress"][0]
    allowed = [p["podSelector"]["matchLabels"] for p in ingress["from"]]
    assert allowed == [{"app.kubernetes.io/name": "lmcache-controller"}, {"app.kubernetes.io/component": "lmcache-index"}]
    scripts = docs["ConfigMap/lmcache-index-scripts"]["data"]
    for name, text in scripts.items():
        f = tmp_path / name
        f.write_text(text)
        p = subprocess.run(["sh", "-n", str(f)], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, f"{name}: {p.stderr}"
    assert "sentinel get-master-addr-by-name lmcache-index" in scripts["primary.sh"]
    assert "sentinel monitor lmcache-index $primary 6379 2" in scripts["sentinel.sh"]
    assert "--replicaof" in scripts["valkey.sh"]


# ------------------------------------------------------------------ the pd overlay
PD = ROOT / "deploy/kubernetes/overlays/pd"
PD_KINDS = ["Deployment/lmcache-decode", "Deployment/lmcache-pd-proxy", "Deployment/lmcache-prefill",
            "NetworkPolicy/lmcache-decode", "NetworkPolicy/lmcache-pd-proxy", "PersistentVolumeClaim/vllm-models",
            "Service/lmcache-decode", "Service/lmcache-pd-proxy", "Service/lmcache-prefill"]
#: what each PD engine's environment sets, as the production stack's operator sets a prefill
#: and a decode node (UCX_TLS as its Helm chart sets it on PD pods)
PD_ENV = {
    "prefill": {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0", "LMCACHE_ENABLE_PD": "True",
                "LMCACHE_TRANSFER_CHANNEL": "nixl", "LMCACHE_PD_ROLE": "sender", "LMCACHE_PD_BUFFER_SIZE": "1073741824",
                "LMCACHE_PD_BUFFER_DEVICE": "cuda", "LMCACHE_PD_PROXY_HOST": "lmcache-pd-proxy",
                "LMCACHE_PD_PROXY_PORT": "7500", "PYTHONHASHSEED": "123", "UCX_TLS": "cuda_ipc,cuda_copy,tcp"},
    "decode": {"LMCACHE_ENABLE_PD": "True", "LMCACHE_TRANSFER_CHANNEL": "nixl", "LMCACHE_PD_ROLE": "receiver",
               "LMCACHE_PD_PEER_HOST": "0.0.0.0", "LMCACHE_PD_PEER_INIT_PORT": "7300",
               "LMCACHE_PD_PEER_ALLOC_PORT": "7400", "LMCACHE_PD_BUFFER_SIZE": "2147483648",
               "LMCACHE_PD_BUFFER_DEVICE": "cuda", "LMCACHE_LOCAL_CPU": "False", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0",
               "PYTHONHASHSEED": "123", "UCX_TLS": "cuda_ipc,cuda_copy,tcp", "UCX_TCP_PORT_RANGE": "7600-7699"},
}
PD_KV = {
    "prefill": ("kv_producer", {"discard_partial_chunks": False, "lmcache_rpc_port": "producer1"}),
    "decode": ("kv_consumer", {"discard_partial_chunks": False, "lmcache_rpc_port": "consumer1", "skip_last_n_tokens": 1}),
}


@pytest.fixture(scope="module")
def pd(tmp_path_factory) -> dict[str, dict]:
    """The pd overlay rendered by kubectl kustomize: its file (``"path"``) and its objects by ``Kind/name``."""
    kubectl = _tool("kubectl", "Debian: apt-get install kubectl; it renders kustomize offline")
    p = subprocess.run([kubectl, "kustomize", str(PD)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    f = tmp_path_factory.mktemp("rendered") / "pd.yaml"
    f.write_text(p.stdout)
    return {"path": f, **{f"{d['kind']}/{d['metadata']['name']}": d for d in objects(f)}}


def _container(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]["containers"][0]


def _env(c: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def _ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def _flags(args: list[str]) -> dict[str, str]:
    """``--flag value`` pairs (every flag here takes a value)."""
    flags = [a for a in args if a.startswith("--")]
    out = {a: args[args.index(a) + 1] for a in flags}
    assert len(out) == len(flags), f"a flag repeated: {args}"
    return out


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_the_pd_overlay_renders_and_passes_strict_schema_validation(pd):
    """pd: a prefill and a decode engine, LMCache's proxy, their Services and NetworkPolicies
    and the models PVC; nothing of the base's Valkey tier or controller."""
    assert sorted(k for k in pd if k != "path") == PD_KINDS
    p = validate(pd["path"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count(" passed for resource ") == len(PD_KINDS), p.stdout


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_pd_engines_are_the_base_engine_with_lmcaches_pd_settings(rendered, pd, role):
    """Each PD engine is the gpu overlay's engine (image, probes, resources, security
    context, GPU toleration, volumes, metrics annotations, the served model) with its PD
    role: LMCacheConnectorV1's kv-transfer-config as the production stack writes it and its
    operator's environment. The base ConfigMap's config is not mounted: its tiers would
    clash with LMCACHE_LOCAL_CPU (one setting in both vocabularies is a ConfigError)."""
    base = next(d for d in objects(rendered["gpu"]) if d["kind"] == "Deployment" and d["metadata"]["name"] == "vllm-lmcache")
    dep = pd[f"Deployment/lmcache-{role}"]
    pod, bpod = dep["spec"]["template"], base["spec"]["template"]
    c, bc = _container(dep), _container(base)
    labels = pod["metadata"]["labels"]
    assert labels["role"] == role and dep["metadata"]["labels"]["role"] == role
    assert dep["spec"]["selector"]["matchLabels"] == labels
    other = pd[f"Deployment/lmcache-{'decode' if role == 'prefill' else 'prefill'}"]
    assert not _selects(dep["spec"]["selector"]["matchLabels"], other["spec"]["template"]["metadata"]["labels"])
    # what the base engine has
    assert c["image"] == bc["image"] == "localhost/lmcache-vllm:gpu"
    for key in ("startupProbe", "readinessProbe", "livenessProbe", "resources", "securityContext"):
        assert c.get(key) == bc.get(key), key
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for key in ("securityContext", "shareProcessNamespace", "terminationGracePeriodSeconds", "tolerations"):
        assert pod["spec"].get(key) == bpod["spec"].get(key), key
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["metadata"]["annotations"] == bpod["metadata"]["annotations"]
    assert pod["spec"]["volumes"] == [v for v in bpod["spec"]["volumes"] if v["name"] != "lmcache-config"]
    assert c["volumeMounts"] == [m for m in bc["volumeMounts"] if m["name"] != "lmcache-config"]
    at, bat = c["args"].index("--kv-transfer-config"), bc["args"].index("--kv-transfer-config")
    assert c["args"][:at] == bc["args"][:bat] and c["args"][0] == "/models/model"
    # the PD role
    kv = json.loads(c["args"][at + 1])
    kv_role, extra = PD_KV[role]
    assert kv == {"kv_connector": "LMCacheConnectorV1", "kv_role": kv_role, "kv_connector_extra_config": extra}
    env = _env(c)
    assert {k: env.get(k) for k in PD_ENV[role]} == PD_ENV[role]
    assert "LMCACHE_CONFIG_FILE" not in env and "LMCACHE_CONTROLLER_TOKEN" not in env
    assert env["PROMETHEUS_MULTIPROC_DIR"] == "/tmp/lmcache_prometheus"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_pd_engines_lmcache_settings_load(pd, role, tmp_path):
    """Our engine takes each PD engine's LMCACHE_* environment as it stands (LMCache's own
    keys): `lmcache config show` with exactly those variables exits 0 with the nixl channel."""
    env = {k: v for k, v in _env(_container(pd[f"Deployment/lmcache-{role}"])).items()
           if k.startswith("LMCACHE_") and isinstance(v, str)}
    p = subprocess.run([sys.executable, "-m", "lmcache.cli.main", "config", "show"], capture_output=True, text=True,
                       timeout=120, env={"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "COLUMNS": "200", **env})
    assert p.returncode == 0, p.stderr
    assert re.search(r"transfer_channel\s*│\s*nixl\s", p.stdout), p.stdout


def test_the_pd_ports_agree_across_deployments_services_and_network_policies(pd):
    """The production stack's port names and numbers (pd-port-3 7300 init, pd-port-4 7400
    alloc, pd-port-5 7500 notifications) are the same in the containers, the Services, the
    engines' environment and the NetworkPolicies; the decoder's PD ports and the proxy's
    notification port admit the prefill pods only, 8000 stays open as in the other overlays."""
    dec, pre, prx = (pd[f"Deployment/lmcache-{n}"] for n in ("decode", "prefill", "pd-proxy"))
    labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in
              (("decode", dec), ("prefill", pre), ("pd-proxy", prx))}
    ports = {n: _ports(_container(d)) for n, d in (("decode", dec), ("prefill", pre), ("pd-proxy", prx))}
    assert ports == {"decode": {"http": 8000, "pd-port-3": 7300, "pd-port-4": 7400}, "prefill": {"http": 8000},
                     "pd-proxy": {"http": 8000, "pd-port-5": 7500}}
    denv, penv = _env(_container(dec)), _env(_container(pre))
    assert denv["LMCACHE_PD_PEER_INIT_PORT"] == str(ports["decode"]["pd-port-3"])
    assert denv["LMCACHE_PD_PEER_ALLOC_PORT"] == str(ports["decode"]["pd-port-4"])
    assert f"Service/{penv['LMCACHE_PD_PROXY_HOST']}" in pd
    assert penv["LMCACHE_PD_PROXY_PORT"] == str(ports["pd-proxy"]["pd-port-5"])
    for name in ("decode", "prefill", "pd-proxy"):
        svc = pd[f"Service/lmcache-{name}"]["spec"]
        assert _selects(svc["selector"], labels[name]) and svc["selector"].get("role")
        assert not any(_selects(svc["selector"], labels[o]) for o in labels if o != name), name
        assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["ports"]} == {
            n: (num, n) for n, num in ports[name].items()}, name
    ucx = tuple(int(x) for x in denv["UCX_TCP_PORT_RANGE"].split("-"))
    for name, from_prefill in (("decode", {7300, 7400, ucx}), ("pd-proxy", {7500})):
        pol = pd[f"NetworkPolicy/lmcache-{name}"]["spec"]
        assert pol["policyTypes"] == ["Ingress"]
        assert _selects(pol["podSelector"]["matchLabels"], labels[name])
        assert not any(_selects(pol["podSelector"]["matchLabels"], labels[o]) for o in labels if o != name)
        open_rules = [r for r in pol["ingress"] if "from" not in r]
        assert [[(p["port"], p["protocol"]) for p in r["ports"]] for r in open_rules] == [[(8000, "TCP")]]
        (rule,) = [r for r in pol["ingress"] if "from" in r]
        (peer,) = rule["from"]
        sel = peer["podSelector"]["matchLabels"]
        assert _selects(sel, labels["prefill"]) and not _selects(sel, labels["decode"]) and not _selects(sel, labels["pd-proxy"])
        assert all(p["protocol"] == "TCP" for p in rule["ports"])
        assert {(p["port"], p["endPort"]) if "endPort" in p else p["port"] for p in rule["ports"]} == from_prefill
        for p in rule["ports"]:
            assert "endPort" in p or p["port"] in ports[name].values()


def test_the_pd_proxy_runs_lmcaches_proxy_against_the_services(pd):
    """LMCache's disagg_proxy_server.py from LMCache's image, listening on all addresses (its
    default is localhost), pointed at the Services' names and ports, with the decoder's PD
    buffer size, the chunk size and the model the engines serve."""
    prx = pd["Deployment/lmcache-pd-proxy"]
    c = _container(prx)
    assert c["image"] == "lmcache/vllm-openai:latest"
    assert c["command"] == ["/opt/venv/bin/python3", "/workspace/LMCache/examples/disagg_prefill/disagg_proxy_server.py"]
    flags = _flags(c["args"])
    svc = {n: {p["name"]: p["port"] for p in pd[f"Service/{n}"]["spec"]["ports"]}
           for n in ("lmcache-prefill", "lmcache-decode", "lmcache-pd-proxy")}
    assert flags["--host"] == "0.0.0.0" and flags["--proxy-host"] == "0.0.0.0"
    assert flags["--port"] == str(svc["lmcache-pd-proxy"]["http"]) == str(_ports(c)["http"])
    assert flags["--proxy-port"] == str(svc["lmcache-pd-proxy"]["pd-port-5"]) == str(_ports(c)["pd-port-5"])
    assert flags["--prefiller-host"] == "lmcache-prefill" and flags["--prefiller-port"] == str(svc["lmcache-prefill"]["http"])
    assert flags["--decoder-host"] == "lmcache-decode" and flags["--decoder-port"] == str(svc["lmcache-decode"]["http"])
    assert flags["--decoder-init-port"] == str(svc["lmcache-decode"]["pd-port-3"])
    assert flags["--decoder-alloc-port"] == str(svc["lmcache-decode"]["pd-port-4"])
    denv = _env(_container(pd["Deployment/lmcache-decode"]))
    assert flags["--pd-buffer-size"] == denv["LMCACHE_PD_BUFFER_SIZE"] and flags["--chunk-size"] == "256"
    # the model the engines serve, from the same volume
    assert flags["--model"] == _container(pd["Deployment/lmcache-decode"])["args"][0] == "/models/model"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in prx["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/models"]]["persistentVolumeClaim"]["claimName"] == "vllm-models"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["tcpSocket"] == {"port": "http"}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert prx["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
