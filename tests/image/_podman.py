"""podman for the image's tests: the settings `make image` uses (deploy/image/podman-env.sh),
containers started as users start them and always removed, and a client for a `vllm serve`
container's published port."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Sequence

from lmcache.benchmarks.vllm_live import VllmServer, free_port
from lmcache.errors import LMCacheError

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("LMCACHE_IMAGE", "localhost/lmcache-vllm:cpu")
#: the kv-transfer-config of LMCache's deployments (production stack, operator, llm-d)
UPSTREAM_KV = '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'


def podman_env() -> dict[str, str]:
    """The environment for podman: CONTAINERS_CONF as deploy/image/podman-env.sh writes it."""
    out = subprocess.run(["bash", "-c", f'source "{ROOT}/deploy/image/podman-env.sh" && printf %s "$CONTAINERS_CONF"'],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return {**os.environ, "CONTAINERS_CONF": out}


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``podman ARGS``; :class:`LMCacheError` with its stderr if it fails and ``check``."""
    p = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=podman_env())
    if check and p.returncode != 0:
        raise LMCacheError(f"podman {' '.join(args[:3])} ... exited {p.returncode}: {p.stderr.strip()[-800:]}")
    return p


def podman_problem() -> str | None:
    """Why the image's live tests cannot run here, or None."""
    if shutil.which("podman") is None:
        return "podman is not installed (as root on Debian: bash requirements/install-image-tools.sh)"
    if shutil.which("runc") is None:
        return "runc is not installed (bash requirements/install-image-tools.sh)"
    p = podman("image", "exists", IMAGE, check=False)
    if p.returncode != 0:
        return f"the image {IMAGE} is not built: run `make image` ({p.stderr.strip()})"
    return None


class Container:
    """One ``podman run -d --init`` container, removed by :meth:`remove` (also on failure)."""

    def __init__(self, run_args: Sequence[str], *, name: str | None = None):
        self.name = name or f"lmcache-test-{uuid.uuid4().hex[:10]}"
        podman("run", "-d", "--init", "--name", self.name, *run_args)

    def inspect(self) -> dict:
        return json.loads(podman("inspect", self.name).stdout)[0]

    def running(self) -> bool:
        return bool(self.inspect()["State"]["Running"])

    def ip(self) -> str:
        return self.inspect()["NetworkSettings"]["IPAddress"]

    def logs(self, tail: int = 40) -> str:
        p = podman("logs", "--tail", str(tail), self.name, check=False)
        return (p.stdout + p.stderr)[-6000:]

    def host_pids(self) -> list[int]:
        """The host PIDs of every process in the container."""
        out = podman("top", self.name, "hpid").stdout.split()
        return [int(x) for x in out[1:] if x.isdigit()]

    def stop(self, timeout: int = 60) -> tuple[float, int]:
        """``podman stop`` (SIGTERM, SIGKILL after ``timeout`` s): seconds taken, exit code."""
        t0 = time.monotonic()
        podman("stop", "--time", str(timeout), self.name, timeout=timeout + 60)
        took = time.monotonic() - t0
        return took, int(self.inspect()["State"]["ExitCode"])

    def remove(self) -> None:
        podman("rm", "--force", "--time", "10", self.name, check=False, timeout=120)


class VllmContainer(VllmServer):
    """``vllm serve`` in a container of the image, reached through its published port:
    :meth:`complete`, :meth:`metrics` and :meth:`close` as for a local server."""

    def __init__(self, model_dir: Path, *, env: dict[str, str] | None = None, volumes: Sequence[str] = (),
                 kv_transfer_config: str | None = None, start_timeout: float = 600.0):
        self.port = free_port()
        self.name = "model"
        self.log_path = None
        # vLLM's processes share tensors through /dev/shm (160 MiB here; podman gives 64 MiB)
        args = ["-p", f"127.0.0.1:{self.port}:8000", "--shm-size", "1g", "-v", f"{model_dir}:/models/smollm2:ro"]
        for v in volumes:
            args += ["-v", v]
        # as VllmServer runs vLLM on this machine (benchmarks/vllm_live.py)
        e = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "2",
             "OMP_NUM_THREADS": str(os.cpu_count() or 2), "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE",
             "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        for k, v in e.items():
            args += ["-e", f"{k}={v}"]
        args += [IMAGE, "/models/smollm2", "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "model",
                 "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096", "--max-num-seqs", "8",
                 "--no-enable-prefix-caching"]
        if kv_transfer_config:
            args += ["--kv-transfer-config", kv_transfer_config]
        self.container = Container(args)
        try:
            self._wait(start_timeout)
        except BaseException:
            self.container.remove()
            raise

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.container.running():
                raise LMCacheError(f"vllm serve container exited before it was ready: {self.container.logs()}")
            try:
                if self._request("GET", "/health", timeout=2.0)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        raise LMCacheError(f"vllm serve container not ready within {timeout:g}s: {self.container.logs()}")

    def tail(self, n: int = 15) -> str:
        return self.container.logs(n)

    def close(self, timeout: float = 30.0) -> None:
        self.container.remove()


def readable_model(model_dir: Path, dest: Path) -> Path:
    """A copy of the model directory that the image's non-root user (uid 1000) can read:
    the model cache's weights are private to their owner (mode 0600)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file():
            shutil.copyfile(f, dest / f.name)
            (dest / f.name).chmod(0o644)
    dest.chmod(0o755)
    return dest
