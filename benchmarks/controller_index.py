"""The index part of ``lmcache bench controller``: the controller's index (``memory`` and
``valkey``) measured against the limit of its store in the same run.

- **Lookups per chunk count**: ``instances`` instances hold prefixes of one prompt (the
  i-th of N the first i/N of it, the last all of it), registered through the index's own
  methods; a lookup by chunk hashes (what a router sends) is timed ``count`` times for
  each prompt length of ``chunks`` chunks: the index object called directly (no HTTP),
  and through the controller's HTTP API. The limit for ``valkey``: a raw redis-py
  pipeline reading the same keys on the same server (:func:`raw_reads`), interleaved
  with the index's lookups so both see the same machine.
- **Memory per million (chunk, instance) entries**: ``memory``: the growth of this
  process's RSS while a fresh index takes ``entries`` entries (distinct keys, the worst
  case: no chunk shared between instances); ``valkey``: the growth of the server's
  ``used_memory``. Extrapolated linearly to 10 M.
- **Failover gaps**: two controller processes, a client given both URLs doing lookups in
  a loop; the one it uses is SIGKILLed: failed lookups and the longest gap between two
  answered lookups. With ``valkey``: a primary, a replica and a Sentinel; the primary is
  SIGKILLed under the same loop: failed lookups and the time until lookups are answered
  again (Sentinel's ``down-after-milliseconds`` is part of it and is reported).

Valkey servers come from :mod:`lmcache.testing.stores` (installed when missing). When
``ControllerServer`` does not take ``index="valkey://..."`` (an older lmcache) the
valkey rows say ``valkey index not available: WHY`` instead of failing.
"""

from __future__ import annotations

import contextlib
import gc
import secrets
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from .harness import child_procs, err

NAMESPACE, MODEL, SIG = "bench", "bench/synthetic", "float16-L2-H2-D8-layout-tp0of1"
TIERS = ["cpu", "disk"]


