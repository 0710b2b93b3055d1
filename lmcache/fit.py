"""Fitting entries into a backend's declared limits (``max_value_size``, ``max_key_length``).

A backend declares the largest value it accepts in one ``write`` and the longest key (in
UTF-8 bytes) as class attributes of :class:`~lmcache.storage.StorageBackend` (``None``:
unbounded). A tier opens such a backend through :func:`fit`, a view with the same contract
whose entries have any size and any key length:

- an entry whose key and encoded payload fit is stored as it is, under its own key (the
  layout of a backend without limits; nothing changes for it);
- any other entry is stored *bounded*: its payload is cut into parts of at most
  ``max_value_size`` bytes, each under a key ``lmc1:lmcache.part:-:<gen>.<i>:<digest>``,
  and a head ``lmc1:lmcache.head:-:v1:<digest>`` lists them. ``<digest>`` is a 128-bit BLAKE2b of the full key;
  ``<gen>`` is random per write, so a reader never joins the parts of two writes. The
  head holds the full key, and so does the payload's own header: a read checks both, so
  two keys with the same digest can only make each other miss, never hand back the
  other's value (the digest's length is therefore not a safety margin, only what keeps
  such misses out of reach). Parts are written first and the head last; a write replaces
  an older head's parts after its own head is in place.

Reading a bounded entry joins its parts and decodes them with the backend's own checks: a
missing, short or damaged part is a miss, counted in ``integrity`` like any corrupt payload,
and the entry is removed; a partial or foreign value is never handed on. ``keys``,
``entries`` and ``usage`` list each entry once under its full key with the bytes of its
head and parts (part keys are never listed). A key that fits is looked up as a head only
where it can have one: on a store with a value limit that holds entries in parts, which
the first such write says with a small :data:`MARK` entry; a view checks for it at most
every :data:`MARK_RECHECK` seconds. Until then (and always on a store with a key limit
alone) a miss costs one lookup, as on any backend.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from typing import Callable, Iterator, Sequence

from . import payload
from .errors import CorruptPayloadError, EntryPathError, PluginError
from .memory import MemoryObj
from .storage import BytesBackend, EntryInfo, StorageBackend

#: heads and parts are canonical keys (stores that share a namespace with other software
#: list only those) in namespaces of their own, hidden from every listing of the view
HEAD = "lmc1:lmcache.head:-:"
PART = "lmc1:lmcache.part:-:"
HEAD_MAGIC = b"LMCB\x01"
#: the smallest limits a backend may declare (a part key is at most 72 bytes; a head of a
#: key of a few hundred bytes with tens of parts is under 4 KiB)
MIN_KEY_LENGTH = 80
MIN_VALUE_SIZE = 4096
#: written once into a store before its first entry stored in parts: while a view has not
#: seen it, a miss of a key that fits costs no lookup of a head (a peer's first split entry
#: can then read as a miss for up to MARK_RECHECK seconds, never as another value)
MARK = PART + "bounded.0:" + "0" * 32
MARK_RECHECK = 2.0
#: a head lists at most this many parts (bounds what a damaged head can make a reader do)
MAX_PARTS = 1 << 16


def fit(backend: StorageBackend, *, max_value_size: int | None = None, max_key_length: int | None = None) -> StorageBackend:
    """``backend`` itself if it declares no limit (and none is given), else a
    :class:`FittedBackend` view of it. ``max_value_size``/``max_key_length`` tighten the
    backend's own limits (tests use them to exercise splitting at small sizes); they never
    loosen them. Raises :class:`PluginError` for a limit below the minimum or a backend
    that declares one without storing bytes."""
    if isinstance(backend, FittedBackend):  # already a view: tighten its inner backend's
        if max_value_size is None and max_key_length is None:
            return backend
        return fit(backend.inner, max_value_size=_tighter(backend.max_value_size, max_value_size),
                   max_key_length=_tighter(backend.max_key_length, max_key_length))
    value = _tighter(backend.max_value_size, max_value_size)
    key = _tighter(backend.max_key_length, max_key_length)
    if value is None and key is None:
        return backend
    name = f"{type(backend).__module__}:{type(backend).__qualname__}"
    for label, v, lo in (("max_value_size", value, MIN_VALUE_SIZE), ("max_key_length", key, MIN_KEY_LENGTH)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < lo):
            raise PluginError(f"backend {name}: {label} must be None or an integer of at least {lo}, got {v!r}")
    if backend.values != "bytes":
        raise PluginError(f"backend {name} declares size limits but does not store bytes (its values are "
                          f"{backend.values}); only byte stores are split")
    return FittedBackend(backend, value, key)


def _codec_of(buffers: Sequence[bytes | memoryview]) -> str | None:
    """The codec a payload's header names (shown in listings of bounded entries)."""
    try:
        return payload.parse_header(buffers[0]).codec  # payload.encode's first buffer is the header
    except Exception:  # noqa: BLE001 - only shown in listings
        return None


