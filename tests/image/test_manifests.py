"""The Kubernetes manifests (deploy/kubernetes): every overlay rendered by kustomize
(`kubectl kustomize`, offline), every rendered object validated against the Kubernetes API
schemas by kubernetes-validate --strict (unknown fields and wrong types refused), and the
lmcache config the ConfigMap holds checked by `lmcache config validate`. No cluster runs
here: nothing is applied.

Run: make test-image  (or LMCACHE_IMAGE_TESTS=1 .venv/bin/python -m pytest tests/image/test_manifests.py)
"""

from __future__ import annotations

import os
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
