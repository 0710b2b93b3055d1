"""The storage contract: one vocabulary at every level.

A store answers five verbs, batch first, over canonical key strings
(:meth:`lmcache.keys.CacheKey.to_string`):

=====================  ==========================================================
``exists(keys)``       ``list[bool]``
``get(keys)``          ``list[value | None]``: a missing key is ``None``, never an
                       exception
``put(items)``         ``list[int]``: the bytes each ``(key, value)`` takes (0: not
                       stored)
``delete(keys)``       ``list[bool]``: whether each key was there
``keys()``             every ``(key, stored bytes)``
=====================  ==========================================================

with single-key forms ``exists_one``, ``get_one``, ``put_one`` and ``delete_one``. A class
implements one form of each pair, batch or single, and the other is derived from it
(checked when the class is created: :class:`Store`). The same verbs, with the same
shapes, are spoken by a backend, a tier (:class:`lmcache.tier.Tier`), the hierarchy and
the chunk gateway; the domain verbs (lookup, store, retrieve, release) belong to the
engine alone.

What a store holds is its *value*:

- :class:`StorageBackend`: :class:`~lmcache.memory.MemoryObj` values (the cpu tier keeps
  references into the memory pool);
- :class:`BytesBackend`: payload bytes (``get`` returns any bytes-like object, ``put``
  takes a sequence of buffers stored as their concatenation, atomically). A tier opens
  such a store through :class:`lmcache.encoded.Encoded`, the wrapper that encodes and
  checks payloads with the tier's codec and the self-describing header of
  :mod:`lmcache.payload` (a payload that fails its checks is removed and reported as a
  miss) and fits them into the store's declared limits (:mod:`lmcache.fit`). A store
  that can decode in place (disk reads into pool memory) names its own subclass of it
  in :attr:`BytesBackend.objects_view`.

What a backend can do is declared (``supports_bytes``, ``holds_memory_objects``,
``shared``, ``streams_gets``, ``parallel_puts``, ``max_value_size``,
``max_key_length``); code asks these, never ``isinstance``. Backends written against the
contract before this one (``contains``/``remove`` and, on byte stores,
``read``/``write``/``delete(key)``/``exists(key)``/``list``) are adapted when their class
is created, with one :class:`DeprecationWarning` (:mod:`lmcache.storage_legacy`).

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

from . import payload, storage_legacy
from .codecs import Codec, load_codec
from .errors import ConfigError
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


class Store:
    """The five verbs (see the module docstring), each batch form derived from its
    single-key form and back: a subclass overrides one of each pair (``exists`` or
    ``exists_one``, ``get`` or ``get_one``, ``put`` or ``put_one``, ``delete`` or
    ``delete_one``) and ``keys``. A class that overrides neither form of a pair is a
    :class:`TypeError` when it is created; a base that leaves them to its subclasses says
    so with ``class Base(Store, abstract=True)``."""

    #: the pairs of which a concrete store overrides at least one form
    PAIRS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("exists", "exists_one"), ("get", "get_one"), ("put", "put_one"), ("delete", "delete_one"))

    def __init_subclass__(cls, abstract: bool = False, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        storage_legacy.adapt(cls, Store)
        if abstract:  # the contract's own bases: what they define of the pairs is a default
            for pair in cls.PAIRS:
                _DEFAULTS.update(cls.__dict__[n] for n in pair if n in cls.__dict__)
            return
        missing = [f"{a} or {b}" for a, b in cls.PAIRS
                   if getattr(cls, a) in _DEFAULTS and getattr(cls, b) in _DEFAULTS]
        if missing:
            raise TypeError(f"store {cls.__module__}:{cls.__qualname__} must implement {', '.join(missing)} "
                            "(see lmcache.storage)")

    # -- batch forms, from the single-key ones
    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [self.exists_one(k) for k in keys]

    def get(self, keys: Sequence[str], on_ready: Callable[[int, Any], None] | None = None) -> list[Any]:
        """One value per key or ``None``. On a :class:`StorageBackend` each object is the
        caller's (one reference); ``on_ready`` is described there."""
        return [self.get_one(k) for k in keys]

    def put(self, items: Sequence[tuple[str, Any]]) -> list[int]:
        return [self.put_one(k, v) for k, v in items]

    def delete(self, keys: Sequence[str]) -> list[bool]:
        return [self.delete_one(k) for k in keys]

    def keys(self) -> Iterator[tuple[str, int]]:
        """Every stored ``(key, stored bytes)``, for the CLI and for rebuilding indexes."""
        raise NotImplementedError

    # -- single-key forms, from the batch ones
    def exists_one(self, key: str) -> bool:
        return self.exists([key])[0]

    def get_one(self, key: str) -> Any:
        return self.get([key])[0]

    def put_one(self, key: str, value: Any) -> int:
        return self.put([(key, value)])[0]

    def delete_one(self, key: str) -> bool:
        return self.delete([key])[0]


