"""The ``zstd`` codec: lossless Zstandard compression (python-zstandard)."""

from __future__ import annotations

import threading
from typing import ClassVar

import zstandard


class ZstdCodec:
    name: ClassVar[str] = "zstd"
    lossless: ClassVar[bool] = True

    def __init__(self, level: int = 3, threads: int = 0) -> None:
        if not isinstance(level, int) or not -7 <= level <= 22:
            raise ValueError(f"zstd level must be an integer in [-7, 22], got {level!r}")
        self.level = level
        self.threads = threads
        self._local = threading.local()  # zstd (de)compressors are not thread-safe

    def _c(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = zstandard.ZstdCompressor(level=self.level, threads=self.threads)
        return c

    def _d(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = zstandard.ZstdDecompressor()
        return d

    def encode(self, data: memoryview) -> bytes:
        return self._c().compress(data)

    def decode(self, data: memoryview, nbytes: int) -> bytes:
        try:
            out = self._d().decompress(data, max_output_size=nbytes)
        except zstandard.ZstdError as exc:
            raise ValueError(f"zstd payload does not decompress: {exc}") from None
        if len(out) != nbytes:
            raise ValueError(f"zstd payload decompressed to {len(out)} bytes, expected {nbytes}")
        return out

    def max_encoded_size(self, nbytes: int) -> int:
        # ZSTD_COMPRESSBOUND plus frame header slack
        return nbytes + (nbytes >> 8) + 128
