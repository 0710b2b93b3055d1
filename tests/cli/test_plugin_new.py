"""``lmcache plugin new``: the package it writes installs, is found by lmcache and passes its
own tests through lmcache's pytest plugin; and ``lmcache plugins --json`` names each
plugin's ``requires`` and version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lmcache.cli.main import app

runner = CliRunner()
KINDS = ("backend", "codec", "policy", "connector")


def new(*args: str):
    return runner.invoke(app, ["plugin", "new", *args])


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "PYTHON", "PYTEST"))}


def test_new_writes_a_package_with_the_entry_point(tmp_path):
    result = new("my-store", "--kind", "backend", "--dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    pkg = tmp_path / "lmcache-my-store"
    assert result.stdout.strip() == str(pkg)
    assert sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*") if p.is_file()) == [
        ".gitignore", "README.md", "lmcache_my_store/__init__.py", "lmcache_my_store/backend.py",
        "lmcache_my_store/plugin.py", "pyproject.toml", "tests/conftest.py", "tests/test_lmcache_my_store.py",
    ]
    meta = (pkg / "pyproject.toml").read_text()
    assert 'name = "lmcache-my-store"' in meta and 'dependencies = ["lmcache>=' in meta
    assert '[project.entry-points.lmcache]\nmy-store = "lmcache_my_store.plugin"\n' in meta
    tests = (pkg / "tests" / "test_lmcache_my_store.py").read_text()
    assert "lmcache_engine" in tests and "lmcache_key_prefix" in tests and "FileBackendTests" in tests
    readme = (pkg / "README.md").read_text()
    assert "pip install -e ." in readme and "pytest" in readme and "twine upload" in readme
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lmcache-my-store"]  # no temporary folder left


@pytest.mark.parametrize("typed", ["lmcache-my-store", "lmcache_my-store"])
def test_a_name_that_starts_with_lmcache_is_the_package_name(tmp_path, typed):
    """PyPI's plugins are named lmcache-NAME; before, `plugin new lmcache-foo` wrote the
    package lmcache-lmcache-foo with the module lmcache_lmcache_foo."""
    result = new(typed, "--kind", "backend", "--dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lmcache-my-store"]
    meta = (tmp_path / "lmcache-my-store" / "pyproject.toml").read_text()
    assert 'name = "lmcache-my-store"' in meta
    assert '[project.entry-points.lmcache]\nmy-store = "lmcache_my_store.plugin"\n' in meta
    assert (tmp_path / "lmcache-my-store" / "lmcache_my_store" / "backend.py").is_file()
    assert "registering 'my-store'" in result.stderr


@pytest.mark.parametrize(
    "name, kind, problem",
    [
        ("My-Store", "backend", "is not a plugin name"),
        ("1store", "codec", "is not a plugin name"),
        ("my.store", "policy", "is not a plugin name"),
        ("my--store", "backend", "is not a plugin name"),
        ("a" * 41, "backend", "is not a plugin name"),
        ("cpu", "backend", "registered already"),
        ("lmcache-cpu", "backend", "registered already"),
        ("lmcache-", "backend", "is not a plugin name"),
        ("lru", "policy", "registered already"),
        ("zstd", "codec", "registered already"),
        ("fine", "cache", "must be one of backend, codec, policy, connector"),
    ],
)
def test_a_bad_name_or_kind_is_one_line_exit_2_and_writes_nothing(tmp_path, name, kind, problem):
    result = new(name, "--kind", kind, "--dir", str(tmp_path))
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmcache: error: ") and problem in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_existing_package_directory_is_refused_and_kept(tmp_path):
    (tmp_path / "lmcache-mine").mkdir()
    (tmp_path / "lmcache-mine" / "keep.txt").write_text("mine")
    result = new("mine", "--kind", "codec", "--dir", str(tmp_path))
    assert result.exit_code == 2 and "exists already" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["lmcache-mine"]
    assert [p.name for p in (tmp_path / "lmcache-mine").iterdir()] == ["keep.txt"]


def test_plugins_json_names_requires_and_version(tmp_path, monkeypatch):
    """An installed third-party plugin (a dist-info with an entry point, as pip leaves it)
    registered with ``requires=``: ``plugins --json`` gives both. Before: no 'requires' key."""
    (tmp_path / "fancy_plugin.py").write_text(textwrap.dedent('''
        from lmcache import hookimpl

        @hookimpl
        def lmcache_register_backends(registry):
            registry.add("fancy", "fancy_plugin_impl:FancyBackend", requires="fancy-kv>=1.0")
    '''))
    info = tmp_path / "lmcache_fancy-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lmcache-fancy\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text("[lmcache]\nfancy = fancy_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)
    result = runner.invoke(app, ["plugins", "--json", "--kind", "backend"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    fancy = rows["fancy"]
    assert (fancy["distribution"], fancy["version"], fancy["requires"]) == ("lmcache-fancy", "1.2.3", "fancy-kv>=1.0")
    assert rows["cpu"]["requires"] is None and rows["cpu"]["version"]


# ------------------------------------------------------- generated packages, installed


def _throwaway_venv(where: Path) -> Path:
    """A virtualenv that sees everything installed in this one (lmcache, pytest, torch)
    and installs into its own site-packages: no network, nothing changed here."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    # an import line in a .pth runs at start-up: addsitedir also reads ours' .pth files (editable installs)
    (Path(purelib) / "_lmcache_reuse.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    return python


@pytest.mark.slow
def test_generated_packages_install_and_pass_their_own_tests(tmp_path):
    """One package of each kind, pip-installed (editable, no network) into one throwaway
    environment; each package's own test suite passes there under pytest (it uses the
    fixtures of lmcache's pytest plugin and lmcache's conformance suites), and ``lmcache
    plugins`` there lists each plugin with its package and version."""
    pkgs = {}
    for kind in KINDS:
        result = new(f"my-{kind}", "--kind", kind, "--dir", str(tmp_path))
        assert result.exit_code == 0, result.output
        pkgs[kind] = tmp_path / f"lmcache-my-{kind}"
    python = _throwaway_venv(tmp_path / "venv")
    env = _clean_env()
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         *(a for p in pkgs.values() for a in ("-e", str(p)))],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    runs = {
        kind: subprocess.Popen([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=pkg, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for kind, pkg in pkgs.items()
    }
    listing = subprocess.run([str(python), "-m", "lmcache.cli.main", "plugins", "--json"], capture_output=True,
                             text=True, timeout=120, env=env, cwd=tmp_path)
    outputs = {kind: proc.communicate(timeout=300)[0] for kind, proc in runs.items()}
    for kind, proc in runs.items():
        assert proc.returncode == 0, f"the generated {kind} package's tests failed:\n{outputs[kind][-6000:]}"
        assert " passed" in outputs[kind] and "skipped" not in outputs[kind], outputs[kind][-2000:]

    assert listing.returncode == 0, listing.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(listing.stdout)}
    for kind in KINDS:
        row = rows[(kind, f"my-{kind}")]
        assert (row["plugin"], row["distribution"], row["version"]) == (f"my-{kind}", f"lmcache-my-{kind}", "0.1.0")