def _pct(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    n = len(s)
    return {"p50": round(s[n // 2] * 1000, 4), "p99": round(s[min(n - 1, int(0.99 * n))] * 1000, 4)}


def _hashes(n: int, salt: str) -> list[str]:
    """``n`` distinct 128-bit hex chunk hashes (xxh3_128's form), the same in every run."""
    import hashlib

    return [hashlib.blake2b(f"{salt}:{i}".encode(), digest_size=16).hexdigest() for i in range(n)]


def _prefix() -> str:
    from urllib.parse import quote

    from lmcache.keys import KEY_PREFIX

    return ":".join((KEY_PREFIX, NAMESPACE, quote(MODEL, safe="-_.~"), SIG, ""))


def _register(index: Any, iid: str, keys: list[str], batch: int = 1000) -> str:
    body = {"instance_id": iid, "namespace": NAMESPACE, "model": MODEL, "kv_signature": SIG, "chunk_size": 256,
            "hash_algorithm": "xxh3_128", "save_unfull_chunk": True, "tiers": TIERS}
    session = index.register(body)["session"]
    for i in range(0, len(keys), batch):
        index.events({"instance_id": iid, "session": session,
                      "events": [["admit", "cpu", k] for k in keys[i:i + batch]]})
    return session


# --------------------------------------------------------------------------- index construction
def valkey_support() -> str | None:
    """``None`` when ``ControllerServer`` takes ``index="valkey://..."``; else why not."""
    import inspect

    from lmcache.server.controller import ControllerServer

    if "index" not in inspect.signature(ControllerServer).parameters:
        return "ControllerServer takes no index= (the valkey index is not in this lmcache)"
    return None


@contextlib.contextmanager
def controller(index_url: str, token: str, max_keys: int) -> Iterator[Any]:
    """An in-process ``ControllerServer`` on loopback over ``index_url``."""
    from lmcache.server.controller import ControllerServer

    kw: dict[str, Any] = {} if index_url == "memory" else {"index": index_url}
    srv = ControllerServer("127.0.0.1", 0, token=token, instance_timeout=600.0, max_keys_per_instance=max_keys, **kw)
    try:
        yield srv
    finally:
        srv.close()


@contextlib.contextmanager
def valkey_server() -> Iterator[tuple[str, int]]:
    """A standalone loopback valkey-server: (``valkey://127.0.0.1:PORT/0``, port)."""
    from lmcache.testing import stores

    with stores.start("valkey") as st:
        url = st.options["url"]
        yield url, int(url.split(":")[2].split("/")[0])


# --------------------------------------------------------------------------- the raw limit
def raw_reads(port: int, keys: list[str], instances: list[str]) -> Callable[[], Any]:
    """One redis-py pipeline reading, on the same server, what the valkey index's lookup
    must read for the chunk ``keys`` of the prompt: the namespace's live leases
    (``ZRANGEBYSCORE lmc:{ns}:leases``) and, per instance, ``HMGET lmc:{ns}:k:<id> hash...``
    (the tier bitmask of each chunk, held by its hash; :mod:`lmcache.server.index_valkey`'s layout);
    no transaction, one round trip. The index's Lua script does this and the instances'
    records, their sessions and the scoring besides, so it cannot beat this."""
    import redis

    r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5.0)
    tag = "lmc:{" + NAMESPACE + "}:"
    if not r.exists(tag + "k:" + instances[-1]):
        raise RuntimeError(f"the valkey index's layout changed: no {tag}k:{instances[-1]} (update raw_reads)")

    def read() -> Any:
        with r.pipeline(transaction=False) as p:
            p.zrangebyscore(tag + "leases", int(time.time() * 1000), "+inf")
            for i in instances:
                p.hmget(tag + "k:" + i, keys)
            return p.execute()

    return read


# --------------------------------------------------------------------------- lookups
def lookup_rows(kind: str, index_url: str, chunks: list[int], instances: int, count: int,
                valkey_port: int | None) -> list[dict[str, Any]]:
    """Per chunk count: direct and HTTP lookups of ``kind`` (p50/p99 ms, lookups/s), and,
    for valkey, the raw pipelined reads of the same keys and the ratio to them."""
    from lmcache.plugins.services.controller_client import ControllerClient

    token = secrets.token_hex(8)
    top = max(chunks)
    hashes = _hashes(top, "prompt")
    prefix = _prefix()
    ids = [f"bench-{i}" for i in range(instances)]
    rows = []
    with controller(index_url, token, max_keys=top * 2 + 10) as srv:
        index = srv.index
        for i, iid in enumerate(ids):
            held = top if i == instances - 1 else max(1, top * (i + 1) // instances)
            _register(index, iid, [prefix + h for h in hashes[:held]])
        with ControllerClient(srv.url, token, timeout=10.0) as client:
            for c in chunks:
                body = {"chunk_hashes": hashes[:c], "namespace": NAMESPACE, "model": MODEL}
                got = index.lookup(dict(body))
                if not got["results"] or got["results"][0]["hit_chunks"] != c:
                    raise RuntimeError(f"{kind}: a lookup of {c} chunks found no instance holding all of them: {got}")
                raw = raw_reads(valkey_port, hashes[:c], ids) if valkey_port else None
                direct: list[float] = []
                http: list[float] = []
                limit: list[float] = []
                for _ in range(5):  # untimed: connections, caches
                    index.lookup(dict(body))
                    client.request("POST", "/v1/lookup", body=body)
                    if raw:
                        raw()
                for _ in range(count):  # interleaved: all three see the same machine
                    t0 = time.perf_counter()
                    index.lookup(dict(body))
                    t1 = time.perf_counter()
                    client.request("POST", "/v1/lookup", body=body)
                    t2 = time.perf_counter()
                    direct.append(t1 - t0)
                    http.append(t2 - t1)
                    if raw:
                        t3 = time.perf_counter()
                        raw()
                        limit.append(time.perf_counter() - t3)
                row: dict[str, Any] = {"index": kind, "chunks": c, "instances": instances,
                                       "direct_ms": _pct(direct), "http_ms": _pct(http),
                                       "direct_per_s": round(len(direct) / sum(direct)),
                                       "http_per_s": round(len(http) / sum(http))}
                if limit:
                    row["raw_pipeline_ms"] = _pct(limit)
                    row["ratio_direct_to_raw_p50"] = round(row["direct_ms"]["p50"] / row["raw_pipeline_ms"]["p50"], 2)
                rows.append(row)
    return rows


# --------------------------------------------------------------------------- memory
def memory_per_million(kind: str, index_url: str, entries: int, valkey_port: int | None) -> dict[str, Any]:
    """Bytes the index takes for ``entries`` (chunk, instance) entries (4 instances,
    distinct keys), per million and extrapolated to 10 M: ``memory`` by tracemalloc (the
    Python objects the index keeps, the key strings included), ``valkey`` by the server's
    ``used_memory``."""
    import tracemalloc

    per = max(1, entries // 4)
    prefix = _prefix()
    with controller(index_url, "t", max_keys=per + 1) as srv:
        gc.collect()
        if valkey_port:
            before = _used_memory(valkey_port)
        else:
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
        for i in range(4):
            keys = [prefix + h for h in _hashes(per, f"mem-{i}")]
            _register(srv.index, f"mem-{i}", keys)
            del keys
        gc.collect()
        if valkey_port:
            after = _used_memory(valkey_port)
        else:
            after = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
    n = per * 4
    per_m = (after - before) / n * 1e6
    return {"index": kind, "entries": n, "measure": "used_memory" if valkey_port else "tracemalloc",
            "bytes_per_entry": round((after - before) / n, 1), "mib_per_million": round(per_m / (1 << 20), 1),
            "gib_for_10m": round(per_m * 10 / (1 << 30), 2)}


def _used_memory(port: int | None) -> int:
    from lmcache.testing.stores.redis import command

    info = command(int(port or 0), "INFO", "memory").decode()
    return int(next(line.split(":")[1] for line in info.splitlines() if line.startswith("used_memory:")))


# --------------------------------------------------------------------------- failover
def _lookup_loop(client: Any, body: dict[str, Any], stop: threading.Event, log: list[tuple[float, bool]],
                 tally: Callable[[Any], None] | None = None) -> None:
    while not stop.is_set():
        try:
            answer = client.request("POST", "/v1/lookup", body=body)
            log.append((time.monotonic(), True))
            if tally is not None:
                tally(answer)
        except Exception:  # noqa: BLE001 - counted, the point of the measurement
            log.append((time.monotonic(), False))
            time.sleep(0.005)


def _gaps(log: list[tuple[float, bool]], killed_at: float) -> dict[str, Any]:
    """Failed lookups, the longest gap between two answered ones, and when lookups were
    answered again after the kill (after the last failure; 0 when none failed)."""
    ok = [t for t, good in log if good]
    failed_at = [t for t, good in log if not good]
    longest = max((b - a for a, b in zip(ok, ok[1:])), default=0.0)
    again = 0.0
    if failed_at:
        first_after = next((t for t in ok if t > failed_at[-1]), None)
        again = None if first_after is None else first_after - killed_at
    return {"lookups": len(log), "failed": len(failed_at), "longest_gap_ms": round(longest * 1000, 1),
            "answered_again_after_ms": None if again is None else round(max(0.0, again) * 1000, 1)}


def _recovered(log: list[tuple[float, bool]], killed_at: float, quiet: float) -> bool:
    """A lookup answered after the last failure since the kill, or ``quiet`` seconds
    after the kill without any failure."""
    failed = [t for t, good in log if not good and t > killed_at]
    if not failed:
        return time.monotonic() > killed_at + quiet
    return any(good and t > failed[-1] for t, good in log[-20:])


def _kill_under_lookups(urls: list[str], token: str, kill: Callable[[], None], seconds: float,
                        quiet: float, tally: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Lookups in a loop through a client given ``urls``; ``kill()`` after ``seconds``;
    the loop runs until lookups are answered again (:func:`_recovered`, at most 30 s),
    then ``seconds`` more: :func:`_gaps`."""
    from lmcache.plugins.services.controller_client import ControllerClient

    client = ControllerClient(urls, token, timeout=2.0)
    body = {"chunk_hashes": _hashes(32, "prompt"), "namespace": NAMESPACE, "model": MODEL}
    log: list[tuple[float, bool]] = []
    stop = threading.Event()
    t = threading.Thread(target=_lookup_loop, args=(client, body, stop, log, tally), daemon=True)
    t.start()
    try:
        time.sleep(seconds)
        killed_at = time.monotonic()
        kill()
        deadline = killed_at + 30
        while time.monotonic() < deadline and not _recovered(log, killed_at, quiet):
            time.sleep(0.05)
        time.sleep(seconds)
    finally:
        stop.set()
        t.join(10)
    return _gaps(log, killed_at)


def controller_failover(index_url: str, workdir: Path, spawn: Callable[..., Any],
                        seconds: float = 1.5) -> dict[str, Any]:
    """Two controller processes over ``index_url`` (started by ``spawn``, the bench's child
    launcher, passed in so this module does not import its caller); a client with both URLs
    looks up in a loop; the first is SIGKILLed after ``seconds``; the loop runs ``seconds`` more."""
    _spawn = spawn

    token = secrets.token_hex(8)
    spec = {"token": token, **({} if index_url == "memory" else {"index": index_url})}
    a, (url_a,) = _spawn("controller", spec, workdir, "controller-a")
    b, (url_b,) = _spawn("controller", spec, workdir, "controller-b")
    try:
        gaps = _kill_under_lookups([url_a, url_b], token, lambda: a.send_signal(signal.SIGKILL), seconds, 0.0)
        return {"what": "controller replica SIGKILLed", "index": index_url.split("://")[0], **gaps}
    finally:
        for p in (a, b):
            child_procs().stop(p)


@contextlib.contextmanager
def sentinel_pair(down_after_ms: int) -> Iterator[dict[str, Any]]:
    """A valkey primary, a replica of it and one Sentinel (quorum 1) on loopback."""
    from lmcache.testing.stores import LocalServer, free_port
    from lmcache.testing.stores.redis import _binaries, _server, command

    server_bin, _ = _binaries("valkey")
    root = Path(tempfile.mkdtemp(prefix="lmcache-bench-sentinel-"))
    servers: list[Any] = []
    try:
        pport, rport, sport = free_port(), free_port(), free_port()
        primary = _server(server_bin, "valkey-primary", pport, root / "primary")
        replica = _server(server_bin, "valkey-replica", rport, root / "replica", ["--replicaof", "127.0.0.1", str(pport)])
        for s in (primary, replica):
            servers.append(s)
            s.start()
        sdir = root / "sentinel"
        sdir.mkdir()
        conf = sdir / "sentinel.conf"
        conf.write_text(f"port {sport}\nbind 127.0.0.1\nprotected-mode no\ndir {sdir}\n"
                        f"sentinel monitor lmcache 127.0.0.1 {pport} 1\n"
                        f"sentinel down-after-milliseconds lmcache {down_after_ms}\n"
                        "sentinel failover-timeout lmcache 10000\n")

        def ready() -> bool:
            try:
                r = command(sport, "SENTINEL", "replicas", "lmcache", timeout=0.5)
            except OSError:
                return False
            return isinstance(r, list) and len(r) == 1

        sentinel = LocalServer("valkey-sentinel", [server_bin, str(conf), "--sentinel"], sport, workdir=sdir, ready=ready)
        servers.append(sentinel)
        sentinel.start()
        yield {"url": f"valkey+sentinel://127.0.0.1:{sport}/lmcache", "primary": primary, "down_after_ms": down_after_ms,
               "sentinel_port": sport, "replica_port": rport, "primary_port": pport}
    finally:
        for s in reversed(servers):
            s.close()
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def _watch_promotion(sp: dict[str, Any], t0: float, promoted: list[float], limit: float = 30.0) -> None:
    """Append the seconds from ``t0`` until Sentinel names the replica as the primary."""
    from lmcache.testing.stores.redis import command

    want = str(sp["replica_port"]).encode()
    while time.monotonic() < t0 + limit:
        try:
            r = command(sp["sentinel_port"], "SENTINEL", "get-master-addr-by-name", "lmcache", timeout=0.5)
        except OSError:
            r = None
        if isinstance(r, list) and r[1:] == [want]:
            promoted.append(time.monotonic() - t0)
            return
        time.sleep(0.01)


def primary_failover(workdir: Path, spawn: Callable[..., Any], seconds: float = 1.5,
                     down_after_ms: int = 1000) -> dict[str, Any]:
    """A controller over ``valkey+sentinel://`` (started by ``spawn``) with one instance
    holding the looked-up chunks (heartbeating); its primary SIGKILLed under a lookup loop;
    the loop runs until lookups are answered again (at most 30 s). Failed lookups, and
    answered ones that missed the instance (incomplete) or came from the replica (stale)."""
    _spawn = spawn
    from lmcache.plugins.services.controller_client import ControllerClient
    from lmcache.testing.stores.redis import command

    with sentinel_pair(down_after_ms) as sp:
        token = secrets.token_hex(8)
        ctl, (url,) = _spawn("controller", {"token": token, "index": sp["url"]}, workdir, "controller-sentinel")
        promoted: list[float] = []
        writer = ControllerClient(url, token, timeout=2.0)
        info = {"instance_id": "bench-held", "namespace": NAMESPACE, "model": MODEL, "kv_signature": SIG,
                "chunk_size": 256, "tiers": TIERS}
        session = writer.register(info)["session"]
        writer.events("bench-held", session, [["admit", "cpu", _prefix() + h] for h in _hashes(32, "prompt")])
        end = time.monotonic() + 30  # the replica's first sync waits repl-diskless-sync-delay (5 s)
        while command(sp["primary_port"], "WAIT", "1", "100") != 1 and time.monotonic() < end:
            pass
        counts = {"incomplete": 0, "stale": 0}

        def tally(answer: Any) -> None:
            rows = {r["instance_id"]: r["hit_chunks"] for r in answer.get("results", ())}
            counts["incomplete"] += rows.get("bench-held") != 32
            counts["stale"] += bool(answer.get("stale"))

        beating = threading.Event()

        def beat() -> None:  # the instance stays live through the run (lease 10 s)
            while not beating.wait(1.0):
                try:
                    writer.heartbeat("bench-held", session)
                except Exception:  # noqa: BLE001 - 503 while the primary is away: the next one lands
                    pass

        def kill() -> None:
            """SIGKILL the primary; a thread notes when Sentinel names the replica primary."""
            t0 = time.monotonic()
            sp["primary"].kill()
            threading.Thread(target=_watch_promotion, args=(sp, t0, promoted), daemon=True).start()

        threading.Thread(target=beat, daemon=True).start()
        try:
            gaps = _kill_under_lookups([url], token, kill, seconds, down_after_ms / 1000 + 3, tally)
            return {"what": "valkey primary SIGKILLed (Sentinel)", "index": "valkey+sentinel",
                    "sentinel_down_after_ms": down_after_ms,
                    "promoted_after_ms": round(promoted[0] * 1000, 1) if promoted else None, **gaps, **counts}
        finally:
            beating.set()
            writer.close()
            child_procs().stop(ctl)


# --------------------------------------------------------------------------- the whole part
def run_index(chunks: list[int], instances: int, count: int, entries: int, failover: bool,
              spawn: Callable[..., Any]) -> dict[str, Any]:
    """Every measurement above, for ``memory`` and (when available) ``valkey``."""
    e = err()
    out: dict[str, Any] = {"chunks": chunks, "lookups": [], "memory": [], "failover": [], "valkey": "available"}
    e.print(f"index memory: {entries} entries in a memory index ...")
    out["memory"].append(memory_per_million("memory", "memory", entries, None))
    e.print(f"index lookups: memory, {count} per chunk count {chunks} ...")
    out["lookups"] += lookup_rows("memory", "memory", chunks, instances, count, None)
    why = valkey_support()
    with tempfile.TemporaryDirectory(prefix="lmcache-bench-index-") as d:
        wd = Path(d)
        if failover:
            e.print("failover: a controller replica SIGKILLed under lookups ...")
            out["failover"].append(controller_failover("memory", wd, spawn))
        if why is None:
            try:
                with valkey_server() as (url, port):
                    e.print(f"index memory: {entries} entries in a valkey index ...")
                    out["memory"].append(memory_per_million("valkey", url, entries, port))
                    _flush(port)
                    e.print(f"index lookups: valkey, {count} per chunk count {chunks} ...")
                    out["lookups"] += lookup_rows("valkey", url, chunks, instances, count, port)
                    if failover:
                        _flush(port)
                        e.print("failover: a controller replica over valkey SIGKILLed under lookups ...")
                        out["failover"].append(controller_failover(url, wd, spawn))
                if failover:
                    e.print("failover: the valkey primary SIGKILLed under lookups (Sentinel) ...")
                    out["failover"].append(primary_failover(wd, spawn))
            except Exception as exc:  # noqa: BLE001 - reported in the output, the memory rows stand
                why = f"{type(exc).__name__}: {exc}"
        if why is not None:
            out["valkey"] = f"valkey index not available: {why}"
            e.print(out["valkey"])
    return out


def _flush(port: int) -> None:
    from lmcache.testing.stores.redis import command

    command(port, "FLUSHALL")


def print_index(data: dict[str, Any], o: Any) -> None:
    """The index part as tables on console ``o``."""
    o.print(f"index lookups by chunk hashes ({data['lookups'][0]['instances'] if data['lookups'] else 0} instances; ms)")
    o.print("index    chunks  direct p50  p99     /s      http p50  p99     /s      raw p50  p99    direct/raw")
    for r in data["lookups"]:
        raw = r.get("raw_pipeline_ms")
        tail = f"{raw['p50']:8.3f} {raw['p99']:7.3f}  {r['ratio_direct_to_raw_p50']:6.2f}" if raw else "       -       -       -"
        o.print(f"{r['index']:8} {r['chunks']:6} {r['direct_ms']['p50']:10.3f} {r['direct_ms']['p99']:7.3f} "
                f"{r['direct_per_s']:7} {r['http_ms']['p50']:9.3f} {r['http_ms']['p99']:7.3f} {r['http_per_s']:7} {tail}")
    for m in data["memory"]:
        o.print(f"index memory, {m['index']}: {m['bytes_per_entry']} B/entry ({m['measure']}, {m['entries']} entries), "
                f"{m['mib_per_million']} MiB per million, {m['gib_for_10m']} GiB for 10 M")
    for f in data["failover"]:
        promo = f" (Sentinel promoted the replica after {f['promoted_after_ms']} ms)" if "promoted_after_ms" in f else ""
        more = f", {f['incomplete']} incomplete, {f['stale']} from the replica (stale)" if "incomplete" in f else ""
        o.print(f"failover: {f['what']} ({f['index']}): {f['failed']} of {f['lookups']} lookups failed{more}, longest "
                f"gap {f['longest_gap_ms']} ms, answered again {f['answered_again_after_ms']} ms after the kill{promo}")
    if data["valkey"] != "available":
        o.print(data["valkey"])


__all__ = ["print_index", "run_index", "valkey_support"]
