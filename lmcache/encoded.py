"""Payload encoding as a wrapper: :class:`Encoded`, the store of memory objects a tier
opens over a :class:`~lmcache.storage.BytesBackend`.

It speaks the same five verbs as every store (:mod:`lmcache.storage`) and moves each value
through :mod:`lmcache.payload`: ``put`` encodes with the tier's codec under the
self-describing header, ``get`` decodes with the codec the header names and checks it
(length, checksum, key); a payload that fails its checks is counted in the store's
``integrity``, deleted, and reported as a miss, so nothing corrupt or foreign reaches an
engine. Values and keys over the store's declared limits go through the fitting view of
:mod:`lmcache.fit` (``store``); the store itself is ``raw``.

A store that can decode without an intermediate copy (from a buffer it lends only during
a call, or straight into pool memory) names a subclass in
:attr:`~lmcache.storage.BytesBackend.objects_view` that overrides :meth:`Encoded.get_native`
(reads of keys stored as they are) or the verbs themselves.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Sequence

from . import payload
from .errors import CorruptPayloadError
from .fit import FittedBackend, fit
from .memory import MemoryObj
from .storage import BytesBackend, EntryInfo, StorageBackend, Usage

log = logging.getLogger(__name__)


class Encoded(StorageBackend):
    """Memory objects over the byte store ``store`` (see the module docstring)."""

    supports_bytes = True

    def __init__(self, store: BytesBackend):
        # not StorageBackend.__init__: the store is open and its options checked
        self.raw = store
        self.store: BytesBackend = fit(store)  # type: ignore[assignment]
        self.context = store.context
        self.options = store.options
        self.integrity = store.integrity
        self.shared = store.shared
        self.parallel_puts = store.parallel_puts

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.store!r})"

    # ------------------------------------------------------------ reads
    def get(self, keys: Sequence[str], on_ready: Callable[[int, MemoryObj], None] | None = None) -> list[MemoryObj | None]:
        if not isinstance(self.store, FittedBackend):
            return self.get_native(keys)
        fitted = self.store
        out: list[MemoryObj | None] = [None] * len(keys)
        fits = [i for i, k in enumerate(keys) if fitted.key_fits(k)]
        try:
            for i, obj in zip(fits, self.get_native([keys[i] for i in fits]) if fits else []):
                out[i] = obj
            rest = [i for i in range(len(keys)) if out[i] is None and fitted.may_be_bounded(keys[i])]
            if rest:
                part = [keys[i] for i in rest]
                for i, obj in zip(rest, self.decode_all(part, fitted.get_bounded(part), bounded=True)):
                    out[i] = obj
        except BaseException:
            release(out)
            raise
        return out

    def get_native(self, keys: Sequence[str]) -> list[MemoryObj | None]:
        """``keys`` as the store holds them (not bounded), decoded: the store's own batch
        read. A view whose store lends its buffers decodes from them here."""
        return self.decode_all(keys, self.raw.get(keys))

    def decode_all(self, keys: Sequence[str], datas: Sequence[Any], *, bounded: bool = False) -> list[MemoryObj | None]:
        """Each payload of ``datas`` decoded and checked; those that fail are deleted (in
        one batch; ``bounded``: through the fitting view, parts and all) and are misses."""
        out: list[MemoryObj | None] = []
        corrupt: list[str] = []
        try:
            for k, data in zip(keys, datas):
                obj = None if data is None else self.decode_checked(k, data)
                if data is not None and obj is None:
                    corrupt.append(k)
                out.append(obj)
        except BaseException:
            release(out)
            raise
        if corrupt:
            self.drop_corrupt(corrupt, bounded=bounded)
        return out

    def decode_checked(self, key: str, data: Any) -> MemoryObj | None:
        """One payload decoded, or ``None`` if it fails its checks (counted in
        ``integrity`` and logged; the caller deletes the entry)."""
        try:
            return payload.decode(data, key, self.context.codec_lookup, self.context.allocate)
        except CorruptPayloadError as exc:
            self.note_corrupt(key, exc)
            return None

    def note_corrupt(self, key: str, exc: Exception) -> None:
        self.raw.note_corrupt(key, exc)

    def drop_corrupt(self, keys: Sequence[str], *, bounded: bool = False) -> None:
        """Delete entries that failed their checks; best effort (the next reader drops
        them again)."""
        try:
            (self.store if bounded else self.raw).delete(keys)
        except Exception:
            log.exception("tier %s: could not delete corrupt entries", self.context.tier)

    # ------------------------------------------------------------ the other verbs
    def put(self, items: Sequence[tuple[str, MemoryObj]]) -> list[int]:
        codec = self.context.codec
        return self.store.put([(k, payload.encode(k, o, codec)) for k, o in items])

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self.store.exists(keys)

    def delete(self, keys: Sequence[str]) -> list[bool]:
        return self.store.delete(keys)

    def keys(self) -> Iterator[tuple[str, int]]:
        return self.store.keys()

    def entries(self) -> Iterator[EntryInfo]:
        return self.store.entries()

    def reserve_size(self, key: str, obj: MemoryObj) -> int:
        return self.store.reserve_size(key, obj)

    def in_use(self, key: str) -> bool:
        return self.store.in_use(key)

    def usage(self) -> Usage:
        return self.store.usage()

    def close(self) -> None:
        self.store.close()


def open_objects(backend: StorageBackend) -> StorageBackend:
    """``backend`` as a store of memory objects: a :class:`BytesBackend` through its
    :attr:`~BytesBackend.objects_view` (encoding, checks, fitting), any other backend as
    it is."""
    if backend.values == "bytes":
        return (backend.objects_view or Encoded)(backend)  # type: ignore[attr-defined]
    return backend


def bytes_store(backend: StorageBackend) -> StorageBackend | None:
    """The store of payload bytes under ``backend`` (its view's ``store``, fitted to its
    limits, or the byte store itself), ``None`` for a backend of objects."""
    if not backend.supports_bytes:
        return None
    return getattr(backend, "store", backend)


def release(objs: Sequence[MemoryObj | None]) -> None:
    """Drop the caller's reference to each object read so far (a read that failed part way)."""
    for o in objs:
        if o is not None:
            o.unref()


__all__ = ["Encoded", "bytes_store", "open_objects", "release"]
