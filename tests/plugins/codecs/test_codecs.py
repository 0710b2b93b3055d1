"""Codec chains, the shuffle and quantizing codecs, and their use through tiers."""

from __future__ import annotations

import pytest
import torch
import yaml

import lmcache
from lmcache import payload
from lmcache.codecs import decode_tensor, encode_tensor, load_codec
from lmcache.config import KVSpec, load_config
from lmcache.errors import ConfigError
from lmcache.memory import MemoryPool
from lmcache.plugin_manager import get_registries
from lmcache.encoded import open_objects
from lmcache.storage import BackendContext
from lmcache.testing import make_key

REGS = get_registries()
L, H, D = 3, 2, 16


def kv_for(tokens, dtype=torch.float32):
    t = torch.as_tensor(list(tokens), dtype=torch.float64)
    base = torch.arange(L * 2 * H * D, dtype=torch.float64).reshape(L, 2, 1, H, D)
    return (torch.sin(base * 0.01 + t.reshape(1, 1, -1, 1, 1) * 0.37) * (1 + base % 7)).to(dtype)


def test_chain_spellings_in_config():
    for spec in (["int8", "zstd"], "int8+zstd"):
        cfg = load_config({"tiers": [{"backend": "disk", "path": "/tmp/x", "capacity": "1MiB", "codec": spec}]})
        assert cfg.tiers[0].codec == "int8+zstd"
    f = "tiers:\n  - {backend: disk, path: /tmp/x, capacity: 1MiB, codec: [shuffle, zstd]}\n"
    assert load_config(yaml.safe_load(f)).tiers[0].codec == "shuffle+zstd"


@pytest.mark.parametrize(
    "codec,options,key,fragment",
    [
        ([], None, "tiers[0].codec", "empty list"),
        (["int8", 3], None, "tiers[0].codec[1]", "expected"),
        (["int8", "rot13"], None, "tiers[0].codec", "unknown codec 'rot13'"),
        (["zstd", "int8"], None, "tiers[0].codec", "must be the first codec"),
        (["shuffle", "int4"], None, "tiers[0].codec", "must be the first codec"),
        (["int8", "zstd"], {"lz4": {}}, "tiers[0].codec_options", "not in the chain"),
        (["int8", "zstd"], {"zstd": {"level": 99}}, "tiers[0].codec_options", "zstd level"),
        (["int8", "zstd"], {"int8": {"group_size": 0}}, "tiers[0].codec_options", "group_size"),
        (["int8", "zstd"], {"zstd": 3}, "tiers[0].codec_options", "mapping"),
        ("int4", {"bits": 3}, "tiers[0].codec_options", "bits"),
    ],
)
def test_bad_chains_name_the_key(tmp_path, codec, options, key, fragment):
    tier = {"backend": "disk", "path": str(tmp_path / "d"), "capacity": "1MiB", "codec": codec}
    if options is not None:
        tier["codec_options"] = options
    with pytest.raises(ConfigError) as ei:
        lmcache.CacheEngine.from_config({"tiers": [tier]})
    assert ei.value.key == key, str(ei.value)
    assert fragment in str(ei.value)


def test_chain_is_lossless_only_if_every_stage_is():
    assert load_codec(REGS.codecs.load, "shuffle+zstd").lossless
    assert not load_codec(REGS.codecs.load, "int8+zstd").lossless
    assert not any(REGS.codecs.load(n).lossless for n in ("int8", "int4", "fp8"))


def test_shuffle_helps_zstd_on_bf16_kv():
    kv = kv_for(range(256), torch.bfloat16)
    raw = kv.numel() * kv.element_size()
    obj = MemoryPool.allocate_unpooled(kv.shape, kv.dtype)
    obj.tensor.copy_(kv)
    plain = sum(len(b) for b in payload.encode("k", obj, load_codec(REGS.codecs.load, "zstd")))
    shuffled = sum(len(b) for b in payload.encode("k", obj, load_codec(REGS.codecs.load, "shuffle+zstd")))
    assert shuffled < plain < raw + 200


def _ctx(tmp_path, codec):
    return BackendContext.standalone({"path": str(tmp_path)}, codec=load_codec(REGS.codecs.load, codec))