def _tighter(declared: int | None, given: int | None) -> int | None:
    return given if declared is None else declared if given is None else min(declared, given)


def _digest(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def head_key(key: str) -> str:
    """The key of ``key``'s head when it is stored bounded."""
    return f"{HEAD}v1:{_digest(key)}"


def _part_key(key: str, gen: str, i: int) -> str:
    return f"{PART}{gen}.{i}:{_digest(key)}"


def _slices(buffers: Sequence[bytes | memoryview], step: int) -> Iterator[list[memoryview]]:
    """The concatenation of ``buffers`` in pieces of at most ``step`` bytes, without copying."""
    piece: list[memoryview] = []
    room = step
    for b in buffers:
        mv = memoryview(b).cast("B")
        while len(mv):
            take = mv[:room]
            piece.append(take)
            mv = mv[len(take):]
            room -= len(take)
            if room == 0:
                yield piece
                piece, room = [], step
    if piece:
        yield piece


class _Head:
    """A parsed head: the full key, the write's generation and the parts' sizes."""

    def __init__(self, data: bytes | bytearray | memoryview, max_part: int):
        raw = bytes(data)
        if not raw.startswith(HEAD_MAGIC):
            raise CorruptPayloadError("not a bounded entry's head")
        try:
            doc = json.loads(raw[len(HEAD_MAGIC):])
        except ValueError as exc:
            raise CorruptPayloadError(f"unreadable head: {exc}") from None
        key, gen, parts, codec = (doc.get(f) if isinstance(doc, dict) else None for f in ("key", "gen", "parts", "codec"))
        if not (isinstance(key, str) and isinstance(gen, str) and gen.isalnum() and len(gen) <= 16
                and isinstance(parts, list) and 0 < len(parts) <= MAX_PARTS
                and all(isinstance(n, int) and not isinstance(n, bool) and 0 < n <= max_part for n in parts)):
            raise CorruptPayloadError("malformed head")
        self.key, self.gen, self.parts = key, gen, parts
        self.codec = codec if isinstance(codec, str) else None
        self.size = len(raw) + sum(parts)

    @staticmethod
    def encode(key: str, gen: str, parts: Sequence[int], codec: str | None) -> bytes:
        return HEAD_MAGIC + json.dumps({"key": key, "gen": gen, "parts": list(parts), "codec": codec},
                                       separators=(",", ":")).encode()


class FittedBackend(BytesBackend):
    """A byte store seen without its size limits (see the module docstring): the five
    verbs over bytes and nothing else; what is particular to the wrapped store is
    ``inner``'s (no blind delegation of unknown attributes)."""

    def __init__(self, inner: BytesBackend, max_value_size: int | None, max_key_length: int | None):
        # not BytesBackend.__init__: the inner backend is open and its options checked
        self.inner = inner
        self.context = inner.context
        self.options = inner.options
        self.integrity = inner.integrity
        self.max_value_size = max_value_size
        self.max_key_length = max_key_length
        self.shared = inner.shared
        self.parallel_puts = inner.parallel_puts
        self.holds_memory_objects = inner.holds_memory_objects
        self.streams_gets = False  # bounded entries are read whole; the tier then never passes on_ready
        self._marked = False  # the store holds MARK (it never goes away)
        self._mark_checked = float("-inf")
        self._mark_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"fit({self.inner!r}, max_value_size={self.max_value_size}, max_key_length={self.max_key_length})"

    # ------------------------------------------------------------ layout
    def _key_fits(self, key: str) -> bool:
        return self.max_key_length is None or len(key.encode()) <= self.max_key_length

    def _value_fits(self, size: int) -> bool:
        return self.max_value_size is None or size <= self.max_value_size

    def _may_be_bounded(self, key: str) -> bool:
        """Whether ``key`` can have a head: a key over the limit always; one that fits only
        on a store with a value limit that holds entries in parts (:data:`MARK`)."""
        if not self._key_fits(key):
            return True
        return self.max_value_size is not None and self._store_marked()

    def _store_marked(self) -> bool:
        if self._marked:
            return True
        now = time.monotonic()
        with self._mark_lock:
            if not self._marked and now - self._mark_checked >= MARK_RECHECK:
                self._mark_checked = now
                self._marked = bool(self.inner.exists_one(MARK))
            return self._marked

    def _mark(self) -> None:
        """Say in the store that it holds entries in parts (before the first one)."""
        if not self._marked:
            self.inner.put_one(MARK, [HEAD_MAGIC])
            self._marked = True

    def _part_size(self) -> int:
        return self.max_value_size or (1 << 62)

    def _head(self, key: str) -> _Head | None:
        """``key``'s head, ``None`` if absent or another key's (a digest collision: a miss,
        left alone); a damaged head is counted, removed with its parts, and ``None``."""
        data = self.inner.get_one(head_key(key))
        if data is None:
            return None
        try:
            head = _Head(data, self._part_size())
        except CorruptPayloadError as exc:
            self.inner.note_corrupt(key, exc)
            self.inner.delete_one(head_key(key))
            return None
        return head if head.key == key else None

    def _drop_bounded(self, key: str, head: _Head | None = None) -> bool:
        """Remove ``key``'s bounded entry (head first, then its parts); True if there was one."""
        head = head or self._head(key)
        if head is None:
            return False
        self.inner.delete_one(head_key(key))
        self.inner.delete([_part_key(key, head.gen, i) for i in range(len(head.parts))])
        return True

    def _write_bounded(self, key: str, buffers: Sequence[bytes | memoryview], codec: str | None) -> int:
        """Store ``buffers`` as parts and a head; return the bytes they take."""
        self._mark()
        old = self._head(key)
        gen = secrets.token_hex(4)
        sizes: list[int] = []
        try:
            for i, piece in enumerate(_slices(buffers, self._part_size())):
                if i >= MAX_PARTS:
                    raise EntryPathError(f"{key}: more than {MAX_PARTS} parts of {self.max_value_size} bytes")
                self.inner.put_one(_part_key(key, gen, i), piece)
                sizes.append(sum(len(p) for p in piece))
            head = _Head.encode(key, gen, sizes, codec)
            if not self._value_fits(len(head)):
                raise EntryPathError(f"{key}: its head ({len(head)} bytes) is over the backend's max_value_size")
            self.inner.put_one(head_key(key), [head])
        except BaseException:
            self.inner.delete([_part_key(key, gen, i) for i in range(len(sizes))])
            raise
        if self._key_fits(key):
            self.inner.delete_one(key)  # an older copy stored as it is would shadow this one
        if old is not None and old.gen != gen:
            self.inner.delete([_part_key(key, old.gen, i) for i in range(len(old.parts))])
        return len(head) + sum(sizes)

    def _read_bounded(self, key: str) -> bytes | None:
        """The joined payload bytes of ``key``'s bounded entry, or ``None`` (a missing or
        short part is counted as corrupt and the entry removed)."""
        head = self._head(key)
        if head is None:
            return None
        pieces = []
        for i, n in enumerate(head.parts):
            data = self.inner.get_one(_part_key(key, head.gen, i))
            if data is None or len(data) != n:
                got = "missing" if data is None else f"{len(data)} bytes, not {n}"
                self.inner.note_corrupt(key, CorruptPayloadError(f"part {i} of {len(head.parts)} is {got}"))
                self._drop_bounded(key, head)
                return None
            pieces.append(data)
        return b"".join(pieces)

    def _store(self, key: str, buffers: Sequence[bytes | memoryview], codec: str | None, *, stale: bool) -> int:
        size = sum(len(memoryview(b).cast("B")) for b in buffers)
        if self._key_fits(key) and self._value_fits(size):
            self.inner.put_one(key, buffers)
            if stale and self._may_be_bounded(key):
                self._drop_bounded(key)
            return size
        return self._write_bounded(key, buffers, codec)

    # ------------------------------------------------------------ the five verbs, over bytes
    def get(self, keys: Sequence[str], on_ready: Callable[[int, object], None] | None = None) -> list[object]:
        """Keys that fit from the store's own (batched) ``get``; a miss that may be stored
        bounded is joined from its parts."""
        out: list[object] = [None] * len(keys)
        fitting = [i for i, k in enumerate(keys) if self._key_fits(k)]
        for i, data in zip(fitting, self.inner.get([keys[i] for i in fitting]) if fitting else []):
            out[i] = data
        rest = [i for i in range(len(keys)) if out[i] is None and self._may_be_bounded(keys[i])]
        for i, data in zip(rest, self.get_bounded([keys[i] for i in rest]) if rest else []):
            out[i] = data
        return out

    def get_bounded(self, keys: Sequence[str]) -> list[bytes | None]:
        """The joined payloads of ``keys`` stored bounded (``None`` for the others)."""
        heads = self.inner.exists([head_key(k) for k in keys]) if keys else []
        return [self._read_bounded(k) if here else None for k, here in zip(keys, heads)]

    def put(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> list[int]:
        """Values that fit go to the store's own (batched) ``put``, stored as they are; the
        others are stored bounded."""
        sizes = [0] * len(items)
        total = [sum(memoryview(b).nbytes for b in bufs) for _, bufs in items]
        native = [i for i, (k, _) in enumerate(items) if self._key_fits(k) and self._value_fits(total[i])]
        for i, size in zip(native, self.inner.put([items[i] for i in native]) if native else []):
            sizes[i] = size
        chosen = set(native)
        for i, (k, bufs) in enumerate(items):
            if i not in chosen:
                sizes[i] = self._store(k, bufs, _codec_of(bufs), stale=False)
        return sizes

    def put_one(self, key: str, buffers: Sequence[bytes | memoryview]) -> int:
        """One value stored as it is if it fits, bounded otherwise; the other form of the
        key is removed (an operator's re-encoding may move an entry between the two)."""
        return self._store(key, buffers, _codec_of(buffers), stale=True)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        out = [False] * len(keys)
        fitting = [i for i, k in enumerate(keys) if self._key_fits(k)]
        for i, here in zip(fitting, self.inner.exists([keys[i] for i in fitting]) if fitting else []):
            out[i] = here
        rest = [i for i in range(len(keys)) if not out[i] and self._may_be_bounded(keys[i])]
        if rest:
            for i, here in zip(rest, self.inner.exists([head_key(keys[i]) for i in rest])):
                out[i] = here
        return out

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Each key in both forms (stored as it is, bounded); True where either was there."""
        out = [False] * len(keys)
        fitting = [i for i, k in enumerate(keys) if self._key_fits(k)]
        for i, gone in zip(fitting, self.inner.delete([keys[i] for i in fitting]) if fitting else []):
            out[i] = bool(gone)
        rest = [i for i, k in enumerate(keys) if self._may_be_bounded(k)]
        for i, here in zip(rest, self.inner.exists([head_key(keys[i]) for i in rest]) if rest else []):
            if here and self._drop_bounded(keys[i]):
                out[i] = True
        return out

    def keys(self) -> Iterator[tuple[str, int]]:
        for e in self.entries():
            yield e.key, e.size

    def entries(self) -> Iterator[EntryInfo]:
        """Entries stored as they are, then bounded ones (their head read for the full key);
        part keys are never listed, and a key in both forms is listed once."""
        bounded: list[EntryInfo] = []
        seen: set[str] = set()
        for e in self.inner.entries():
            if e.key.startswith(PART):
                continue
            if e.key.startswith(HEAD):
                bounded.append(e)
                continue
            seen.add(e.key)
            yield e
        for e in bounded:
            data = self.inner.get_one(e.key)
            try:
                head = _Head(data, self._part_size()) if data is not None else None
            except CorruptPayloadError:
                continue
            if head is not None and head.key not in seen and head_key(head.key) == e.key:
                yield EntryInfo(head.key, head.size, head.codec, e.stored_at)

    def note_corrupt(self, key: str, exc: Exception) -> None:
        self.inner.note_corrupt(key, exc)

    def key_fits(self, key: str) -> bool:
        """Whether ``key`` is short enough for the store to hold under itself."""
        return self._key_fits(key)

    def may_be_bounded(self, key: str) -> bool:
        """Whether ``key`` may be stored bounded (an object view's fast path reads the
        others from the store itself)."""
        return self._may_be_bounded(key)

    def reserve_size(self, key: str, obj: MemoryObj) -> int:
        size = self.inner.reserve_size(key, obj)
        if self._key_fits(key) and self._value_fits(size):
            return size
        parts = -(-size // self._part_size())
        return size + len(HEAD_MAGIC) + 96 + 2 * len(key.encode()) + 12 * parts

    def in_use(self, key: str) -> bool:
        return self.inner.in_use(key)

    def close(self) -> None:
        self.inner.close()
