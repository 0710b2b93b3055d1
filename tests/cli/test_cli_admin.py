"""The admin commands of ``lmcache``: tiers, ls, evict, pin, unpin, config show/validate,
stats, --version and shell completion.

Each runs through typer's test runner against a live engine in this process (its API on
a free loopback port) and offline on a config's disk tier; the last tests run the real
``lmcache`` command in subprocesses against an engine in another process
(tests/cli/live_instance.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _kv import wave
import yaml
from typer.testing import CliRunner

import lmcache
from lmcache.cli.main import app
from lmcache.errors import AdminError

from _missing import missing

runner = CliRunner()
HERE = Path(__file__).parent
TOKEN = "t0ken"
MODEL = "org/demo-model"


def kv_for(tokens):
    t = torch.as_tensor(list(tokens), dtype=torch.float32)
    base = torch.arange(2 * 2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 2, 8)
    return wave(base * 0.01 + t.reshape(1, 1, -1, 1, 1) * 0.37)


def prompt(i):
    return [1000 * (i + 1) + j for j in range(64)]


def config_dict(d: Path, api: bool = False) -> dict:
    cfg = {
        "chunk_size": 16,
        "model": MODEL,
        "tiers": [
            {"backend": "cpu", "capacity": "1MiB"},
            {"backend": "disk", "path": str(d / "kv"), "capacity": "4MiB"},
        ],
    }
    if api:
        cfg["api"] = {"enabled": True, "token": TOKEN, "timeout": 2}
    return cfg


def fill(e, n=3):
    for i in range(n):
        e.store(prompt(i), kv_for(prompt(i)))
    e.flush()
    e.retrieve(prompt(0))


@pytest.fixture
def live(tmp_path):
    """A live engine with the API on; yields the common options for --url."""
    e = lmcache.CacheEngine.from_config(config_dict(tmp_path, api=True))
    fill(e)
    e.url_args = ["--url", e.api_url, "--token", TOKEN]
    yield e
    e.close()


@pytest.fixture
def offline(tmp_path):
    """A config file whose disk tier holds 12 chunks (3 prompts of 4), no engine running."""
    with lmcache.CacheEngine.from_config(config_dict(tmp_path)) as e:
        fill(e)
    f = tmp_path / "lmcache.yaml"
    f.write_text(yaml.safe_dump(config_dict(tmp_path)))
    return f


def ok(args, **kw):
    result = runner.invoke(app, args, **kw)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result


def one_line_error(result, code=1) -> str:
    assert result.exit_code == code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("lmcache: error: ") and "Traceback" not in result.output
    return lines[0]


def disk_files(cfg: Path) -> list[Path]:
    return list((cfg.parent / "kv").rglob("*.lmc"))


# ------------------------------------------------------------------ tiers


def test_tiers_live(live):
    rows = json.loads(ok(["tiers", "--json", *live.url_args]).stdout)
    assert [r["name"] for r in rows] == ["cpu", "disk"]
    cpu = rows[0]
    assert cpu["backend"] == "cpu" and cpu["entries"] == 12 and cpu["hits"] == 4 and cpu["hit_rate"] == 1.0
    table = ok(["tiers", *live.url_args]).stdout
    for text in ("cpu", "disk", "48.0 KiB / 1.0 MiB", "100.0%", "evictions"):
        assert text in table


def test_tiers_offline_shows_the_disk_tier(offline):
    result = ok(["tiers", "--config", str(offline)])
    assert "disk" in result.stdout and "12" in result.stdout and "4.0 MiB" in result.stdout
    assert "tier 'cpu' is not shown" in result.stderr
    rows = json.loads(ok(["tiers", "--config", str(offline), "--json"]).stdout)
    assert [(r["name"], r["entries"]) for r in rows] == [("disk", 12)]


def test_tiers_takes_the_config_from_the_environment(offline, monkeypatch):
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(offline))
    assert json.loads(ok(["tiers", "--json"]).stdout)[0]["name"] == "disk"


def test_url_from_the_environment_unless_a_config_is_given(offline, live, monkeypatch):
    monkeypatch.setenv("LMCACHE_API_URL", live.api_url)
    monkeypatch.setenv("LMCACHE_API_TOKEN", TOKEN)
    assert [r["name"] for r in json.loads(ok(["tiers", "--json"]).stdout)] == ["cpu", "disk"]
    assert [r["name"] for r in json.loads(ok(["tiers", "--json", "--config", str(offline)]).stdout)] == ["disk"]


def test_target_errors(offline, live, tmp_path):
    line = one_line_error(runner.invoke(app, ["tiers"]))
    assert "--url" in line and "--config" in line
    one_line_error(runner.invoke(app, ["tiers", "--url", live.api_url, "--config", str(offline)]), code=2)
    line = one_line_error(runner.invoke(app, ["tiers", "--url", live.api_url, "--token", "wrong"]))
    assert "missing or wrong token" in line
    line = one_line_error(runner.invoke(app, ["tiers", "--url", live.api_url]))  # no token
    assert "missing or wrong token" in line
    line = one_line_error(runner.invoke(app, ["tiers", "--url", "localhost:1"]))
    assert "expected http://HOST:PORT" in line
    line = one_line_error(runner.invoke(app, ["tiers", "--config", str(tmp_path / "missing.yaml")]))
    assert "cannot read config file" in line


def test_unreachable_url_fails_fast(tmp_path):
    import socket

    with socket.socket() as srv:  # listens, never answers
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        t0 = time.monotonic()
        result = runner.invoke(app, ["tiers", "--url", f"http://127.0.0.1:{srv.getsockname()[1]}", "--timeout", "0.3"])
        assert time.monotonic() - t0 < 5
    assert "no answer from" in one_line_error(result) and "0.3s" in result.stderr


def test_bad_config_is_one_line_naming_key_and_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("tiers:\n  - {backend: disk, capacity: lots, path: /tmp/x}\n")
    line = one_line_error(runner.invoke(app, ["tiers", "--config", str(f)]))
    assert "tiers[0].capacity" in line and str(f) in line


def test_debug_shows_the_exception(live, monkeypatch):
    monkeypatch.setenv("LMCACHE_DEBUG", "1")
    result = runner.invoke(app, ["ls", "--tier", "ssd", *live.url_args])
    assert result.exit_code != 0 and isinstance(result.exception, AdminError)


# ------------------------------------------------------------------ ls


def test_ls_live_json_and_filters(live):
    rows = json.loads(ok(["ls", "--json", "--limit", "0", *live.url_args]).stdout)
    assert len(rows) == 24 and {r["tier"] for r in rows} == {"cpu", "disk"}
    r = rows[0]
    assert set(r) >= {"key", "tier", "size", "codec", "age_s", "pinned", "model", "namespace"}
    assert r["model"] == MODEL and r["key"].startswith("lmc1:default:org%2Fdemo-model:")
    result = ok(["ls", "--json", "--limit", "5", "--tier", "disk", *live.url_args])
    assert len(json.loads(result.stdout)) == 5 and "showing 5 of 12" in result.stderr
    assert ok(["ls", "--json", "--model", "other", *live.url_args]).stdout.strip() == "[]"
    assert len(json.loads(ok(["ls", "--json", "-l", "0", "-m", MODEL, "-n", "default", *live.url_args]).stdout)) == 24
    assert "No entries." in ok(["ls", "--model", "other", *live.url_args]).stdout


def test_ls_pages_through_the_api(live, monkeypatch):
    from lmcache.cli import ls_cmd

    monkeypatch.setattr(ls_cmd, "PAGE", 5)
    rows = json.loads(ok(["ls", "--json", "--limit", "0", *live.url_args]).stdout)
    assert len(rows) == 24 and len({(r["tier"], r["key"]) for r in rows}) == 24


def test_ls_offline_table(offline):
    result = ok(["ls", "--config", str(offline), "--limit", "0"])
    assert result.stdout.count("lmc1:default:org%2Fdemo-model:") == 12
    assert "disk" in result.stdout and "raw" in result.stdout
    line = one_line_error(runner.invoke(app, ["ls", "--config", str(offline), "--tier", "cpu"]))
    assert "it lives in a running instance's memory" in line


def test_ls_unknown_tier_live(live):
    line = one_line_error(runner.invoke(app, ["ls", "--tier", "ssd", *live.url_args]))
    assert "unknown tier 'ssd'; tiers: cpu, disk" in line


# ------------------------------------------------------------------ evict


def test_evict_all_offline_empties_the_disk_tier(offline):
    assert len(disk_files(offline)) == 12
    result = ok(["evict", "--tier", "disk", "--all", "--yes", "--config", str(offline)])
    assert "Evicted 12 entries" in result.stdout
    assert disk_files(offline) == []
    assert json.loads(ok(["tiers", "--json", "--config", str(offline)]).stdout)[0]["entries"] == 0


def test_evict_dry_run_changes_nothing(offline):
    result = ok(["evict", "--tier", "disk", "--bytes", "9KiB", "--dry-run", "--config", str(offline)])
    assert "Would evict 3 entries" in result.stdout  # 3 files of ~4.2 KiB cover 9 KiB
    data = json.loads(ok(["evict", "--tier", "disk", "--all", "--dry-run", "--json", "--config", str(offline)]).stdout)
    assert data["dry_run"] and len(data["evicted"]) == 12
    assert len(disk_files(offline)) == 12


def test_evict_without_a_terminal_refuses_unless_yes(offline):
    result = runner.invoke(app, ["evict", "--tier", "disk", "--all", "--config", str(offline)])
    line = one_line_error(result)
    assert "refusing to evict 12 entries" in line and "--yes" in line
    assert len(disk_files(offline)) == 12


def test_evict_asks_on_a_terminal(offline, monkeypatch):
    from lmcache.cli import _util

    monkeypatch.setattr(_util, "stdin_is_tty", lambda: True)
    no = runner.invoke(app, ["evict", "--tier", "disk", "--older-than", "0s", "--config", str(offline)], input="n\n")
    assert no.exit_code == 1 and "aborted" in no.stderr and len(disk_files(offline)) == 12
    assert "Evict 12 entries (" in no.stderr  # the question goes to stderr
    yes = runner.invoke(app, ["evict", "--tier", "disk", "--older-than", "0s", "--config", str(offline)], input="y\n")
    assert yes.exit_code == 0 and disk_files(offline) == []


def test_evict_by_age_and_key_live(live):
    out = ok(["evict", "--older-than", "1h", "--yes", *live.url_args]).stdout
    assert "Nothing to evict." in out
    rows = json.loads(ok(["ls", "--json", "--tier", "disk", "--limit", "2", *live.url_args]).stdout)
    keys = [r["key"] for r in rows]
    data = json.loads(ok(["evict", "--key", keys[0], "-k", keys[1], "--tier", "disk", "--yes", "--json",
                          *live.url_args]).stdout)
    assert sorted(e["key"] for e in data["evicted"]) == sorted(keys) and data["bytes"] > 8192
    assert live.stats()["tiers"]["disk"]["entries"] == 10 and live.stats()["tiers"]["disk"]["evictions"] == 2
    result = ok(["evict", "--key", keys[0], "--tier", "disk", "--yes", *live.url_args])
    assert "Nothing to evict." in result.stdout and "not in tier 'disk'" in result.stderr
    assert "from tier cpu" in ok(["evict", "--key", keys[0], "--yes", *live.url_args]).stdout
    result = ok(["evict", "--key", keys[0], "--yes", *live.url_args])
    assert "Nothing to evict." in result.stdout and "not in any tier" in result.stderr


def test_evict_bytes_needs_a_tier_when_there_are_several(live):
    line = one_line_error(runner.invoke(app, ["evict", "--bytes", "8KiB", "--yes", *live.url_args]))
    assert "bytes needs a tier" in line


@pytest.mark.parametrize(
    "args,fragment",
    [
        ([], "say what to evict"),
        (["--all", "--bytes", "1MiB"], "--all cannot be combined"),
        (["--key", "lmc1:x"], "not an lmcache key"),
        (["--bytes", "lots"], "cannot read 'lots' as a size"),
        (["--older-than", "soon"], "cannot read 'soon' as a duration"),
        (["--key", "k", "--all"], "--key cannot be combined"),
    ],
)
def test_evict_usage_errors(offline, args, fragment):
    line = one_line_error(runner.invoke(app, ["evict", *args, "--config", str(offline)]), code=2)
    assert fragment in line


# ------------------------------------------------------------------ pin / unpin


def test_pin_and_unpin_live(live):
    key = json.loads(ok(["ls", "--json", "--tier", "disk", "--limit", "1", *live.url_args]).stdout)[0]["key"]
    assert f"pinned {key} in cpu, disk" in ok(["pin", key, *live.url_args]).stdout
    rows = json.loads(ok(["ls", "--json", "--limit", "0", *live.url_args]).stdout)
    assert sum(r["pinned"] for r in rows) == 2
    result = ok(["evict", "--tier", "disk", "--all", "--yes", *live.url_args])
    assert "Evicted 11 entries" in result.stdout and "skipped 1: 1 pinned" in result.stderr
    assert json.loads(ok(["unpin", key, "--json", *live.url_args]).stdout) == [{"key": key, "unpinned": ["cpu", "disk"]}]
    assert "was not pinned" in ok(["unpin", key, *live.url_args]).stderr
    missing = lmcache.CacheKey("default", MODEL, "x", "0" * 32).to_string()
    assert "not in any tier" in one_line_error(runner.invoke(app, ["pin", missing, *live.url_args]))


def test_pin_needs_a_live_instance(offline):
    key = lmcache.CacheKey("default", MODEL, "x", "0" * 32).to_string()
    line = one_line_error(runner.invoke(app, ["pin", key, "--config", str(offline)]))
    assert "pin needs a running instance" in line and "--url" in line
    one_line_error(runner.invoke(app, ["unpin", "garbage", "--url", "http://127.0.0.1:1"]), code=2)


# ------------------------------------------------------------------ config


def test_config_show_names_the_source_of_each_value(offline, monkeypatch):
    monkeypatch.setenv("LMCACHE_WRITE_QUEUE_SIZE", "64")
    data = json.loads(ok(["config", "show", "--config", str(offline), "--json"]).stdout)
    assert data["file"] == str(offline)
    assert data["values"]["write_queue_size"] == 64 and data["values"]["chunk_size"] == 16
    assert data["sources"]["write_queue_size"] == "env:LMCACHE_WRITE_QUEUE_SIZE"
    assert data["sources"]["chunk_size"] == f"file:{offline}"
    assert data["sources"]["staging_size"] == "default"
    table = ok(["config", "show", "--config", str(offline)]).stdout
    assert f"config file: {offline}" in table
    rows = {line.split("│")[1].strip(): line.split("│")[3].strip() for line in table.splitlines() if line.count("│") == 4}
    assert rows["write_queue_size"] == "env (LMCACHE_WRITE_QUEUE_SIZE)"
    assert rows["chunk_size"] == "file" and rows["staging_size"] == "default" and rows["tiers[1]"] == "file"
    assert "tiers[1]" in table and "4.0 MiB" in table


def test_config_show_without_a_file_shows_defaults(monkeypatch):
    result = ok(["config", "show", "--json"])
    data = json.loads(result.stdout)
    assert data["file"] is None and set(data["sources"].values()) == {"default"}
    assert "no config file" in result.stderr


def test_config_show_live_masks_the_token(live):
    data = json.loads(ok(["config", "show", "--json", *live.url_args]).stdout)
    assert data["values"]["api"]["token"] == "***" and data["sources"]["api.token"] == "mapping"
    assert TOKEN not in ok(["config", "show", *live.url_args]).stdout


def test_config_validate(offline, tmp_path):
    result = ok(["config", "validate", str(offline)])
    assert "valid" in result.stdout and "disk (disk, 4.0 MiB)" in result.stdout
    data = json.loads(ok(["config", "validate", str(offline), "--json"]).stdout)
    assert data["valid"] and [t["persistent"] for t in data["tiers"]] == [False, True]
    assert data["tiers"][1]["class"] == "lmcache.backends.disk:DiskBackend"
    bad = tmp_path / "bad.yaml"
    for text, key in [
        ("chunk_sise: 3\n", "chunk_sise"),
        ("tiers: [{backend: disk, capacity: 1GiB, path: /tmp/x, colour: red}]\n", "tiers[0].colour"),
        ("tiers: [{backend: disk, capacity: 1GiB}]\n", "tiers[0].path"),
        ("tiers: [{backend: floppy, capacity: 1GiB}]\n", "tiers[0].backend"),
        ("tiers: [{backend: cpu, capacity: 1GiB, codec: zstd, codec_options: {level: 99}}]\n", "tiers[0].codec_options"),
        ("api: {enabled: maybe}\n", "api.enabled"),
    ]:
        bad.write_text(text)
        line = one_line_error(runner.invoke(app, ["config", "validate", str(bad)]))
        assert f"'{key}'" in line and str(bad) in line, line


def test_config_validate_creates_nothing(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(f"tiers: [{{backend: disk, capacity: 1GiB, path: {tmp_path / 'not-yet'}}}]\n")
    ok(["config", "validate", str(f)])
    assert not (tmp_path / "not-yet").exists()


# ------------------------------------------------------------------ stats


def test_stats_live(live):
    data = json.loads(ok(["stats", "--json", *live.url_args]).stdout)
    assert data["live"] and data["tiers"]["cpu"]["hits"] == 4 and data["pool"]["used"] > 0
    table = ok(["stats", *live.url_args]).stdout
    assert "bytes out" in table and "memory pool" in table and "write queue" in table


def test_stats_watch_is_bounded(live):
    result = ok(["stats", "--watch", "0.05", "--count", "3", "--json", *live.url_args])
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3 and all("time" in json.loads(x) for x in lines)
    table = ok(["stats", "--watch", "0.05", "--count", "2", *live.url_args]).stdout
    assert table.count("memory pool") == 2 and "hits/s" in table
    one_line_error(runner.invoke(app, ["stats", "--count", "2", *live.url_args]), code=2)


def test_stats_offline(offline):
    data = json.loads(ok(["stats", "--json", "--config", str(offline)]).stdout)
    assert data["live"] is False and data["tiers"]["disk"]["entries"] == 12 and data["pool"] is None


# ------------------------------------------------------------------ root


def test_version_option():
    assert ok(["--version"]).stdout.strip() == f"lmcache {lmcache.__version__}"
    assert ok(["-V"]).stdout.strip() == f"lmcache {lmcache.__version__}"


@pytest.mark.parametrize(
    "args",
    [["tiers", "--help"], ["ls", "--help"], ["evict", "--help"], ["pin", "--help"], ["unpin", "--help"],
     ["stats", "--help"], ["config", "--help"], ["config", "show", "--help"], ["config", "validate", "--help"]],
)
def test_help(args):
    assert "Usage" in ok(args).stdout


def test_plugins_table_shows_type_package_version_hooks():
    text = ok(["plugins"]).stdout
    for col in ("type", "name", "package", "version", "hooks"):
        assert col in text
    assert "lmcache.backends.disk:DiskBackend" in text and lmcache.__version__ in text


def _lmcache_exe() -> str:
    exe = Path(sys.executable).parent / "lmcache"
    if not exe.exists():  # pragma: no cover - not installed as a script
        msg = f"the lmcache console script is not installed at {exe} (make test installs it)"
        missing(msg)
    return str(exe)


def test_shell_completion_completes_commands():
    env = {**os.environ, "_LMCACHE_COMPLETE": "complete_bash", "COMP_WORDS": "lmcache ti", "COMP_CWORD": "1"}
    proc = subprocess.run([_lmcache_exe()], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split() == ["tiers"]
    env.update(COMP_WORDS="lmcache config ", COMP_CWORD="2")
    proc = subprocess.run([_lmcache_exe()], env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["show", "validate", "convert"]
    assert "--install-completion" in ok(["--help"]).stdout


# ------------------------------------------------------------------ a real instance in another process


@pytest.fixture(scope="module")
def instance(tmp_path_factory):
    d = tmp_path_factory.mktemp("instance")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "live_instance.py"), "--dir", str(d), "--token", TOKEN],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        line = proc.stdout.readline()
        if not line.startswith("URL "):
            proc.kill()
            pytest.fail(f"live instance did not start: {line!r} {proc.stderr.read()}")
        yield proc, line.split()[1], d
    finally:
        if proc.poll() is None:
            proc.stdin.close()  # it stops when its stdin closes
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover
                proc.kill()


def cli(*args, timeout=60):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    return subprocess.run([_lmcache_exe(), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_subprocess_against_a_live_instance(instance):
    _, url, d = instance
    auth = ["--url", url, "--token", TOKEN]
    p = cli("tiers", "--json", *auth)
    assert p.returncode == 0, p.stderr
    tiers = {t["name"]: t for t in json.loads(p.stdout)}
    assert tiers["cpu"]["entries"] == 10 and tiers["disk"]["entries"] == 10  # 3 prompts share one chunk
    assert tiers["cpu"]["hits"] == 8
    p = cli("ls", "--json", "--tier", "disk", "--limit", "0", *auth)
    keys = [r["key"] for r in json.loads(p.stdout)]
    assert len(keys) == 10 and all(k.startswith("lmc1:default:org%2Fdemo-model:") for k in keys)
    p = cli("pin", keys[0], *auth)
    assert p.returncode == 0 and "pinned" in p.stdout
    p = cli("evict", "--tier", "disk", "--all", "--yes", "--json", *auth)
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["evicted"]) == 9 and "1 pinned" in p.stderr
    p = cli("stats", "--json", *auth)
    assert json.loads(p.stdout)["tiers"]["disk"]["evictions"] == 9
    assert len(list((d / "kv").rglob("*.lmc"))) == 1
    p = cli("config", "show", "--json", *auth)
    assert json.loads(p.stdout)["values"]["api"]["token"] == "***"


def test_subprocess_error_paths(instance):
    _, url, _ = instance
    p = cli("tiers", "--url", url, "--token", "wrong")
    assert p.returncode == 1 and p.stderr.startswith("lmcache: error: ") and "missing or wrong token" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and p.stdout == ""
    p = cli("ls", "--tier", "ssd", "--url", url, "--token", TOKEN)
    assert p.returncode == 1 and "unknown tier 'ssd'" in p.stderr
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    p = cli("tiers", "--url", f"http://127.0.0.1:{port}", "--timeout", "0.5")
    assert p.returncode == 1 and "cannot reach" in p.stderr and time.monotonic() - t0 < 30
    p = cli("evict", "--tier", "cpu", "--all", "--url", url, "--token", TOKEN)  # stdin is not a terminal
    assert p.returncode == 1 and "refusing to" in p.stderr and "--yes" in p.stderr


def test_subprocess_offline_after_the_instance_stops(instance):
    proc, _, d = instance
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    cfg = str(d / "lmcache.yaml")
    p = cli("tiers", "--config", cfg, "--json")
    assert p.returncode == 0, p.stderr
    assert [(t["name"], t["entries"]) for t in json.loads(p.stdout)] == [("disk", 1)]
    p = cli("evict", "--tier", "disk", "--all", "--yes", "--config", cfg)
    assert p.returncode == 0 and "Evicted 1 entry" in p.stdout
    assert json.loads(cli("ls", "--json", "--config", cfg).stdout) == []


def test_tiers_on_a_config_whose_remote_store_is_down_says_so(tmp_path):
    from lmcache.testing.stores import free_port

    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(yaml.safe_dump({"tiers": [
        {"backend": "disk", "path": str(tmp_path / "d"), "capacity": "1GiB"},
        {"backend": "redis", "url": f"redis://127.0.0.1:{free_port()}/0", "capacity": "1GiB", "timeout": 0.3},
    ]}))
    r = runner.invoke(app, ["tiers", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    assert "tier redis: unreachable" in r.stdout and "Connection refused" in r.stdout.replace("\n", "")
    r = runner.invoke(app, ["tiers", "--config", str(cfg), "--json"])
    rows = {t["name"]: t for t in json.loads(r.stdout)}
    assert rows["redis"]["available"] is False and rows["disk"]["available"] is True
