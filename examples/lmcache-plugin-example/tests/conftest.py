import os

import pytest


@pytest.fixture(autouse=True)
def _clean_lmcache_env(monkeypatch):
    """The tests never inherit LMCACHE_* settings from the shell."""
    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name, raising=False)
