"""The ``lmcache`` command: plugins, version, demo synthetic, bench tiers, and one-line errors.

The real-model demo and ``bench e2e`` are tested in tests/benchmarks/test_demo_e2e.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from lmcache.cli.main import app
from lmcache.errors import ConfigError

runner = CliRunner()

# A small workload: 4 MiB chunks, 52 MiB of distinct KV, a CPU tier of half of it.
SMALL = ["--layers", "4", "--prompts", "4", "--tokens", "1024", "--memcpy-size", "16MiB"]


def one_line_error(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("lmcache: error: ")
    return lines[0]


# ------------------------------------------------------------------ plugins / version


def test_plugins_json_lists_builtins():
    result = runner.invoke(app, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    names = {(r["kind"], r["name"]) for r in rows}
    for want in [("backend", "cpu"), ("backend", "disk"), ("codec", "raw"), ("codec", "zstd"), ("policy", "lru")]:
        assert want in names
    cpu = next(r for r in rows if r["name"] == "cpu")
    assert cpu["target"] == "lmcache.backends.cpu:CPUBackend"
    assert cpu["plugin"] == "lmcache.backends.builtin"
    assert cpu["distribution"] == "lmcache" and cpu["version"]
    assert cpu["hooks"] == ["lmcache_register_backends", "lmcache_register_bench_baselines",
                            "lmcache_register_store_launchers"]
    redis = next(r for r in rows if r["name"] == "redis" and r["kind"] == "baseline")  # the bench's raw client
    assert redis["plugin"] == "lmcache.backends.builtin"


def test_plugins_kind_filter_and_table():
    result = runner.invoke(app, ["plugins", "--json", "--kind", "codec"])
    assert result.exit_code == 0
    assert {r["kind"] for r in json.loads(result.stdout)} == {"codec"}
    table = runner.invoke(app, ["plugins"])
    assert table.exit_code == 0 and "disk" in table.stdout and "register_codecs" in table.stdout


def test_plugins_empty_json_is_empty_list(monkeypatch):
    from lmcache.plugin_manager import DEFAULT_PLUGINS

    monkeypatch.setenv("LMCACHE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("LMCACHE_DISABLED_PLUGINS", ",".join(DEFAULT_PLUGINS))
    result = runner.invoke(app, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "[]"


def test_version():
    from lmcache import __version__

    result = runner.invoke(app, ["version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"lmcache {__version__}"
    assert json.loads(runner.invoke(app, ["version", "--json"]).stdout)["lmcache"] == __version__


def test_console_script_entry_point_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", "plugins", "--json", "--kind", "policy"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "lru" in {r["name"] for r in json.loads(proc.stdout)}


# ------------------------------------------------------------------ errors


def test_bad_config_prints_one_line(monkeypatch):
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "abc")
    result = runner.invoke(app, ["demo", "synthetic", *SMALL])
    assert result.exit_code == 1
    line = one_line_error(result)
    assert "chunk_size" in line and "Traceback" not in result.output


def test_bad_option_value_prints_one_line():
    result = runner.invoke(app, ["demo", "synthetic", "--cpu-capacity", "lots"])
    assert result.exit_code == 2
    assert "--cpu-capacity" in one_line_error(result)


def test_unknown_option_prints_one_line():
    result = runner.invoke(app, ["bench", "tiers", "--no-such-option"])
    assert result.exit_code == 2
    assert "--no-such-option" in one_line_error(result)


def test_prefix_longer_than_prompt_is_rejected():
    result = runner.invoke(app, ["demo", "synthetic", "--tokens", "256", "--prefix", "512"])
    assert result.exit_code == 2
    assert "--prefix" in one_line_error(result)


def test_non_empty_dir_is_rejected(tmp_path):
    (tmp_path / "something").write_text("x")
    result = runner.invoke(app, ["demo", "synthetic", *SMALL, "--dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "not empty" in one_line_error(result)


def test_debug_shows_the_exception(monkeypatch):
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "abc")
    monkeypatch.setenv("LMCACHE_DEBUG", "1")
    result = runner.invoke(app, ["demo", "synthetic", *SMALL])
    assert result.exit_code != 0
    assert isinstance(result.exception, ConfigError)


# ------------------------------------------------------------------ demo and bench


def test_demo_synthetic_small_is_exact_and_survives_a_restart(tmp_path):
    kv_dir = tmp_path / "cache"
    result = runner.invoke(app, ["demo", "synthetic", *SMALL, "--dir", str(kv_dir)])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "PASS" in text and "FAIL" not in text and " NO " not in text
    # every retrieve was exact, the shared prefix was stored once, the disk tier served some
    assert "5/5 retrieves bit-exact" in text or "4/4 retrieves bit-exact" in text
    assert "stored once" in text
    assert "partly served from disk" in text and "0 of 4 prompts partly served" not in text
    assert "after restart 4/4 bit-exact with 16 disk hits" in text
    # the directory given with --dir is kept, with the chunk files in it
    assert list((kv_dir / "kv").rglob("*.lmc"))


def test_demo_synthetic_removes_its_temporary_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    result = runner.invoke(app, ["demo", "synthetic", *SMALL, "--prompts", "2", "--no-restart"])
    assert result.exit_code == 0, result.output
    assert list(tmp_path.iterdir()) == []


def test_bench_tiers_json(tmp_path):
    result = runner.invoke(
        app,
        ["bench", "tiers", "--json", "--layers", "2", "--prompts", "3", "--tokens", "512", "--memcpy-size", "8MiB",
         "--restart", "--dir", str(tmp_path / "b")],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    ph = data["physical"]
    assert ph["memcpy_gbps"] > 0 and ph["file_write_gbps"] > 0 and ph["file_read_gbps"] > 0
    assert data["machine"]["cpus"] >= 1 and data["machine"]["torch"]
    for name in ("cpu", "disk"):
        tier = data["tiers"][name]
        assert tier["store_gbps"] > 0 and tier["retrieve_gbps"] > 0, (name, tier)
        assert tier["store_ratio"] > 0 and tier["retrieve_ratio"] > 0
        assert tier["hits"] > 0
    assert data["exact"] and data["complete"]
    assert data["store"]["skipped_tokens"] == 2 * data["workload"]["prefix"]
    assert data["restart"]["exact"] and data["restart"]["disk_hits"] == 3 * 2  # 3 prompts x 2 chunks


def test_bench_tiers_table(tmp_path):
    result = runner.invoke(
        app, ["bench", "tiers", "--layers", "2", "--prompts", "2", "--tokens", "512", "--memcpy-size", "8MiB"]
    )
    assert result.exit_code == 0, result.output
    assert "memcpy" in result.stdout and "exact=True" in result.stdout


def test_bench_tiers_matrix(tmp_path):
    """--matrix: one cell per tier x shape x concurrency, each with our GB/s, the raw
    limit of the same bytes on the same threads, the ratios, and exactness; a plot."""
    png = tmp_path / "m.png"
    result = runner.invoke(
        app, ["bench", "tiers", "--matrix", "--shapes", "smollm2", "--concurrency", "1,2", "--total", "12MiB",
              "--repeats", "1", "--dir", str(tmp_path / "b"), "--json", "--plot", str(png)],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    cells = data["cells"]
    assert {(c["tier"], c["concurrency"]) for c in cells} == {
        (t, n) for t in ("cpu", "disk", "disk+odirect") for n in (1, 2)}
    for c in cells:
        assert c["shape"] == "smollm2" and c["chunk_bytes"] == 256 * 30 * 2 * 3 * 64 * 2
        assert c["exact"] and c["total_bytes"] >= c["chunk_bytes"] * 2 * c["concurrency"]
        for k in ("store_gbps", "retrieve_gbps", "raw_write_gbps", "raw_read_gbps", "store_ratio", "retrieve_ratio"):
            assert c[k] > 0, (c["tier"], k)
    assert data["exact"] and png.stat().st_size > 10_000
    assert list((tmp_path / "b").iterdir()) == []  # nothing left behind


@pytest.mark.parametrize("args, hint", [
    (["--shapes", "gpt5"], "--shapes"), (["--concurrency", "0"], "--concurrency"),
    (["--concurrency", "two"], "--concurrency"), (["--tiers", "tape"], "--tiers"), (["--total", "lots"], "--total"),
])
def test_bench_tiers_matrix_bad_options(args, hint):
    result = runner.invoke(app, ["bench", "tiers", "--matrix", *args])
    assert result.exit_code == 2 and hint in result.output, result.output


@pytest.mark.parametrize(
    "args",
    [["--help"], ["demo", "--help"], ["demo", "synthetic", "--help"], ["bench", "tiers", "--help"], ["bench", "e2e", "--help"]],
)
def test_help(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 0
    assert "Usage" in result.stdout


def _command_paths(cmd, path=()):
    """Every command and group under ``cmd`` (hidden ones and those plugged in by entry
    points too, as the group lists them), as argument paths."""
    import typer

    yield path
    if hasattr(cmd, "list_commands"):
        ctx = typer.Context(cmd)
        for name in sorted(cmd.list_commands(ctx)):
            yield from _command_paths(cmd.get_command(ctx, name), (*path, name))


def test_every_commands_help_renders():
    """Each command's --help renders (before: `lmcache controller serve --help` crashed in
    rich, which read `[/DB]` in an option's help as a closing markup tag)."""
    import typer.main

    paths = list(_command_paths(typer.main.get_command(app)))
    assert ("controller", "serve") in paths and len(paths) > 30, paths
    failed = []
    for path in paths:
        result = runner.invoke(app, [*path, "--help"], terminal_width=200)
        if result.exit_code != 0 or "Usage" not in result.stdout:
            failed.append((" ".join(path), result.exit_code, repr(result.exception)))
    print(f"rendered the help of {len(paths)} commands")
    assert not failed, failed
    # the command that crashed, as a user runs it, and LMCache's server entry point
    texts = []
    for argv in ([sys.executable, "-m", "lmcache.cli.main", "controller", "serve", "--help"],
                 [sys.executable, "-c", "from lmcache.cli.legacy_server import main; main()", "--help"]):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "250"})
        assert proc.returncode == 0 and "usage" in proc.stdout.lower(), (argv, proc.stderr[-2000:])
        texts.append(proc.stdout)
    assert "valkey://HOST:PORT[/DB]" in texts[0]  # shown as written, not read as markup


def test_demo_is_a_group_with_the_synthetic_demo_and_a_hidden_restart_check():
    text = runner.invoke(app, ["demo", "--help"]).stdout
    assert "synthetic" in text and "--questions" in text and "--doc-tokens" in text
    assert "restart-check" not in text
