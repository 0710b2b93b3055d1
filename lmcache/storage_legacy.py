"""Backends written against the storage contract before its one vocabulary keep working
for one release: :func:`adapt` maps their verbs onto today's when the class is created,
with one :class:`DeprecationWarning` naming the class and what to rename.

The old contract, and what each verb becomes:

- every backend: ``contains(keys)`` -> ``exists``, ``contains_one`` -> ``exists_one``,
  ``remove_one`` -> ``delete_one``, ``remove(keys)`` (it returned nothing) -> ``delete``,
  each key reported as deleted;
- a :class:`~lmcache.storage.BytesBackend`: ``read(key)`` -> ``get_one``,
  ``write(key, buffers)`` -> ``put_one`` (the bytes it takes: the buffers' total),
  ``exists(key)`` -> ``exists_one``, ``delete(key)`` -> ``delete_one``, ``list()`` ->
  ``keys``. Such a class that also overrides object reads or writes (``get``,
  ``get_one``, ``put``, ``put_one``, which now move bytes) cannot be adapted: a
  :class:`TypeError` says so.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

#: the object verbs of the old contract and their names now
RENAMED = {"contains": "exists", "contains_one": "exists_one", "remove_one": "delete_one", "remove": "delete"}
#: a byte store's old verbs (any of these in a class body marks it as written for them)
BYTE_VERBS = ("read", "write", "list")


def _put_by_write(write: Callable[..., Any]) -> Callable[..., int]:
    def put_one(self: Any, key: str, buffers: Sequence[Any]) -> int:
        write(self, key, buffers)
        return sum(memoryview(b).nbytes for b in buffers)

    return put_one


def _delete_by_remove(remove: Callable[..., Any]) -> Callable[..., list[bool]]:
    def delete(self: Any, keys: Sequence[str]) -> list[bool]:
        remove(self, keys)
        return [True] * len(keys)

    return delete


def adapt(cls: type, store: type) -> None:
    """Map the old verbs ``cls`` defines in its own body onto today's (see the module
    docstring); nothing for a class written for today's contract. ``store``:
    :class:`lmcache.storage.Store`, whose batch forms loop over the single-key ones."""
    body = cls.__dict__
    byte_store = bool(getattr(cls, "supports_bytes", False)) and any(n in body for n in BYTE_VERBS)
    old = [n for n in RENAMED if n in body]
    if byte_store:
        old += [n for n in (*BYTE_VERBS, "exists", "delete") if n in body]
    if not old:
        return
    if byte_store:
        clash = [n for n in ("get", "get_one", "put", "put_one") if n in body]
        if clash:
            raise TypeError(f"backend {cls.__module__}:{cls.__qualname__} is written for the old byte contract "
                            f"(read/write/list) and overrides {', '.join(clash)}, which now move bytes: implement "
                            "get/put/exists/delete/keys over bytes (see lmcache.storage)")
        single = {"read": "get_one", "exists": "exists_one", "delete": "delete_one", "list": "keys"}
        for name, new in single.items():
            if name in body:
                setattr(cls, new, body[name])
        if "write" in body:
            cls.put_one = _put_by_write(body["write"])  # type: ignore[attr-defined]
        for batch in ("exists", "delete"):  # their old single-key bodies: the batch forms are derived again
            if batch in body:
                setattr(cls, batch, store.__dict__[batch])
    for name in RENAMED:
        if name in body:
            fn = body[name]
            setattr(cls, RENAMED[name], _delete_by_remove(fn) if name == "remove" else fn)
    new_names = sorted({RENAMED.get(n) or {"read": "get_one", "write": "put_one", "list": "keys"}.get(n, n + "_one")
                        for n in old})
    warnings.warn(
        f"backend {cls.__module__}:{cls.__qualname__} implements the old storage verbs ({', '.join(sorted(old))}); "
        f"they work for one more release: implement {', '.join(new_names)} instead (see lmcache.storage)",
        DeprecationWarning,
        stacklevel=3,
    )


__all__ = ["adapt", "RENAMED", "BYTE_VERBS"]
