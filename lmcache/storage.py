"""The storage backend contract.

A backend is small and batch-first. Subclasses implement the single-key methods
(``contains_one``, ``get_one``, ``put_one``, ``remove_one``, ``keys``); the batch forms
(``contains``, ``get``, ``put``, ``remove``) default to loops and may be overridden for
speed. Keys are canonical key strings (:meth:`lmcache.keys.CacheKey.to_string`). A missing
key is ``None``, never an exception.

Backends that store bytes outside the process derive from :class:`BytesBackend`: they
move opaque payload bytes (``read``/``write``/``delete``/``exists``/``list``), and the
base class encodes and checks payloads with the tier's codec and the self-describing
header of :mod:`lmcache.payload`; a payload that fails its checks is removed and reported
as a miss.

A backend is built as ``Backend(context)``; see :class:`BackendContext`.
"""

from __future__ import annotations

import inspect
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence

import torch

from . import payload
from .codecs import Codec, load_codec
from .errors import ConfigError, CorruptPayloadError
from .memory import MemoryObj, MemoryPool
from .settings import near_miss

log = logging.getLogger(__name__)


@dataclass
class Usage:
    used_bytes: int
    capacity_bytes: int
    entries: int


@dataclass
class EntryInfo:
    """What a backend knows about one stored entry (for the CLI and the instance API).

    ``codec`` is the codec the entry is stored with and ``stored_at`` the wall-clock
    time (``time.time()``) it was written; either is ``None`` when the backend cannot
    tell.
    """

    key: str
    size: int
    codec: str | None = None
    stored_at: float | None = None


@dataclass
class BackendContext:
    """What a backend is built with.

    - ``tier``: the tier's name (for messages); ``capacity``: its byte capacity;
    - ``options``: the backend-specific keys of the tier's config, already checked
      against the backend's ``OPTIONS``;
    - ``codec``: the tier's codec (bytes backends encode with it);
    - ``codec_lookup``: name -> codec, for reading payloads written with another codec;
    - ``allocate``: ``(shape, dtype) -> MemoryObj``; always returns an object (from the
      pool if it has room, else a transient heap object);
    - ``clock``: seconds, monotonic; injected so tests control time;
    - ``read_only``: the backend is opened only to inspect it (``lmcache ls``/``tiers``
      on a config): it should not create, repair or delete anything while opening.
      Advisory: writes may still be requested (``lmcache evict`` opens tiers writable).
    """

    tier: str
    capacity: int
    options: Mapping[str, Any]
    codec: Codec
    codec_lookup: Callable[[str], Codec]
    allocate: Callable[[Sequence[int], torch.dtype], MemoryObj]
    clock: Callable[[], float] = time.monotonic
    pool: MemoryPool | None = None
    read_only: bool = False

    @classmethod
    def standalone(
        cls,
        options: Mapping[str, Any] | None = None,
        *,
        capacity: int = 1 << 30,
        codec: Codec | None = None,
        pool: MemoryPool | None = None,
        tier: str = "test",
        read_only: bool = False,
    ) -> BackendContext:
        """A context for using a backend on its own (tests, tools)."""
        from .plugin_manager import get_registries

        regs = get_registries()
        if codec is None:
            codec = regs.codecs.load("raw")()

        def lookup(name: str) -> Codec:
            return codec if name == codec.name else load_codec(regs.codecs.load, name)  # type: ignore[return-value]

        def allocate(shape: Sequence[int], dtype: torch.dtype) -> MemoryObj:
            obj = pool.allocate(shape, dtype) if pool is not None else None
            return obj if obj is not None else MemoryPool.allocate_unpooled(shape, dtype)

        return cls(tier, capacity, dict(options or {}), codec, lookup, allocate, time.monotonic, pool, read_only)


def check_backend_options(backend_cls: type, options: Mapping[str, Any], capacity: int | None) -> dict[str, Any]:
    """``backend_cls.check_options(options, capacity)``: the one signature of the contract.

    A backend whose ``check_options`` still takes only ``options`` (the signature before
    capacity was passed) keeps working for now: it is called as ``check_options(options)``
    with a :class:`DeprecationWarning` naming the class and the expected signature, and it
    cannot see the tier's capacity."""
    fn = backend_cls.check_options
    try:
        inspect.signature(fn).bind(options, capacity)
    except TypeError:
        warnings.warn(
            f"backend {backend_cls.__module__}:{backend_cls.__qualname__}: check_options(cls, options) is "
            "deprecated; declare check_options(cls, options, capacity=None) and call "
            "super().check_options(options, capacity)",
            DeprecationWarning,
            stacklevel=3,
        )
        return fn(options)
    except ValueError:  # pragma: no cover - not introspectable
        pass
    return fn(options, capacity)


def registered_name(backend_cls: type) -> str:
    """The name ``backend_cls`` is registered under (``"redis"``, a plugin's
    ``"memcached"``), as a tier's config names it; its class name if it is not registered."""
    from .plugin_manager import get_registries

    target = f"{backend_cls.__module__}:{backend_cls.__qualname__}"
    try:
        entries = get_registries().backends.entries()
    except Exception:  # noqa: BLE001 - a message's detail, never a reason to fail
        return backend_cls.__name__
    for e in entries:
        if e.target is backend_cls or e.target == target:
            return e.name
    return backend_cls.__name__


