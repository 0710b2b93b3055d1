"""Issue 47: a retrieve into ``out`` reads a disk tier's hits straight into ``out`` (one
copy, checked there), and promotes them into the CPU tier afterwards, off the request.
Real files in a temporary directory; the engine reopened on them as after a restart."""

from __future__ import annotations

import time

import pytest
import torch

from lmcache.config import KVSpec, load_config
from lmcache.engine import CacheEngine

L, H, D, CS, K = 4, 2, 16, 16, 6
N = CS * K
GUARD = 30.0


def _engine(path, dtype="float32", codec=None, tiers=("cpu", "disk")) -> CacheEngine:
    ts = []
    if "cpu" in tiers:
        ts.append({"backend": "cpu", "capacity": 64 << 20})
    disk = {"backend": "disk", "capacity": 64 << 20, "path": str(path)}
    if codec:
        disk["codec"] = codec
    ts.append(disk)
    cfg = load_config(None, chunk_size=CS, write_policy="write-through", tiers=ts, memory_pool_size=64 << 20)
    return CacheEngine(cfg, kv_spec=KVSpec(num_layers=L, num_kv_heads=H, head_size=D, dtype=dtype))


def _kv(dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn((L, 2, N, H, D), generator=g).to(dtype)


def _stored(path, dtype="float32", codec=None) -> tuple[list[int], torch.Tensor]:
    toks = list(range(1000, 1000 + N))
    kv = _kv(getattr(torch, dtype))
    with _engine(path, dtype, codec) as e:
        assert e.store(toks, kv).stored_tokens == N
        e.flush()
    return toks, kv


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype != b.dtype else a, b)


def _until(cond, what: str) -> None:
    end = time.monotonic() + GUARD
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_restart_hit_lands_in_out_in_one_copy_and_is_promoted_after(tmp_path, dtype):
    toks, kv = _stored(tmp_path / "d", dtype)
    with _engine(tmp_path / "d", dtype) as e:
        cpu, disk = e.hierarchy.tiers
        out = torch.zeros_like(kv)
        r = e.retrieve(toks, out=out)
        assert r.num_tokens == N and torch.equal(out, kv)
        assert disk.backend.direct_reads == K and disk.stats.hits == K  # every chunk read into out
        assert disk.stats.get_seconds > 0 and disk.stats.hit_bytes == kv.numel() * kv.element_size()  # bench tiers' figures
        _until(lambda: len(list(cpu.keys())) == K, "the direct reads promoted into the cpu tier")
        out.zero_()
        assert e.retrieve(toks, out=out).num_tokens == N and torch.equal(out, kv)
        assert disk.backend.direct_reads == K  # the second one came from the cpu tier


def test_a_damaged_file_is_a_miss_from_its_chunk_on_and_removed(tmp_path):
    toks, kv = _stored(tmp_path / "d")
    files = sorted((tmp_path / "d").rglob("*.lmc"), key=lambda f: f.stat().st_mtime_ns)
    assert len(files) == K
    with _engine(tmp_path / "d", tiers=("disk",)) as e:
        keys = e.chunk_keys(toks)[1]
        disk = e.hierarchy.tiers[0]
        # damage chunk 3's body (its file named by its key)
        victim = disk.backend.raw._path(keys[3])
        data = bytearray(victim.read_bytes())
        data[-100] ^= 0xFF
        victim.write_bytes(bytes(data))
        out = torch.zeros_like(kv)
        r = e.retrieve(toks, out=out)
        assert r.num_tokens == 3 * CS and torch.equal(out[:, :, : 3 * CS], kv[:, :, : 3 * CS])
        assert not victim.exists() and not disk.exists([keys[3]])[0]
        assert disk.backend.direct_reads == K - 1  # every other chunk went straight into out


def test_what_cannot_be_read_into_out_is_read_as_before(tmp_path):
    """An ``out`` of another layout (heads and head size transposed), no ``out`` at all,
    and entries of another codec: the same bytes, through pool memory."""
    toks, kv = _stored(tmp_path / "d")
    with _engine(tmp_path / "d", tiers=("disk",)) as e:
        disk = e.hierarchy.tiers[0]
        odd = torch.zeros((L, 2, N, D, H)).transpose(3, 4)  # not contiguous in its last dims
        assert e.retrieve(toks, out=odd).num_tokens == N and torch.equal(odd, kv)
        assert torch.equal(e.retrieve(toks).kv, kv)
        assert disk.backend.direct_reads == 0
    toks, kv = _stored(tmp_path / "z", codec="zstd")
    with _engine(tmp_path / "z", codec="zstd", tiers=("disk",)) as e:
        out = torch.zeros_like(kv)
        assert e.retrieve(toks, out=out).num_tokens == N and torch.equal(out, kv)
        assert e.hierarchy.tiers[0].backend.direct_reads == 0
