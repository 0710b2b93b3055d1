"""vLLM's prefix-cache block hashes, computed without importing vLLM, so that lmcache's
standalone KV-event publisher names a block as vLLM (and a router that joins vLLM's
events with ours) does.

vLLM (``vllm.v1.core.kv_cache_utils.hash_block_tokens``, 0.32 and 0.33) hashes each
full engine block as ``hash_fn((parent, tuple(token_ids), extra_keys))``, where
``parent`` is the previous block's hash, or for the first block ``NONE_HASH =
hash_fn(seed)``; the seed is ``$PYTHONHASHSEED`` when set, else ``"vllm-none-hash"``
(``init_none_hash``). ``hash_fn`` is its ``prefix_caching_hash_algo``:

- ``sha256`` (vLLM's default): SHA-256 of the object pickled with protocol 5
  (``pickle.HIGHEST_PROTOCOL`` on every Python vLLM supports). The bytes CPython's
  pickler writes for the few types a block key holds (tuples of bytes, ints, ``str`` and
  ``None``, under 64 KiB) are written here by :func:`pickle5` without the ``pickle``
  module: nothing is ever unpickled, and the test compares them with ``pickle.dumps``.
- ``sha256_cbor``: SHA-256 of its canonical CBOR encoding (encoded here for the same
  few types, as ``cbor2.dumps(obj, canonical=True)`` writes them).

Only blocks without extra keys (no LoRA, cache salt or multimodal item) are hashed
here: ``extra_keys`` is ``None``. ``xxhash`` variants are not offered, as vLLM seeds
them randomly per process. Equality with vLLM's own functions is checked in
``tests/engines/test_vllm_kv_events.py``.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Any, Callable, Sequence

#: vLLM's seed of ``NONE_HASH`` when ``PYTHONHASHSEED`` is unset (``DEFAULT_NONE_HASH_SEED``)
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
ALGOS = ("sha256", "sha256_cbor")


#: CPython's pickler frames what follows PROTO once it is at least this long (FRAME_SIZE_MIN)
_FRAME_MIN = 4
#: ... and starts a new frame past this many bytes (FRAME_SIZE_TARGET): not written here
_FRAME_MAX = 64 * 1024


def _pickle(obj: Any, out: bytearray) -> None:
    if obj is None:
        out += b"N"
    elif isinstance(obj, bool):
        out += b"\x88" if obj else b"\x89"  # NEWTRUE / NEWFALSE
    elif isinstance(obj, int):
        if 0 <= obj < 1 << 8:
            out += b"K" + bytes((obj,))  # BININT1
        elif 0 <= obj < 1 << 16:
            out += b"M" + struct.pack("<H", obj)  # BININT2
        elif -(1 << 31) <= obj < 1 << 31:
            out += b"J" + struct.pack("<i", obj)  # BININT
        else:  # LONG1: little-endian two's complement, shortest form
            raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
            out += b"\x8a" + bytes((len(raw),)) + raw
    elif isinstance(obj, bytes):
        head = b"C" + bytes((len(obj),)) if len(obj) < 1 << 8 else b"B" + struct.pack("<I", len(obj))
        out += head + obj + b"\x94"  # SHORT_BINBYTES / BINBYTES, MEMOIZE
    elif isinstance(obj, str):
        raw = obj.encode("utf-8", "surrogatepass")
        head = b"\x8c" + bytes((len(raw),)) if len(raw) < 1 << 8 else b"X" + struct.pack("<I", len(raw))
        out += head + raw + b"\x94"  # SHORT_BINUNICODE / BINUNICODE, MEMOIZE
    elif isinstance(obj, tuple):
        if not obj:
            out += b")"  # EMPTY_TUPLE (not memoized)
            return
        if len(obj) > 3:
            out += b"("  # MARK
        for x in obj:
            _pickle(x, out)
        out += (b"\x85", b"\x86", b"\x87")[len(obj) - 1] if len(obj) <= 3 else b"t"
        out += b"\x94"
    else:
        raise TypeError(f"pickle5: cannot encode {type(obj).__name__}")


def pickle5(obj: Any) -> bytes:
    """The bytes ``pickle.dumps(obj, protocol=5)`` writes for ``obj`` made of tuples,
    bytes, ints, str, bool and ``None`` (each object once, as block keys are), under 64 KiB."""
    body = bytearray()
    _pickle(obj, body)
    body += b"."  # STOP
    if len(body) >= _FRAME_MAX:
        raise ValueError(f"pickle5: {len(body)} bytes would span several frames")
    frame = b"\x95" + struct.pack("<Q", len(body)) if len(body) >= _FRAME_MIN else b""
    return b"\x80\x05" + frame + bytes(body)


def sha256(obj: Any) -> bytes:
    """vLLM's ``sha256``: the digest of ``obj`` pickled with protocol 5 (:func:`pickle5`)."""
    return hashlib.sha256(pickle5(obj)).digest()


