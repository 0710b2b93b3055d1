"""Chunk keys and the token processor.

A chunk key is ``(namespace, model, kv signature, chunk hash)``. The chunk hash is a
128-bit hash chained over token ids: ``h_i = H(h_{i-1} || little-endian int64 tokens of
chunk i)`` with ``h_{-1}`` = 16 zero bytes (or a caller-given seed), using xxh3-128 or
blake2b-128. It never depends on Python's ``hash()``, so it is identical across
processes, machines and ``PYTHONHASHSEED`` values.

A request whose KV depends on more than its token ids (a vLLM ``cache_salt``, a LoRA
adapter, images behind placeholder tokens) hashes with a :class:`KeyExtra`: its ``scope``
replaces ``h_{-1}`` and each multimodal item alters ``h_{i-1}`` of every chunk it
overlaps, so such a request shares no chunk key with one of another scope or other
items, while a request with no extra keeps exactly the keys above.

Canonical string form (used by every backend, the CLI and the controller)::

    lmc1:<namespace>:<model, percent-encoded>:<signature>:<32 hex digits>
"""

from __future__ import annotations

import array
import hashlib
import re
import struct
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple
from urllib.parse import quote, unquote

import numpy as np
import xxhash

KEY_PREFIX = "lmc1"
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_SIG = re.compile(r"^[A-Za-z0-9._-]+$")
_NS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True, order=True)
class CacheKey:
    namespace: str
    model: str
    signature: str
    chunk_hash: str  # 32 lowercase hex digits

    def __post_init__(self) -> None:
        if not _NS.match(self.namespace):
            raise ValueError(f"bad namespace {self.namespace!r}")
        if not self.model:
            raise ValueError("model must not be empty")
        if not _SIG.match(self.signature):
            raise ValueError(f"bad kv signature {self.signature!r}")
        if not _HEX32.match(self.chunk_hash):
            raise ValueError(f"bad chunk hash {self.chunk_hash!r}: expected 32 lowercase hex digits")

    def to_string(self) -> str:
        return ":".join(
            (KEY_PREFIX, self.namespace, quote(self.model, safe="-_.~"), self.signature, self.chunk_hash)
        )

    __str__ = to_string

    @classmethod
    def parse(cls, text: str) -> CacheKey:
        """Inverse of :meth:`to_string`; raises ``ValueError`` naming what is wrong."""
        parts = text.split(":")
        if len(parts) != 5 or parts[0] != KEY_PREFIX:
            raise ValueError(
                f"not an lmcache key: {text!r} (expected '{KEY_PREFIX}:namespace:model:signature:hash')"
            )
        return cls(parts[1], unquote(parts[2]), parts[3], parts[4])


class Chunk(NamedTuple):
    """One chunk of a token sequence: tokens ``[start, end)`` and its chained hash.

    A named tuple rather than a dataclass: a 128k-token prompt makes 512 of them per
    store, retrieve and lookup, and a tuple is built about three times faster."""

    start: int
    end: int
    chunk_hash: str

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


_new_chunk = tuple.__new__
_LITTLE = sys.byteorder == "little"


#: a list of tokens is packed this many at a time (one ``struct`` call each; the call's
#: argument tuple, 64 KiB, stays below the sizes malloc maps afresh on every call)
PACK_BATCH = 8192
_PACK = struct.Struct(f"<{PACK_BATCH}q")


def pack_tokens(tokens: list[int] | tuple[int, ...]) -> np.ndarray:
    """A list of Python ints as a little-endian int64 array, ``struct`` packing it straight
    into the array (in batches of :data:`PACK_BATCH`): about twice ``array('q', tokens)``'s
    rate from a few hundred tokens up (docs/benchmarks.md#measurements-behind-the-code);
    only integers (or ``__index__`` objects) within int64 pass, anything else raises
    ``struct.error``.

    The call goes through ``functools.partial`` so that the tokens become the call's
    argument tuple once (``pack_into(arr, 0, *tokens)`` copies them into a list first,
    then into the tuple)."""
    n = len(tokens)
    arr = np.empty(n, dtype="<i8")
    if n <= PACK_BATCH:
        partial(struct.Struct(f"<{n}q").pack_into, arr, 0)(*tokens)
        return arr
    full = n - n % PACK_BATCH
    for i in range(0, full, PACK_BATCH):
        partial(_PACK.pack_into, arr, i * 8)(*tokens[i : i + PACK_BATCH])
    if full < n:
        partial(struct.Struct(f"<{n - full}q").pack_into, arr, full * 8)(*tokens[full:])
    return arr


