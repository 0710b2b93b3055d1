"""Counting an engine's chunk-hash calls (issue 31: one request, one hash per process)."""

from __future__ import annotations

from typing import Any


def count_digests(engine: Any) -> list[int]:
    """Wrap ``engine``'s chunk digest so that ``calls[0]`` counts its calls (the real
    digest still computes every key); returns ``calls``."""
    calls = [0]
    real = engine.tokens._digest

    def digest(data: Any) -> bytes:
        calls[0] += 1
        return real(data)

    engine.tokens._digest = digest
    return calls


def count_prompt_digests(engine: Any) -> list[int]:
    """Wrap the digest ``engine``'s prompt memo takes of a whole prompt to find it again
    (:meth:`lmcache.prompt.PromptMemo._key`) so that ``calls[0]`` counts its calls."""
    calls = [0]
    memo = engine.prompts
    real = memo._key

    def key(*args: Any) -> Any:
        calls[0] += 1
        return real(*args)

    memo._key = key
    return calls
