"""The raw-client baselines of ``lmcache bench tiers --backend`` (not part of the backend contract).

A baseline is the physical limit of a store: what its own client achieves doing the same
transfers in the plainest fast way (pipelines, multi-get, concurrent requests). Each is a
function ``baseline(options, items, batch) -> (put_seconds, get_seconds)``: it stores
``items`` (name, bytes) under names of its own choosing with the store's client, ``batch``
at a time, reads them all back, deletes them, and returns the two wall times. ``options``
are the tier's backend keys (as ``--option`` gives them).

Baselines are registered by name (the backend's name) through the hook
``lmcache_register_bench_baselines``, the built-in ones by ``lmcache.backends.builtin``,
exactly as a third-party package registers its own; ``lmcache bench tiers --backend NAME``
looks ``NAME`` up there. The stores' client libraries are imported only when a baseline runs.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Mapping, Sequence
from urllib.parse import quote

from lmcache import wire as proto
from lmcache.errors import BackendError
from lmcache.storage import check_backend_options

Items = Sequence[tuple[str, bytes]]


def _chunks(seq: Sequence[Any], n: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(seq), max(1, n)):
        yield seq[i : i + n]


def redis(options: Mapping[str, Any], items: Items, batch: int) -> tuple[float, float]:
    """The ``redis`` backend's baseline (see :func:`redis_like`)."""
    from lmcache.backends.redis import RedisBackend

    return redis_like(RedisBackend, options, items, batch)


def valkey(options: Mapping[str, Any], items: Items, batch: int) -> tuple[float, float]:
    """The ``valkey`` backend's baseline (see :func:`redis_like`)."""
    from lmcache.backends.valkey import ValkeyBackend

    return redis_like(ValkeyBackend, options, items, batch)


def redis_like(cls: Any, options: Mapping[str, Any], items: Items, batch: int) -> tuple[float, float]:
    """redis-py alone: pipelined SETs, then pipelined GETs of the same keys,
    ``batch`` per round trip; then UNLINK them all."""
    from lmcache.backends.redis import parse_url

    opts = check_backend_options(cls, options, None)
    target = parse_url(opts["url"], cls.SCHEMES)
    api = cls._client_api()
    client, sentinel = cls._connect(api, target, opts)
    names = [opts["prefix"] + name for name, _ in items]

    def pipe() -> Any:
        return client.pipeline() if target.mode == "cluster" else client.pipeline(transaction=False)

    try:
        t0 = time.perf_counter()
        for part in _chunks(list(zip(names, (v for _, v in items))), batch):
            p = pipe()
            for k, v in part:
                p.set(k, v)
            p.execute()
        t1 = time.perf_counter()
        got = 0
        for part in _chunks(names, batch):
            p = pipe()
            for k in part:
                p.get(k)
            got += sum(len(v) for v in p.execute() if v is not None)
        t2 = time.perf_counter()
        want = sum(len(v) for _, v in items)
        if got != want:
            raise BackendError(f"raw transfer read back {got} bytes of {want}")
        return t1 - t0, t2 - t1
    finally:
        try:
            for part in _chunks(names, batch):
                p = pipe()
                for k in part:
                    p.unlink(k)
                p.execute()
        finally:
            client.close()
            if sentinel is not None:
                for s in sentinel.sentinels:
                    s.close()

