"""Child processes of lmcache's tools (benchmarks, demos) and tests: read the line a child
prints when it is ready, wait for a condition, stop a child, and the child's side, serving
until its parent closes its stdin. Every wait is bounded; a bound is a hang guard, not a
timing claim."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable

from ..errors import LMCacheError


def readline(proc: subprocess.Popen, timeout: float) -> str:
    """The next line ``proc`` prints on stdout (stripped); :class:`LMCacheError` if it
    prints none within ``timeout`` seconds or exits first.

    A reader thread per process moves its lines into a queue: waiting on the pipe with
    ``select`` would miss lines the text stream has already buffered."""
    lines = _lines(proc)
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        line = None
    else:
        if line is None:  # the process closed its stdout: so will every later wait see
            lines.put(None)
    if line is None:
        raise LMCacheError(f"process {proc.args} printed nothing within {timeout:g}s (exit code {proc.poll()})")
    return line.strip()


_readers: weakref.WeakKeyDictionary[subprocess.Popen, queue.Queue] = weakref.WeakKeyDictionary()
_readers_lock = threading.Lock()


def _lines(proc: subprocess.Popen) -> queue.Queue[str | None]:
    with _readers_lock:
        q = _readers.get(proc)
        if q is None:
            q = _readers[proc] = queue.Queue()
            stream = proc.stdout

            def pump() -> None:
                try:
                    for line in stream:
                        q.put(line)
                except (OSError, ValueError):
                    pass
                q.put(None)  # end of output

            threading.Thread(target=pump, name=f"lmcache-readline-{proc.pid}", daemon=True).start()
        return q


def until(fn: Callable[[], Any], what: str, timeout: float) -> Any:
    """Poll ``fn`` until it returns something true, and return it; :class:`LMCacheError`
    naming ``what`` otherwise."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = fn()
        if last:
            return last
        time.sleep(0.05)
    raise LMCacheError(f"not reached within {timeout:g}s: {what} (last: {last!r})")


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Close its stdin (a child of :func:`serve_until_stdin_closes` then stops by itself),
    then SIGTERM, then SIGKILL, waiting ``grace`` seconds for each. A child without a stdin
    pipe (a server run as users run it) cannot be told that way: SIGTERM comes first."""
    try:
        if proc.stdin:
            proc.stdin.close()
    except OSError:
        pass
    for sig in ((None,) if proc.stdin else ()) + (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        if sig is not None:
            proc.send_signal(sig)
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            pass


def serve_until_stdin_closes(ready: str | None = None) -> None:
    """In a child: print ``ready`` (if given), then block until stdin closes (the parent
    went away or called :func:`stop`), SIGTERM or SIGINT."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())

    def watch() -> None:
        try:
            while sys.stdin.read(1):
                pass
        except (OSError, ValueError):
            pass
        done.set()

    threading.Thread(target=watch, daemon=True).start()
    if ready is not None:
        print(ready, flush=True)
    done.wait()
