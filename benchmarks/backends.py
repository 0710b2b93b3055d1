"""``lmcache bench tiers --backend NAME``: one storage backend against its raw client.

The physical limit of a networked or shared store is what its own client achieves doing
the same transfers in the plainest fast way (redis-py pipelined SET/GET, boto3 concurrent
put/get, fsspec writes and reads, Mooncake batch put/get). Each backend provides that
baseline through the hook ``lmcache_register_bench_baselines`` (the built-ins in
:mod:`lmcache.benchmarks.raw_baselines`; a third-party package registers its own the
same way, under its backend's name); this module times the
backend's own batch ``put``/``get`` (payload encoding with the self-describing header and
checksum, decoding and verifying into a memory object) on the same bytes, in the same
run, against the same server, and reports the ratio.

How the numbers are taken (GB/s are 10^9 bytes per second, of payload bytes, which are the
chunk's KV plus a header of a few hundred bytes; the raw client moves exactly as many):

- values: ``--values`` chunks of the workload's shape (``--layers``, ``--kv-heads``,
  ``--head-size``, ``--chunk-size`` tokens, ``--dtype``), random content;
- put: wall time of ``backend.put(batch)`` over all values, ``--batch`` values per call;
- get: wall time of ``backend.get(keys)`` over all values, same batches; the first
  round checks that every value comes back bit-exact;
- raw: the registered baseline with the same bytes and batch size;
- each round opens the backend, stores, reads and deletes everything once untimed (a
  fresh client's buffers and connections warm up), then timed, and closes it; then
  the raw client does the same; the best of ``--repeats`` rounds counts for each (the
  same rule for both). Dirty page cache is written back (``sync``) before each timed
  phase, so that one side's file writes do not throttle the other's.

Without ``--option url=...`` the store is started on loopback for the run by the launcher
registered under the backend's name through ``lmcache_register_store_launchers`` (the
built-ins' in :mod:`lmcache.testing.stores`; a third-party plugin registers its own, so its
backend is benchmarked the same way; ``--store redis-cluster`` picks another launcher), or,
for ``fs`` and ``gds``, a temporary directory is used.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import yaml

from lmcache.encoded import open_objects

GB = 1e9


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (values parsed as YAML scalars: numbers, booleans, strings)."""
    import typer

    opts: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="'--option'")
        try:
            parsed = yaml.safe_load(value) if value else ""
        except yaml.YAMLError:
            parsed = value
        opts[key.strip()] = value if isinstance(parsed, (dict, list)) or parsed is None else parsed
    return opts


@contextlib.contextmanager
def open_store(backend: str, options: dict[str, Any], store: str | None) -> Iterator[tuple[dict[str, Any], str]]:
    """The options that reach the store, and a description of it: the given ones, or a
    store started on loopback (a temporary directory for fs and gds) for the run."""
    if options:
        yield options, "given by --option"
        return
    if backend in ("fs", "gds", "disk"):
        tmp = Path(tempfile.mkdtemp(prefix=f"lmcache-bench-{backend}-"))
        try:
            opts = {"path": str(tmp)} if backend == "disk" else {"url": f"{'file' if backend == 'fs' else 'gds'}://{tmp}"}
            yield opts, f"temporary directory {tmp}"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    from lmcache.testing import stores as loopback

    with loopback.start(store or backend) as st:
        yield dict(st.options), f"{store or backend} started on loopback for this run"


