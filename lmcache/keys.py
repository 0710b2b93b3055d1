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

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Sequence
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
    def parse(cls, text: str) -> "CacheKey":
        """Inverse of :meth:`to_string`; raises ``ValueError`` naming what is wrong."""
        parts = text.split(":")
        if len(parts) != 5 or parts[0] != KEY_PREFIX:
            raise ValueError(
                f"not an lmcache key: {text!r} (expected '{KEY_PREFIX}:namespace:model:signature:hash')"
            )
        return cls(parts[1], unquote(parts[2]), parts[3], parts[4])


@dataclass(frozen=True)
class Chunk:
    """One chunk of a token sequence: tokens ``[start, end)`` and its chained hash."""

    start: int
    end: int
    chunk_hash: str

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def as_token_array(tokens: Any) -> np.ndarray:
    """Tokens (list, numpy array or 1-D tensor) as a contiguous little-endian int64 array."""
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # torch.Tensor, imported lazily
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype="<i8")


class TokenProcessor:
    """Splits token sequences into chunks and hashes them as a prefix chain."""

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
            self._digest = lambda b: xxhash.xxh3_128_digest(b)
        elif hash_algorithm == "blake2b":
            self._digest = lambda b: hashlib.blake2b(b, digest_size=16).digest()
        else:
            raise ValueError(f"unknown hash algorithm {hash_algorithm!r}")
        self.hash_algorithm = hash_algorithm

    def chunks(self, tokens: Any, seed: bytes = b"\0" * 16) -> list[Chunk]:
        """Chunks of ``tokens`` in order; the last one is partial only if
        ``save_unfull_chunk`` is set."""
        arr = as_token_array(tokens)
        n = len(arr)
        out: list[Chunk] = []
        prev = seed
        for start in range(0, n, self.chunk_size):
            end = min(start + self.chunk_size, n)
            if end - start < self.chunk_size and not self.save_unfull_chunk:
                break
            prev = self._digest(prev + arr[start:end].tobytes())
            out.append(Chunk(start, end, prev.hex()))
        return out

    def hashes(self, tokens: Sequence[int]) -> list[str]:
        return [c.chunk_hash for c in self.chunks(tokens)]
