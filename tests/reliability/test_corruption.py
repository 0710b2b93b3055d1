"""Issue 10, item 2: corrupt bytes in a store are a miss, never wrong KV and never an
exception into the engine.

For each bytes tier (disk, fs, redis, s3) a real prompt's KV is stored through the
transformers connector (SmolLM2), then stored entries are corrupted in place with the
store's own client or raw file operations: bit flips at random offsets in the header and
in the body, truncation at random lengths, zero length, a header forged to another key /
shape / dtype / codec with a recomputed header checksum, and another entry's payload
copied over. Generating again must give exactly the no-cache greedy output, the corrupt
entry must be removed from the store (and counted), and nothing may raise.
"""

from __future__ import annotations

import contextlib
import json
import random
import resource
import struct
import time
from typing import Any, Callable, Iterator

import pytest
import torch
import xxhash

import lmcache
from lmcache import payload
from lmcache.plugins.connectors.hf import TransformersConnector, kv_spec_of

from _missing import loopback_store, missing

CHUNK = 64
NEW_TOKENS = 4
TIME_CAP = 6.0  # seconds of corruption rounds per backend (bounded in count too)
DOC = " ".join(f"Fact {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7} marbles." for i in range(14))
PROMPT = DOC + "\nQuestion: how many marbles does box 12 hold?\nAnswer:"

KINDS = [
    "flip_header", "flip_body", "truncate", "zero_length",
    "forge_key", "forge_shape", "forge_dtype", "forge_codec", "copy_other",
]


# --------------------------------------------------------------------- raw access
class Raw:
    """Read and overwrite one stored entry's bytes without going through lmcache."""

    def __init__(self, get: Callable[[str], bytes | None], put: Callable[[str, bytes], None]):
        self.get, self.put = get, put


@contextlib.contextmanager
def tier_for(name: str, tmp_path) -> Iterator[tuple[dict, Callable[[Any], Raw]]]:
    """(tier config, raw access factory taking the opened backend) for a backend name."""
    if name == "disk":
        def raw_disk(b):
            def get(k):
                p = b._path(k)
                return p.read_bytes() if p.exists() else None
            return Raw(get, lambda k, data: b._path(k).write_bytes(data))
        yield {"backend": "disk", "path": str(tmp_path / "disk"), "capacity": "1GiB"}, raw_disk
    elif name == "fs":
        try:
            import fsspec  # noqa: F401
        except ImportError:
            missing("fsspec is not installed (the fs backend's client): pip install 'lmcache[fs]'")

        def raw_fs(b):
            fs = b._fs()

            def get(k):
                try:
                    return fs.cat_file(b._path(k))
                except FileNotFoundError:
                    return None
            return Raw(get, lambda k, data: fs.pipe_file(b._path(k), data))
        yield {"backend": "fs", "url": f"file://{tmp_path}/fs", "capacity": "1GiB"}, raw_fs
    elif name == "redis":
        with loopback_store("redis") as store:
            import redis

            def raw_redis(b):
                r = redis.Redis.from_url(store.options["url"])
                return Raw(lambda k: r.get(b.prefix + k), lambda k, data: r.set(b.prefix + k, data))
            yield {"backend": "redis", **store.options, "capacity": "1GiB"}, raw_redis
    elif name == "s3":
        with loopback_store("s3") as store:
            import boto3

            def raw_s3(b):
                o = store.options
                c = boto3.client("s3", endpoint_url=o["endpoint_url"], region_name=o.get("region") or "us-east-1",
                                 aws_access_key_id=o["access_key_id"], aws_secret_access_key=o["secret_access_key"])

                def get(k):
                    try:
                        return c.get_object(Bucket=b.bucket, Key=b._name(k))["Body"].read()
                    except c.exceptions.NoSuchKey:
                        return None
                return Raw(get, lambda k, data: c.put_object(Bucket=b.bucket, Key=b._name(k), Body=data))
            yield {"backend": "s3", **store.options, "capacity": "1GiB"}, raw_s3
    else:  # pragma: no cover
        raise ValueError(name)


# --------------------------------------------------------------------- corruptions
def _split(data: bytes) -> tuple[dict, bytes]:
    hlen = struct.unpack_from("<I", data, 6)[0]
    hdr = json.loads(data[payload.PREFIX_SIZE : payload.PREFIX_SIZE + hlen])
    return hdr, data[payload.PREFIX_SIZE + hlen :]


