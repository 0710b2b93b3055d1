"""``lmcache bench controller`` and ``lmcache bench p2p``: the distributed parts measured
against the machine's own limits in the same run.

Why separate processes: a controller lookup and a peer fetch cross a process boundary
in production, so the numbers must too. Everything here starts real processes on
loopback (``python -m lmcache.benchmarks.dist controller|engine|p2p-peer SPEC``), each
watching its stdin: when this process exits, even killed, their stdin closes and they
stop, so a failed bench leaves nothing behind.

``controller``: a controller and N engines (synthetic KV; instance ``i`` holds the first
``i/N`` of the prompt, whole chunks), then ``count`` lookups of the full prompt by token
ids, one HTTP call each. The limit it is put next to: ``GET /v1/health`` on the same
controller through the same client, ``count`` times, interleaved with the lookups, so
both see the same machine. What is left after the ratio is the controller's work (JSON
decoding of the token list, hashing, the index walk) and the larger bodies. Then the
index part (:mod:`~lmcache.benchmarks.controller_index`): ``memory`` vs ``valkey`` vs raw
pipelined Valkey reads per chunk count, memory per million entries, failover gaps.

``p2p``: a peer engine in another process holds the chunks and runs its peer endpoint;
this process fetches them with the code an engine runs on a local miss
(``P2P._fetch_from``: pipelined GETs, decoding into pool memory, shape checks, the put
into the local hierarchy). The controller lookup that normally picks the peer is
skipped: it is what ``controller`` measures. The limit: the same payload bytes (encoded
once, ahead of time) sent by a plain socket source in the peer process and received
into one reused buffer here (the peer client too receives into a reused per-connection
buffer and then decodes into pool memory; that copy is part of what the ratio shows),
``p2p.BATCH`` per request as the peer client does. Best of
``repeats``; every fetched chunk is compared bit for bit with KV regenerated here from
the same seed.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Callable

import typer

from lmcache.errors import LMCacheError

from .harness import child_procs, err, out, print_json

HANG = 120.0  # seconds a child may take to start or a cluster to settle; a guard, not a budget
_U64 = struct.Struct("<Q")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print the results as JSON.")]


# --------------------------------------------------------------------------- child processes
def _spawn(mode: str, spec: dict[str, Any], workdir: Path, name: str) -> tuple[subprocess.Popen, list[str]]:
    """Start ``python -m lmcache.benchmarks.dist MODE SPEC`` and return it with its READY line's fields.
    The spec (it may hold tokens) goes into a 0600 file of the private work directory."""
    path = workdir / f"{name}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(spec, f)
    log = open(workdir / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "lmcache.benchmarks.dist", mode, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True)
    log.close()
    try:
        line = child_procs().readline(proc, HANG)
    except LMCacheError:
        child_procs().stop(proc)
        tail = (workdir / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
        raise LMCacheError(f"{name} did not start: {' | '.join(tail) or 'no output'}") from None
    fields = line.split()
    if fields[:1] != ["READY"]:
        child_procs().stop(proc)
        raise LMCacheError(f"{name} did not start: {line[:200]!r}")
    return proc, fields[1:]


def _until(fn: Callable[[], Any], what: str, timeout: float = HANG) -> Any:
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        try:
            last = fn()
        except LMCacheError as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.05)
    raise LMCacheError(f"not reached within {timeout:g}s: {what} (last: {str(last)[:200]})")


def _pct(sorted_s: list[float]) -> dict[str, float]:
    n = len(sorted_s)

    def at(p: float) -> float:
        return round(sorted_s[min(n - 1, int(p * n))] * 1000, 3)

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "max": round(sorted_s[-1] * 1000, 3)}


def _machine() -> dict[str, Any]:
    from .harness import machine_info, warn_if_busy  # lazy: benchmarks.commands imports this module

    m = machine_info()
    warn_if_busy(m)
    return m


# --------------------------------------------------------------------------- lookup
LOOKUP_KV = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}  # size does not enter a lookup


def prompt_tokens(n: int) -> list[int]:
    return [(i * 7919 + 13) % 30000 for i in range(n)]


def held_prefixes(instances: int, tokens: int, chunk: int) -> list[int]:
    """Instance i (1..N) holds the first i/N of the prompt, rounded down to whole chunks
    (at least one); the last holds all of it."""
    out_ = [max(chunk, i * tokens // instances // chunk * chunk) for i in range(1, instances)]
    return [min(t, tokens) for t in out_] + [tokens]


def run_lookup(instances: int, tokens: int, chunk_size: int, count: int) -> dict[str, Any]:
    from lmcache.plugins.services.controller_client import ControllerClient

    ctl_token = secrets.token_hex(16)
    prompt = prompt_tokens(tokens)
    held = held_prefixes(instances, tokens, chunk_size)
    procs: list[subprocess.Popen] = []
    e = err()
    with tempfile.TemporaryDirectory(prefix="lmcache-bench-lookup-") as d:
        wd = Path(d)
        try:
            e.print(f"starting a controller and {instances} engines on loopback ...")
            ctl, (url,) = _spawn("controller", {"token": ctl_token}, wd, "controller")
            procs.append(ctl)
            for i, n in enumerate(held):
                cfg = {"chunk_size": chunk_size, "model": "bench/synthetic", "kv_spec": LOOKUP_KV,
                       "tiers": [{"backend": "cpu", "capacity": "256MiB"}], "staging_size": "16MiB",
                       "controller": {"url": url, "token": ctl_token, "instance_id": f"bench-{i}",
                                      "heartbeat_interval": 1.0, "timeout": 5.0}}
                p, _ = _spawn("engine", {"config": cfg, "tokens": prompt[:n]}, wd, f"engine-{i}")
                procs.append(p)
            want = {f"bench-{i}": n for i, n in enumerate(held)}
            with ControllerClient(url, ctl_token, timeout=10.0) as c:
                def indexed() -> bool:
                    got = {r["instance_id"]: r["hit_tokens"] for r in c.lookup(prompt)["results"]}
                    return got == want
                _until(indexed, f"all {instances} instances registered and indexed")
                e.print(f"timing {count} lookups of {tokens} tokens and {count} health calls ...")
                for _ in range(5):  # untimed: connections, caches
                    c.health()
                    last = c.lookup(prompt)
                lt: list[float] = []
                ht: list[float] = []
                for _ in range(count):  # interleaved: both see the same machine
                    t0 = time.perf_counter()
                    c.health()
                    t1 = time.perf_counter()
                    last = c.lookup(prompt)
                    t2 = time.perf_counter()
                    ht.append(t1 - t0)
                    lt.append(t2 - t1)
        finally:
            for p in reversed(procs):
                child_procs().stop(p)
    lt.sort()
    ht.sort()
    lookup_ms, health_ms = _pct(lt), _pct(ht)
    hits = {r["instance_id"]: r["hit_tokens"] for r in last["results"]}
    return {
        "bench": "controller", "instances": instances, "tokens": tokens, "chunk_size": chunk_size, "count": count,
        "held_tokens": held, "best": last["best"], "hit_tokens": hits, "complete": hits == want,
        "lookup_ms": lookup_ms, "health_ms": health_ms,
        "ratio_p50": round(lookup_ms["p50"] / health_ms["p50"], 2) if health_ms["p50"] else None,
    }


def lookup_cmd(
    instances: Annotated[int, typer.Option("--instances", min=1, max=64, help="Engine processes registered with the controller.")] = 3,
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="Prompt length in tokens.")] = 8192,
    chunk_size: Annotated[int, typer.Option("--chunk-size", min=1, help="Tokens per chunk.")] = 256,
    count: Annotated[int, typer.Option("--count", min=1, help="Timed lookups (and as many health calls); also per chunk count of the index part.")] = 1000,
    index: Annotated[bool, typer.Option("--index/--no-index", help="Also the index part: memory vs valkey vs raw pipelined Valkey reads, memory per million entries, failover gaps.")] = True,
    chunks: Annotated[str, typer.Option("--chunks", help="Index part: prompt lengths in chunks, comma-separated.")] = "8,32,128",
    entries: Annotated[int, typer.Option("--entries", min=4, help="Index part: (chunk, instance) entries for the memory measurement.")] = 200_000,
    failover: Annotated[bool, typer.Option("--failover/--no-failover", help="Index part: SIGKILL a controller replica and a Valkey primary under lookups.")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Controller lookup latency (by token ids, N instances) next to a trivial HTTP round
    trip; then the index itself: memory vs valkey vs raw pipelined Valkey reads per chunk
    count, memory per million entries, and failover gaps."""
    from .harness import csv_option

    if tokens < chunk_size:
        raise typer.BadParameter(f"must be at least --chunk-size ({chunk_size})", param_hint="'--tokens'")
    chunk_counts = csv_option(chunks, "'--chunks'", conv=lambda v: int(v))  # not `int`: that caps at 64
    if any(not 1 <= c <= 4096 for c in chunk_counts):
        raise typer.BadParameter(f"chunk counts must be between 1 and 4096, got {chunks!r}", param_hint="'--chunks'")
    machine = _machine()
    data = run_lookup(instances, tokens, chunk_size, count)
    if index:
        from .controller_index import run_index

        data["index"] = run_index(chunk_counts, instances, count, entries, failover, _spawn)
    data["machine"] = machine
    if as_json:
        print_json(data)
    else:
        o = out()
        lk, hp = data["lookup_ms"], data["health_ms"]
        o.print(f"lmcache bench controller: {tokens} tokens, {instances} instances, {count} calls each (ms)")
        o.print("            p50      p90      p99      max")
        for name, r in (("lookup", lk), ("health", hp)):
            o.print(f"{name:8} {r['p50']:8.3f} {r['p90']:8.3f} {r['p99']:8.3f} {r['max']:8.3f}")
        o.print(f"lookup / health (p50): {data['ratio_p50']}   best: {data['best']}   complete={data['complete']}")
        if index:
            from .controller_index import print_index

            print_index(data["index"], o)
    if not data["complete"]:
        raise LMCacheError(f"the lookup did not report every instance's prefix: {data['hit_tokens']}")


