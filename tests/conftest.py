from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# tests/engines need the engines' own virtualenvs (vLLM and SGLang pin other versions of
# shared packages); `make test` runs them there with LMCACHE_ENGINE_TESTS=1
collect_ignore_glob = [] if os.environ.get("LMCACHE_ENGINE_TESTS") == "1" else ["engines/*"]


@pytest.fixture(autouse=True)
def _clean_lmcache_env(monkeypatch):
    """Tests never inherit LMCACHE_* settings from the shell."""
    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer): SmolLM2-135M-Instruct in float32 on the CPU, loaded once."""
    from model_fixtures import require_model

    return require_model()