def _forge(hdr: dict, body: bytes) -> bytes:
    """A payload with ``hdr`` and a correct header checksum (a forgery, not noise)."""
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    return struct.pack("<4sHIQ", payload.MAGIC, payload.VERSION, len(raw), xxhash.xxh3_64_intdigest(raw)) + raw + body


def corrupt(kind: str, data: bytes, other: bytes, rng: random.Random) -> bytes:
    hdr_end = payload.PREFIX_SIZE + struct.unpack_from("<I", data, 6)[0]
    buf = bytearray(data)
    if kind == "flip_header":
        for _ in range(rng.randint(1, 3)):
            buf[rng.randrange(hdr_end)] ^= 1 << rng.randrange(8)
        return bytes(buf)
    if kind == "flip_body":
        for _ in range(rng.randint(1, 3)):
            buf[rng.randrange(hdr_end, len(buf))] ^= 1 << rng.randrange(8)
        return bytes(buf)
    if kind == "truncate":
        return data[: rng.randrange(1, len(data))]
    if kind == "zero_length":
        return b""
    if kind == "copy_other":
        return other
    hdr, body = _split(data)
    if kind == "forge_key":
        hdr["key"] = _split(other)[0]["key"]
    elif kind == "forge_shape":  # same byte count, another shape: the body checksum still holds
        shape = list(hdr["shape"])
        n = shape[2] * shape[3] * shape[4]
        hdr["shape"] = [shape[0], shape[1] * n] if rng.random() < 0.5 else list(reversed(shape))
        if hdr["shape"] == shape:
            hdr["shape"] = [shape[0] * shape[1], n]
    elif kind == "forge_dtype":  # same byte count, other element type
        hdr["dtype"] = {"float32": "int32", "float16": "bfloat16", "bfloat16": "float16"}[hdr["dtype"]]
    elif kind == "forge_codec":
        hdr["codec"] = rng.choice(["zstd", "fp8", "no-such-codec"])
    else:  # pragma: no cover
        raise ValueError(kind)
    return _forge(hdr, body)


# --------------------------------------------------------------------- the test
@pytest.fixture(scope="module")
def reference(smollm2):
    model, tok = smollm2
    eng = lmcache.CacheEngine.from_config({"chunk_size": CHUNK, "tiers": [{"backend": "cpu", "capacity": "64MiB"}]},
                                          kv_spec=kv_spec_of(model))
    conn = TransformersConnector(model, tok, eng)
    ids = conn.encode(PROMPT)
    base = conn.generate(ids, max_new_tokens=NEW_TOKENS, use_cache=False, store=False)
    conn.close()
    return ids, base


def _valid(data: bytes | None, key: str) -> bool:
    if data is None:
        return False
    try:
        payload.decode(data, key, lambda n: lmcache_codec(n), lambda s, d: _Heap(torch.empty(s, dtype=d)))
    except lmcache.errors.CorruptPayloadError:
        return False
    return True


class _Heap:
    def __init__(self, t):
        self.tensor = t

    def byte_view(self):
        return self.tensor.view(-1).view(torch.uint8)

    def unref(self):
        pass


def lmcache_codec(name):
    from lmcache.plugin_manager import get_registries

    return get_registries().codecs.load(name)()


