"""Chunk keys and the token processor.

A chunk key is ``(namespace, model, kv signature, chunk hash)``. The chunk hash is a
128-bit hash chained over token ids: ``h_i = H(h_{i-1} || little-endian int64 tokens of
chunk i)`` with ``h_{-1}`` = 16 zero bytes (or a caller-given seed), using xxh3-128 or
blake2b-128. It never depends on Python's ``hash()``, so it is identical across
processes, machines and ``PYTHONHASHSEED`` values.

Canonical string form (used by every backend, the CLI and the controller)::

    lmc1:<namespace>:<model, percent-encoded>:<signature>:<32 hex digits>
"""

from __future__ import annotations

import array
import hashlib
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
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


def as_token_array(tokens: Any) -> np.ndarray:
    """Tokens (list, numpy array or 1-D tensor) as a contiguous little-endian int64 array."""
    if _LITTLE and type(tokens) in (list, tuple):
        # the usual input (token ids from a tokenizer or vLLM): one C loop that accepts
        # only integers, about 1.5x faster than np.asarray (which first discovers the dtype)
        try:
            return np.frombuffer(array.array("q", tokens), dtype="<i8")
        except (TypeError, OverflowError):
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

    def _chain(self, arr: np.ndarray, seed: bytes) -> tuple[list[str], bytes]:
        """Hex hashes of the chunks of ``arr`` (contiguous int64, starting at a chunk
        boundary) chained from ``seed``, and the last raw digest."""
        data = memoryview(arr).cast("B")
        step = self.chunk_size * 8
        digest = self._digest
        prev = seed
        out: list[str] = []
        append = out.append
        for off in range(0, len(data), step):
            prev = digest(prev + data[off : off + step])
            append(prev.hex())
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

    def chunks(self, tokens: Any, seed: bytes = b"\0" * 16) -> list[Chunk]:
        """Chunks of ``tokens`` in order; the last one is partial only if
        ``save_unfull_chunk`` is set."""
        arr = as_token_array(tokens)
        stop = self._stop(len(arr))
        return self._chunks(0, stop, self._chain(arr[:stop], seed)[0])

    def chunk_keys(self, tokens: Any, prefix: str, seed: bytes = b"\0" * 16) -> tuple[list[Chunk], list[str]]:
        """:meth:`chunks` and each chunk's key string, ``prefix`` (from :func:`key_prefix`)
        followed by the chunk hash, in one pass."""
        arr = as_token_array(tokens)
        stop = self._stop(len(arr))
        hashes = self._chain(arr[:stop], seed)[0]
        return self._chunks(0, stop, hashes), [prefix + h for h in hashes]

    def key_batches(
        self, tokens: Any, prefix: str, first: int = 8, growth: int = 4, seed: bytes = b"\0" * 16
    ) -> Iterator[list[str]]:
        """The keys of :meth:`chunk_keys` in consecutive batches of ``first``,
        ``first * growth``, ... chunks. The tokens are hashed (and, given as a list,
        converted) only as far as the caller iterates, so a prefix lookup that stops at its
        first miss pays for the chunks up to that miss, not for the whole prompt. Chunk
        ``i`` ends at token ``min((i + 1) * chunk_size, len(tokens))``."""
        lazy = type(tokens) in (list, tuple)
        arr = None if lazy else as_token_array(tokens)
        stop = self._stop(len(tokens) if arr is None else len(arr))
        cs = self.chunk_size
        start, size, prev = 0, max(1, first), seed
        while start < stop:
            end = min(stop, start + size * cs)
            part = as_token_array(tokens[start:end]) if arr is None else arr[start:end]
            hashes, prev = self._chain(part, prev)
            yield [prefix + h for h in hashes]
            start, size = end, size * growth

    def hashes(self, tokens: Sequence[int]) -> list[str]:
        arr = as_token_array(tokens)
        return self._chain(arr[: self._stop(len(arr))], b"\0" * 16)[0]
