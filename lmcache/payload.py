"""The self-describing payload format of every backend that stores bytes.

Layout::

    b"LMCK" | u16 version | u32 header length | u64 xxh3-64 of header | header | body

The header is UTF-8 JSON with the key, codec (``a+b`` for a chain of codecs, see
:mod:`lmcache.codecs`), dtype, shape, raw byte count, body length and the xxh3-64 of the
body. Nothing is pickled. :func:`decode` checks every field and
both checksums; any mismatch raises :class:`CorruptPayloadError`, so corrupt bytes are
never handed to an engine.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import xxhash

from .codecs import Codec, is_tensor_codec
from .dtypes import dtype_from_name, dtype_name
from .errors import CorruptPayloadError
from .memory import MemoryObj

MAGIC = b"LMCK"
VERSION = 1
_PREFIX = struct.Struct("<4sHIQ")
PREFIX_SIZE = _PREFIX.size  # 18
MAX_HEADER = 64 << 10
# enough to read the whole header of any payload in one small read
HEADER_READ_HINT = 4096
#: decimal digits of the largest xxh3-64 value (a header is sized before its body is hashed)
_MAX_HASH_DIGITS = 20


@dataclass(frozen=True)
class Header:
    key: str
    codec: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    body_len: int
    body_xxh3: int
    header_len: int  # bytes before the body

    @property
    def total_len(self) -> int:
        return self.header_len + self.body_len


def header_overhead(key: str, ndim: int) -> int:
    """Upper bound of the header size for a key and tensor rank."""
    return PREFIX_SIZE + 200 + len(key.encode()) * 2 + 24 * ndim


def encode(key: str, obj: MemoryObj, codec: Codec, header_align: int | None = None) -> list:
    """Header and body buffers (zero-copy for the ``raw`` codec) of one payload.

    Tensor codecs (and chains, see :mod:`lmcache.codecs`) get the tensor itself; the
    header's ``codec`` is the codec's name, ``a+b`` for a chain. With ``header_align``
    the header's JSON is padded with spaces (which JSON ignores) so that the body starts
    at a multiple of it: the disk backend's O_DIRECT files, whose body then moves
    between the file and pool memory without a bounce buffer. Every reader reads both."""
    if is_tensor_codec(codec):
        body = codec.encode_tensor(obj.tensor)  # type: ignore[attr-defined]
    else:
        body = codec.encode(memoryview(obj.byte_view().numpy()).cast("B"))
    body_mv = memoryview(body).cast("B") if not isinstance(body, memoryview) else body
    if codec.name == "raw" and not header_align:  # one size for a raw entry, however written
        return [raw_header(key, obj, xxhash.xxh3_64_intdigest(body_mv)), body_mv]
    hdr = _header_json(key, codec.name, obj, len(body_mv), xxhash.xxh3_64_intdigest(body_mv))
    if header_align:
        hdr += b" " * ((-(PREFIX_SIZE + len(hdr))) % header_align)
    return [_prefixed(hdr), body_mv]


def _header_json(key: str, codec: str, obj: MemoryObj, body_len: int, body_xxh3: int) -> bytes:
    return json.dumps(
        {
            "key": key,
            "codec": codec,
            "dtype": dtype_name(obj.dtype),
            "shape": list(obj.shape),
            "nbytes": obj.nbytes,
            "body_len": body_len,
            "body_xxh3": body_xxh3,
        },
        separators=(",", ":"),
    ).encode()


def _prefixed(hdr: bytes) -> bytes:
    return _PREFIX.pack(MAGIC, VERSION, len(hdr), xxhash.xxh3_64_intdigest(hdr)) + hdr


def raw_header_len(key: str, obj: MemoryObj) -> int:
    """The length of :func:`raw_header` for ``key`` and ``obj``, whatever the checksum:
    known before the body is hashed, so that a writer can put the body in place first,
    hashing it as it goes, and the header in front of it last."""
    return PREFIX_SIZE + len(_header_json(key, "raw", obj, obj.nbytes, 0)) + _MAX_HASH_DIGITS - 1


def raw_header(key: str, obj: MemoryObj, body_xxh3: int) -> bytes:
    """The prefix and header of ``obj``'s ``raw`` payload (the body is its bytes as they
    are) whose body hashes to ``body_xxh3``; exactly :func:`raw_header_len` bytes (the
    JSON padded with spaces, which every reader skips, as ``header_align`` does)."""
    hdr = _header_json(key, "raw", obj, obj.nbytes, body_xxh3)
    return _prefixed(hdr + b" " * (raw_header_len(key, obj) - PREFIX_SIZE - len(hdr)))


def parse_header(data: bytes | memoryview) -> Header:
    """Parse and check the header at the start of ``data`` (the body may be absent)."""
    mv = memoryview(data)
    if len(mv) < PREFIX_SIZE:
        raise CorruptPayloadError(f"payload too short ({len(mv)} bytes) for a header")
    magic, version, hlen, hsum = _PREFIX.unpack_from(mv)
    if magic != MAGIC:
        raise CorruptPayloadError(f"bad magic {bytes(magic)!r}; not an lmcache payload")
    if version != VERSION:
        raise CorruptPayloadError(f"unsupported payload format version {version} (this lmcache reads {VERSION})")
    if hlen > MAX_HEADER or PREFIX_SIZE + hlen > len(mv):
        raise CorruptPayloadError(f"header length {hlen} does not fit the payload")
    raw = mv[PREFIX_SIZE : PREFIX_SIZE + hlen]
    if xxhash.xxh3_64_intdigest(raw) != hsum:
        raise CorruptPayloadError("header checksum mismatch")
    try:
        h = json.loads(bytes(raw))
        header = Header(
            key=str(h["key"]),
            codec=str(h["codec"]),
            dtype=str(h["dtype"]),
            shape=tuple(int(x) for x in h["shape"]),
            nbytes=int(h["nbytes"]),
            body_len=int(h["body_len"]),
            body_xxh3=int(h["body_xxh3"]),
            header_len=PREFIX_SIZE + hlen,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptPayloadError(f"malformed header: {exc}") from None
    try:
        itemsize = torch.empty((), dtype=dtype_from_name(header.dtype)).element_size()
    except ValueError as exc:
        raise CorruptPayloadError(str(exc)) from None
    numel = 1
    for d in header.shape:
        if d < 0:
            raise CorruptPayloadError(f"negative dimension in shape {header.shape}")
        numel *= d
    if numel * itemsize != header.nbytes:
        raise CorruptPayloadError(f"shape {header.shape} of {header.dtype} is not {header.nbytes} bytes")
    if header.codec == "raw" and header.body_len != header.nbytes:
        raise CorruptPayloadError(f"raw body of {header.body_len} bytes for a {header.nbytes}-byte tensor")
    if header.body_len < 0:
        raise CorruptPayloadError(f"negative body length {header.body_len}")
    return header


def decode(
    data: bytes | bytearray | memoryview,
    expected_key: str | None,
    codec_lookup: Callable[[str], Codec],
    allocate: Callable[[tuple[int, ...], torch.dtype], MemoryObj],
) -> MemoryObj:
    """Check ``data`` and decode it into a memory object from ``allocate``."""
    header = parse_header(data)
    if expected_key is not None and header.key != expected_key:
        raise CorruptPayloadError(f"payload holds key {header.key!r}, expected {expected_key!r}")
    mv = memoryview(data)
    if len(mv) != header.total_len:
        raise CorruptPayloadError(f"payload is {len(mv)} bytes, header says {header.total_len}")
    body = mv[header.header_len :]
    if xxhash.xxh3_64_intdigest(body) != header.body_xxh3:
        raise CorruptPayloadError("body checksum mismatch")
    try:
        codec = codec_lookup(header.codec)
    except Exception as exc:
        raise CorruptPayloadError(f"payload codec {header.codec!r} is not available: {exc}") from None
    dtype = dtype_from_name(header.dtype)
    # allocated before decoding: ``allocate`` may refuse a size no entry can have, and
    # then no codec has been asked to produce it
    obj = allocate(header.shape, dtype)
    try:
        if is_tensor_codec(codec):
            t = codec.decode_tensor(body, header.shape, dtype)  # type: ignore[attr-defined]
            if tuple(t.shape) != header.shape or t.dtype != dtype:
                raise ValueError(f"decoded {tuple(t.shape)} {t.dtype}, expected {header.shape} {header.dtype}")
            raw = None
        else:
            raw = codec.decode(body, header.nbytes)
            if len(memoryview(raw).cast("B")) != header.nbytes:
                raise ValueError(f"decoded {len(memoryview(raw).cast('B'))} bytes, header says {header.nbytes}")
    except (ValueError, RuntimeError) as exc:  # RuntimeError: torch rejecting a malformed tensor
        obj.unref()
        raise CorruptPayloadError(f"codec {header.codec!r} failed: {exc}") from None
    except BaseException:
        obj.unref()
        raise
    try:
        if raw is None:
            obj.tensor.copy_(t)
        elif header.nbytes:
            obj.byte_view().numpy()[:] = np.frombuffer(raw, dtype=np.uint8)
    except Exception:
        obj.unref()
        raise
    return obj