@pytest.mark.parametrize("writer", ["raw", "zstd", "shuffle+zstd", "int8+zstd", "int4"])
def test_payload_header_records_the_chain_and_any_reader_decodes_it(tmp_path, writer):
    kv = kv_for(range(16))
    obj = MemoryPool.allocate_unpooled(kv.shape, kv.dtype)
    obj.tensor.copy_(kv)
    disk = REGS.backends.load("disk")
    w = open_objects(disk(_ctx(tmp_path, writer)))
    w.put([(make_key(1), obj)])
    w.close()
    r = open_objects(disk(_ctx(tmp_path, "raw")))  # a reader whose own tier codec is another one
    assert [info.codec for info in r.entries()] == [writer]
    got = r.get([make_key(1)])[0]
    assert got is not None
    if load_codec(REGS.codecs.load, writer).lossless:
        assert torch.equal(got.tensor, kv)
    else:
        bound = load_codec(REGS.codecs.load, writer).error_bound(kv)
        assert bool(((got.tensor - kv).abs() <= bound).all())
    r.close()


def _lookup(name):
    return load_codec(REGS.codecs.load, name)


def _with_codec_name(bufs, name):
    """The payload ``bufs`` with its header's codec renamed (checksums made to match)."""
    import json
    import struct

    import xxhash

    h = json.loads(bytes(bufs[0][payload.PREFIX_SIZE :]))
    h["codec"] = name
    hb = json.dumps(h, separators=(",", ":")).encode()
    prefix = struct.pack("<4sHIQ", payload.MAGIC, payload.VERSION, len(hb), xxhash.xxh3_64_intdigest(hb))
    return prefix + hb + bytes(bufs[1])


def test_a_payload_that_is_not_what_its_chain_says_is_rejected():
    kv = kv_for(range(16))
    obj = MemoryPool.allocate_unpooled(kv.shape, kv.dtype)
    obj.tensor.copy_(kv)
    good = payload.encode(make_key(1), obj, _lookup("int8+zstd"))
    assert payload.parse_header(good[0]).codec == "int8+zstd"
    assert payload.decode(b"".join(bytes(b) for b in good), make_key(1), _lookup, MemoryPool.allocate_unpooled).shape == kv.shape
    # checksums match, but the body was written by another chain
    for writer, claimed in [("int4+zstd", "int8+zstd"), ("zstd", "int8+zstd"), ("int8+zstd", "int8"), ("int8", "shuffle")]:
        data = _with_codec_name(payload.encode(make_key(1), obj, _lookup(writer)), claimed)
        with pytest.raises(lmcache.errors.CorruptPayloadError):
            payload.decode(data, make_key(1), _lookup, MemoryPool.allocate_unpooled)


@pytest.mark.parametrize("chain", [["int8", "zstd"], ["int4", "zstd"], ["fp8", "zstd"]])
def test_quantized_disk_tier_through_the_cache_engine(tmp_path, chain):
    toks = list(range(100))
    kv = kv_for(toks)
    spec = {"num_layers": L, "num_kv_heads": H, "head_size": D, "dtype": "float32"}
    disk = {"backend": "disk", "path": str(tmp_path / "disk"), "capacity": "8MiB", "codec": chain,
            "codec_options": {chain[0]: {"group_size": 8}}}
    cfg = {"chunk_size": 16, "save_unfull_chunk": True, "tiers": [{"backend": "cpu", "capacity": "4MiB"}, disk]}
    with lmcache.CacheEngine.from_config(cfg, kv_spec=KVSpec(**spec)) as e:
        e.store(toks, kv)
        assert torch.equal(e.retrieve(toks).kv, kv)  # the cpu tier holds it exactly
    with lmcache.CacheEngine.from_config({"chunk_size": 16, "save_unfull_chunk": True, "tiers": [disk]},
                                         kv_spec=KVSpec(**spec)) as e2:
        res = e2.retrieve(toks)
        n = res.num_tokens
        assert n >= 96 and res.tiers == ["disk"] * len(res.tiers)
        got = res.kv
        assert not torch.equal(got, kv[:, :, :n])  # it was quantized ...
        codec = REGS.codecs.load(chain[0])(group_size=8)
        for s in range(0, n, 16):  # ... within the documented bound of each chunk
            ref = kv[:, :, s : min(s + 16, n)]
            err = (got[:, :, s : s + ref.shape[2]] - ref).abs()
            assert bool((err <= codec.error_bound(ref)).all())
        if chain[0] == "fp8":
            assert float((got - kv[:, :, :n]).abs().max()) <= float(kv.abs().max()) / 16
        else:
            step = (kv.amax() - kv.amin()) / (255 if chain[0] == "int8" else 15)
            assert float((got - kv[:, :, :n]).abs().max()) <= float(step)


