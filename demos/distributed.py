"""``lmcache demo distributed``: three engine instances and a controller on loopback, with
the real model, walked through the distributed features one step at a time.

Why real processes: what the walk-through shows (a router's lookup, a peer fetch that
skips a prefill, a prefill -> decode push, a move, an instance dying) only means
something across process boundaries, so every piece runs as a user would run it: the
controller is ``lmcache controller serve``; each instance is its own Python process
(this module run as ``python -m lmcache.demos.distributed instance SPEC``) loading
SmolLM2-135M-Instruct on the CPU with the transformers connector over a
:class:`~lmcache.engine.CacheEngine` that has a CPU tier, the instance API, a peer
endpoint and a controller worker; and every operator step is the real ``lmcache
controller ...`` command run as a subprocess, printed with its real output so that
``docs/distributed.md`` can paste it.

The instances are driven over their stdin/stdout (one JSON request per line, one
``LMDEMO {json}`` reply per line) because the demo needs "run this prompt and tell me
the time to first token", which no product API offers; everything else goes through
the product's own interfaces (the controller's CLI, the instance API's ``/v1/push``).

Roles: ``prefill-a`` runs prompts from scratch; ``decode-b`` does not fetch from peers
(``p2p.fetch: false``), so what it hits can only have been pushed to it; ``peer-c``
fetches from peers on a local miss. The command exits non-zero when a check fails:
a hit is missing, an answer with cached KV differs from the answer without, or the
killed instance is still offered by lookups.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Callable

import typer

from lmcache.errors import LMCacheError

from lmcache.benchmarks.harness import child_procs, err, out

PREFILL, DECODE, PEER = "prefill-a", "decode-b", "peer-c"
ROLES = (PREFILL, DECODE, PEER)
REPLY = "LMDEMO "  # the prefix of an instance's reply lines (anything else on stdout is ignored)
HANG = 120.0  # a generous guard on every wait, not a timing expectation


# ============================================================================ the instances
def instance_config(iid: str, ctl_url: str, ctl_token: str, p2p_token: str, api_token: str, chunk_size: int,
                    heartbeat: float, cpu_capacity: str) -> dict[str, Any]:
    """One instance's engine config: a CPU tier, the instance API, a peer endpoint and
    the controller worker, all on loopback with tokens."""
    from lmcache.benchmarks.handbook import MODEL_KEY

    return {
        "chunk_size": chunk_size,
        "model": MODEL_KEY,
        "tiers": [{"backend": "cpu", "capacity": cpu_capacity}],
        "api": {"enabled": True, "token": api_token},
        "controller": {"url": ctl_url, "token": ctl_token, "instance_id": iid, "heartbeat_interval": heartbeat,
                       "timeout": 2.0},
        "p2p": {"enabled": True, "token": p2p_token, "fetch": iid != DECODE, "timeout": 5.0},
    }


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


def instance_main(spec_path: str) -> None:
    """One engine instance: load the model, build the engine, say READY, then serve the
    demo's requests on stdin until EOF (or SIGTERM), and close the engine cleanly."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = json.loads(Path(spec_path).read_text())
    import torch

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    from lmcache.engine import CacheEngine
    from lmcache import connector

    TransformersConnector = connector("transformers")  # through the plugin registries
    kv_spec_of = TransformersConnector.kv_spec_of

    from lmcache.benchmarks.handbook import build_document, load_model, warm_up

    model, tok, info = load_model(None)
    warm_up(model, tok, spec["doc_tokens"])
    engine = CacheEngine.from_config(spec["config"], kv_spec=kv_spec_of(model))
    conn = TransformersConnector(model, tok, engine)
    signal.signal(signal.SIGTERM, lambda *_: sys.stdin.close())
    docs: dict[int, Any] = {}
    try:
        _reply({"ready": True, "instance_id": engine.instance_id, "api_url": engine.api_url,
                "peer_url": engine.peer_url, "load_seconds": info["seconds"], "pid": os.getpid()})
        for line in sys.stdin:
            try:
                req = json.loads(line)
                op = req.get("op")
                if op == "prompt":
                    seed = int(req["seed"])
                    if seed not in docs:
                        docs[seed] = build_document(tok, spec["doc_tokens"], spec["chunk_size"], seed)
                    fact = docs[seed].facts[int(req["fact"]) - 1]
                    _reply({"ids": docs[seed].prompt_ids(tok, fact.question), "question": fact.question,
                            "expected": fact.answer})
                elif op == "ask":
                    g = conn.generate(req["tokens"], max_new_tokens=int(req["max_new_tokens"]),
                                      use_cache=bool(req.get("use_cache", True)), store=bool(req.get("store", True)))
                    _reply({"tokens": g.tokens, "text": (g.text or "").strip(), "prompt_tokens": g.prompt_tokens,
                            "cached_tokens": g.cached_tokens, "tiers": dict(Counter(g.tiers)), "ttft": g.ttft,
                            "load_seconds": g.timings.get("load", 0.0), "kv_bytes": g.kv_bytes_loaded,
                            "p2p": engine.stats()["p2p"]})
                elif op == "stats":
                    _reply({"p2p": engine.stats()["p2p"]})
                else:
                    _reply({"error": f"unknown op {op!r}"})
            except Exception as exc:  # reported to the demo, which fails the step
                _reply({"error": f"{type(exc).__name__}: {exc}"})
    except (OSError, ValueError):
        pass  # stdin closed by SIGTERM
    finally:
        conn.close()


