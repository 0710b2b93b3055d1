"""Child processes in multi-process tests: :mod:`lmcache.testing.procs` with the tests' default
bound (a hang guard, not a timing assertion) and assertion errors instead of LMCacheError."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from typing import Any, Callable

from lmcache.testing import procs
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


def talk(port: int, data: bytes, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Send ``data``, close our side, read until the server closes; (reply, closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        with contextlib.suppress(OSError):  # the server may close before it read everything
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        got = bytearray()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return bytes(got), True
            except TimeoutError:
                return bytes(got), False
            if not chunk:
                return bytes(got), True
            got += chunk
        return bytes(got), False
