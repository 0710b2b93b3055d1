"""The multi-host suite: hosts are network namespaces on this machine
(:mod:`lmcache.testing.netns`). ``make test`` runs it as its own target
(``make test-multihost``) beside the main suite; without root it is skipped with the
reason (a failure under ``CI=true``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_missing.py

from _missing import missing  # noqa: E402


@pytest.fixture(scope="module")
def make_hosts():
    """``make_hosts(n, name)``: a :class:`~lmcache.testing.netns.Hosts` removed when the
    module ends, or :func:`missing` saying why namespaces cannot be made."""
    from lmcache.testing.netns import Hosts, NetnsUnavailable

    made: list[Hosts] = []

    def make(n: int, name: str = "t") -> Hosts:
        try:
            h = Hosts(n, name=name)
        except NetnsUnavailable as exc:
            missing(f"network namespaces unavailable: {exc}")
        made.append(h)
        return h

    yield make
    for h in reversed(made):
        h.close()