# --------------------------------------------------------------------------- p2p
def p2p_kv(spec: dict[str, Any], n_tok: int, seed: int):
    """The peer's KV, generated from ``seed`` alone so this process can regenerate it."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (spec["num_layers"], 2, n_tok, spec["num_kv_heads"], spec["head_size"])
    return torch.randn(shape, generator=g, dtype=getattr(torch, spec["dtype"]))


def _p2p_engine_config(spec: dict[str, Any], chunk_size: int, total: int, token: str, fetch: bool) -> dict[str, Any]:
    cap = max(64 << 20, total * 5 // 4)
    return {"chunk_size": chunk_size, "kv_spec": spec, "tiers": [{"backend": "cpu", "capacity": cap}],
            "staging_size": "64MiB", "p2p": {"enabled": True, "token": token, "fetch": fetch, "timeout": 60.0}}


def _raw_fetch(port: int, token: str, n_values: int, batch: int) -> tuple[float, int]:
    """Seconds and bytes to receive the source's ``n_values`` values, ``batch`` per request,
    each into one reused scratch buffer with warm pages (as the peer client receives
    before it decodes into pool memory): the socket and nothing else."""
    from lmcache import wire as proto

    c = socket.create_connection(("127.0.0.1", port), timeout=60)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        c.sendall(token.encode())
        if proto.recv_exact(c, 1) != b"\x01":
            raise LMCacheError("the raw source refused the token")
        scratch = bytearray(0)
        got = 0
        t0 = time.perf_counter()
        i = 0
        while i < n_values:
            n = min(batch, n_values - i)
            c.sendall(_U64.pack(n))
            for _ in range(n):
                size = _U64.unpack(proto.recv_exact(c, 8))[0]
                if size > len(scratch):  # the first value only: later ones reuse it
                    t_alloc = time.perf_counter()
                    scratch = bytearray(size)
                    scratch[::4096] = b"\x01" * len(range(0, size, 4096))  # fault its pages in now
                    t0 += time.perf_counter() - t_alloc
                proto.recv_into_exact(c, memoryview(scratch)[:size])
                got += size
            i += n
        dt = time.perf_counter() - t0
        c.sendall(_U64.pack(0))
    finally:
        c.close()
    return dt, got


def run_p2p(chunks: int, chunk_size: int, layers: int, kv_heads: int, head_size: int, dtype: str,
            repeats: int, seed: int = 0) -> dict[str, Any]:
    import torch

    import lmcache
    from lmcache.plugins.services import p2p as p2p_mod

    spec = {"num_layers": layers, "num_kv_heads": kv_heads, "head_size": head_size, "dtype": dtype}
    n_tok = chunks * chunk_size
    token = secrets.token_hex(16)
    e = err()
    with tempfile.TemporaryDirectory(prefix="lmcache-bench-p2p-") as d:
        peer = None
        me = None
        try:
            e.print(f"starting the peer process ({chunks} chunks of {chunk_size} tokens) ...")
            peer, (url, raw_port) = _spawn("p2p-peer", {"kv_spec": spec, "chunk_size": chunk_size, "chunks": chunks,
                                                        "seed": seed, "token": token}, Path(d), "peer")
            kv = p2p_kv(spec, n_tok, seed)
            total = kv.numel() * kv.element_size()
            me = lmcache.CacheEngine.from_config(_p2p_engine_config(spec, chunk_size, total, token, fetch=False))
            tokens = list(range(n_tok))
            cks, keys = me.chunk_keys(tokens)
            fetch_s = raw_s = float("inf")
            raw_bytes = 0
            exact = True
            e.print(f"fetching {total / 1e9:.2f} GB over p2p and over raw TCP, {repeats} times ...")
            for _ in range(repeats):  # best of: the first round also pays page faults
                me.admin.clear(all=True)
                t0 = time.perf_counter()
                got = me.p2p._fetch_from(url, cks, keys)
                fetch_s = min(fetch_s, time.perf_counter() - t0)
                if got != chunks:
                    raise LMCacheError(f"the p2p fetch returned {got} of {chunks} chunks")
                r = me.retrieve(tokens)  # local hits only (fetch is off): exactly what was fetched
                exact = exact and r.num_tokens == n_tok and torch.equal(r.kv, kv)
                del r
                dt, raw_bytes = _raw_fetch(int(raw_port), token, chunks, p2p_mod.BATCH)
                raw_s = min(raw_s, dt)
            served = me.stats()["p2p"]
        finally:
            if me is not None:
                me.close()
            if peer is not None:
                child_procs().stop(peer)
    gb = total / 1e9
    return {
        "bench": "p2p", "chunks": chunks, "chunk_size": chunk_size, "kv_spec": spec,
        "chunk_bytes": total // chunks, "bytes": total, "repeats": repeats, "batch": p2p_mod.BATCH,
        "p2p_fetch_s": round(fetch_s, 4), "p2p_fetch_gbps": round(gb / fetch_s, 3),
        "raw_tcp_bytes": raw_bytes, "raw_tcp_s": round(raw_s, 4), "raw_tcp_gbps": round(raw_bytes / 1e9 / raw_s, 3),
        "ratio": round((gb / fetch_s) / (raw_bytes / 1e9 / raw_s), 3),
        "exact": bool(exact), "fetched_chunks": served.get("fetched_chunks"),
    }


def p2p_cmd(
    chunks: Annotated[int, typer.Option("--chunks", min=1, max=4096, help="Chunks the peer holds and this process fetches.")] = 16,
    chunk_size: Annotated[int, typer.Option("--chunk-size", min=1, help="Tokens per chunk.")] = 256,
    layers: Annotated[int, typer.Option("--layers", min=1)] = 32,
    kv_heads: Annotated[int, typer.Option("--kv-heads", min=1)] = 8,
    head_size: Annotated[int, typer.Option("--head-size", min=1)] = 128,
    dtype: Annotated[str, typer.Option("--dtype", help="float16, bfloat16 or float32.")] = "float16",
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Rounds; the best of each transfer counts.")] = 3,
    as_json: JsonOpt = False,
) -> None:
    """Peer-to-peer fetch GB/s from another process next to raw loopback TCP of the same bytes."""
    if dtype not in ("float16", "bfloat16", "float32"):
        raise typer.BadParameter("must be float16, bfloat16 or float32", param_hint="'--dtype'")
    machine = _machine()
    data = run_p2p(chunks, chunk_size, layers, kv_heads, head_size, dtype, repeats)
    data["machine"] = machine
    if as_json:
        print_json(data)
    else:
        o = out()
        o.print(f"lmcache bench p2p: {chunks} chunks of {data['chunk_bytes'] / (1 << 20):.1f} MiB, best of {repeats} "
                "(GB/s = 10^9 bytes/s)")
        o.print(f"p2p fetch   {data['p2p_fetch_gbps']:8.3f} GB/s   ({data['p2p_fetch_s']} s)")
        o.print(f"raw TCP     {data['raw_tcp_gbps']:8.3f} GB/s   ({data['raw_tcp_s']} s)")
        o.print(f"ratio {data['ratio']}   exact={data['exact']}")
    if not data["exact"]:
        raise LMCacheError("some fetched KV differed from what the peer stored")


# --------------------------------------------------------------------------- process entry points
def _controller_main(spec: dict[str, Any]) -> None:
    from lmcache.server.controller import ControllerServer

    index = {"index": spec["index"]} if spec.get("index") else {}  # a valkey URL (lmcache bench controller's index part)
    server = ControllerServer("127.0.0.1", 0, token=spec["token"], instance_timeout=10.0, **index)
    try:
        child_procs().serve_until_stdin_closes(f"READY {server.url}")
    finally:
        server.close()


def _engine_main(spec: dict[str, Any]) -> None:
    import torch

    import lmcache

    tokens = spec["tokens"]
    with lmcache.CacheEngine.from_config(spec["config"]) as engine:
        s = engine.kv_spec
        engine.store(tokens, torch.randn(s.num_layers, 2, len(tokens), s.num_kv_heads, s.head_size))
        engine.flush()
        child_procs().serve_until_stdin_closes(f"READY {engine.instance_id}")


def _raw_source(lsock: socket.socket, token: bytes, values: list[list[Any]]) -> None:
    """Serve ``values`` (each a list of buffers) to one client at a time: after the token,
    each u64 count requested is answered with that many (u64 length, bytes); 0 ends."""
    from lmcache import wire as proto

    while True:
        try:
            conn, _ = lsock.accept()
        except OSError:
            return
        try:
            conn.settimeout(60)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not hmac.compare_digest(bytes(proto.recv_exact(conn, len(token))), token):
                conn.sendall(b"\x00")
                continue
            conn.sendall(b"\x01")
            i = 0
            while True:
                n = _U64.unpack(proto.recv_exact(conn, 8))[0]
                if n == 0 or n > len(values):
                    break
                bufs: list[Any] = []
                for j in range(i, i + n):
                    v = values[j % len(values)]
                    bufs += [_U64.pack(sum(memoryview(b).nbytes for b in v)), *v]
                proto.send_buffers(conn, bufs)
                i += n
        except (OSError, ConnectionError):
            pass
        finally:
            conn.close()


def _p2p_peer_main(spec: dict[str, Any]) -> None:
    import lmcache

    n_tok = spec["chunks"] * spec["chunk_size"]
    kv = p2p_kv(spec["kv_spec"], n_tok, spec["seed"])
    total = kv.numel() * kv.element_size()
    tokens = list(range(n_tok))
    cfg = _p2p_engine_config(spec["kv_spec"], spec["chunk_size"], total, spec["token"], fetch=False)
    with lmcache.CacheEngine.from_config(cfg) as engine:
        engine.store(tokens, kv)
        engine.flush()
        del kv
        store = engine.p2p.endpoint.store
        held = [store.get_one(k) for k in engine.chunk_keys(tokens)[1]]  # the payloads a peer GET sends, encoded once
        if any(h is None for h in held):
            raise SystemExit("the peer did not keep every chunk (cpu tier too small?)")
        lsock = socket.socket()
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(1)
        threading.Thread(target=_raw_source, args=(lsock, spec["token"].encode(), held), daemon=True).start()
        try:
            child_procs().serve_until_stdin_closes(f"READY {engine.peer_url} {lsock.getsockname()[1]}")
        finally:
            lsock.close()
            for h in held:
                store.release(h)


_MODES = {"controller": _controller_main, "engine": _engine_main, "p2p-peer": _p2p_peer_main}


def _main(argv: list[str]) -> None:
    """``python -m lmcache.benchmarks.dist MODE SPEC.json`` runs a child process of the
    benches; ``controller``/``p2p`` run the benches themselves (``lmcache bench controller``
    and ``lmcache bench p2p`` are the same commands, with the CLI's one-line errors)."""
    if len(argv) == 2 and argv[0] in _MODES:
        _MODES[argv[0]](json.loads(Path(argv[1]).read_text()))
        return
    root = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True)
    root.command("controller")(lookup_cmd)
    root.command("p2p")(p2p_cmd)
    root(prog_name="lmcache bench", args=argv)


if __name__ == "__main__":
    _main(sys.argv[1:])