def _cbor_head(major: int, n: int, out: bytearray) -> None:
    if n < 24:
        out.append(major << 5 | n)
    elif n < 1 << 8:
        out += bytes((major << 5 | 24, n))
    elif n < 1 << 16:
        out += struct.pack(">BH", major << 5 | 25, n)
    elif n < 1 << 32:
        out += struct.pack(">BI", major << 5 | 26, n)
    elif n < 1 << 64:
        out += struct.pack(">BQ", major << 5 | 27, n)
    else:
        raise ValueError(f"cbor: integer {n} does not fit in 64 bits")


def _cbor(obj: Any, out: bytearray) -> None:
    if obj is None:
        out.append(0xF6)
    elif isinstance(obj, bool):
        out.append(0xF5 if obj else 0xF4)
    elif isinstance(obj, int):
        _cbor_head(0, obj, out) if obj >= 0 else _cbor_head(1, -1 - obj, out)
    elif isinstance(obj, bytes):
        _cbor_head(2, len(obj), out)
        out += obj
    elif isinstance(obj, str):
        raw = obj.encode()
        _cbor_head(3, len(raw), out)
        out += raw
    elif isinstance(obj, (tuple, list)):
        _cbor_head(4, len(obj), out)
        for x in obj:
            _cbor(x, out)
    else:
        raise TypeError(f"cbor: cannot encode {type(obj).__name__}")


def sha256_cbor(obj: Any) -> bytes:
    """vLLM's ``sha256_cbor``: the digest of ``obj``'s canonical CBOR encoding."""
    out = bytearray()
    _cbor(obj, out)
    return hashlib.sha256(out).digest()


class BlockHasher:
    """vLLM's chained hashes of full blocks under ``algo`` (one of :data:`ALGOS`)."""

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        fns: dict[str, Callable[[Any], bytes]] = {"sha256": sha256, "sha256_cbor": sha256_cbor}
        if algo not in fns:
            raise ValueError(f"unknown block hash algorithm {algo!r}; expected one of {', '.join(ALGOS)}")
        self.algo = algo
        self._fn = fns[algo]
        if seed is None:
            seed = os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
        #: the parent hash of every prefix's first block (vLLM's ``NONE_HASH``)
        self.none_hash = self._fn(seed)

    def block(self, parent: bytes | None, token_ids: Sequence[int]) -> bytes:
        """The hash of one full block of ``token_ids`` (Python ints) after ``parent``."""
        return self._fn((parent or self.none_hash, tuple(token_ids), None))

    def chain(self, token_ids: Sequence[int], block_size: int, parent: bytes | None = None) -> list[bytes]:
        """The hashes of the full blocks of ``token_ids``; a partial last block has none."""
        out: list[bytes] = []
        for i in range(len(token_ids) // block_size):
            parent = self.block(parent, token_ids[i * block_size : (i + 1) * block_size])
            out.append(parent)
        return out