def fs(options: Mapping[str, Any], items: Items, batch: int) -> tuple[float, float]:
    """fsspec's own ``pipe_file`` and ``open().readinto`` of the same bytes, ``concurrency``
    requests at a time, ``batch`` items per round, into a scratch directory that is
    removed afterwards."""
    from lmcache.backends.fs import FSBackend as cls
    from lmcache.backends.fs import _filesystem_class

    opts = check_backend_options(cls, options, None)
    fs_cls = _filesystem_class(opts["url"])
    fs = fs_cls(**{**fs_cls._get_kwargs_from_urls(opts["url"]), **opts["fs_options"]})
    scratch = f"{fs_cls._strip_protocol(opts['url']).rstrip('/')}/.raw-{uuid.uuid4().hex}"
    fs.makedirs(scratch, exist_ok=True)
    paths = [f"{scratch}/{quote(name, safe='')}" for name, _ in items]
    step = max(1, batch)
    try:
        with ThreadPoolExecutor(opts["concurrency"]) as pool:
            t0 = time.perf_counter()
            for i in range(0, len(items), step):
                list(pool.map(fs.pipe_file, paths[i : i + step], [d for _, d in items[i : i + step]]))
            # reads land in buffers allocated once, as ours land in the memory pool:
            # fresh bytes objects per read would measure page faults, not the store
            bufs = [bytearray(max(len(d) for _, d in items)) for _ in range(min(step, len(items)))]

            def read_into(path: str, buf: bytearray) -> int:
                with fs.open(path, "rb") as f:
                    return f.readinto(memoryview(buf)[: fs.size(path)])

            t1 = time.perf_counter()
            for i in range(0, len(items), step):
                list(pool.map(read_into, paths[i : i + step], bufs))
            t2 = time.perf_counter()
    finally:
        fs.rm(scratch, recursive=True)
    return t1 - t0, t2 - t1

def s3(options: Mapping[str, Any], items: Items, batch: int) -> tuple[float, float]:
    """Plain boto3 ``put_object``/``get_object`` of the same bytes, ``concurrency``
    requests in flight, ``batch`` items at a time, under a private prefix that is
    deleted afterwards."""
    from lmcache.backends.s3 import DELETE_BATCH
    from lmcache.backends.s3 import S3Backend as cls

    opts = check_backend_options(cls, options, None)
    client = cls._client(opts, opts["concurrency"])
    bucket, prefix = cls.location(opts)
    base = (prefix + "/" if prefix else "") + f"lmcache-raw-{uuid.uuid4().hex}/"
    names = [base + name for name, _ in items]
    batch = max(1, int(batch))
    try:
        if opts["create_bucket"]:
            try:
                client.head_bucket(Bucket=bucket)
            except Exception:
                client.create_bucket(Bucket=bucket)
        with ThreadPoolExecutor(opts["concurrency"], thread_name_prefix="lmcache-s3-raw") as pool:

            def put(i: int) -> None:
                client.put_object(Bucket=bucket, Key=names[i], Body=items[i][1])

            def get(i: int) -> int:
                with client.get_object(Bucket=bucket, Key=names[i])["Body"] as body:
                    return len(body.read())

            def timed(fn: Callable[[int], Any]) -> float:
                t0 = time.perf_counter()
                for start in range(0, len(items), batch):
                    list(pool.map(fn, range(start, min(start + batch, len(items)))))
                return time.perf_counter() - t0

            put_s = timed(put)
            get_s = timed(get)
    finally:
        try:
            for i in range(0, len(names), DELETE_BATCH):
                client.delete_objects(
                    Bucket=bucket,
                    Delete={"Objects": [{"Key": n} for n in names[i : i + DELETE_BATCH]], "Quiet": True},
                )
        finally:
            client.close()
    return put_s, get_s

