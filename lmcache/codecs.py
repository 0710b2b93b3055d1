"""The codec contract: how a tier turns chunk bytes into stored bytes and back.

A codec is a small strategy object injected into a tier; backends never hard-code one.
``encode`` takes the raw bytes of a chunk and returns bytes-like data to store;
``decode`` gets that data back plus the raw length and returns exactly ``nbytes`` bytes.
Lossless codecs must round-trip bit-exactly. The codec's name is written into every
payload header, so data stays readable after a tier's codec is changed.

Tensor codecs (optional extension). A codec that needs the dtype and shape of a chunk
(byte shuffling, quantization) also implements

- ``encode_tensor(t: torch.Tensor) -> bytes-like``: the encoded form of the tensor ``t``;
- ``decode_tensor(data, shape, dtype) -> torch.Tensor``: a tensor of that shape and dtype,
  raising ``ValueError`` on bad input.

The payload layer calls these instead of ``encode``/``decode`` when a codec has them.
The encoded form must be self-describing (a reader builds the codec with default
options), so options that matter for decoding travel in the encoded bytes. Lossy codecs
declare ``lossless = False`` and may declare ``error_bound(t) -> torch.Tensor``, the
largest absolute error of each element of ``t`` after a round trip.

Chains. ``int8+zstd`` (``codec: [int8, zstd]`` in a tier) applies the stages in order on
encode and in reverse on decode; :class:`CodecChain` is itself a codec whose name is the
stage names joined by ``+`` (codec names never contain ``+``), which is what a payload
header records. Only the first stage of a chain sees the tensor; tensor codecs must
therefore come first.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, ClassVar, Mapping, Protocol, Sequence, runtime_checkable

from .errors import LMCacheError

Buffer = "bytes | bytearray | memoryview"
CHAIN_SEP = "+"


class ChainError(LMCacheError, ValueError):
    """A chain of codecs that cannot work (empty, or a tensor codec after the first stage)."""


@runtime_checkable
class Codec(Protocol):
    name: ClassVar[str]
    lossless: ClassVar[bool]

    def encode(self, data: memoryview) -> bytes | bytearray | memoryview:
        """Encoded form of ``data`` (the chunk's raw bytes)."""

    def decode(self, data: memoryview, nbytes: int) -> bytes | bytearray | memoryview:
        """The ``nbytes`` raw bytes that ``data`` encodes; raises ``ValueError`` on bad input."""

    def max_encoded_size(self, nbytes: int) -> int:
        """An upper bound of ``len(encode(x))`` for ``len(x) == nbytes`` (capacity reservations)."""


def is_tensor_codec(codec: object) -> bool:
    """True if ``codec`` implements the optional tensor methods."""
    return callable(getattr(codec, "encode_tensor", None)) and callable(getattr(codec, "decode_tensor", None))


def encode_tensor(codec: object, t: Any) -> bytes | bytearray | memoryview:
    """Encode tensor ``t`` with ``codec``, through its tensor methods where it has them."""
    import torch

    if is_tensor_codec(codec):
        return codec.encode_tensor(t)  # type: ignore[attr-defined]
    return codec.encode(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))  # type: ignore[attr-defined]


def decode_tensor(codec: object, data: memoryview, shape: Sequence[int], dtype: Any):
    """The tensor (``shape``, ``dtype``) that ``data`` encodes; ``ValueError`` on bad input."""
    import numpy as np
    import torch

    if is_tensor_codec(codec):
        t = codec.decode_tensor(data, tuple(shape), dtype)  # type: ignore[attr-defined]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(f"codec {codec.name!r} decoded {tuple(t.shape)} {t.dtype}, expected {tuple(shape)} {dtype}")
        return t
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = itemsize
    for d in shape:
        n *= d
    raw = codec.decode(data, n)  # type: ignore[attr-defined]
    if len(raw) != n:
        raise ValueError(f"codec {codec.name!r} decoded {len(raw)} bytes, expected {n}")  # type: ignore[attr-defined]
    if not n:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy()).view(dtype).reshape(tuple(shape))


