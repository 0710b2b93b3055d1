"""A small ``lmcache bench codecs`` run on the real model (the full one is in docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lmcache.benchmarks import codecs as bench_codecs
from lmcache.cli.main import app

pytestmark = pytest.mark.slow


def test_bench_codecs_small_run(smollm2):
    model, tok = smollm2
    data = bench_codecs.run(
        ["shuffle+zstd", "int8+zstd", "int4", "zstd@bf16", "int8/g16"], text=bench_codecs.DEFAULT_TEXT, tokens=80, chunk_size=32,
        prompts=5, gen_prompts=1, gen_tokens=4, repeats=1, group_size=None, model=model, tokenizer=tok,
    )
    rows = {r["row"]: r for r in data["rows"]}
    assert data["tokens"] == 80 and data["prompts"] == 5 and data["kv_shape"][1] == 2
    lossless = rows["shuffle+zstd"]
    assert lossless["lossless"] and lossless["k_max_err"] == 0 and lossless["top1"] == 1.0 and lossless["ratio"] > 1
    for name in ("int8+zstd", "int4"):
        r = rows[name]
        assert not r["lossless"] and 0 < r["k_max_err"] and 0 < r["v_mean_err"] <= r["v_max_err"]
        assert 0 <= r["top1"] <= 1 and 0 <= r["greedy"] <= 1
        assert r["encode_gbps"] > 0 and r["decode_gbps"] > 0
    assert rows["int4"]["ratio"] > rows["int8+zstd"]["ratio"] > 3  # float32 KV
    assert rows["int4"]["k_max_err"] > rows["int8+zstd"]["k_max_err"]
    assert rows["zstd@bf16"]["dtype"] == "bfloat16" and rows["zstd@bf16"]["top1"] is not None


def test_bench_codecs_cli_json_and_errors(smollm2, tmp_path):
    png = tmp_path / "codecs.png"
    r = CliRunner().invoke(app, ["bench", "codecs", "--codec", "int8+zstd", "--codec", "cachegen", "--tokens", "40",
                                 "--chunk-size", "16", "--prompts", "3", "--gen-prompts", "0", "--repeats", "1",
                                 "--json", "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(r.stdout)
    assert [row["codec"] for row in data["rows"]] == ["int8+zstd", "cachegen"] and data["gen_prompts"] == 0
    bad = CliRunner().invoke(app, ["bench", "codecs", "--codec", "zstd+int8", "--tokens", "8"])
    assert bad.exit_code != 0 and "must be the first codec" in bad.output