@pytest.mark.parametrize("backend", ["disk", "fs", "redis", "s3"])
def test_corrupt_entries_are_misses_and_removed(smollm2, reference, backend, tmp_path):
    model, tok = smollm2
    ids, base = reference
    rng = random.Random(f"corruption-{backend}")
    rounds = detected = removed = 0
    kinds_done: dict[str, int] = {}
    with tier_for(backend, tmp_path) as (tier_cfg, raw_of):
        eng = lmcache.CacheEngine.from_config({"chunk_size": CHUNK, "tiers": [tier_cfg]}, kv_spec=kv_spec_of(model))
        conn = TransformersConnector(model, tok, eng)
        try:
            first = conn.generate(ids, max_new_tokens=NEW_TOKENS)
            eng.flush()
            assert first.tokens == base.tokens
            tier = eng.hierarchy.tiers[0]
            bk = tier.backend
            raw = raw_of(bk.raw)  # the store itself, under the tier's object view (lmcache.encoded)
            keys = eng.chunk_keys(ids)[1]
            assert len(keys) >= 4 and all(raw.get(k) for k in keys)
            warm = conn.generate(ids, max_new_tokens=NEW_TOKENS, store=False)
            assert warm.cached_tokens == len(ids) - 1 and warm.tokens == base.tokens
            end = time.monotonic() + TIME_CAP
            plan = KINDS * 3  # every kind at least once, up to three times each within the time cap
            for i, kind in enumerate(plan):
                if i >= len(KINDS) and time.monotonic() > end:
                    break
                j = rng.randrange(len(keys))
                victim = keys[j]
                good = raw.get(victim)
                other = raw.get(keys[(j + 1 + rng.randrange(len(keys) - 1)) % len(keys)])
                assert _valid(good, victim) and other is not None
                bad = corrupt(kind, good, other, rng)
                assert bad != good
                raw.put(victim, bad)
                corrupt_before = bk.integrity.corrupt
                counted_before = tier.info()["corrupt"]
                # the engine reads the corrupt entry: a miss from it on, exact output, no exception
                hit = conn.generate(ids, max_new_tokens=NEW_TOKENS, store=False)
                rounds += 1
                kinds_done[kind] = kinds_done.get(kind, 0) + 1
                assert hit.tokens == base.tokens, (backend, kind, hit.text, base.text)
                assert hit.cached_tokens == j * CHUNK, (backend, kind, j, hit.cached_tokens)
                if bk.integrity.corrupt > corrupt_before:
                    detected += 1
                elif kind not in ("forge_shape", "forge_dtype"):  # the engine's shape check drops those
                    pytest.fail(f"{backend}/{kind}: corrupt entry not counted")
                # every corrupt entry, whichever check caught it, counts in the tier's stats
                assert tier.info()["corrupt"] == counted_before + 1, (backend, kind)
                # ... and the corrupt entry is gone from the store
                assert raw.get(victim) is None, (backend, kind)
                assert not tier.exists([victim])[0]
                removed += 1
                # the next store writes it again, valid
                conn.generate(ids, max_new_tokens=1)
                eng.flush()
                assert _valid(raw.get(victim), victim), (backend, kind)
            assert set(kinds_done) == set(KINDS)
            final = conn.generate(ids, max_new_tokens=NEW_TOKENS, store=False)
            assert final.cached_tokens == len(ids) - 1 and final.tokens == base.tokens
        finally:
            conn.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"\ncorruption[{backend}]: rounds={rounds} kinds={len(kinds_done)} corrupt_injected={rounds} "
          f"counted_by_backend={detected} dropped_by_shape_check={removed - detected} removed={removed} "
          f"wrong_outputs=0 exceptions=0 peak_rss_mib={rss}")


# ---------------------------------------------------------------- hazards in the disk directory
def _kv(tokens: list[int]) -> torch.Tensor:
    t = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1, 1)
    return t.expand(2, 2, len(tokens), 2, 8).contiguous()


def _run_bounded(fn: Callable[[], Any], what: str, bound: float = 30.0) -> Any:
    """``fn()`` on a thread; fails (instead of hanging the suite) if it does not return."""
    import threading

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["v"] = fn()
        except BaseException as exc:  # re-raised below
            box["e"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound)
    assert not t.is_alive(), f"{what} hung for {bound:g}s"
    if "e" in box:
        raise box["e"]
    return box.get("v")