def mooncake(options: Mapping[str, Any], items: Items, batch: int) -> tuple[float, float]:
    """The raw client's ``upsert_parts``/``batch_get_buffer`` of the same bytes,
    ``batch`` at a time (cut to fit the local buffer, as the client requires), then
    ``batch_remove``. One untimed round first: a fresh client's buffers are mapped
    lazily, and the first touch of their pages is not what the store costs."""
    from lmcache.backends.mooncake import OBJECT_NOT_FOUND, MooncakeError, _groups, _setup_args, import_client
    from lmcache.backends.mooncake import MooncakeBackend as cls

    opts = check_backend_options(cls, options, None)
    mod = import_client()
    store = mod.MooncakeDistributedStore()
    args = _setup_args(opts)
    rc = store.setup(*args)
    if rc != 0:
        raise MooncakeError(f"setup (master {args[6]})", rc)
    budget = max(args[3] // 2, 1)
    step = max(batch, 1)
    names = [opts["prefix"] + n for n, _ in items]
    values = [v for _, v in items]

    def once() -> tuple[float, float]:
        t0 = time.perf_counter()
        for s in range(0, len(items), step):
            part = list(range(s, min(s + step, len(items))))
            for i in part:  # faster than upsert_batch here (4.2 vs 7 GB/s for 32 MiB values)
                rc = store.upsert_parts(names[i], values[i])
                if rc != 0:
                    raise MooncakeError("upsert_parts", rc)
        t1 = time.perf_counter()
        for s in range(0, len(items), step):
            part = list(range(s, min(s + step, len(items))))
            for g in _groups([len(values[i]) for i in part], budget):  # gets fit the buffer too
                idx = [names[part[j]] for j in g]
                handles = store.batch_get_buffer(idx)
                for h, n in zip(handles, idx):
                    if h is None:
                        raise BackendError(f"mooncake raw get of {n} found nothing")
                del handles
        t2 = time.perf_counter()
        codes = store.batch_remove(names, True)
        bad = [c for c in codes if c not in (0, OBJECT_NOT_FOUND)]
        if bad:
            raise MooncakeError("batch_remove", bad[0])
        return t1 - t0, t2 - t1

    try:
        once()
        return once()
    finally:
        try:
            store.batch_remove(names, True)  # after an error midway
        finally:
            store.close()

def lm(options: Mapping[str, Any], items: Items, batch: int) -> tuple[float, float]:
    """Plain loopback TCP of the same bytes, the floor under any protocol: a trivial
    sink/echo server (a thread on 127.0.0.1) receives each value with ``recv_into``
    after an 8-byte length and acknowledges each ``batch`` with one byte (put);
    then it sends the values back, ``batch`` per request, into buffers the client
    allocated (get). ``options`` are not used: the baseline never touches the server."""

    return raw_tcp_transfer([v for _, v in items], batch)


def raw_tcp_transfer(values: Sequence[bytes], batch: int) -> tuple[float, float]:
    """``(put_seconds, get_seconds)`` of plain socket transfers of ``values`` on loopback."""
    import struct

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    stored: list[Any] = []
    failure: list[BaseException] = []
    u64 = struct.Struct("<Q")

    def sink() -> None:
        try:
            conn, _ = lsock.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with conn:
                while True:  # put phase: u64 count, then count x (u64 length, bytes); ack 1 byte
                    n = u64.unpack(proto.recv_exact(conn, 8))[0]
                    if n == 0:
                        break
                    for _ in range(n):
                        size = u64.unpack(proto.recv_exact(conn, 8))[0]
                        stored.append(proto.recv_exact(conn, size))
                    conn.sendall(b"\x01")
                i = 0
                while i < len(stored):  # get phase: u64 count requested, values sent back
                    n = u64.unpack(proto.recv_exact(conn, 8))[0]
                    proto.send_buffers(conn, stored[i : i + n])
                    i += n
        except BaseException as exc:  # noqa: BLE001 - reported by the client side
            failure.append(exc)

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    c = socket.create_connection(lsock.getsockname(), timeout=60)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        t0 = time.perf_counter()
        for part in _chunks(values, batch):
            bufs: list[Any] = [u64.pack(len(part))]
            for v in part:
                bufs += [u64.pack(len(v)), v]
            proto.send_buffers(c, bufs)
            proto.recv_exact(c, 1)
        c.sendall(u64.pack(0))
        t1 = time.perf_counter()
        got = 0
        for part in _chunks(values, batch):
            c.sendall(u64.pack(len(part)))
            for v in part:
                buf = proto.alloc(len(v))  # the buffer kind the lm client receives into
                proto.recv_into_exact(c, memoryview(buf))
                got += len(buf)
        t2 = time.perf_counter()
    finally:
        c.close()
        t.join(10)
        lsock.close()
    if failure:
        raise BackendError(f"raw transfer failed: {failure[0]}")
    want = sum(len(v) for v in values)
    if got != want:
        raise BackendError(f"raw transfer read back {got} bytes of {want}")
    return t1 - t0, t2 - t1
