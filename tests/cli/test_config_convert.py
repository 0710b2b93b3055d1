"""``lmcache config convert`` and ``lmcache config show`` with LMCache's vocabulary."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from lmcache import upstream
from lmcache.cli.main import app
from lmcache.config import load_config

runner = CliRunner()

UPSTREAM = """\
chunk_size: 256
local_cpu: True
max_local_cpu_size: 1.5
local_disk: "file://{disk}/"
max_local_disk_size: 2
remote_url: "lm://localhost:65432"
remote_serde: "cachegen"
use_layerwise: true
enable_controller: true
controller_pull_url: "localhost:8300"
controller_reply_url: "localhost:8400"
lmcache_instance_id: pod-1
nixl_enable_gc: True
extra_config: {{use_odirect: false, lookup_backoff_time: 0.001}}
"""


def _same(a, b) -> None:
    assert [(t.backend, t.name, t.capacity, t.codec, t.policy, t.options) for t in a.tiers] == \
        [(t.backend, t.name, t.capacity, t.codec, t.policy, t.options) for t in b.tiers]
    assert (a.chunk_size, a.vllm, a.controller) == (b.chunk_size, b.vllm, b.controller)


def test_convert_writes_our_format_and_lists_no_effect_keys(tmp_path):
    upstream._warned.clear()
    src = tmp_path / "lmcache-upstream.yaml"
    src.write_text(UPSTREAM.format(disk=tmp_path / "disk"))
    result = runner.invoke(app, ["config", "convert", str(src)])
    assert result.exit_code == 0, result.output
    assert "local_cpu" not in result.stdout and "tiers:" in result.stdout
    assert sorted(result.stderr.splitlines()) == sorted([
        "lmcache: no effect here: nixl_enable_gc (" + upstream.NO_EFFECT["nixl_enable_gc"] + ")",
        "lmcache: no effect here: controller_reply_url (" + upstream.NO_EFFECT["controller_reply_url"] + ")",
        "lmcache: no effect here: extra_config.lookup_backoff_time (" + upstream._EXTRA_WHY + ")",
    ])
    out = tmp_path / "ours.yaml"
    out.write_text(result.stdout)
    _same(load_config(out, environ={}), load_config(src, environ={}))

    written = tmp_path / "written.yaml"
    again = runner.invoke(app, ["config", "convert", str(src), "-o", str(written)])
    assert again.exit_code == 0 and again.stdout == "" and written.read_text() == result.stdout
    valid = runner.invoke(app, ["config", "validate", str(written)])
    assert valid.exit_code == 0 and "valid" in valid.stdout


def test_convert_refuses_a_bad_file_in_one_line(tmp_path):
    src = tmp_path / "bad.yaml"
    src.write_text('remote_url: "infinistore://127.0.0.1:12345"\n')
    result = runner.invoke(app, ["config", "convert", str(src)])
    assert result.exit_code == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "remote_url" in lines[0] and "infinistore" in lines[0]


def test_show_takes_upstream_file_and_env(tmp_path, monkeypatch):
    src = tmp_path / "lmcache-upstream.yaml"
    src.write_text("local_cpu: true\nuse_layerwise: true\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(src))
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_CPU_SIZE", "1.5")
    monkeypatch.delenv("LMCACHE_API_URL", raising=False)
    result = runner.invoke(app, ["config", "show", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["values"]["tiers"][0]["capacity"] == 3 << 29 and report["values"]["vllm"]["layerwise"] is True
    assert report["sources"]["tiers"] == f"file:{src}, env:LMCACHE_MAX_LOCAL_CPU_SIZE"
    table = runner.invoke(app, ["config", "show"])
    assert table.exit_code == 0 and "env (LMCACHE_MAX_LOCAL_CPU_SIZE)" in table.stdout


def _bigger_than_this_machine() -> str:
    """LMCache's CPU size in GiB that this machine cannot hold: llm-d's 200.0 (or more on a
    big machine)."""
    from lmcache.config import _physical_memory

    total = _physical_memory() or 0
    return "200.0" if total < 190 << 30 else str(float((total >> 30) * 4))


def test_show_convert_and_validate_take_a_config_bigger_than_this_machine(tmp_path):
    """Operators inspect and convert configs for big nodes on small machines. Before: all
    three refused with "the memory pool would need ... more than this machine has"; now
    they translate it with a one-line warning, and only an engine refuses."""
    import pytest

    from lmcache.errors import ConfigError

    size = _bigger_than_this_machine()
    src = tmp_path / "llm-d.yaml"
    src.write_text(f"chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: {size}\n")

    shown = runner.invoke(app, ["config", "show", "--json"],
                          env={"LMCACHE_CONFIG_FILE": "", "LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": size})
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.stdout)
    tiers = report["values"]["tiers"]
    assert any(t["backend"] == "cpu" and t["capacity"] >= 190 << 30 for t in tiers), tiers
    warned = [line for line in shown.stderr.strip().splitlines() if "no config file" not in line]
    assert len(warned) == 1 and "warning:" in warned[0] and "more than this machine has" in warned[0], shown.stderr
    assert "max_local_cpu_size" in warned[0]  # LMCache's key, as the operator wrote it

    converted = runner.invoke(app, ["config", "convert", str(src)])
    assert converted.exit_code == 0, converted.output
    assert "backend: cpu" in converted.stdout and "more than this machine has" in converted.stderr
    out = tmp_path / "ours.yaml"
    out.write_text(converted.stdout)
    checked = runner.invoke(app, ["config", "validate", str(out)])
    assert checked.exit_code == 0, checked.output
    assert "more than this machine has" in checked.stderr

    with pytest.raises(ConfigError, match="more than this machine has"):
        load_config(src, environ={})  # what an engine loads: refused


PD_DECODER = """\
local_cpu: False
max_local_cpu_size: 0
enable_pd: True
transfer_channel: "nixl"
pd_role: "receiver"
pd_peer_host: "0.0.0.0"
pd_peer_init_port: 7300
pd_peer_alloc_port: 7400
pd_buffer_size: 2147483648
pd_buffer_device: "cuda"
pd_backend_mode: async
nixl_backends: [UCX]
"""


def test_convert_and_show_a_pd_config(tmp_path, monkeypatch):
    """LMCache's PD decoder file converts to our pd and transfer sections; the result loads to
    the same PD settings, and `config show` prints them."""
    upstream._warned.clear()
    src = tmp_path / "lmcache-decoder-config.yaml"
    src.write_text(PD_DECODER)
    result = runner.invoke(app, ["config", "convert", str(src)])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "lmcache: no effect here: pd_backend_mode (" + upstream.NO_EFFECT["pd_backend_mode"] + ")"]
    out = tmp_path / "ours.yaml"
    out.write_text(result.stdout)
    ours, theirs = load_config(out, environ={}), load_config(src, environ={})
    assert (ours.pd, ours.transfer, ours.transfer_channel) == (theirs.pd, theirs.transfer, theirs.transfer_channel)
    assert (ours.pd.role, ours.pd.peer_init_port, ours.transfer.buffer_size) == ("receiver", [7300], 2 << 30)
    assert [(t.backend, t.capacity) for t in ours.tiers] == [("cpu", 2 << 30)]
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(out))
    monkeypatch.delenv("LMCACHE_API_URL", raising=False)
    shown = runner.invoke(app, ["config", "show", "--json"])
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.stdout)
    assert report["values"]["pd"]["role"] == "receiver" and report["values"]["pd"]["peer_alloc_port"] == [7400]
    assert report["sources"]["pd.peer_host"] == f"file:{out}"