def test_hazards_in_the_disk_directory_cost_one_miss_never_the_tier(tmp_path):
    """The outside review: a directory where an entry file should be stopped the engine
    from starting (IsADirectoryError in the index rebuild) and, at run time, put the whole
    tier in backoff; a FIFO there hung retrieve and engine start; a file where a 2-hex
    subdirectory should be put the tier in backoff. Each now costs its own entry only."""
    import os

    cfg = {"chunk_size": 16, "kv_spec": {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"},
           "tiers": [{"backend": "disk", "path": str(tmp_path / "kv"), "capacity": "8MiB"}]}
    prompts = {name: [base + i for i in range(32)] for name, base in (("a", 1000), ("b", 2000), ("c", 3000),
                                                                    ("d", 4000), ("e", 5000), ("f", 6000))}
    with lmcache.CacheEngine.from_config(cfg) as e:
        disk = e.hierarchy.tiers[0].backend.raw  # the store under the tier's object view
        for name in "abc":
            e.store(prompts[name], _kv(prompts[name]))
        e.flush()
        path = {n: [disk._path(k) for k in e.chunk_keys(p)[1]] for n, p in prompts.items()}
    # at rest: a directory in a's first entry's place, a FIFO in b's
    path["a"][0].unlink()
    path["a"][0].mkdir()
    path["b"][0].unlink()
    os.mkfifo(path["b"][0])
    e = _run_bounded(lambda: lmcache.CacheEngine.from_config(cfg), "engine start over a FIFO")
    try:
        tier = e.hierarchy.tiers[0]
        assert _run_bounded(lambda: e.lookup(prompts["a"]), "lookup") == 0
        assert e.lookup(prompts["b"]) == 0
        r = _run_bounded(lambda: e.retrieve(prompts["c"]), "retrieve")
        assert r.num_tokens == 32 and torch.equal(r.kv, _kv(prompts["c"]))
        # at run time: c's second entry becomes a FIFO, then a directory
        path["c"][1].unlink()
        os.mkfifo(path["c"][1])
        r = _run_bounded(lambda: e.retrieve(prompts["c"]), "retrieve of a FIFO")
        assert r.num_tokens == 16 and torch.equal(r.kv, _kv(prompts["c"][:16]))
        assert tier.available
        # a file where d's 2-hex subdirectory should be, a directory where e's file goes
        sub = path["d"][0].parent
        blocked = not sub.exists()  # (another entry may own that subdirectory already)
        if blocked:
            sub.write_bytes(b"in the way")
        path["e"][0].parent.mkdir(exist_ok=True)
        path["e"][0].mkdir()
        e.store(prompts["d"], _kv(prompts["d"]))
        e.store(prompts["e"], _kv(prompts["e"]))
        e.store(prompts["f"], _kv(prompts["f"]))
        e.flush()
        assert tier.available, tier.info()
        assert e.lookup(prompts["f"]) == 32  # the tier kept serving and storing
        r = e.retrieve(prompts["f"])
        assert r.num_tokens == 32 and torch.equal(r.kv, _kv(prompts["f"]))
        assert e.lookup(prompts["e"]) == 0  # its first chunk could not be written
        if blocked:
            assert e.lookup(prompts["d"]) == 0
    finally:
        e.close()


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_forged_sizes_on_disk_cost_one_miss(tmp_path, codec):
    """The outside review: a forged header with valid checksums but a smaller ``nbytes``
    was taken for an outage (the tier backed off, the entry stayed forever), and a header
    claiming a 16 GiB tensor stalled every read for seconds. Both are one corrupt entry:
    a miss, counted, and removed; the tier keeps serving the other prompts, and no read
    allocates more than a chunk."""
    cfg = {"chunk_size": 16, "kv_spec": {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"},
           "tiers": [{"backend": "disk", "path": str(tmp_path / "kv"), "capacity": "8MiB", "codec": codec}]}
    prompts = {name: [base + i for i in range(32)] for name, base in (("small", 1000), ("huge", 2000), ("ok", 3000))}
    with lmcache.CacheEngine.from_config(cfg) as e:
        disk = e.hierarchy.tiers[0].backend.raw  # the store under the tier's object view
        for p in prompts.values():
            e.store(p, _kv(p))
        e.flush()
        path = {n: disk._path(e.chunk_keys(p)[1][0]) for n, p in prompts.items()}
    # "small": the shape says 8 tokens (half the bytes) over the whole 16-token body
    hdr, body = _split(path["small"].read_bytes())
    hdr["shape"][2] //= 2
    hdr["nbytes"] //= 2
    path["small"].write_bytes(_forge(hdr, body))
    # "huge": the header claims 2**30 tokens (16 GiB) over the same small body
    hdr, body = _split(path["huge"].read_bytes())
    hdr["shape"][2] = 1 << 30
    hdr["nbytes"] = 2 * 2 * (1 << 30) * 2 * 8 * 4
    if codec == "raw":
        hdr["body_len"] = hdr["nbytes"]  # with the true (small) body: the file is too short for it
    else:  # a frame that does not state its size: a decoder would size its output by the header
        import zstandard

        body = zstandard.ZstdCompressor(write_content_size=False).compress(zstandard.ZstdDecompressor().decompress(body))
        hdr["body_len"], hdr["body_xxh3"] = len(body), xxhash.xxh3_64_intdigest(body)
    path["huge"].write_bytes(_forge(hdr, body))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    e = lmcache.CacheEngine.from_config(cfg)
    try:
        tier = e.hierarchy.tiers[0]
        for name in ("small", "huge"):
            for _ in range(3):  # again and again: one miss, then simply absent
                r = _run_bounded(lambda: e.retrieve(prompts[name]), f"retrieve of the {name} forgery")
                assert r.num_tokens == 0, name
            assert not path[name].exists(), f"the {name} forgery stayed on disk"
            assert tier.available, tier.info()
            r = e.retrieve(prompts["ok"])
            assert r.num_tokens == 32 and torch.equal(r.kv, _kv(prompts["ok"]))
        assert tier.info()["corrupt"] == 2, tier.info()
    finally:
        e.close()
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown_kib < 512 << 10, f"reads of forged entries grew the process by {grown_kib} KiB"
