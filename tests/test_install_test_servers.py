"""``requirements/install-test-servers.sh`` under a concurrent apt (issue 29, item 12): it waits
for the dpkg lock instead of failing, and a package it cannot install makes it exit 1
naming the package. Real apt-get as root on Debian; elsewhere ``missing()``.

apt takes its locks with ``fcntl`` (POSIX record locks), so the test holds
``/var/lib/dpkg/lock-frontend`` the same way (``flock(1)`` would not block apt)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from _missing import missing

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "requirements" / "install-test-servers.sh"
LOCK = Path("/var/lib/dpkg/lock-frontend")


@pytest.fixture(autouse=True)
def debian_root():
    if os.geteuid() != 0 or shutil.which("apt-get") is None or not LOCK.exists():
        missing("the install script's apt path needs root on Debian (apt-get, /var/lib/dpkg/lock-frontend)")


def installed(package: str) -> bool:
    r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return r.stdout.strip() == "install ok installed"


def apt_install_running() -> bool:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"apt-get") and b"install" in argv:
            return True
    return False


def take_lock(f) -> None:
    """The dpkg frontend lock, waiting (bounded) for another apt to finish."""
    deadline = time.monotonic() + 300
    while True:
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail("another apt/dpkg held the dpkg lock for 300 s")
            time.sleep(1)


def test_waits_for_the_dpkg_lock_held_by_another_apt():
    if not installed("openssl"):
        missing("openssl is not installed (the test reinstalls nothing, it installs an installed package)")
    env = {**os.environ, "LMCACHE_APT_LOCK_TIMEOUT": "300"}
    with open(LOCK, "a") as lock:
        take_lock(lock)
        p = subprocess.Popen(["bash", str(SCRIPT), "openssl"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
        try:
            deadline = time.monotonic() + 120  # apt-get update first (the network), then install
            while not apt_install_running():
                assert p.poll() is None, f"finished before it reached apt-get install: {p.communicate()}"
                assert time.monotonic() < deadline, "apt-get install did not start within 120 s"
                time.sleep(0.1)
            time.sleep(2)  # an apt-get without a lock timeout has failed by now
            assert p.poll() is None, f"gave up while another process held the dpkg lock: {p.communicate()}"
        finally:
            fcntl.lockf(lock, fcntl.LOCK_UN)
        try:
            out, err = p.communicate(timeout=300)
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode == 0, err
    assert "installing openssl" in err and "could not" not in err and "FAILED" not in err, err


def test_a_package_that_cannot_be_installed_exits_1_naming_it():
    env = {**os.environ, "LMCACHE_APT_LOCK_TIMEOUT": "300"}
    p = subprocess.run(["bash", str(SCRIPT), "lmcache-no-such-package"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 1, p.stderr
    assert "FAILED to install: lmcache-no-such-package" in p.stderr, p.stderr
