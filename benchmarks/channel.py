"""``lmcache bench channel``: one request's KV, sender pool -> receiver pool, over each
transfer channel (:mod:`lmcache.transfer`), against a memcpy of the same bytes.

Two processes on this host, each with its own memory pool and transfer endpoint. The
sender fills ``chunks`` pool objects of ``chunk_mib`` MiB; each pass pushes all of them
as one request (allocate at the receiver, write, commit into the receiver's sink), pushes
them again by read (``push_by: read``: the receiver reserves, reads from the sender's pool,
commits, answers; channels that read one-sidedly only) and then pulls them back the other way (offer, read, release). The baseline is a
single-threaded ``torch`` copy of the same chunks into other pool objects in the sender
process, interleaved with the passes (the same load on the machine). Medians of ``passes`` passes (after one warm-up pass that also
opens the connection and, for NIXL, exchanges agent metadata). Each channel runs with each
checksum policy (``verify``: ``full`` hashes every byte on both sides, as a p2p PUT;
``sample`` each chunk's first, middle and last 64 KiB; ``off``); ``write`` is the
channel's move alone. Idle CPU: what each endpoint's process
spends over 2 s with nothing in flight.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

MiB = 1 << 20


def _peer(channel: str) -> None:
    import torch

    from lmcache.memory import MemoryPool
    from lmcache.transfer import open_channel

    pool = MemoryPool(int(os.environ["BENCH_POOL"]), pin=False)
    got: dict[str, Any] = {}

    def sink(key: str, obj: Any) -> bool:
        old = got.pop(key, None)
        if old is not None:
            old.unref()
        got[key] = obj
        return True

    try:
        ep = open_channel(channel, pool, sink=sink, **json.loads(os.environ.get("BENCH_OPTS", "{}")))
    except Exception as exc:
        print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
    print(f"READY {ep.url}", flush=True)
    items: list[tuple[str, Any]] = []
    dst = None
    torch.set_num_threads(1)  # one copying thread, as a channel's copy is (and as the engine's cores are busy)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "fill":
            g = torch.Generator().manual_seed(0)
            for i in range(cmd["n"]):
                o = pool.allocate((cmd["nbytes"] // 2,), torch.bfloat16)
                assert o is not None
                o.byte_view().copy_(torch.randint(0, 256, (cmd["nbytes"],), dtype=torch.uint8, generator=g))
                items.append((f"k{i}", o))
            r: dict[str, Any] = {"n": len(items)}
        elif op == "memcpy":  # into pool objects allocated (and prefaulted) once, as the receiver's slots are
            if dst is None:
                dst = [pool.allocate(o.shape, o.dtype) for _, o in items]
            t0 = time.perf_counter()
            for (_, o), d in zip(items, dst):
                d.tensor.copy_(o.tensor)
            r = {"seconds": time.perf_counter() - t0}
        elif op == "push":
            ep.push_by = cmd.get("by", "write")
            r = ep.push(cmd["url"], cmd["request"], items)
        elif op == "offer":
            r = ep.offer(cmd["request"], items)
        elif op == "pull":
            r = ep.pull(cmd["offer"])
        elif op == "cpu":
            u = resource.getrusage(resource.RUSAGE_SELF)
            r = {"cpu": u.ru_utime + u.ru_stime}
        else:
            break
        print(json.dumps(r), flush=True)
    ep.close()


class _Proc:
    def __init__(self, channel: str, pool: int, opts: dict[str, Any]):
        env = {**os.environ, "BENCH_POOL": str(pool), "BENCH_OPTS": json.dumps(opts)}
        self.p = subprocess.Popen([sys.executable, "-m", "lmcache.benchmarks.channel", "peer", channel],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        first = self.p.stdout.readline().strip()
        if not first.startswith("READY"):
            self.close()
            raise RuntimeError(first or f"the {channel} peer did not start")
        self.url = first.split()[1]

    def __call__(self, **cmd: Any) -> dict[str, Any]:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self) -> None:
        try:
            self.p.stdin.close()
            self.p.wait(10)
        except Exception:
            self.p.kill()


def run(channels: tuple[str, ...] = ("nixl", "tcp"), chunks: int = 32, chunk_mib: float = 4.0, passes: int = 7,
        verify: tuple[str, ...] = ("full", "sample", "off"), progress_thread: bool = True) -> list[dict[str, Any]]:
    """One row per channel and checksum setting: medians in seconds and the ratio to memcpy."""
    nbytes = int(chunk_mib * MiB) // 256 * 256
    total = chunks * nbytes
    pool = 5 * total + 64 * MiB  # chunks, memcpy targets, received chunks and the next slots
    rows = []
    runs = [(ch, v, False) for ch in channels for v in verify]
    if progress_thread and "nixl" in channels:  # NIXL's own progress thread, as vLLM's NixlConnector runs it
        runs.append(("nixl", "sample", True))
    for ch, v, pthread in runs:
        if True:
            opts = {"verify": v, "buffer_size": 2 * total, "slot_timeout": 60.0,
                    "options": {"nixl_progress_thread": pthread}}
            try:
                rx, tx = _Proc(ch, pool, opts), _Proc(ch, pool, opts)
            except RuntimeError as exc:
                rows.append({"channel": ch + (" +progress thread" if pthread else ""), "verify": v, "error": str(exc)})
                continue
            try:
                tx(op="fill", n=chunks, nbytes=nbytes)
                rx(op="fill", n=chunks, nbytes=nbytes)
                mem, push, write, pull, fetch = [], [], [], [], []
                for i in range(passes + 1):  # interleaved, so that each sees the same load
                    m = tx(op="memcpy")["seconds"]
                    r = tx(op="push", url=rx.url, request=f"bench-{i}")
                    assert r.get("committed") == chunks and r["by"] == "write", r
                    f = tx(op="push", url=rx.url, request=f"read-{i}", by="read")
                    assert f.get("committed") == chunks, f
                    o = rx(op="offer", request=f"back-{i}")
                    q = tx(op="pull", offer=o)
                    assert q.get("committed") == chunks, q
                    if i:  # the first pass opens the connection
                        mem.append(m)
                        push.append(r["seconds"])
                        write.append(r["write_seconds"])
                        pull.append(q["seconds"])
                        if f["by"] == "read":
                            fetch.append(f["seconds"])
                memcpy = statistics.median(mem)
                idle = []
                for p in (rx, tx):
                    a = p(op="cpu")["cpu"]
                    time.sleep(2.0)
                    idle.append(p(op="cpu")["cpu"] - a)
                row = {"channel": ch + (" +progress thread" if pthread else ""), "verify": v, "bytes": total, "memcpy_s": memcpy,
                       "push_s": statistics.median(push), "push_best_s": min(push), "memcpy_best_s": min(mem), "write_s": statistics.median(write),
                       "pull_s": statistics.median(pull),
                       "push_read_s": statistics.median(fetch) if fetch else None, "idle_cpu_receiver_s": idle[0], "idle_cpu_sender_s": idle[1]}
                for k in ("push", "write", "pull", "push_read"):
                    row[f"{k}_x_memcpy"] = row[f"{k}_s"] / memcpy if row[f"{k}_s"] is not None else None
                rows.append(row)
            finally:
                rx.close()
                tx.close()
    return rows


def markdown(rows: list[dict[str, Any]], chunks: int, chunk_mib: float) -> str:
    load = os.getloadavg()[0]
    out = [f"One request: {chunks} chunks of {chunk_mib:g} MiB ({chunks * chunk_mib:g} MiB), sender pool -> receiver "
           f"pool, two processes on this host ({os.cpu_count()} cores, load average {load:.1f} at the end); medians.",
           "",
           "| channel | checksums | memcpy | push (alloc+write+commit) | write alone | push by read (fetch) "
           "| pull (offer->read->release) | push best / memcpy best | idle CPU over 2 s (rx / tx) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['channel']} | {r['verify']} | {r['error']} | | | | | | |")
            continue
        ms = lambda s: f"{s * 1000:.1f} ms"  # noqa: E731
        out.append(f"| {r['channel']} | {r['verify']} | {ms(r['memcpy_s'])} "
                   f"| {ms(r['push_s'])} ({r['push_x_memcpy']:.2f}x) | {ms(r['write_s'])} ({r['write_x_memcpy']:.2f}x) "
                   + (f"| {ms(r['push_read_s'])} ({r['push_read_x_memcpy']:.2f}x) " if r["push_read_s"] is not None
                      else "| – (no one-sided read) ")
                   + f"| {ms(r['pull_s'])} ({r['pull_x_memcpy']:.2f}x) "
                   f"| {ms(r['push_best_s'])} / {ms(r['memcpy_best_s'])} ({r['push_best_s'] / r['memcpy_best_s']:.2f}x) "
                   f"| {r['idle_cpu_receiver_s'] * 1000:.1f} / {r['idle_cpu_sender_s'] * 1000:.1f} ms |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> None:
    if argv[:1] == ["peer"]:
        _peer(argv[1])
        return
    import argparse

    ap = argparse.ArgumentParser(prog="python -m lmcache.benchmarks.channel")
    ap.add_argument("--channels", default="nixl,tcp")
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--chunk-mib", type=float, default=4.0)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    a = ap.parse_args(argv)
    rows = run(tuple(a.channels.split(",")), a.chunks, a.chunk_mib, a.passes)
    md = markdown(rows, a.chunks, a.chunk_mib)
    print(md)
    if a.out:
        with open(a.out, "a") as f:
            f.write(md + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