#: the pairs' forms the contract's bases define (each derived from the other form)
_DEFAULTS: set[Any] = {f for pair in Store.PAIRS for n in pair for f in (Store.__dict__[n],)}


class StorageBackend(Store, abstract=True):
    """Base class of storage backends. See the module docstring for the contract."""

    #: backend-specific config keys and their defaults; unknown keys are config errors
    OPTIONS: ClassVar[Mapping[str, Any]] = {}
    #: True if the backend stores self-describing payload bytes: a :class:`BytesBackend`,
    #: or the :class:`~lmcache.encoded.Encoded` view a tier opens it through (its ``store``:
    #: the bytes). Values over its size limits are then split (:mod:`lmcache.fit`) and
    #: ``lmcache compress`` can re-encode its entries. Code asks this, never ``isinstance``.
    supports_bytes: ClassVar[bool] = False
    #: What the store's values are: ``"objects"`` (:class:`MemoryObj`) or ``"bytes"``
    #: (payload bytes: a :class:`BytesBackend`, which a tier opens through its object view).
    values: ClassVar[str] = "objects"
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
    #: The largest value, in bytes, a :class:`BytesBackend` accepts in one ``put`` (an
    #: encoded payload); ``None``: unbounded. Larger payloads are split into parts of at
    #: most this size (:mod:`lmcache.fit`), so ``put`` is never handed more; the store
    #: must accept any value up to it.
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

    def entries(self) -> Iterator[EntryInfo]:
        """Every stored entry with its metadata (codec, time stored) where the backend
        knows it. Derived from :meth:`keys` by default; backends that keep or can cheaply
        read per-entry metadata override it."""
        for key, size in self.keys():
            yield EntryInfo(key, size)

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


class BytesBackend(StorageBackend, abstract=True):
    """A store of self-describing payload bytes: the five verbs over bytes.

    ``get`` returns any bytes-like object per key (``None``: missing); ``put`` takes
    ``(key, buffers)`` items and stores each concatenation atomically, returning the bytes
    each takes; ``exists``, ``delete`` and ``keys`` as on every store. A tier opens it
    through :attr:`objects_view` (:class:`lmcache.encoded.Encoded` unless the class names
    a subclass), which encodes, checks and fits payloads. A store that finds a value it
    can never hand back (a foreign type under one of its keys) counts it with
    :meth:`note_corrupt` and reports a miss.
    """

    supports_bytes: ClassVar[bool] = True
    values: ClassVar[str] = "bytes"
    #: the object view a tier opens this store through: a subclass of
    #: :class:`lmcache.encoded.Encoded` (``None``: that class itself)
    objects_view: ClassVar[type | None] = None

    def __init__(self, context: BackendContext):
        super().__init__(context)
        self.integrity = IntegrityStats()

    get = Store.get  # the plain loop again: a byte store's reads stream through its object view

    def note_corrupt(self, key: str, exc: Exception) -> None:
        """Count and log a payload that failed its checks (the caller deletes it)."""
        self.integrity.corrupt += 1
        self.integrity.last_error = str(exc)
        log.warning("tier %s: dropping corrupt entry %s: %s", self.context.tier, key, exc)

    def reserve_size(self, key: str, obj: MemoryObj) -> int:
        """An upper bound of the bytes ``obj``'s payload takes under ``key``."""
        return payload.header_overhead(key, len(obj.shape)) + self.context.codec.max_encoded_size(obj.nbytes)
