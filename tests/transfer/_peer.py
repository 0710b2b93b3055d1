"""One transfer endpoint in its own process, driven by JSON lines on stdin (tests and the
channel benchmark). Prints ``READY <url>`` once listening, then one JSON answer per command.

Commands: ``{"op": "fill", "n": N, "nbytes": B, "seed": S, "heap": false}`` (N chunks of
deterministic bytes in the pool, or on the heap, keys ``k0..``), ``push {url, request, n?, alloc_wait?, by?}``, ``fetch_and_die {url, request}``,
``fetch_raw {url, patch, expires_in?}``, ``offer {request, ttl?}``,
``pull {offer}``, ``digests`` (xxh3 of every committed chunk, by key), ``stats``, ``cpu``
(process CPU seconds), ``exit``."""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch

from lmcache.memory import MemoryObj, MemoryPool
from lmcache.transfer import TransferError, checksum, open_channel


def main() -> None:
    channel = sys.argv[1]
    pool = MemoryPool(int(os.environ.get("PEER_POOL", str(512 << 20))), pin=False)
    got: dict[str, object] = {}

    def sink(key, obj):
        old = got.pop(key, None)
        if old is not None:
            old.unref()
        got[key] = obj
        return True

    kw = json.loads(os.environ.get("PEER_OPTS", "{}"))
    try:
        ep = open_channel(channel, pool, sink=sink, **kw)
    except Exception as exc:  # the one line a user sees
        print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
    print(f"READY {ep.url}", flush=True)
    items: list = []
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "fill":
                g = torch.Generator().manual_seed(cmd.get("seed", 0))
                for _, o in items:
                    o.unref()
                items = []
                for i in range(cmd["n"]):
                    if cmd.get("heap"):  # outside the pool (and so outside what NIXL has registered)
                        t = torch.empty((cmd["nbytes"] // 2,), dtype=torch.float16)
                        o = MemoryObj(None, 0, cmd["nbytes"], t.shape, t.dtype, t)
                    else:
                        o = pool.allocate((cmd["nbytes"] // 2,), torch.float16)
                    assert o is not None, "pool full"
                    o.byte_view().copy_(torch.randint(0, 256, (cmd["nbytes"],), dtype=torch.uint8, generator=g))
                    items.append((f"k{i}", o))
                r = {"digests": {k: checksum(o) for k, o in items}}
            elif op == "push":
                ep.push_by = cmd.get("by", ep.push_by)
                n = cmd.get("n", len(items))
                r = ep.push(cmd["url"], cmd["request"], items[:n], alloc_wait=cmd.get("alloc_wait"))
            elif op == "hold":  # allocate at the receiver, write (half, over tcp), never commit: then be killed
                from lmcache.transfer import ChunkMeta, byte_buffer

                c = ep._connect(cmd["url"])
                metas = [ChunkMeta.of(k, o) for k, o in items]
                a = c.call({"op": "alloc", "request": cmd["request"], "chunks": [m.to_json() for m in metas]})
                objs = [o for _, o in items]
                if channel == "tcp":  # the message and half the bytes: the receiver waits for the rest
                    bufs = [byte_buffer(o) for o in objs]
                    c.send({"op": "write", "alloc": a["alloc"]}, bufs[: len(bufs) // 2])
                else:
                    ep.channel.write(c, objs, a["slots"], a["alloc"], time.monotonic() + 5)
                r = {"alloc": a["alloc"], "slots": len(a["slots"])}
            elif op == "fetch_and_die":  # ask the receiver to read this side's chunks, then exit at once
                c = ep._connect(cmd["url"])
                o = ep._hold("dying", cmd["request"], items, 30.0)
                d = o.description
                c.send({"op": "fetch", "expires_in": 30.0,
                        "offer": {k: d[k] for k in ("offer", "request", "chunks", "addrs", "checksums", "verify")}})
                os._exit(0)
            elif op == "fetch_raw":  # a fetch message as given (hostile input), answered as it comes back
                c = ep._connect(cmd["url"])
                o = ep._hold("raw", "raw", items, 30.0)
                d = {k: o.description[k] for k in ("offer", "request", "chunks", "addrs", "checksums", "verify")}
                d.update(cmd.get("patch", {}))
                try:
                    r = c.call({"op": "fetch", "expires_in": cmd.get("expires_in", 30.0), "offer": d})
                except TransferError as exc:
                    r = {"error": f"{type(exc).__name__}: {exc}"}
                ep._release(o.id)
            elif op == "offer":
                r = ep.offer(cmd["request"], items, ttl=cmd.get("ttl"))
            elif op == "pull":
                r = ep.pull(cmd["offer"])
            elif op == "digests":
                r = {"digests": {k: checksum(o) for k, o in got.items()}}
            elif op == "stats":
                r = ep.info()
            elif op == "cpu":
                u = resource.getrusage(resource.RUSAGE_SELF)
                r = {"cpu": u.ru_utime + u.ru_stime, "t": time.monotonic()}
            elif op == "exit":
                break
            else:
                r = {"error": f"unknown op {op}"}
        except TransferError as exc:
            r = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(r), flush=True)
    ep.close()


if __name__ == "__main__":
    main()