class CodecChain:
    """Stages applied in order on encode, in reverse on decode.

    Encoded form: ``u8 n | n-1 x u64 intermediate lengths | body of the last stage``.
    """

    lossless: bool  # instance attribute: lossless only if every stage is

    def __init__(self, stages: Sequence[object]):
        if len(stages) < 1:
            raise ChainError("a codec chain needs at least one codec")
        for i, s in enumerate(stages[1:], 1):
            if is_tensor_codec(s):
                raise ChainError(
                    f"{s.name!r} works on tensors and must be the first codec of a chain (it is number {i + 1})"
                )
        self.stages = list(stages)
        self.name = CHAIN_SEP.join(s.name for s in stages)  # type: ignore[attr-defined]
        self.lossless = all(getattr(s, "lossless", False) for s in stages)
        self._lens = struct.Struct(f"<B{len(stages) - 1}Q")
        eb = getattr(stages[0], "error_bound", None)
        if eb is not None and all(getattr(s, "lossless", False) for s in stages[1:]):
            #: the first stage's per-element error bound (the later stages are lossless)
            self.error_bound = eb

    def __repr__(self) -> str:
        return f"CodecChain({self.name!r})"

    def _finish(self, first: bytes | bytearray | memoryview) -> bytes:
        lens = []
        data = _bytes_view(first)
        for s in self.stages[1:]:
            lens.append(len(data))
            data = _bytes_view(s.encode(data))  # type: ignore[attr-defined]
        return self._lens.pack(len(self.stages), *lens) + bytes(data)

    def _unwind(self, data: memoryview) -> memoryview:
        """Undo every stage but the first; return the first stage's encoded form."""
        mv = memoryview(data).cast("B")
        if len(mv) < self._lens.size:
            raise ValueError(f"{self.name} payload too short ({len(mv)} bytes)")
        n, *lens = self._lens.unpack_from(mv)
        if n != len(self.stages):
            raise ValueError(f"{self.name} payload has {n} stages, expected {len(self.stages)}")
        body = mv[self._lens.size :]
        for s, ln in zip(reversed(self.stages[1:]), reversed(lens)):
            body = _bytes_view(s.decode(body, ln))  # type: ignore[attr-defined]
            if len(body) != ln:
                raise ValueError(f"{s.name} stage of {self.name} decoded {len(body)} bytes, expected {ln}")
        return body

    def encode(self, data: memoryview) -> bytes:
        return self._finish(self.stages[0].encode(data))  # type: ignore[attr-defined]

    def decode(self, data: memoryview, nbytes: int) -> bytes | bytearray | memoryview:
        body = self._unwind(data)
        out = self.stages[0].decode(body, nbytes)  # type: ignore[attr-defined]
        if len(out) != nbytes:
            raise ValueError(f"{self.name} payload decoded to {len(out)} bytes, expected {nbytes}")
        return out

    def encode_tensor(self, t: Any) -> bytes:
        return self._finish(encode_tensor(self.stages[0], t))

    def decode_tensor(self, data: memoryview, shape: Sequence[int], dtype: Any):
        body = self._unwind(data)
        return decode_tensor(self.stages[0], body, shape, dtype)

    def max_encoded_size(self, nbytes: int) -> int:
        for s in self.stages:
            nbytes = s.max_encoded_size(nbytes)  # type: ignore[attr-defined]
        return self._lens.size + nbytes


def _bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    mv = data if isinstance(data, memoryview) else memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def chain_names(spec: str | Sequence[str]) -> list[str]:
    """``"int8+zstd"`` or ``["int8", "zstd"]`` -> ``["int8", "zstd"]``."""
    if isinstance(spec, str):
        return spec.split(CHAIN_SEP)
    return list(spec)


def load_codec(
    load: Callable[[str], type],
    spec: str | Sequence[str],
    options: Mapping[str, Any] | None = None,
) -> object:
    """Build the codec ``spec`` names (one name, ``a+b`` or a list) with ``load(name)`` returning
    the codec class. For one codec, ``options`` are its keyword arguments; for a chain, a
    mapping ``{stage name: {options}}``. Unknown stages raise what ``load`` raises; bad
    options ``TypeError``/``ValueError``; a bad chain ``ValueError``."""
    names = chain_names(spec)
    if not names or any(not n for n in names):
        raise ChainError(f"bad codec chain {spec!r}: empty codec name")
    if len(names) == 1:
        return load(names[0])(**dict(options or {}))
    opts = dict(options or {})
    for k in opts:
        if k not in names:
            raise ValueError(f"codec_options names {k!r}, which is not in the chain {CHAIN_SEP.join(names)}")
        if not isinstance(opts[k], Mapping):
            raise TypeError(f"codec_options.{k} must be a mapping of options, got {opts[k]!r}")
    stages = [load(n)(**dict(opts.get(n) or {})) for n in names]
    return CodecChain(stages)
