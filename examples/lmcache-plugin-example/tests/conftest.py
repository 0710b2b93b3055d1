"""The example's test settings. lmcache's pytest plugin (installed with lmcache, the ``pytest11``
entry point ``lmcache``) provides the fixtures ``lmcache_store``, ``lmcache_engine`` and
``lmcache_key_prefix``; nothing here re-implements them."""

import os

import pytest


@pytest.fixture(autouse=True)
def _clean_lmcache_env(monkeypatch):
    """The tests never inherit LMCACHE_* settings from the shell."""
    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name, raising=False)