def as_token_array(tokens: Any) -> np.ndarray:
    """Tokens (list, numpy array or 1-D tensor) as a contiguous little-endian int64 array."""
    if type(tokens) in (list, tuple):
        # the usual input (token ids from a tokenizer or vLLM): C loops that accept only
        # integers, faster than np.asarray, which first discovers the dtype
        try:
            if len(tokens) >= 256:
                return pack_tokens(tokens)
            if _LITTLE:
                return np.frombuffer(array.array("q", tokens), dtype="<i8")
        except (TypeError, OverflowError, struct.error):
            pass  # not all int64: the general path below says what is wrong
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # torch.Tensor, imported lazily
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype="<i8")


def key_prefix(namespace: str, model: str, signature: str) -> str:
    """The part of every chunk key before the hash (``lmc1:ns:model:sig:``), checked once;
    ``key_prefix(...) + chunk_hash == CacheKey(..., chunk_hash).to_string()``."""
    CacheKey(namespace, model, signature, "0" * 32)  # raises ValueError naming a bad part
    return ":".join((KEY_PREFIX, namespace, quote(model, safe="-_.~"), signature, ""))


#: bounds of a :class:`KeyExtra` (so of its wire form, at most ``MAX_EXTRA_BYTES``)
MAX_SCOPE_BYTES = 64
MAX_ITEM_ID_BYTES = 64
MAX_ITEMS = 1024
_EXTRA_HEAD = struct.Struct("<BBH")  # format version, scope length, item count
_ITEM_HEAD = struct.Struct("<IIB")  # start, length, id length
MAX_EXTRA_BYTES = _EXTRA_HEAD.size + MAX_SCOPE_BYTES + MAX_ITEMS * (_ITEM_HEAD.size + MAX_ITEM_ID_BYTES)
_SCOPE_TAG = b"lmcache-scope\0"
_ITEMS_TAG = b"lmcache-items\0"