class Instance:
    """The demo's handle on one instance process: requests in, replies out, each
    reply awaited with a hang guard; stderr goes to a log file shown on failure."""

    def __init__(self, iid: str, spec_path: Path, log_path: Path, env: dict[str, str]):
        self.iid = iid
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache.demos.distributed", "instance", str(spec_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.info: dict[str, Any] = {}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                self._lines.put(line[len(REPLY):])
        self._lines.put(None)

    def reply(self, timeout: float = HANG) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise LMCacheError(f"{self.iid} did not answer within {timeout:.0f} s (log: {self.log_path})") from None
        if line is None:  # stdout closed: the process is exiting
            self._lines.put(None)  # and every later call fails as fast
            try:
                code = self.proc.wait(10)
            except subprocess.TimeoutExpired:
                code = None
            raise LMCacheError(f"{self.iid} exited (code {code}); {self._tail()}")
        r = json.loads(line)
        if "error" in r:
            raise LMCacheError(f"{self.iid}: {r['error']}")
        return r

    def call(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise LMCacheError(f"{self.iid} is not running (code {self.proc.poll()}); {self._tail()}") from None
        return self.reply()

    def _tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return f"last log line: {lines[-1]}" if lines else f"log: {self.log_path}"

    def stop(self) -> None:
        """Close stdin (a clean engine close, which deregisters), then SIGTERM, SIGKILL."""
        child_procs().stop(self.proc, grace=15)
        self._log.close()


# ============================================================================ the walk-through
class Walk:
    """Printing, the CLI runner and the checks of one run."""

    def __init__(self, work: Path, env: dict[str, str]):
        self.o = out()
        self.work = work
        self.env = env
        self.checks: list[tuple[str, bool]] = []

    def say(self, text: str = "") -> None:
        self.o.print(text, markup=False, highlight=False, soft_wrap=True)

    def step(self, n: int, title: str) -> None:
        self.o.print()
        self.o.print(f"[bold]{n}. {title}[/]", soft_wrap=True)

    def check(self, what: str, ok: bool) -> bool:
        self.checks.append((what, bool(ok)))
        self.say(f"  check: {what}: {'ok' if ok else 'FAILED'}")
        return bool(ok)

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run ``lmcache ARGS`` as a subprocess and print the command and its real output."""
        self.say(f"$ lmcache {shlex.join(args)}")
        p = subprocess.run([sys.executable, "-m", "lmcache.cli.main", *args], capture_output=True, text=True,
                           env=self.env, timeout=timeout)
        for text in (p.stdout, p.stderr):
            if text.strip():
                self.say(text.rstrip("\n"))
        if p.returncode != 0:
            self.say(f"(exit code {p.returncode})")
        return p

    def tokens_file(self, name: str, ids: list[int]) -> str:
        path = self.work / name
        path.write_text(json.dumps(ids))
        return str(path)


def _wait(fn: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    end = time.monotonic() + timeout
    while True:
        r = fn()
        if r:
            return r
        if time.monotonic() > end:
            raise LMCacheError(f"not reached within {timeout:.0f} s: {what}")
        time.sleep(0.1)


def _ms(s: float) -> str:
    return f"{s * 1e3:,.0f} ms" if s < 1 else f"{s:,.2f} s"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _holders(client: Any, ids: list[int]) -> dict[str, int]:
    return {r["instance_id"]: r["hit_tokens"] for r in client.lookup(ids)["results"]}


def _answer_line(w: Walk, who: str, a: dict[str, Any], expected: str) -> None:
    tiers = ", ".join(f"{k} x{v}" for k, v in a["tiers"].items()) or "-"
    w.say(f"  {who}: prompt {a['prompt_tokens']:,} tokens, cached {a['cached_tokens']:,} (chunks from: {tiers}), "
          f"computed {a['prompt_tokens'] - a['cached_tokens']:,}; TTFT {_ms(a['ttft'])}")
    w.say(f"  answer: {a['text']!r} (the handbook says: {expected})")


def walk_through(w: Walk, ctl_url: str, ctl_token: str, api_token: str, insts: dict[str, Instance],
                 max_new_tokens: int, instance_timeout: float) -> None:
    from lmcache.plugins.services.controller_client import ControllerClient

    client = ControllerClient(ctl_url, ctl_token, 10.0)
    a, b, c = insts[PREFILL], insts[DECODE], insts[PEER]

    def registered() -> bool:
        rows = {r["instance_id"]: r for r in client.instances()}
        return all(i in rows and rows[i]["healthy"] and rows[i].get("peer_url") for i in ROLES)

    _wait(registered, "all three instances registered with their peer endpoints", 60)
    w.say()
    w.say("The three instances registered with the controller:")
    w.cli("controller", "instances", "--url", ctl_url)

    p1 = a.call(op="prompt", seed=0, fact=1)
    p2 = a.call(op="prompt", seed=1, fact=2)
    ids1, ids2 = p1["ids"], p2["ids"]
    f1 = w.tokens_file("prompt1.json", ids1)
    f2 = w.tokens_file("prompt2.json", ids2)
    w.say()
    w.say(f"Prompt 1: a staff handbook (seed 0) + {p1['question']!r}: {len(ids1):,} tokens, saved as {f1}")
    w.say(f"Prompt 2: another handbook (seed 1) + {p2['question']!r}: {len(ids2):,} tokens, saved as {f2}")
    _steps_1_to_3(w, client, ctl_url, a, c, p1, f1, max_new_tokens)
    _step_4_push(w, a, b, p2, api_token, max_new_tokens)
    _step_5_move(w, client, ctl_url, p2, f2)
    _step_6_kill(w, client, ctl_url, a, (p1, f1), (p2, f2), instance_timeout)


def _steps_1_to_3(w: Walk, client: Any, ctl_url: str, a: Instance, c: Instance, p1: dict[str, Any], f1: Path,
                  max_new_tokens: int) -> None:
    ids1 = p1["ids"]
    # 1 ------------------------------------------------------------------
    w.step(1, f"prompt 1 on {PREFILL}: nothing is cached anywhere, a full prefill")
    r1 = a.call(op="ask", tokens=ids1, max_new_tokens=max_new_tokens)
    _answer_line(w, PREFILL, r1, p1["expected"])
    w.check(f"{PREFILL} computed every token (cached 0)", r1["cached_tokens"] == 0)

    # 2 ------------------------------------------------------------------
    w.step(2, "a KV-aware router asks the controller who holds prompt 1")
    _wait(lambda: _holders(client, ids1).get(PREFILL) == len(ids1), f"the controller indexed {PREFILL}'s chunks")
    w.cli("controller", "lookup", "--url", ctl_url, "--tokens-file", f1)
    h = _holders(client, ids1)
    w.check(f"lookup lists {PREFILL} holding all {len(ids1):,} tokens", h.get(PREFILL) == len(ids1))

    # 3 ------------------------------------------------------------------
    w.step(3, f"prompt 1 on {PEER}: a local miss, fetched from {PREFILL}'s peer endpoint")
    r3 = c.call(op="ask", tokens=ids1, max_new_tokens=max_new_tokens)
    _answer_line(w, PEER, r3, p1["expected"])
    p2p = r3["p2p"]
    w.say(f"  p2p: {p2p['fetched_chunks']} chunks ({_mb(p2p['fetched_bytes'])}) fetched from {PREFILL} "
          f"after {p2p['lookups']} controller lookup(s); the prefill of {r3['cached_tokens']:,} tokens was skipped: "
          f"TTFT {_ms(r3['ttft'])} instead of {_ms(r1['ttft'])} ({r1['ttft'] / max(r3['ttft'], 1e-9):.1f}x)")
    w.check(f"{PEER} skipped the prefill of {r3['cached_tokens']:,} tokens (all but the last)",
            r3["cached_tokens"] == len(ids1) - 1 and p2p["fetched_chunks"] > 0)
    w.check(f"{PEER}'s answer is identical to {PREFILL}'s full-prefill answer", r3["tokens"] == r1["tokens"])


def _step_4_push(w: Walk, a: Instance, b: Instance, p2: dict[str, Any], api_token: str, max_new_tokens: int) -> None:
    from lmcache.plugins.services.api_client import ApiClient

    ids2 = p2["ids"]
    # 4 ------------------------------------------------------------------
    w.step(4, f"prefill -> decode: {PREFILL} prefills prompt 2 and pushes its KV to {DECODE}")
    r4a = a.call(op="ask", tokens=ids2, max_new_tokens=1)
    w.say(f"  {PREFILL}: prefilled {r4a['prompt_tokens']:,} tokens (cached {r4a['cached_tokens']}), "
          f"TTFT {_ms(r4a['ttft'])}")
    api_url = a.info["api_url"]
    body = w.work / "push.json"  # the body that the curl line sends
    body.write_text(json.dumps({"target": DECODE, "tokens": ids2}))
    w.say(f"$ curl -s -H \"Authorization: Bearer $API_TOKEN\" -H 'Content-Type: application/json' "
          f"-d @{body} {api_url}/v1/push")
    pushed = ApiClient(api_url, api_token, 60.0).request("POST", "/v1/push", body={"target": DECODE, "tokens": ids2})
    shown = {k: (f"[{len(v)} keys]" if isinstance(v, list) and v else v) for k, v in pushed.items()}
    w.say(json.dumps(shown))
    w.say("  (lists of chunk keys shortened to their length)")
    before = b.call(op="stats")["p2p"]
    base = b.call(op="ask", tokens=ids2, max_new_tokens=max_new_tokens, use_cache=False, store=False)
    w.say(f"  {DECODE} without lmcache (use_cache=False): TTFT {_ms(base['ttft'])}, answer {base['text']!r}")
    r4 = b.call(op="ask", tokens=ids2, max_new_tokens=max_new_tokens)
    _answer_line(w, DECODE, r4, p2["expected"])
    w.say(f"  {DECODE} does not fetch from peers (p2p.fetch: false): its endpoint received "
          f"{r4['p2p']['endpoint']['received_chunks']} pushed chunks; it fetched {r4['p2p']['fetched_chunks']}")
    w.check(f"{PREFILL} pushed every chunk of prompt 2", len(pushed["pushed"]) > 0 and not pushed["missing"])
    w.check(f"{DECODE} skipped the prefill of {r4['cached_tokens']:,} tokens with the pushed KV",
            r4["cached_tokens"] == len(ids2) - 1 and r4["p2p"]["fetched_chunks"] == before["fetched_chunks"])
    w.check(f"{DECODE}'s answer is identical to its answer without lmcache", r4["tokens"] == base["tokens"])


def _step_5_move(w: Walk, client: Any, ctl_url: str, p2: dict[str, Any], f2: Path) -> None:
    ids2 = p2["ids"]
    # 5 ------------------------------------------------------------------
    w.step(5, f"the operator moves prompt 2 from {DECODE}'s cpu tier to {PEER}'s")
    p = w.cli("controller", "move", DECODE, "cpu", PEER, "cpu", "--tokens-file", f2, "--remove-source", "--url", ctl_url)
    w.check("controller move succeeded", p.returncode == 0)

    def moved() -> bool:
        hh = _holders(client, ids2)
        return hh.get(PEER) == len(ids2) and DECODE not in hh

    try:
        _wait(moved, f"the controller saw {PEER} admit and {DECODE} evict prompt 2's chunks")
    except LMCacheError as exc:
        w.say(f"  {exc}")
    w.cli("controller", "lookup", "--url", ctl_url, "--tokens-file", f2)
    h = _holders(client, ids2)
    w.check(f"lookup lists {PEER} holding prompt 2, and no longer {DECODE}", h.get(PEER) == len(ids2) and DECODE not in h)


def _step_6_kill(w: Walk, client: Any, ctl_url: str, a: Instance, one: tuple[dict[str, Any], Path],
                 two: tuple[dict[str, Any], Path], instance_timeout: float) -> None:
    (p1, f1), (p2, f2) = one, two
    ids1, ids2 = p1["ids"], p2["ids"]
    # 6 ------------------------------------------------------------------
    w.step(6, f"{PREFILL} dies (SIGKILL): the controller stops routing to it")
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    t0 = time.monotonic()
    w.say(f"$ kill -9 {a.proc.pid}    # {PREFILL}")

    def unhealthy() -> bool:
        return any(r["instance_id"] == PREFILL and not r["healthy"] for r in client.instances())

    _wait(unhealthy, f"{PREFILL} marked unhealthy", max(30.0, 10 * instance_timeout))
    w.say(f"  ({_ms(time.monotonic() - t0)} after the kill, {PREFILL}'s last heartbeat is older than the "
          f"controller's --instance-timeout {instance_timeout:g} s: it is unhealthy)")
    w.cli("controller", "instances", "--url", ctl_url)
    w.cli("controller", "lookup", "--url", ctl_url, "--tokens-file", f1)
    w.cli("controller", "lookup", "--url", ctl_url, "--tokens-file", f2)
    h1, h2 = _holders(client, ids1), _holders(client, ids2)
    rows = {r["instance_id"]: r for r in client.instances()}
    w.check(f"{PREFILL} is listed unhealthy", PREFILL in rows and not rows[PREFILL]["healthy"])
    w.check(f"lookups no longer list {PREFILL}; {PEER} still serves both prompts",
            PREFILL not in h1 and PREFILL not in h2 and h1.get(PEER) == len(ids1) and h2.get(PEER) == len(ids2))


# ============================================================================ the command
def _show_config(w: Walk, ctl_url: str, chunk_size: int, heartbeat: float) -> None:
    import yaml

    masked = json.loads(json.dumps(instance_config(PEER, ctl_url, "***", "***", "***", chunk_size, heartbeat, "256MiB")))
    w.say()
    w.say(f"Each instance is a process loading the model, with this lmcache config ({PEER}'s; "
          f"{PREFILL} differs only in instance_id, {DECODE} also has p2p.fetch: false; tokens masked):")
    w.say(yaml.safe_dump(masked, sort_keys=False, default_flow_style=None).rstrip())


def distributed_cmd(
    doc_tokens: Annotated[int, typer.Option("--doc-tokens", min=64, help="Tokens of each prompt's handbook, rounded to whole chunks.")] = 1536,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Longest answer, in tokens (greedy).")] = 8,
    chunk_size: Annotated[int, typer.Option("--chunk-size", min=1, help="Tokens per chunk.")] = 256,
    instance_timeout: Annotated[float, typer.Option("--instance-timeout", min=0.5, metavar="SECONDS",
                                                    help="The controller's instance timeout (heartbeats every quarter of it).")] = 2.0,
    threads: Annotated[int | None, typer.Option("--threads", min=1, show_default=False, help="torch threads per instance.")] = None,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the work directory (configs, prompts, instance logs).")] = False,
) -> None:
    """A 3-instance walk-through with the real model on loopback: a controller, a prefill, a
    decode and a peer instance; lookup, P2P fetch, prefill->decode push, move, and an
    instance dying. Each step prints the real command and its output."""
    started = time.perf_counter()
    o, e = out(), err()
    work = Path(tempfile.mkdtemp(prefix="lmcache-demo-dist-"))
    ctl_token, p2p_token, api_token = (secrets.token_hex(8) for _ in range(3))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env.update(HF_HUB_OFFLINE="1", LMCACHE_CONTROLLER_TOKEN=ctl_token, COLUMNS=env.get("COLUMNS", "120"))
    w = Walk(work, env)
    ctl: subprocess.Popen | None = None
    insts: dict[str, Instance] = {}
    failed: str | None = None
    try:
        o.print("[bold]lmcache demo distributed[/]: a controller and three instances of SmolLM2-135M-Instruct "
                "(CPU, transformers connector) on loopback", soft_wrap=True)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        w.say(f"({os.cpu_count()} CPUs, load average {load:.2f} at the start: the times below are this machine's, "
              "and other work on it slows them)")
        w.say()
        w.say(f"$ export LMCACHE_CONTROLLER_TOKEN={ctl_token}")
        heartbeat = instance_timeout / 4
        args = ["controller", "serve", "--port", "0", "--instance-timeout", f"{instance_timeout:g}"]
        w.say(f"$ lmcache {shlex.join(args)} &")
        with open(work / "controller.log", "wb") as log:  # the child keeps its own descriptor
            ctl = subprocess.Popen([sys.executable, "-m", "lmcache.cli.main", *args], stdout=subprocess.PIPE,
                                   stderr=log, text=True, env=env)
        assert ctl.stdout is not None
        try:
            ctl_url = child_procs().readline(ctl, 60.0)  # a hang guard
        except LMCacheError:
            ctl_url = ""
        if not ctl_url.startswith("http"):
            raise LMCacheError(f"the controller did not start (exit {ctl.poll()}); see {work / 'controller.log'}")
        w.say(ctl_url)
        for iid in ROLES:
            cfg = instance_config(iid, ctl_url, ctl_token, p2p_token, api_token, chunk_size, heartbeat, "256MiB")
            spec = work / f"{iid}.json"
            spec.write_text(json.dumps({"config": cfg, "doc_tokens": doc_tokens, "chunk_size": chunk_size,
                                        "threads": threads}))
            insts[iid] = Instance(iid, spec, work / f"{iid}.log", env)
        _show_config(w, ctl_url, chunk_size, heartbeat)
        with e.status("three instances load the model ..."):
            for iid, inst in insts.items():
                inst.info = inst.reply(HANG)
        w.say("Instances up: " + "; ".join(
            f"{iid} (pid {i.info['pid']}, api {i.info['api_url']}, peer {i.info['peer_url']})" for iid, i in insts.items()))
        walk_through(w, ctl_url, ctl_token, api_token, insts, max_new_tokens, instance_timeout)
    except (LMCacheError, OSError, subprocess.TimeoutExpired) as exc:
        failed = str(exc)
    finally:
        for inst in insts.values():
            inst.stop()
        if ctl is not None:
            child_procs().stop(ctl)
        bad = [what for what, ok in w.checks if not ok]
        keep = keep or bool(failed or bad)  # the instance logs say why
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    _verdict(w, failed, bad, time.perf_counter() - started, work, keep)


def _verdict(w: Walk, failed: str | None, bad: list[str], seconds: float, work: Path, keep: bool) -> None:
    """PASS, or FAIL with why (exit 1)."""
    o = out()
    o.print()
    if failed or bad or not w.checks:
        why = failed or ("; ".join(bad) if bad else "no checks ran")
        o.print(f"[bold red]FAIL[/]: {why} ({len(w.checks) - len(bad)}/{len(w.checks)} checks passed, {seconds:.0f} s)",
                soft_wrap=True)
        err().print(f"lmcache demo distributed: {why} (configs and instance logs kept in {work})",
                    markup=False, soft_wrap=True)
        raise typer.Exit(1)
    o.print(f"[bold green]PASS[/]: all {len(w.checks)} checks passed ({seconds:.0f} s in all)."
            + (f" Work directory: {work}" if keep else ""), soft_wrap=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["instance"] and len(sys.argv) == 3:
        instance_main(sys.argv[2])
    else:
        app = typer.Typer(add_completion=False)
        app.command()(distributed_cmd)
        app()
