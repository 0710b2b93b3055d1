"""What the operator page's browser tests share (tests/web/conftest.py makes the fixtures): a real controller with auth on (an admin token and two
tenant tokens), three real engines registered with it (each with its instance API), and
headless Chromium driven with selenium.

Set up once per module (about 10 s on a 2-core machine, most of it Chromium's start):

=========  =========  ==============  ==============================================
instance   namespace  tiers           holds
=========  =========  ==============  ==============================================
web-a1     team-a     cpu, disk       DOC (80 tokens, 5 chunks), in both tiers
web-a2     team-a     cpu             OTHER (48 tokens) and one entry whose key holds
                                      ``<script>alert(1)</script>`` (:data:`HOSTILE_KEY`)
web-b1     team-b     cpu             DOC[:32] (2 chunks) and B_ONLY (48 tokens)
=========  =========  ==============  ==============================================

Each engine's worker registers with its tenant's token, as a tenant's deployment would; the
instance APIs take the admin token (the controller dispatches with it) and the tenants.
The hostile key is what a writer that does not quote model names (another version, another
tenant of a shared store) leaves in a store: it parses as a team-a key whose model is
``<script>alert(1)</script>``, so it reaches team-a's listings.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "web-admin-token"
TENANT_TOKENS = {"team-a": "web-tok-a", "team-b": "web-tok-b"}
TENANTS = {ns: (tok,) for ns, tok in TENANT_TOKENS.items()}
CHUNK = 16
KV_SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}
MODEL = "org/web-model"
DOC = [(i * 7919 + 13) % 30000 for i in range(80)]
OTHER = [(i * 104729 + 7) % 30000 for i in range(48)]
B_ONLY = [(i * 3571 + 5) % 30000 for i in range(48)]
#: instance id -> (namespace, disk tier or not, token lists it stores)
LAYOUT: dict[str, tuple[str, bool, list[list[int]]]] = {
    "web-a1": ("team-a", True, [DOC]),
    "web-a2": ("team-a", False, [OTHER]),
    "web-b1": ("team-b", False, [DOC[:32], B_ONLY]),
}
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: the flags this machine's headless Chromium needs (no sandbox as root, no GPU, no network
#: of its own: no QUIC, no background or component update traffic, no sync)
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1200,800")


def hostile_key(signature: str) -> str:
    """A team-a key whose model part is ``<script>alert(1)</script>`` unquoted."""
    return f"lmc1:team-a:<script>alert(1)</script>:{signature}:{'ab' * 16}"


class Cluster:
    """The controller and the engines (in this process); ``api(iid)`` an admin client
    of an instance's API, ``ctl(token)`` a client of the controller."""

    def __init__(self, tmp: Path):
        import torch

        import lmcache
        from lmcache.server.controller import ControllerServer

        self.server = ControllerServer("127.0.0.1", 0, token=ADMIN, tenants=TENANTS, instance_timeout=5)
        self.url = self.server.url
        self.engines: dict[str, Any] = {}
        try:
            for iid, (ns, disk, stored) in LAYOUT.items():
                tiers: list[dict[str, Any]] = [{"backend": "cpu", "capacity": "4MiB"}]
                if disk:
                    tiers.append({"backend": "disk", "path": str(tmp / iid), "capacity": "16MiB"})
                eng = lmcache.CacheEngine.from_config({
                    "chunk_size": CHUNK, "namespace": ns, "model": MODEL, "kv_spec": KV_SPEC, "tiers": tiers,
                    "api": {"enabled": True, "token": ADMIN, "tenants": {k: list(v) for k, v in TENANTS.items()},
                            "timeout": 5},
                    "controller": {"url": self.url, "token": TENANT_TOKENS[ns], "instance_id": iid,
                                   "heartbeat_interval": 0.2, "timeout": 2.0},
                })
                self.engines[iid] = eng
                s = eng.kv_spec
                for toks in stored:
                    eng.store(toks, torch.randn(s.num_layers, 2, len(toks), s.num_kv_heads, s.head_size))
                eng.flush()
            # a hit rate to show: web-a1 serves DOC (5 chunks hit) and misses OTHER's 3
            a1 = self.engines["web-a1"]
            assert a1.retrieve(DOC).num_tokens == len(DOC) and a1.retrieve(OTHER).num_tokens == 0
            a2 = self.engines["web-a2"]
            self.hostile = hostile_key(a2.kv_spec.signature)
            obj = a2.hierarchy.allocate((2, 2, CHUNK, 2, 8), torch.float32)
            assert obj is not None
            try:
                assert a2.hierarchy.put_one(self.hostile, obj)
            finally:
                obj.unref()
        except BaseException:
            self.close()
            raise

    def api(self, iid: str):
        from lmcache.plugins.services.api_client import ApiClient

        return ApiClient(self.engines[iid].api_url, ADMIN, timeout=10)

    def ctl(self, token: str | None = ADMIN):
        from lmcache.plugins.services.controller_client import ControllerClient

        return ControllerClient(self.url, token, timeout=10)

    def instances(self, token: str | None = ADMIN) -> dict[str, dict[str, Any]]:
        """``GET /v1/instances`` by instance id."""
        return {i["instance_id"]: i for i in self.ctl(token).instances()}

    def keys(self, iid: str, tier: str) -> list[str]:
        """The keys an instance's tier holds, from its own API."""
        return [e["key"] for e in self.api(iid).keys(tier, limit=None)["entries"]]

    def close(self) -> None:
        for eng in self.engines.values():
            eng.close()
        self.server.close()


class Browser:
    """Headless Chromium (selenium): ``driver``, and every URL the browser requested so
    far (``urls()``, from the DevTools performance log, with the headers it sent)."""

    def __init__(self, driver: Any, profile: str):
        self.driver = driver
        self.profile = profile
        self.requests: list[dict[str, Any]] = []

    def drain(self) -> list[dict[str, Any]]:
        """The requests made since the last call, appended to :attr:`requests`:
        ``{"url", "method", "headers"}``, from ``Network.requestWillBeSent``."""
        import json

        new = []
        for entry in self.driver.get_log("performance"):
            msg = json.loads(entry["message"])["message"]
            if msg.get("method") == "Network.requestWillBeSent":
                req = msg["params"]["request"]
                new.append({"url": req["url"], "method": req["method"], "headers": req.get("headers", {})})
        self.requests.extend(new)
        return new

    def close(self) -> None:
        try:
            self.driver.quit()
        finally:
            shutil.rmtree(self.profile, ignore_errors=True)
