"""The codec contract: how a tier turns chunk bytes into stored bytes and back.

A codec is a small strategy object injected into a tier; backends never hard-code one.
``encode`` takes the raw bytes of a chunk and returns bytes-like data to store;
``decode`` gets that data back plus the raw length and returns exactly ``nbytes`` bytes.
Lossless codecs must round-trip bit-exactly. The codec's name is written into every
payload header, so data stays readable after a tier's codec is changed.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

Buffer = "bytes | bytearray | memoryview"


@runtime_checkable
class Codec(Protocol):
    name: ClassVar[str]
    lossless: ClassVar[bool]

    def encode(self, data: memoryview) -> "bytes | bytearray | memoryview":
        """Encoded form of ``data`` (the chunk's raw bytes)."""

    def decode(self, data: memoryview, nbytes: int) -> "bytes | bytearray | memoryview":
        """The ``nbytes`` raw bytes that ``data`` encodes; raises ``ValueError`` on bad input."""

    def max_encoded_size(self, nbytes: int) -> int:
        """An upper bound of ``len(encode(x))`` for ``len(x) == nbytes`` (capacity reservations)."""
