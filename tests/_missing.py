"""One rule for tests whose component is absent: fail under CI, skip elsewhere."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import pytest


def missing(message: str) -> None:
    """Stop a test that needs something absent: a clear failure when ``CI`` is true
    (CI installs everything), a skip with the same message on a developer machine."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    else:
        pytest.skip(message)


@contextlib.contextmanager
def loopback_store(name: str, **kwargs: Any) -> Iterator[Any]:
    """A store started on loopback for a test (:func:`lmcache.testing.stores.start`), or
    :func:`missing` saying why it could not start."""
    from lmcache.testing import stores as loopback

    try:
        cm = loopback.start(name, **kwargs)
        store = cm.__enter__()
    except loopback.ServerUnavailable as exc:
        missing(f"{name} store unavailable: {exc}")
    try:
        yield store
    finally:
        cm.__exit__(None, None, None)
