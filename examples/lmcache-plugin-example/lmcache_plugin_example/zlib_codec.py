"""The ``zlib`` codec: lossless DEFLATE from the standard library.

A tier selects it with ``codec: zlib`` and may pass ``codec_options: {level: 9}``.
"""

from __future__ import annotations

import zlib
from typing import ClassVar

# Bytes allowed beyond zlib's compressBound(): the bound already counts the 2-byte zlib
# header and 4-byte Adler-32 trailer; this covers any preset-dictionary id and rounding.
_SLACK = 64


def compress_bound(nbytes: int) -> int:
    """zlib's ``compressBound()``: the most ``compress()`` can emit for ``nbytes`` input."""
    return nbytes + (nbytes >> 12) + (nbytes >> 14) + (nbytes >> 25) + 13


class ZlibCodec:
    name: ClassVar[str] = "zlib"
    lossless: ClassVar[bool] = True

    def __init__(self, level: int = 6) -> None:
        if isinstance(level, bool) or not isinstance(level, int) or not -1 <= level <= 9:
            raise ValueError(f"zlib level must be an integer in [-1, 9], got {level!r}")
        self.level = level

    def encode(self, data: memoryview) -> bytes:
        out = zlib.compress(data, self.level)
        if len(out) > self.max_encoded_size(len(data)):
            # Some zlib builds (zlib-ng's fast levels) may expand incompressible input past
            # compressBound(); stored blocks (level 0) never do, so the bound stays true.
            out = zlib.compress(data, 0)
        return out

    def decode(self, data: memoryview, nbytes: int) -> bytes:
        d = zlib.decompressobj()
        try:
            # Ask for one byte more than promised, so that a stream that is too long is
            # noticed without inflating all of it.
            out = d.decompress(data, nbytes + 1)
        except zlib.error as exc:
            raise ValueError(f"zlib payload does not decompress: {exc}") from None
        if len(out) > nbytes:
            raise ValueError(f"zlib payload decompresses to more than the expected {nbytes} bytes")
        if len(out) < nbytes:
            raise ValueError(f"zlib payload decompressed to {len(out)} bytes, expected {nbytes}")
        if not d.eof:
            raise ValueError("zlib payload is truncated")
        if d.unused_data:
            raise ValueError(f"zlib payload has {len(d.unused_data)} bytes after the end of its stream")
        return out

    def max_encoded_size(self, nbytes: int) -> int:
        return compress_bound(nbytes) + _SLACK

    def __repr__(self) -> str:
        return f"ZlibCodec(level={self.level})"
