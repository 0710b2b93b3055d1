"""Fixtures of the operator page's browser tests (module-scoped: one cluster and one
browser per test file): ``cluster``, a :class:`_web.Cluster` ready (three instances
indexed with their tier stats), and ``browser``, a :class:`_web.Browser` (headless
Chromium; ``missing()`` where Chromium, its driver or selenium is absent)."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Iterator

import pytest
from _missing import missing
from _procs import until
from _web import CHROME_FLAGS, CHROMEDRIVER, CHROMIUM, Browser, Cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("web-cluster"))
    try:
        want = {"web-a1": 5, "web-a2": 4, "web-b1": 5}  # chunks (a2: 3 of OTHER and the hostile key)

        def indexed():
            rows = c.instances()
            return rows if {i: r["keys"] for i, r in rows.items()} == want and all(
                r["healthy"] and set(r.get("tier_stats") or ()) == set(r["tiers"]) for r in rows.values()) else None

        until(indexed, "the three instances indexed with their keys and tier stats")
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        missing(f"the browser tests need Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): "
                "as root run: bash requirements/install-test-servers.sh")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing("the browser tests need selenium: pip install -e '.[dev]'")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in CHROME_FLAGS:
        opts.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="lmcache-chromium-")
    opts.add_argument(f"--user-data-dir={profile}")
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    # an alert left open must not be dismissed silently: the next command reports it
    opts.set_capability("unhandledPromptBehavior", "ignore")
    try:
        driver = webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
    except Exception:
        shutil.rmtree(profile, ignore_errors=True)
        raise
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    b = Browser(driver, profile)
    try:
        yield b
    finally:
        b.close()