def _chunks(seq: Sequence[Any], n: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def _settle() -> None:
    """Write back dirty page cache before a timed phase, so that what one side wrote
    (hundreds of MiB for a file store) does not throttle the other side's writes."""
    if hasattr(os, "sync"):
        os.sync()


def _warm_up(be: Any, keys: list[str], objs: list[Any], batch: int) -> None:
    """One untimed store/read/delete of everything: a fresh client maps its buffers
    lazily (Mooncake's segment, connection pools), and first touches are not what the
    store costs. Baselines warm up the same way."""
    for part in _chunks(list(zip(keys, objs)), batch):
        be.put(part)
    for part in _chunks(keys, batch):
        for o in be.get(part):
            if o is not None:
                o.unref()
    be.delete(keys)


def run_backend(
    backend: str,
    options: dict[str, Any],
    *,
    shape: tuple[int, ...],
    dtype: str,
    values: int,
    batch: int,
    repeats: int,
    codec: str = "raw",
    seed: int = 0,
) -> dict[str, Any]:
    """Time ``backend``'s batch put/get and its raw client on the same bytes."""
    import torch

    from lmcache import payload
    from lmcache.codecs import load_codec
    from lmcache.keys import CacheKey
    from lmcache.memory import MemoryPool
    from lmcache.plugin_manager import get_registries
    from lmcache.errors import LMCacheError
    from lmcache.storage import BackendContext

    regs = get_registries()
    cls = regs.backends.load(backend)
    if backend not in regs.baselines:
        known = ", ".join(regs.baselines.names()) or "none"
        raise LMCacheError(
            f"backend {backend!r} has no raw-client baseline (registered through lmcache_register_bench_baselines: "
            f"{known}); for cpu and disk run `lmcache bench tiers` without --backend"
        )
    raw_transfer = regs.baselines.load(backend)
    codec_obj = load_codec(regs.codecs.load, codec)
    tdtype = getattr(torch, dtype)
    value_nbytes = math.prod(shape) * torch.empty((), dtype=tdtype).element_size()
    # reads land in a memory pool, as in an engine (reused, already faulted-in pages)
    pool = MemoryPool((batch + 1) * (value_nbytes + 4096))
    ctx = BackendContext.standalone(options, codec=codec_obj, capacity=1 << 62, tier=backend, pool=pool)
    g = torch.Generator().manual_seed(seed)
    sig = f"{dtype}-L{shape[0]}-H{shape[3]}-D{shape[4]}-bench"
    objs, keys = [], []
    for i in range(values):
        obj = MemoryPool.allocate_unpooled(shape, tdtype)
        obj.tensor.copy_(torch.randn(shape, generator=g).to(tdtype))
        objs.append(obj)
        keys.append(CacheKey("lmcache-bench", "lmcache/bench", sig, f"{seed:016x}{i:016x}").to_string())
    raw_items = [
        (f"lmcache-bench-raw-{seed}-{i}", b"".join(bytes(b) for b in payload.encode(k, o, codec_obj)))
        for i, (k, o) in enumerate(zip(keys, objs))
    ]
    nbytes = sum(len(v) for _, v in raw_items)
    best = {"put": float("inf"), "get": float("inf"), "raw_put": float("inf"), "raw_get": float("inf")}
    exact = True
    for r in range(repeats):
        # the backend is open only for its own round: the raw client then has the store to
        # itself (a Mooncake client in the same process would otherwise hold the segment
        # that the raw client's data lands in, and turn its memcpy into a TCP transfer)
        be = open_objects(cls(ctx))
        try:
            be.delete(keys)  # leftovers of an interrupted run
            _warm_up(be, keys, objs, batch)
            _settle()
            t0 = time.perf_counter()
            for part in _chunks(list(zip(keys, objs)), batch):
                be.put(part)
            t1 = time.perf_counter()
            got_all = 0
            for part_keys, part_objs in zip(_chunks(keys, batch), _chunks(objs, batch)):
                got = be.get(part_keys)
                for o, gobj in zip(part_objs, got):
                    if gobj is None:
                        continue
                    got_all += 1
                    if r == 0 and not torch.equal(o.tensor, gobj.tensor):
                        exact = False
                    gobj.unref()
            t2 = time.perf_counter()
            if got_all != values:
                exact = False
        finally:
            with contextlib.suppress(Exception):
                be.delete(keys)
            be.close()
        best["put"] = min(best["put"], t1 - t0)
        best["get"] = min(best["get"], t2 - t1)
        _settle()
        put_s, get_s = raw_transfer(options, raw_items, batch)
        best["raw_put"] = min(best["raw_put"], put_s)
        best["raw_get"] = min(best["raw_get"], get_s)
    gbps = {k: nbytes / v / GB for k, v in best.items()}
    return {
        "backend": backend,
        "codec": codec,
        "values": values,
        "value_bytes": nbytes // max(values, 1),
        "batch": batch,
        "repeats": repeats,
        "bytes": nbytes,
        "put_gbps": gbps["put"],
        "get_gbps": gbps["get"],
        "raw_put_gbps": gbps["raw_put"],
        "raw_get_gbps": gbps["raw_get"],
        "put_ratio": gbps["put"] / gbps["raw_put"],
        "get_ratio": gbps["get"] / gbps["raw_get"],
        "exact": exact,
    }


def print_report(data: dict[str, Any]) -> None:
    from rich.table import Table

    from lmcache.units import format_size

    from .harness import out

    t = Table(title=f"{data['backend']} vs its raw client (GB/s)")
    for col in ("op", "lmcache GB/s", "raw client GB/s", "ratio"):
        t.add_column(col, justify="left" if col == "op" else "right")
    for op in ("put", "get"):
        t.add_row(op, f"{data[op + '_gbps']:.3f}", f"{data['raw_' + op + '_gbps']:.3f}", f"{data[op + '_ratio']:.2f}")
    o = out()
    o.print(t)
    o.print(
        f"{data['values']} values of {format_size(data['value_bytes'])}, {data['batch']} per call, "
        f"codec {data['codec']}, best of {data['repeats']}; store: {data['store']}; exact={data['exact']}"
    )


def main(backend: str, option: list[str], store: str | None, wl: Any, values: int, batch: int,
                   repeats: int, codec: str, as_json: bool) -> None:
    """``lmcache bench tiers --backend``: one backend next to its raw client (table or JSON)."""
    from lmcache.errors import LMCacheError
    from lmcache.units import format_size

    from .harness import emit, err, machine_info, warn_if_busy

    opts = parse_options(option)
    e = err()
    warn_if_busy(machine_info())
    with open_store(backend, opts, store) as (options, where):
        e.print(f"{backend}: {values} chunks of {format_size(wl.chunk_bytes)} x {repeats} rounds against {where} ...")
        data = run_backend(backend, options, shape=wl.shape(wl.chunk_size), dtype=wl.dtype, values=values,
                              batch=batch, repeats=repeats, codec=codec, seed=wl.seed)
    data["store"] = where
    data["machine"] = machine_info()
    emit(data, as_json, print_report)
    if not data["exact"]:
        raise LMCacheError(f"some values read back from {backend} differed from what was stored")