@dataclass
class IntegrityStats:
    """A byte backend's payload check failures: ``corrupt`` entries dropped so far, and the
    last failure's message."""

    corrupt: int = 0
    last_error: str = field(default="")


class StorageBackend:
    """Base class of storage backends. See the module docstring for the contract."""

    #: backend-specific config keys and their defaults; unknown keys are config errors
    OPTIONS: ClassVar[Mapping[str, Any]] = {}
    #: True if the backend stores self-describing payload bytes (:class:`BytesBackend`:
    #: ``read``/``write``/``delete``/``exists``/``list`` under the object methods): a tier
    #: can then split values over its size limits (:mod:`lmcache.fit`) and ``lmcache
    #: compress`` can re-encode its entries. Code asks this, never ``isinstance``.
    supports_bytes: ClassVar[bool] = False
    #: True if the backend keeps :class:`MemoryObj` references (the CPU tier): a hit is a
    #: reference into the memory pool, not a copy.
    holds_memory_objects: ClassVar[bool] = False
    #: True if other processes read and write the same store (redis, valkey, s3, mooncake,
    #: a shared directory): entries appear and vanish under us. The tier does not
    #: enumerate a shared store when it opens (that would cost a scan of the whole store
    #: on every engine start); its capacity bounds what this instance writes, and the
    #: store's own limits (Redis ``maxmemory``, S3 lifecycle rules) bound the total.
    shared: ClassVar[bool] = False
    #: True if :meth:`get` calls ``on_ready(i, obj)`` for each hit as it is ready
    #: (possibly from the backend's I/O threads, before ``get`` returns): the tier then
    #: passes its ``on_ready`` and the engine copies each chunk out as it arrives. False:
    #: the tier calls ``get(keys)`` without it and hands the results over after it returns.
    streams_gets: ClassVar[bool] = False
    #: True if ``put_one`` may run on several threads at once for distinct keys (the
    #: disk backend): the hierarchy's writer then writes queued chunks for this tier
    #: together (``lmcache.hierarchy.WRITE_BATCH``). False: one at a time, in order.
    parallel_puts: ClassVar[bool] = False
    #: The largest value, in bytes, the backend accepts in one ``write`` (a
    #: :class:`BytesBackend`'s encoded payload); ``None``: unbounded. A tier splits larger
    #: payloads into parts of at most this size (:mod:`lmcache.fit`), so ``put_one`` and
    #: ``write`` are never handed more; the backend must accept any value up to it.
    max_value_size: ClassVar[int | None] = None
    #: The longest key, in UTF-8 bytes, the backend accepts (after any prefix of its own
    #: is added, so a backend with a configurable prefix sets it per instance); ``None``:
    #: unbounded. A tier stores an entry with a longer key under a fixed-length digest
    #: key, checking the full key on every read (:mod:`lmcache.fit`).
    max_key_length: ClassVar[int | None] = None
    #: The backend's payload check failures (:class:`IntegrityStats`, counted in the tier's
    #: ``corrupt``); ``None`` for a backend that stores no payload bytes (cpu).
    integrity: IntegrityStats | None = None

    def __init__(self, context: BackendContext):
        self.context = context
        self.options = check_backend_options(type(self), context.options, context.capacity)

    @classmethod
    def check_options(cls, options: Mapping[str, Any], capacity: int | None = None) -> dict[str, Any]:
        """Validate a tier's backend keys without opening anything; return them merged
        with the defaults. Raises :class:`ConfigError` naming the key (``"capacity"`` for
        a capacity this backend cannot hold). ``capacity`` is the tier's capacity in bytes
        (``None`` where no tier is known). The signature is fixed: every backend declares
        ``check_options(cls, options, capacity=None)`` and calls
        ``super().check_options(options, capacity)`` first (``lmcache config validate``
        calls it, so whatever it checks fails there, not when the engine starts). A
        backend with the old one-argument form still works, with a
        :class:`DeprecationWarning` (see :func:`check_backend_options`)."""
        unknown = set(options) - set(cls.OPTIONS)
        if unknown:
            key = sorted(unknown)[0]
            known = ", ".join(sorted(cls.OPTIONS)) or "none"
            hint = near_miss(str(key), list(cls.OPTIONS))
            raise ConfigError(key, f"unknown key for backend {registered_name(cls)!r}{hint or ';'} its keys: {known}")
        return {**cls.OPTIONS, **options}

    # -- single-key methods: implement these
    def contains_one(self, key: str) -> bool:
        raise NotImplementedError

    def get_one(self, key: str) -> MemoryObj | None:
        """A memory object the caller owns (one reference), or ``None``."""
        raise NotImplementedError

    def put_one(self, key: str, obj: MemoryObj) -> int:
        """Store ``obj`` (the caller keeps its reference); return the bytes it takes."""
        raise NotImplementedError

    def remove_one(self, key: str) -> bool:
        raise NotImplementedError

    def keys(self) -> Iterator[tuple[str, int]]:
        """Every stored ``(key, stored bytes)``, for the CLI and for rebuilding indexes."""
        raise NotImplementedError

    def entries(self) -> Iterator[EntryInfo]:
        """Every stored entry with its metadata (codec, time stored) where the backend
        knows it. Derived from :meth:`keys` by default; backends that keep or can cheaply
        read per-entry metadata override it."""
        for key, size in self.keys():
            yield EntryInfo(key, size)

    # -- batch forms: loops by default
    def contains(self, keys: Sequence[str]) -> list[bool]:
        return [self.contains_one(k) for k in keys]

    def get(self, keys: Sequence[str], on_ready: Callable[[int, MemoryObj], None] | None = None) -> list[MemoryObj | None]:
        """One result per key: an object the caller owns (one reference) or ``None``.

        ``on_ready`` is passed only to a backend that declares ``streams_gets = True``
        (the tier never passes it to others, so an override of ``get(keys)`` without it
        keeps working). Such a backend calls ``on_ready(i, obj)`` exactly once per hit
        ``keys[i]``, never for a miss, before ``get`` returns, possibly from its I/O
        threads; ``obj`` is the object also returned at ``i`` (the callback borrows it).
        This default loops over :meth:`get_one` and, if the class declares
        ``streams_gets``, calls ``on_ready(i, obj)`` on the caller's thread right after
        each hit's ``get_one``; otherwise it never calls ``on_ready``. An exception from
        ``on_ready`` is logged, never raised (the hit is still returned)."""
        out: list[MemoryObj | None] = []
        for i, k in enumerate(keys):
            obj = self.get_one(k)
            out.append(obj)
            if obj is not None and on_ready is not None and self.streams_gets:
                try:
                    on_ready(i, obj)
                except Exception:
                    log.exception("tier %s: on_ready for %s failed", self.context.tier, k)
        return out

    def put(self, items: Sequence[tuple[str, MemoryObj]]) -> list[int]:
        return [self.put_one(k, o) for k, o in items]

    def remove(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.remove_one(k)

    # -- the rest
    def reserve_size(self, key: str, obj: MemoryObj) -> int:
        """An upper bound of what ``put_one(key, obj)`` will return."""
        return obj.nbytes

    def in_use(self, key: str) -> bool:
        """True while something outside the backend still reads this entry."""
        return False

    def usage(self) -> Usage:
        n = used = 0
        for _, size in self.keys():
            n += 1
            used += size
        return Usage(used, self.context.capacity, n)

    def close(self) -> None:
        pass

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BytesBackend(StorageBackend):
    """A backend that stores self-describing payload bytes.

    Implement ``read``, ``write``, ``delete``, ``exists`` and ``list``; ``read`` may
    return any bytes-like object.
    """

    supports_bytes: ClassVar[bool] = True

    def __init__(self, context: BackendContext):
        super().__init__(context)
        self.integrity = IntegrityStats()

    def read(self, key: str) -> bytes | bytearray | memoryview | None:
        raise NotImplementedError

    def write(self, key: str, buffers: Sequence[bytes | memoryview]) -> None:
        """Store the concatenation of ``buffers`` under ``key``, atomically."""
        raise NotImplementedError

    def delete(self, key: str) -> bool:
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def list(self) -> Iterator[tuple[str, int]]:
        raise NotImplementedError

    # -- the object contract, in terms of bytes
    def contains_one(self, key: str) -> bool:
        return self.exists(key)

    def get_one(self, key: str) -> MemoryObj | None:
        data = self.read(key)
        if data is None:
            return None
        obj = self.decode_checked(key, data)
        if obj is None:
            try:
                self.delete(key)
            except Exception:  # pragma: no cover - best effort
                log.exception("tier %s: could not delete corrupt entry %s", self.context.tier, key)
        return obj

    def decode_checked(self, key: str, data: bytes | bytearray | memoryview) -> MemoryObj | None:
        """Decode a payload read from the store, or ``None`` if it fails its checks
        (counted in ``integrity`` and logged; the caller deletes the entry). Backends that
        override the batch reads decode through this, so every path drops corrupt data."""
        try:
            return payload.decode(data, key, self.context.codec_lookup, self.context.allocate)
        except CorruptPayloadError as exc:
            self.note_corrupt(key, exc)
            return None

    def note_corrupt(self, key: str, exc: Exception) -> None:
        self.integrity.corrupt += 1
        self.integrity.last_error = str(exc)
        log.warning("tier %s: dropping corrupt entry %s: %s", self.context.tier, key, exc)

    def put_one(self, key: str, obj: MemoryObj) -> int:
        bufs = payload.encode(key, obj, self.context.codec)
        self.write(key, bufs)
        return sum(len(b) for b in bufs)

    def remove_one(self, key: str) -> bool:
        return self.delete(key)

    def keys(self) -> Iterator[tuple[str, int]]:
        return self.list()

    def reserve_size(self, key: str, obj: MemoryObj) -> int:
        return payload.header_overhead(key, len(obj.shape)) + self.context.codec.max_encoded_size(obj.nbytes)
