"""Runs the example plugin package's own tests, as a third party would, when it is installed."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

from _missing import missing

PACKAGE = Path(__file__).resolve().parents[1] / "examples" / "lmcache-plugin-example"
MISSING = "make test installs examples/lmcache-plugin-example; it is missing"


def test_example_plugin_package_passes_its_tests():
    try:
        md.distribution("lmcache-plugin-example")
    except md.PackageNotFoundError:
        missing(MISSING)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PACKAGE / "tests")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"the example plugin's tests failed:\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"
