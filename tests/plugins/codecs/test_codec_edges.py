"""Edge values of the lossy codecs (issue 29, item 11): float32 KV at +-FLT_MAX never makes
an entry that cannot decode, and float16 subnormals stay within the stated error bound."""

from __future__ import annotations

import pytest
import torch

import lmcache
from lmcache.codecs import decode_tensor, encode_tensor
from lmcache.config import KVSpec
from lmcache.plugin_manager import get_registries

REGS = get_registries()
FMAX = torch.finfo(torch.float32).max
LOSSY = [("int8", {}), ("int4", {}), ("int8", {"scale_dtype": "float32"}), ("int4", {"scale_dtype": "float32"}),
         ("cachegen", {}), ("fp8", {})]
FLOAT32_SCALES = [("int8", {"scale_dtype": "float32"}), ("int4", {"scale_dtype": "float32"}), ("cachegen", {})]


def roundtrip(codec, t: torch.Tensor) -> torch.Tensor:
    return decode_tensor(codec, memoryview(encode_tensor(codec, t)).cast("B"), tuple(t.shape), t.dtype)


def extremes(shape=(2, 2, 8, 2, 4)) -> torch.Tensor:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    t[0, 0, 0, 0, 0], t[0, 0, 1, 0, 0], t[0, 1, 0, 0, 0], t[0, 1, 0, 0, 1] = FMAX, -FMAX, FMAX, -FMAX
    return t


@pytest.mark.parametrize("name,options", FLOAT32_SCALES)
def test_float32_at_flt_max_is_stored_so_that_it_decodes_exactly(name, options):
    codec = REGS.codecs.load(name)(**options)
    t = extremes()
    assert torch.equal(roundtrip(codec, t), t)  # stored as it is: the float32 steps would be inf
    near = torch.randn(2, 2, 8, 2, 4, generator=torch.Generator().manual_seed(1)).clamp(-1, 1) * 2.0**125.9
    got = roundtrip(codec, near)  # just under 2**126: quantized, and it decodes within the bound
    assert not torch.equal(got, near)
    assert bool(((got - near).abs() <= codec.error_bound(near)).all())


@pytest.mark.parametrize("name,options", LOSSY)
def test_float16_subnormals_stay_within_the_stated_bound(name, options):
    codec = REGS.codecs.load(name)(**options)
    for seed in range(8):
        t = (torch.randn(2, 2, 24, 2, 8, generator=torch.Generator().manual_seed(seed)) * 2.0**-20).to(torch.float16)
        err = (roundtrip(codec, t).float() - t.float()).abs()
        over = float((err - codec.error_bound(t)).max())
        assert over <= 0, f"seed {seed}: error {over:.3g} over the stated bound"


@pytest.mark.parametrize("codec", ["int8", "cachegen"])
def test_a_disk_tier_serves_flt_max_kv_with_float32_scales(tmp_path, codec):
    """Through a real disk tier: before, such an entry was written, then every read found
    it corrupt (a miss, the ``corrupt`` counter up)."""
    toks = list(range(16))
    kv = extremes((2, 2, 16, 2, 4))
    opts = {"scale_dtype": "float32"} if codec == "int8" else {}
    disk = {"backend": "disk", "path": str(tmp_path / "disk"), "capacity": "8MiB", "codec": codec,
            "codec_options": opts}
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_size=4, dtype="float32")
    with lmcache.CacheEngine.from_config({"chunk_size": 16, "tiers": [disk]}, kv_spec=spec) as e:
        e.store(toks, kv)
        e.flush()
    with lmcache.CacheEngine.from_config({"chunk_size": 16, "tiers": [disk]}, kv_spec=spec) as e2:
        res = e2.retrieve(toks)
        assert res.num_tokens == 16 and torch.equal(res.kv, kv)
        assert e2.stats()["tiers"]["disk"]["corrupt"] == 0
