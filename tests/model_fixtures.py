"""The real model, loaded once per test session (see conftest.py)."""

from __future__ import annotations

from _missing import missing


def require_model():
    """(model, tokenizer) of SmolLM2-135M-Instruct, or a clear failure/skip if absent."""
    from lmcache.errors import MissingDependencyError

    try:
        from lmcache.plugins.connectors.hf_models import load_smollm2

        return load_smollm2()
    except (MissingDependencyError, ImportError) as exc:
        msg = f"the real model is not available: {exc} (make test installs it)"
        missing(msg)