def test_quantizer_edge_values_stay_within_bounds():
    g = torch.Generator().manual_seed(5)
    cases = [
        torch.randn(2, 2, 64, 2, 8, generator=g) * 1e-6 + 1234.5,  # tiny range far from zero
        torch.randn(2, 2, 64, 2, 8, generator=g) * 1e4,  # wide range
        torch.randn(2, 2, 64, 2, 8, generator=g) * 1e-30,  # float16 would underflow
        torch.randn(2, 2, 64, 2, 8, generator=g).sign() * 29999.0,
    ]
    codecs = [REGS.codecs.load(n)(scale_dtype=sdt) for n in ("int8", "int4") for sdt in ("float16", "float32")]
    for codec in codecs + [REGS.codecs.load("fp8")()]:
        for t in cases:
            dec = decode_tensor(codec, memoryview(encode_tensor(codec, t)), tuple(t.shape), t.dtype)
            assert bool(((dec - t).abs() <= codec.error_bound(t)).all()), codec


def test_float16_scales_fall_back_to_exact_storage_for_huge_values():
    t = torch.randn(2, 2, 16, 2, 8) * 1e5
    for sdt, exact in (("float16", True), ("float32", False)):
        codec = REGS.codecs.load("int8")(scale_dtype=sdt)
        dec = decode_tensor(codec, memoryview(encode_tensor(codec, t)), tuple(t.shape), t.dtype)
        assert torch.equal(dec, t) == exact


def test_quantizer_options_are_validated():
    with pytest.raises(ValueError, match="scale_dtype"):
        REGS.codecs.load("int8")(scale_dtype="bfloat16")
    with pytest.raises(ValueError, match="group_size"):
        REGS.codecs.load("int4")(group_size=0)


def test_payloads_decode_whatever_the_reader_options():
    """Group size and scale dtype travel in the payload: a default-built codec reads them."""
    t = kv_for(range(40))
    writer = REGS.codecs.load("int4")(group_size=8, scale_dtype="float32")
    dec = decode_tensor(REGS.codecs.load("int4")(), memoryview(encode_tensor(writer, t)), tuple(t.shape), t.dtype)
    assert bool(((dec - t).abs() <= writer.error_bound(t)).all())


def test_cachegen_disk_tier_through_the_cache_engine(tmp_path):
    """The CacheGen-style codec (quantize, token deltas, zstd) as a tier's whole codec."""
    toks = list(range(100))
    kv = kv_for(toks)
    spec = KVSpec(num_layers=L, num_kv_heads=H, head_size=D, dtype="float32")
    disk = {"backend": "disk", "path": str(tmp_path / "disk"), "capacity": "8MiB", "codec": "cachegen",
            "codec_options": {"group_size": 8}}
    with lmcache.CacheEngine.from_config({"chunk_size": 16, "tiers": [disk]}, kv_spec=spec) as e:
        e.store(toks, kv)
    with lmcache.CacheEngine.from_config({"chunk_size": 16, "tiers": [disk]}, kv_spec=spec) as e2:
        res = e2.retrieve(toks)
        assert res.num_tokens == 100 and set(res.tiers) == {"disk"}
        codec = REGS.codecs.load("cachegen")(group_size=8)
        for s in range(0, 100, 16):
            ref = kv[:, :, s : s + 16]
            err = (res.kv[:, :, s : s + ref.shape[2]] - ref).abs()
            assert bool((err <= codec.error_bound(ref)).all())
