"""lmcache's pytest plugin: fixtures a plugin package's own test suite gets by installing lmcache.

It is registered as the ``pytest11`` entry point ``lmcache``, so pytest loads it in every
environment where lmcache is installed; loading it imports nothing heavy (each fixture
imports what it needs when a test uses it). Disable it with ``-p no:lmcache``.

- ``lmcache_store``: a factory ``lmcache_store(backend, **launcher_kwargs) -> Store`` that
  starts ``backend``'s server(s) on loopback through its launcher (a built-in one or one a
  plugin registers through the hook ``lmcache_register_store_launchers``) and returns the
  running :class:`lmcache.testing.stores.Store`: ``.options`` (the backend options that reach
  it), ``.kill()`` (SIGKILL), ``.freeze()`` (SIGSTOP), ``.thaw()`` (SIGCONT), ``.restart()``.
  Every store is stopped at teardown. A server that cannot be found or started
  (:class:`~lmcache.testing.stores.ServerUnavailable`) fails the test when the environment
  variable ``CI`` is true and skips it elsewhere, with the message; an unknown launcher name
  is an error listing the known ones.
- ``lmcache_key_prefix``: a fresh string per test (``t-<8 hex digits>``), a namespace or key
  prefix that no other test shares.
- ``lmcache_engine``: a factory ``lmcache_engine(tiers, **config_keys) -> CacheEngine`` over a
  tier list (or one tier mapping) plus top-level config keys (``kv_spec`` may be a
  :class:`~lmcache.config.KVSpec`); the namespace is ``lmcache_key_prefix`` unless given.
  Every engine is closed at teardown.

The conformance suites stay where they are: ``from lmcache.testing import BackendTests, ...``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import pytest

if TYPE_CHECKING:
    from lmcache import CacheEngine
    from lmcache.testing.stores import Store


def _missing(message: str) -> None:
    """A component the test needs is absent: fail under CI (which installs everything), skip elsewhere."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture
def lmcache_key_prefix() -> str:
    """A namespace/key prefix unique to this test, e.g. ``t-3fa94c01``."""
    return f"t-{secrets.token_hex(4)}"


@pytest.fixture
def lmcache_store() -> Iterator[Callable[..., Store]]:
    """``lmcache_store(backend, **launcher_kwargs)``: a running loopback store, stopped at teardown."""
    from lmcache.testing import stores

    with contextlib.ExitStack() as stack:

        def start(backend: str, **launcher_kwargs: Any) -> Store:
            launch = stores.launcher(backend)  # an unknown name raises here: a mistake, not a skip
            try:
                return stack.enter_context(launch(**launcher_kwargs))
            except stores.ServerUnavailable as exc:
                problem = str(exc)
            _missing(f"the {backend} store is unavailable: {problem}")  # outside the except: no chained traceback
            raise AssertionError("unreachable")  # pragma: no cover - _missing always raises

        yield start


@pytest.fixture
def lmcache_engine(lmcache_key_prefix: str) -> Iterator[Callable[..., CacheEngine]]:
    """``lmcache_engine(tiers, **config_keys)``: a :class:`lmcache.CacheEngine`, closed at teardown."""
    import lmcache

    with contextlib.ExitStack() as stack:

        def make(tiers: Sequence[Mapping[str, Any]] | Mapping[str, Any], **config_keys: Any) -> CacheEngine:
            tier_list = [tiers] if isinstance(tiers, Mapping) else list(tiers)
            kv_spec = config_keys.pop("kv_spec", None)
            config = {"namespace": lmcache_key_prefix, **config_keys, "tiers": [dict(t) for t in tier_list]}
            engine = lmcache.CacheEngine.from_config(config, kv_spec=kv_spec)
            stack.callback(engine.close)
            return engine

        yield make