@dataclass(frozen=True)
class KeyExtra:
    """What, besides its token ids, decides a request's KV, folded into its chunk keys.

    ``scope`` (at most :data:`MAX_SCOPE_BYTES`; e.g. a digest of a vLLM request's
    ``cache_salt`` and LoRA adapter) holds for the whole request: the chain starts from
    ``H(tag || scope)`` instead of 16 zero bytes, so no chunk of it shares a key with a
    request of another scope. ``items`` are ``(start, length, id)`` token ranges whose
    KV depends on ``id`` (an image's hash behind its placeholder tokens; at most
    :data:`MAX_ITEMS`, ids of at most :data:`MAX_ITEM_ID_BYTES`): the hash of each chunk
    an item overlaps chains from ``H(tag || h_{i-1} || the items there)``, so the chunks
    before the first item keep the keys the tokens alone give and every chunk from it on
    differs between requests with other items. An empty extra changes nothing. Bad
    values raise ``ValueError`` naming the field.
    """

    scope: bytes = b""
    items: tuple[tuple[int, int, bytes], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.scope, bytes) or len(self.scope) > MAX_SCOPE_BYTES:
            raise ValueError(f"key extra: scope must be at most {MAX_SCOPE_BYTES} bytes")
        if len(self.items) > MAX_ITEMS:
            raise ValueError(f"key extra: {len(self.items)} items, at most {MAX_ITEMS}")
        for i, item in enumerate(self.items):
            start, length, ident = item
            if not (0 <= start < 1 << 32 and 0 < length < 1 << 32):
                raise ValueError(f"key extra: item {i} covers [{start}, {start}+{length}): not a token range")
            if not isinstance(ident, bytes) or not 0 < len(ident) <= MAX_ITEM_ID_BYTES:
                raise ValueError(f"key extra: item {i}'s id must be 1 to {MAX_ITEM_ID_BYTES} bytes")

    def __bool__(self) -> bool:
        return bool(self.scope or self.items)

    def to_bytes(self) -> bytes:
        """The wire form (little endian): ``<BBH`` (version 1, scope length, item count),
        the scope, then per item ``<IIB`` (start, length, id length) and the id."""
        parts = [_EXTRA_HEAD.pack(1, len(self.scope), len(self.items)), self.scope]
        for start, length, ident in self.items:
            parts += (_ITEM_HEAD.pack(start, length, len(ident)), ident)
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> KeyExtra:
        """Inverse of :meth:`to_bytes`; ``ValueError`` for anything else (trailing bytes too)."""
        if len(data) > MAX_EXTRA_BYTES:
            raise ValueError(f"key extra: {len(data)} bytes, at most {MAX_EXTRA_BYTES}")
        try:
            version, scope_len, count = _EXTRA_HEAD.unpack_from(data, 0)
            if version != 1:
                raise ValueError(f"key extra: unknown format version {version}")
            at = _EXTRA_HEAD.size + scope_len
            scope, items = bytes(data[_EXTRA_HEAD.size : at]), []
            for _ in range(min(count, MAX_ITEMS + 1)):
                start, length, id_len = _ITEM_HEAD.unpack_from(data, at)
                at += _ITEM_HEAD.size
                items.append((start, length, bytes(data[at : at + id_len])))
                at += id_len
        except struct.error:
            raise ValueError("key extra: truncated") from None
        if at != len(data):
            raise ValueError("key extra: truncated or trailing bytes")
        return cls(scope, tuple(items))

    def seed(self, digest: Any) -> bytes:
        """``h_{-1}`` of this extra's chains under ``digest``."""
        return digest(_SCOPE_TAG + self.scope) if self.scope else b"\0" * 16

    def marks(self, chunk_size: int, stop: int) -> dict[int, bytes]:
        """Chunk index -> the bytes of the items overlapping it (chunks end at ``stop``)."""
        out: dict[int, list[bytes]] = {}
        for start, length, ident in self.items:
            end = min(start + length, stop)
            if start >= end:
                continue
            for i in range(start // chunk_size, -(-end // chunk_size)):
                rel = start - i * chunk_size  # vLLM's offset within the block (may be negative)
                out.setdefault(i, []).append(struct.pack("<qIB", rel, length, len(ident)) + ident)
        return {i: b"".join(v) for i, v in out.items()}


def _blake2b_128(data: Any) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class TokenProcessor:
    """Splits token sequences into chunks and hashes them as a prefix chain.

    The chain is sequential by definition (each hash covers the previous one), so one
    hash call per chunk is the floor; around it there is no per-token Python work: the
    tokens are converted once, and each chunk is a slice of one memoryview."""

    def __init__(
        self,
        chunk_size: int = 256,
        save_unfull_chunk: bool = True,
        hash_algorithm: str = "xxh3_128",
    ):
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        self.chunk_size = chunk_size
        self.save_unfull_chunk = save_unfull_chunk
        if hash_algorithm == "xxh3_128":
            self._digest = xxhash.xxh3_128_digest
        elif hash_algorithm == "blake2b":
            self._digest = _blake2b_128
        else:
            raise ValueError(f"unknown hash algorithm {hash_algorithm!r}")
        self.hash_algorithm = hash_algorithm
        #: chunks hashed so far (the tests count them: a request's chunk is hashed once)
        self.hashed_chunks = 0

    def _chain(self, arr: np.ndarray, seed: bytes, marks: dict[int, bytes] | None = None,
               first: int = 0) -> tuple[list[str], bytes]:
        """Hex hashes of the chunks of ``arr`` (contiguous int64, starting at chunk
        ``first``) chained from ``seed``, and the last raw digest; ``marks`` (chunk index
        -> bytes, from :meth:`KeyExtra.marks`) alter the chain before their chunks."""
        data = memoryview(arr).cast("B")
        step = self.chunk_size * 8
        digest = self._digest
        prev = seed
        out: list[str] = []
        append = out.append
        for i, off in enumerate(range(0, len(data), step), first):
            if marks and i in marks:
                prev = digest(_ITEMS_TAG + prev + marks[i])
            prev = digest(prev + data[off : off + step])
            append(prev.hex())
        self.hashed_chunks += len(out)
        return out, prev

    def _stop(self, n: int) -> int:
        return n if self.save_unfull_chunk else n - n % self.chunk_size

    def _chunks(self, start: int, stop: int, hashes: list[str]) -> list[Chunk]:
        """Chunk tuples for ``hashes``, the chunks of tokens ``[start, stop)``."""
        cs = self.chunk_size
        out = [_new_chunk(Chunk, (s, s + cs, h)) for s, h in zip(range(start, stop, cs), hashes)]
        if out and out[-1].end != stop:  # the partial last chunk
            s, _, h = out[-1]
            out[-1] = _new_chunk(Chunk, (s, stop, h))
        return out

    def _start(self, extra: KeyExtra | None, stop: int) -> tuple[bytes, dict[int, bytes] | None]:
        """The chain's seed and marks for ``extra`` over chunks ending at ``stop``."""
        if not extra:
            return b"\0" * 16, None
        return extra.seed(self._digest), extra.marks(self.chunk_size, stop)

    def chunks(self, tokens: Any, extra: KeyExtra | None = None) -> list[Chunk]:
        """Chunks of ``tokens`` in order; the last one is partial only if
        ``save_unfull_chunk`` is set."""
        arr = as_token_array(tokens)
        stop = self._stop(len(arr))
        return self._chunks(0, stop, self._chain(arr[:stop], *self._start(extra, stop))[0])

    def chunk_keys(self, tokens: Any, prefix: str, extra: KeyExtra | None = None) -> tuple[list[Chunk], list[str]]:
        """:meth:`chunks` and each chunk's key string, ``prefix`` (from :func:`key_prefix`)
        followed by the chunk hash, in one pass."""
        arr = as_token_array(tokens)
        stop = self._stop(len(arr))
        hashes = self._chain(arr[:stop], *self._start(extra, stop))[0]
        return self._chunks(0, stop, hashes), [prefix + h for h in hashes]

    def key_batches(
        self, tokens: Any, prefix: str, first: int = 8, growth: int = 4, extra: KeyExtra | None = None,
        resume: tuple[int, str] | None = None,
    ) -> Iterator[list[str]]:
        """The keys of :meth:`chunk_keys` in consecutive batches of ``first``,
        ``first * growth``, ... chunks. The tokens are hashed (and, given as a list,
        converted) only as far as the caller iterates, so a prefix lookup that stops at its
        first miss pays for the chunks up to that miss, not for the whole prompt. Chunk
        ``i`` ends at token ``min((i + 1) * chunk_size, len(tokens))``. ``resume``
        ``(n, key)``: the first ``n`` full chunks are known, the last of them keyed ``key``
        (a key of these tokens under ``prefix``): the chain goes on from there."""
        lazy = type(tokens) in (list, tuple)
        arr = None if lazy else as_token_array(tokens)
        stop = self._stop(len(tokens) if arr is None else len(arr))
        cs = self.chunk_size
        prev, marks = self._start(extra, stop)
        start, size = 0, max(1, first)
        if resume is not None and resume[0] > 0:
            start, prev = resume[0] * cs, bytes.fromhex(resume[1][len(prefix):])
        while start < stop:
            end = min(stop, start + size * cs)
            part = as_token_array(tokens[start:end]) if arr is None else arr[start:end]
            hashes, prev = self._chain(part, prev, marks, start // cs)
            yield [prefix + h for h in hashes]
            start, size = end, size * growth

    def hashes(self, tokens: Sequence[int]) -> list[str]:
        arr = as_token_array(tokens)
        return self._chain(arr[: self._stop(len(arr))], b"\0" * 16)[0]
