"""Re-encoding stored chunks in place: `lmcache compress` / `decompress`, offline and live."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from typer.testing import CliRunner

import lmcache
from lmcache.plugins.services.api_client import ApiClient
from lmcache.cli.main import app
from lmcache.plugin_manager import get_registries

runner = CliRunner()
L, H, D = 3, 2, 32
SPEC = {"num_layers": L, "num_kv_heads": H, "head_size": D, "dtype": "float32"}


def _kv(n, seed=0):
    return torch.randn(L, 2, n, H, D, generator=torch.Generator().manual_seed(seed))


def _config(tmp_path, **extra):
    cfg = {
        "chunk_size": 64,
        "tiers": [{"backend": "cpu", "capacity": "16MiB"}, {"backend": "disk", "path": str(tmp_path / "kv"), "capacity": "64MiB"}],
        **extra,
    }
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def _disk_only(cfg):
    return {**cfg, "tiers": [cfg["tiers"][1]]}


def _files(tmp_path):
    return sorted((tmp_path / "kv").rglob("*.lmc"))


def test_compress_then_decompress_offline(tmp_path):
    path, cfg = _config(tmp_path)
    toks, kv = list(range(300)), _kv(300)
    with lmcache.CacheEngine.from_config(cfg, kv_spec=SPEC) as e:
        e.store(toks, kv)
    raw_bytes = sum(f.stat().st_size for f in _files(tmp_path))

    dry = runner.invoke(app, ["compress", "--config", str(path), "--tier", "disk", "--codec", "int8+zstd", "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    assert len(json.loads(dry.stdout)["recoded"]) == 5
    assert sum(f.stat().st_size for f in _files(tmp_path)) == raw_bytes  # nothing changed

    res = runner.invoke(app, ["compress", "--config", str(path), "--tier", "disk", "--codec", "int8+zstd", "--yes", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["codec"] == "int8+zstd" and len(out["recoded"]) == 5 and not out["skipped"]
    small = sum(f.stat().st_size for f in _files(tmp_path))
    assert small == out["bytes_after"] and small * 3 < raw_bytes
    int8 = get_registries().codecs.load("int8")()
    with lmcache.CacheEngine.from_config(_disk_only(cfg), kv_spec=SPEC) as e:
        got = e.retrieve(toks)
        assert got.num_tokens == 300 and got.tiers == ["disk"] * 5
        assert bool(((got.kv - kv).abs() <= int8.error_bound(kv) + 1e-6).all())
        lossy = got.kv.clone()

    res = runner.invoke(app, ["decompress", "--config", str(path), "--tier", "disk", "--yes"])
    assert res.exit_code == 0, res.output
    assert "Re-encoded 5 entries of tier disk with raw" in res.stdout
    assert sum(f.stat().st_size for f in _files(tmp_path)) >= kv.numel() * 4
    with lmcache.CacheEngine.from_config(_disk_only(cfg), kv_spec=SPEC) as e:
        assert torch.equal(e.retrieve(toks).kv, lossy)  # raw again: exactly what the codec returned


def test_compress_one_key_and_lossless_chain(tmp_path):
    path, cfg = _config(tmp_path)
    toks = list(range(128))
    kv = torch.zeros(L, 2, 128, H, D)  # compresses well, losslessly
    with lmcache.CacheEngine.from_config(cfg, kv_spec=SPEC) as e:
        e.store(toks, kv)
        key = e.chunk_keys(toks)[1][0]
    res = runner.invoke(app, ["compress", "-c", str(path), "-t", "disk", "--codec", "shuffle+zstd", "--key", key, "--yes", "--json"])
    assert res.exit_code == 0, res.output
    assert [r["key"] for r in json.loads(res.stdout)["recoded"]] == [key]
    with lmcache.CacheEngine.from_config(_disk_only(cfg), kv_spec=SPEC) as e:
        assert torch.equal(e.retrieve(toks).kv, kv)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--codec", "rot13"], "rot13"),
        (["--codec", "zstd+int8"], "codec"),
    ],
)
def test_compress_errors_are_one_line(tmp_path, args, fragment):
    path, cfg = _config(tmp_path)
    with lmcache.CacheEngine.from_config(cfg, kv_spec=SPEC) as e:
        e.store(list(range(64)), _kv(64))
    res = runner.invoke(app, ["compress", "-c", str(path), "-t", "disk", "--yes", *args])
    assert res.exit_code != 0
    assert fragment in res.output and "Traceback" not in res.output


def test_compress_asks_first(tmp_path):
    path, cfg = _config(tmp_path)
    with lmcache.CacheEngine.from_config(cfg, kv_spec=SPEC) as e:
        e.store(list(range(64)), _kv(64))
    res = runner.invoke(app, ["compress", "-c", str(path), "-t", "disk", "--codec", "zstd"])
    assert res.exit_code != 0
    assert "--yes" in res.output


def test_recode_through_the_live_api(tmp_path):
    _, cfg = _config(tmp_path, api={"enabled": True, "port": 0})
    toks, kv = list(range(200)), _kv(200, seed=3)
    with lmcache.CacheEngine.from_config(cfg, kv_spec=SPEC) as e:
        e.store(toks, kv)
        e.flush()
        with ApiClient(e.api_url, timeout=10) as c:
            r = c.recode("disk", "zstd")
            assert len(r["recoded"]) == 4 and r["codec"] == "zstd"
            listed = c.keys(tier="disk")["entries"]  # the listing tells the entries' new codec
            assert len(listed) == 4 and {e["codec"] for e in listed} == {"zstd"}
            with pytest.raises(lmcache.errors.AdminError, match="in memory"):
                c.recode("cpu", "zstd")
            with pytest.raises(lmcache.errors.AdminError) as ei:
                c.recode("nope", "zstd")
            assert ei.value.status == 404
        # the cpu tier still serves exact chunks; the disk tier now holds zstd payloads
        assert torch.equal(e.retrieve(toks).kv, kv)
    with lmcache.CacheEngine.from_config(_disk_only(cfg) | {"api": {"enabled": False}}, kv_spec=SPEC) as e2:
        assert torch.equal(e2.retrieve(toks).kv, kv)
