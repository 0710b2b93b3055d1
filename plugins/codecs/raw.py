"""The ``raw`` codec: bytes stored as they are (zero-copy)."""

from __future__ import annotations

from typing import ClassVar


class RawCodec:
    name: ClassVar[str] = "raw"
    lossless: ClassVar[bool] = True

    def __init__(self) -> None:
        pass

    def encode(self, data: memoryview) -> memoryview:
        return data

    def decode(self, data: memoryview, nbytes: int) -> memoryview:
        if len(data) != nbytes:
            raise ValueError(f"raw payload holds {len(data)} bytes, expected {nbytes}")
        return data

    def max_encoded_size(self, nbytes: int) -> int:
        return nbytes
