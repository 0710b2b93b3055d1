"""``lmcache bench tiers --backend``: one backend next to its raw client, in one run."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lmcache.testing import stores as loopback
from lmcache.cli.main import app
from _missing import missing

SMALL = ["--values", "3", "--batch", "2", "--repeats", "1", "--layers", "2", "--kv-heads", "2",
         "--head-size", "16", "--chunk-size", "16", "--json"]


def run(*args: str):
    return CliRunner().invoke(app, ["bench", "tiers", *args])


def _check(data: dict, backend: str) -> None:
    assert data["backend"] == backend and data["exact"] is True
    assert data["values"] == 3 and data["value_bytes"] == data["bytes"] // 3 > 2 * 2 * 16 * 2 * 16 * 2
    for k in ("put_gbps", "get_gbps", "raw_put_gbps", "raw_get_gbps", "put_ratio", "get_ratio"):
        assert data[k] > 0, k


def test_fs_in_a_temporary_directory():
    r = run("--backend", "fs", *SMALL)
    assert r.exit_code == 0, r.output
    _check(json.loads(r.stdout), "fs")


def test_redis_started_on_loopback_for_the_run():
    try:
        loopback.ensure_binary("redis-server", apt_package="redis-server")
    except loopback.ServerUnavailable as exc:
        missing(str(exc))
    r = run("--backend", "redis", *SMALL)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    _check(data, "redis")
    assert "loopback" in data["store"]


def test_given_store_options_are_used(tmp_path):
    r = run("--backend", "fs", "-o", f"url=file://{tmp_path}", "-o", "concurrency=2", *SMALL)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["store"] == "given by --option"
    assert not any(p.suffix == ".lmc" for p in tmp_path.rglob("*")), "the benchmark left entries behind"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--backend", "disk"], "no raw-client baseline"),
        (["--backend", "fs", "-o", "url"], "expected KEY=VALUE"),
        (["--backend", "fs", "-o", "url=file:///tmp/x", "-o", "bogus=1"], "bogus"),
        (["--backend", "nosuch"], "nosuch"),
    ],
)
def test_bad_requests_fail_with_one_clear_line(args, message):
    r = run(*args, *SMALL)
    assert r.exit_code != 0
    assert message in r.output, r.output
