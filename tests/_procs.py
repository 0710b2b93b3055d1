"""Child processes in multi-process tests: read their first line, wait for a condition,
stop them. Bounds here are hang guards, not timing assertions."""

from __future__ import annotations

import select
import signal
import subprocess
import time
from typing import Any, Callable

HANG = 60.0


def readline(proc: subprocess.Popen, timeout: float = HANG) -> str:
    """The next line ``proc`` prints (stripped); fails if it prints none within ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r, _, _ = select.select([proc.stdout], [], [], 0.2)
        if r:
            line = proc.stdout.readline()
            if line:
                return line.strip()
        if proc.poll() is not None:
            break
    raise AssertionError(f"process {proc.args} printed nothing (exit code {proc.poll()})")


def until(fn: Callable[[], Any], what: str, timeout: float = HANG) -> Any:
    """Poll ``fn`` until it returns something true; fail naming ``what`` otherwise."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = fn()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"not reached within {timeout}s: {what} (last: {last!r})")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
