"""The small error hierarchy of lmcache.

A missing key is never an error (backends return ``None``); a conflict raises a
built-in (``FileExistsError``); everything else raised on purpose by lmcache is an
:class:`LMCacheError` so that callers can catch one type.
"""

from __future__ import annotations

from .redact import redact_text


class LMCacheError(Exception):
    """Base class of every error lmcache raises on purpose.

    Its text never carries a credential: URL passwords and the values of secret-named
    keys in the message are masked when it is made (:func:`lmcache.redact.redact_text`),
    so ``str``, ``repr``, logs and answers built from it show ``***``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*(redact_text(a) if isinstance(a, str) else a for a in args), **kwargs)


class ConfigError(LMCacheError, ValueError):
    """A configuration value is unknown, of the wrong type or impossible.

    The message names the key (dotted path, e.g. ``tiers[1].capacity``) and, when the
    value came from a file, the file.
    """

    def __init__(self, key: str, problem: str, source: str | None = None):
        self.key = key
        self.problem = problem = redact_text(problem)
        self.source = source
        where = f" (in {source})" if source else ""
        super().__init__(f"config key '{key}'{where}: {problem}")


class PluginError(LMCacheError):
    """A plugin could not be loaded, or two plugins claim the same name."""


class MissingDependencyError(PluginError, ImportError):
    """A plugin needs an optional dependency that is not installed."""


class UnknownPluginError(PluginError, KeyError):
    """No plugin of that kind is registered under that name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class MemoryPoolError(LMCacheError):
    """Misuse of a memory object: double free, use after free, wrong size."""


class CorruptPayloadError(LMCacheError):
    """Stored bytes failed their header or checksum check; they are never handed out."""


class EntryPathError(LMCacheError):
    """One entry cannot be written where it belongs (a directory or a file in the way on
    a disk tier): that entry is skipped; the tier is healthy and keeps serving."""


class StoreSkipped(LMCacheError):
    """One store was skipped for a reason that is neither the device's nor a failure (a
    shared disk directory at its capacity, or its lock held by another process past a
    bound): counted in the tier's ``skipped_puts``, no backoff, not logged per store."""


class TierUnusableError(ConfigError):
    """A tier cannot be opened as configured, but the rest of the hierarchy can run
    without it (a disk directory with a damaged marker that holds files the tier did not
    write): an engine starts without that tier and logs the message, which says what to
    do; tools that open that tier alone (``lmcache ls``) report it as an error."""


class BackendError(LMCacheError):
    """A storage backend failed (unreachable, timed out, I/O error)."""


class KVShapeError(LMCacheError, ValueError):
    """A KV tensor does not match the shape the cache engine was set up for."""


class AdminError(LMCacheError):
    """A request to inspect or change a cache instance (the instance API, ``lmcache
    evict``...) is wrong or cannot be served. ``status`` is the HTTP status the instance
    API answers with: 400 for a malformed request, 404 for an unknown tier or key, 401
    for a missing or wrong token, 503 when the instance cannot be reached."""

    status = 400


class NotFoundError(AdminError):
    """An unknown tier, or a key that no tier holds."""

    status = 404


class AuthError(AdminError):
    """The instance API wants a token that was missing or wrong."""

    status = 401


class UnreachableError(AdminError):
    """The instance API did not answer (refused, timed out, not HTTP)."""

    status = 503
