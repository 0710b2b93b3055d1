"""Child processes in multi-process tests: :mod:`lmcache.procs` with the tests' default
bound (a hang guard, not a timing assertion) and assertion errors instead of LMCacheError."""

from __future__ import annotations

import subprocess
from typing import Any, Callable

from lmcache import procs
from lmcache.errors import LMCacheError

HANG = 60.0
stop = procs.stop


def readline(proc: subprocess.Popen, timeout: float = HANG) -> str:
    try:
        return procs.readline(proc, timeout)
    except LMCacheError as exc:
        raise AssertionError(str(exc)) from None


def until(fn: Callable[[], Any], what: str, timeout: float = HANG) -> Any:
    try:
        return procs.until(fn, what, timeout)
    except LMCacheError as exc:
        raise AssertionError(str(exc)) from None
