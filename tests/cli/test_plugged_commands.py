"""Commands plugged into ``lmcache`` by entry points of the group ``lmcache.commands``: an
installed package (a real dist-info on the path of a real ``lmcache`` process) adds one,
a broken one is one line when run and does not take the others down, and a name the
command already has keeps its own meaning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = '''
import typer

app = typer.Typer(name="hello", help="Say hello from a third-party package.", no_args_is_help=True)


@app.command("world")
def world(name: str = "lmcache") -> None:
    """Print a greeting."""
    print(f"hello {name}")


@app.command("twice")
def twice() -> None:
    """Print it twice."""
    print("hello hello")
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    (site / "hello_cmd.py").write_text(PACKAGE)
    info = site / "hello_cmd-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-cmd\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[lmcache.commands]\nhello = hello_cmd:app\nbroken = no_such_module_here:app\nls = hello_cmd:app\n")
    return site


def lmcache(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), "COLUMNS": "250"}
    env.pop("LMCACHE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "lmcache.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_an_installed_package_adds_a_command(site):
    r = lmcache(site, "hello", "world", "--name", "tenant-a")
    assert (r.returncode, r.stdout) == (0, "hello tenant-a\n"), r.stderr
    listed = lmcache(site, "--help")
    assert listed.returncode == 0 and "hello" in listed.stdout and "third-party" in listed.stdout


def test_a_command_that_cannot_load_is_one_line_and_the_others_still_run(site):
    r = lmcache(site, "broken", "anything", "--flag")
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmcache: error: command 'broken' cannot be loaded"), r.stderr
    assert "broken = no_such_module_here:app" in lines[0] and "ModuleNotFoundError" in lines[0]
    listed = lmcache(site, "--help")
    assert listed.returncode == 0 and "cannot be loaded" in listed.stdout
    assert lmcache(site, "hello", "twice").stdout == "hello hello\n"


def test_a_name_the_command_has_keeps_its_meaning(site, tmp_path):
    r = lmcache(site, "ls", "--help")
    assert r.returncode == 0 and "List cached entries" in r.stdout and "third-party" not in r.stdout


def test_bench_and_demo_are_plugged_in_and_load_only_when_used():
    """``lmcache version`` imports neither the benchmarks nor the demos."""
    code = ("import sys; from lmcache.cli.main import app\n"
            "try:\n    app(['version'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith(('lmcache.benchmarks', 'lmcache.demos'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "[]", (r.stdout, r.stderr)
    helped = subprocess.run([sys.executable, "-m", "lmcache.cli.main", "bench", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "tiers" in helped.stdout and "pd" in helped.stdout
