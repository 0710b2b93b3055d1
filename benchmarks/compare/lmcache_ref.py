"""The LMCache side of ``lmcache bench compare``: runs inside the reference virtualenv.

Started by ``lmcache bench compare`` as ``VENV/bin/python -I -P lmcache_ref.py --spec JSON``
with a temporary working directory, so that only PyPI's ``lmcache`` (LMCache 0.5.6) is
importable here, never this repository's package of the same name. It drives LMCache's
own CPU classes the way ``LMCacheEngine`` does for a vLLM worker, with the engine's
paged-memory connector replaced by what a CPU connector does (a ``copy_`` between a KV
tensor and LMCache's memory objects):

- store: ``ChunkedTokenDatabase.process_tokens`` -> ``StorageManager.allocate`` per chunk
  -> copy the chunk's KV into the memory object -> ``StorageManager.batched_put``
  (``LMCacheEngine.store`` with ``batched_from_gpu`` as a ``copy_``);
- retrieve: ``process_tokens`` -> ``StorageManager.get_block_mapping`` ->
  ``StorageManager.batched_get`` per location -> copy each memory object into a
  preallocated destination tensor -> ``ref_count_down`` (``LMCacheEngine.retrieve``:
  ``_process_tokens_internal`` and ``batched_to_gpu`` as a ``copy_``);
- hashing: ``process_tokens`` with keys made (what store, retrieve and lookup run first);
- lookup: ``process_tokens`` -> ``StorageManager.batched_contains`` -> hit tokens
  (``LMCacheEngine.lookup`` without pinning);
- CPU over disk: ``local_cpu`` with ``local_disk`` (the disk writes go on behind the
  store, on LMCache's disk workers): the store's wall time as above, up to
  ``batched_put`` returning, with torch's default threads (``spec["cpu_over_disk"]``);
  persist: until ``local_disk`` holds every key; disk hit: a new ``local_disk``-only
  storage manager's first retrieve of the chunks it stored (files in the page cache).

KV is in LMCache's own layout (``KV_2LTD``: ``(2, layers, tokens, heads * head_size)``), so
a chunk is ``2 * layers`` strided blocks, as it is in ``(layers, 2, tokens, heads,
head_size)`` on our side. Every chunk read back is compared byte for byte with what was
stored. Prints one JSON document on stdout; LMCache's logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

GB = 1e9


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _timing(seconds: list[float], tokens: int) -> dict[str, Any]:
    p50 = _pct(seconds, 50)
    return {
        "calls": len(seconds),
        "p50_ms": p50 * 1e3,
        "p99_ms": _pct(seconds, 99) * 1e3,
        "tokens_per_s": tokens / p50 if p50 > 0 else None,
    }


class Ref:
    """One LMCache StorageManager and token database with a CPU or a disk tier."""

    def __init__(self, shape: dict[str, Any], spec: dict[str, Any], tier: str, capacity: int, directory: str | None):
        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.storage_manager import StorageManager
        from lmcache.v1.token_database import ChunkedTokenDatabase

        cs = spec["chunk_size"]
        self.dtype = getattr(torch, spec["dtype"])
        gib = capacity / 1024**3
        cfg: dict[str, Any] = {"chunk_size": cs, "max_local_cpu_size": gib}
        rounds = max(1, spec.get("store_rounds", 1))
        if tier == "cpu":
            cfg.update(local_cpu=True, local_disk=None, max_local_disk_size=0)
        elif tier == "cpu+disk":  # the disk tier behind the CPU one; room for every round (below)
            cfg.update(local_cpu=True, local_disk=directory, max_local_disk_size=gib * rounds)
        else:  # the CPU backend stays as the allocator (staging buffers), holding nothing
            # LocalDiskBackend.remove() (0.5.6) lowers `usage` but not the admission
            # budget (`current_cache_size`), so the removal between store rounds does not
            # give the bytes back: room for every round, or round 2 is refused
            cfg.update(local_cpu=False, local_disk=directory, max_local_disk_size=gib * rounds)
        self.config = LMCacheEngineConfig.from_dict(cfg)
        L, H, D = shape["layers"], shape["kv_heads"], shape["head_size"]
        self.metadata = LMCacheMetadata(
            model_name="bench-compare", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=self.dtype, kv_shape=(L, 2, cs, H, D), role="worker", chunk_size=cs,
        )
        self.fmt = MemoryFormat.KV_2LTD
        self.sm = StorageManager(self.config, self.metadata, EventManager())
        self.db = ChunkedTokenDatabase(self.config, self.metadata)
        self.tier_name = "LocalDiskBackend" if tier == "disk" else "LocalCPUBackend"
        self.backend = self.sm.storage_backends[self.tier_name]
        self.disk = self.sm.storage_backends.get("LocalDiskBackend")

    def shape(self, tokens: int) -> tuple[int, ...]:
        L, _, _, H, D = self.metadata.kv_shape
        return (2, L, tokens, H * D)

    def keys(self, tokens: list[int]) -> list[Any]:
        return [k for _, _, k in self.db.process_tokens(tokens)]

    def store(self, tokens: list[int], kv) -> list[Any]:
        keys, objs = [], []
        for start, end, key in self.db.process_tokens(tokens):
            obj = self.sm.allocate(self.metadata.get_shapes(end - start), self.metadata.get_dtypes(),
                                   fmt=self.fmt, busy_loop=False)
            if obj is None:
                break
            obj.tensor.copy_(kv[:, :, start:end])
            keys.append(key)
            objs.append(obj)
        if objs:
            self.sm.batched_put(keys, objs)
        return keys

    def wait_stored(self, keys: list[Any], timeout: float = 120.0, backend: Any = None) -> bool:
        """Until every key is in the measured tier, or ``backend`` (the disk writes are
        asynchronous)."""
        backend = backend or self.backend
        pending = list(keys)
        deadline = time.perf_counter() + timeout
        while pending:
            pending = [k for k in pending if not backend.contains(k)]
            if pending:
                if time.perf_counter() > deadline:
                    return False
                time.sleep(0.0005)
        return True

    def retrieve(self, tokens: list[int], out) -> int:
        chunk_infos = [(key, start, end) for start, end, key in self.db.process_tokens(tokens)]
        mapping = self.sm.get_block_mapping(chunk_infos)
        n = 0
        for location, blocks in mapping.items():
            objs = self.sm.batched_get([k for k, _, _ in blocks], location=location)
            ok = True
            for (_, start, end), obj in zip(blocks, objs):
                if obj is None:
                    ok = False
                    continue
                if ok:
                    out[:, :, start:end].copy_(obj.tensor)
                    n = max(n, end)
                obj.ref_count_down()
        return n

    def lookup(self, tokens: list[int]) -> int:
        infos = list(self.db.process_tokens(tokens))
        hit, _ = self.sm.batched_contains([k for _, _, k in infos])
        return infos[hit - 1][1] if hit else 0

    def remove(self, keys: list[Any]) -> None:
        self.sm.batched_remove(keys)

    def close(self) -> None:
        self.sm.close()


def _same_bytes(a, b) -> bool:
    import torch

    return torch.equal(a.view(torch.int16) if a.element_size() == 2 else a, b.view(torch.int16) if b.element_size() == 2 else b)


def _random_kv(shape: tuple[int, ...], dtype, gen):
    """Random bits (any bit pattern, compared as integers, so NaNs do not matter)."""
    import torch

    bits = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16)
    if torch.empty((), dtype=dtype).element_size() == 2:
        return bits.view(dtype)
    return bits.to(dtype)


def run_tier(shape: dict[str, Any], spec: dict[str, Any], tier: str, base_dir: str) -> dict[str, Any]:
    import torch

    cs, tpp = spec["chunk_size"], spec["tokens_per_prompt"]
    prompts = spec["chunks"] * cs // tpp
    gen = torch.Generator().manual_seed(spec["seed"])
    toks = [torch.randint(0, 128256, (tpp,), generator=gen).tolist() for _ in range(prompts)]
    ref = None
    directory = tempfile.mkdtemp(prefix=f"ref-{tier}-", dir=base_dir) if tier == "disk" else None
    try:
        ref = Ref(shape, spec, tier, spec["capacity"], directory)
        kvs = [_random_kv(ref.shape(tpp), ref.dtype, gen) for _ in range(prompts)]
        chunk_bytes = kvs[0][:, :, :cs].numel() * kvs[0].element_size()
        total = prompts * (tpp // cs) * chunk_bytes
        rounds: list[float] = []
        stored = 0
        all_keys: list[Any] = []
        for r in range(spec["store_rounds"]):
            if r:  # the same chunks again, into memory (and files) freed by a removal
                ref.remove(all_keys)
            all_keys = []
            t0 = time.perf_counter()
            for i in range(prompts):
                all_keys += ref.store(toks[i], kvs[i])
            complete = ref.wait_stored(all_keys)
            rounds.append(time.perf_counter() - t0)
            stored = len(all_keys) if complete else sum(ref.backend.contains(k) for k in all_keys)
        out = torch.empty(ref.shape(tpp), dtype=ref.dtype)
        best: list[float] = []
        exact, retrieved = True, 0
        for i in range(prompts):
            times = []
            for _ in range(spec["retrieve_repeats"]):
                out.zero_()
                t0 = time.perf_counter()
                n = ref.retrieve(toks[i], out)
                times.append(time.perf_counter() - t0)
                exact = exact and n == tpp and _same_bytes(out[:, :, :n], kvs[i][:, :, :n])
            retrieved += n
            best.append(min(times))
        ret_s = sum(best)
        return {
            "tier": tier,
            "backend": ref.tier_name,
            "prompts": prompts,
            "chunks": prompts * (tpp // cs),
            "chunk_bytes": chunk_bytes,
            "bytes": total,
            "stored_chunks": stored,
            "retrieved_tokens": retrieved,
            "store_seconds": rounds,
            "store_cold_gbps": total / rounds[0] / GB,
            "store_gbps": total / min(rounds) / GB,
            "retrieve_seconds": ret_s,
            "retrieve_gbps": total / ret_s / GB if ret_s > 0 else None,
            "exact": exact,
            "complete": stored == prompts * (tpp // cs) and retrieved == prompts * tpp,
        }
    finally:
        if ref is not None:
            ref.close()
        if directory:
            shutil.rmtree(directory, ignore_errors=True)


def run_cpu_over_disk(spec: dict[str, Any], base_dir: str) -> dict[str, Any]:
    """A CPU tier with a disk tier behind it; see ``run_ours_cpu_over_disk`` on our side."""
    import statistics

    import torch

    od = spec["cpu_over_disk"]
    cs, n = od["chunk_size"], od["chunks"] * od["chunk_size"]
    gen = torch.Generator().manual_seed(spec["seed"] + 2)
    toks = torch.randint(0, 128256, (n,), generator=gen).tolist()
    directory = tempfile.mkdtemp(prefix="ref-cpu-over-disk-", dir=base_dir)
    threads = torch.get_num_threads()
    ref = None
    try:
        ref = Ref(od, {**spec, "dtype": od["dtype"], "chunk_size": cs, "store_rounds": od["repeats"]}, "cpu+disk",
                  od["capacity"], directory)
        shape = ref.shape(n)  # one engine buffer, LMCache's layout
        kv = torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int32).view(torch.float32)
        seconds: list[float] = []
        persist: list[float] = []
        keys: list[Any] = []
        on_disk = 0
        torch.set_num_threads(od["threads"])
        for r in range(od["repeats"]):
            if r:  # the previous store's disk writes are done; its chunks removed from both tiers
                ref.remove(keys)
            t0 = time.perf_counter()
            keys = ref.store(toks, kv)
            seconds.append(time.perf_counter() - t0)
            ref.wait_stored(keys, backend=ref.disk)
            persist.append(time.perf_counter() - t0)
            on_disk = sum(ref.disk.contains(k) for k in keys)
        out = torch.empty(shape, dtype=torch.float32)
        got = ref.retrieve(toks, out)
        exact = got == n and torch.equal(out.view(torch.int32), kv.view(torch.int32))
        backends = sorted(ref.sm.storage_backends)
        ref.close()
        ref = None
        hits, hit_tokens, hit_exact = disk_hits(od, spec, kv, toks, base_dir)
        return {
            "tier": "cpu over disk",
            "shape": od["name"],
            "dtype": od["dtype"],
            "threads": torch.get_num_threads(),
            "backends": backends,
            "chunks": od["chunks"],
            "bytes": kv.numel() * kv.element_size(),
            "stored_chunks": len(keys),
            "disk_chunks": on_disk,
            "store_seconds": seconds,
            "store_gbps": kv.numel() * kv.element_size() / statistics.median(seconds) / GB,
            "store_best_gbps": kv.numel() * kv.element_size() / min(seconds) / GB,
            "persist_seconds": persist,
            "persist_gbps": kv.numel() * kv.element_size() / statistics.median(persist) / GB,
            "hit_seconds": hits,
            "hit_gbps": kv.numel() * kv.element_size() / statistics.median(hits) / GB,
            "hit_tokens": hit_tokens,
            "hit_exact": hit_exact,
            "exact": exact and hit_exact,
            "complete": len(keys) == od["chunks"] and on_disk == od["chunks"] and hit_tokens == n,
        }
    finally:
        torch.set_num_threads(threads)
        if ref is not None:
            ref.close()
        shutil.rmtree(directory, ignore_errors=True)


def disk_hits(od: dict[str, Any], spec: dict[str, Any], kv, toks: list[int], base_dir: str) -> tuple[list[float], int, bool]:
    """The disk hit: per round a new ``local_disk``-only storage manager (LMCache 0.5.6
    does not index a directory it finds, so it stores the chunks itself and waits for
    every file), then its first retrieve of them, timed, into a preallocated, touched
    tensor. ``(seconds per round, tokens of the last, every byte right)``."""
    import torch

    cs, n = od["chunk_size"], od["chunks"] * od["chunk_size"]
    out = torch.empty_like(kv)
    hits: list[float] = []
    got, exact = 0, True
    for _ in range(od["hit_repeats"]):
        directory = tempfile.mkdtemp(prefix="ref-disk-hit-", dir=base_dir)
        ref = None
        try:
            ref = Ref(od, {**spec, "dtype": od["dtype"], "chunk_size": cs, "store_rounds": 1}, "disk",
                      od["capacity"], directory)
            if not ref.wait_stored(ref.store(toks, kv)):
                raise RuntimeError("LMCache did not write every chunk of the disk-hit workload")
            out.zero_()
            t0 = time.perf_counter()
            got = ref.retrieve(toks, out)
            hits.append(time.perf_counter() - t0)
            exact = exact and got == n and torch.equal(out.view(torch.int32), kv.view(torch.int32))
        finally:
            if ref is not None:
                ref.close()
            shutil.rmtree(directory, ignore_errors=True)
    return hits, got, exact


def run_lookup(spec: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    cs = spec["chunk_size"]
    lengths = spec["lookup_lengths"]
    longest = max(lengths)
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    tokens_t = torch.randint(0, 128256, (longest,), generator=gen)
    tokens = tokens_t.tolist()
    shape = spec["lookup_shape"]
    ref = Ref(shape, spec, "cpu", spec["lookup_capacity"], None)
    rows = []
    try:
        kv = torch.zeros(ref.shape(longest), dtype=ref.dtype)
        ref.store(tokens, kv)  # every length below is a prefix of this prompt: fully cached
        del kv
        for kind, n in [(k, n) for k in spec["lookup_inputs"] for n in lengths]:
            prompt = tokens[:n] if kind == "list" else tokens_t[:n]
            calls = max(spec["lookup_min_calls"], min(spec["lookup_max_calls"], spec["lookup_budget_tokens"] // n))
            ref.keys(prompt)  # warm up
            hs = []
            for _ in range(calls):
                t0 = time.perf_counter()
                keys = ref.keys(prompt)
                hs.append(time.perf_counter() - t0)
            ls = []
            hit = ref.lookup(prompt)
            for _ in range(calls):
                t0 = time.perf_counter()
                hit = ref.lookup(prompt)
                ls.append(time.perf_counter() - t0)
            rows.append({
                "tokens": n,
                "input": kind,
                "chunks": len(keys),
                "hash": _timing(hs, n),
                "lookup": {**_timing(ls, n), "hit_tokens": hit},
                "exact": hit == n // cs * cs and len(keys) == n // cs,
            })
    finally:
        ref.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, help="the workload, as JSON (see lmcache.benchmarks.compare)")
    args = ap.parse_args(argv)
    spec = json.loads(args.spec)

    import torch
    from importlib.metadata import version

    import lmcache

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    base_dir = spec.get("dir") or tempfile.gettempdir()
    t0 = time.perf_counter()
    tiers = []
    for shape in spec["shapes"]:
        for tier in spec["tiers"]:
            row = run_tier(shape, spec, tier, base_dir)
            tiers.append({"shape": shape["name"], **row})
    lookup = run_lookup(spec) if spec["lookup_lengths"] else []
    over_disk = run_cpu_over_disk(spec, base_dir) if spec.get("cpu_over_disk") else None
    doc = {
        "side": "LMCache",
        "lmcache_version": version("lmcache"),
        "lmcache_path": os.path.dirname(lmcache.__file__),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "hash": "python builtin hash (LMCache's default pre_caching_hash_algorithm without vLLM)",
        "tiers": tiers,
        "lookup": lookup,
        "cpu_over_disk": over_disk,
        "seconds": time.perf_counter() - t0,
    }
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    # LMCache's background threads (storage manager loop, disk workers) are closed
    # above; exit without waiting on any non-daemon thread it may leave behind.
    code = main()
    os._exit(code)
