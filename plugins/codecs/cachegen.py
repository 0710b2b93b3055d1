"""The ``cachegen`` codec: CacheGen-style KV compression in pure torch/numpy.

CacheGen (Liu et al., SIGCOMM 2024) observes that the KV of neighbouring tokens is
similar, so coding each token relative to the previous one leaves small, skewed symbols
that an entropy coder shrinks well. This codec:

1. quantizes to 8 bits the way the ``int8`` codec does (keys per channel over groups of
   ``group_size`` tokens, values per token over groups of ``group_size`` channels; exact
   float32 offsets and steps);
2. replaces each token's codes by their difference (mod 256) from the previous token's,
   per channel, and lays every channel's token sequence out contiguously;
3. entropy-codes scales and deltas with zstd (``level``).

Step 2 is lossless on the codes, so the error is the quantizer's alone: for every
element, ``|x - x'| <= step / 2 + eps(dtype) * (|x| + step) + sub(dtype) / 2`` plus float32
arithmetic (``sub``: the dtype's smallest subnormal; see :meth:`error_bound` and
:mod:`lmcache.plugins.codecs.quant`). Tensors that are not chunk-shaped ``(layers, 2, tokens,
heads, head_size)`` floats with finite values below 2**126 (larger ones would overflow the
float32 steps), and encodings that would not be smaller, are stored as they are. Encoded form: ``b"LMG" | u8 version | u8 mode | u16 group_size``, then
the raw bytes (mode 0) or one zstd frame (mode 1).
"""

from __future__ import annotations

import struct
from typing import ClassVar

import numpy as np
import torch
import zstandard

from .quant import MAX_MAGNITUDE, _bound, _dequantize, _parts, _quantize, bound_by_parts

_HDR = struct.Struct("<3sBBH")
_MAGIC = b"LMG"
_VERSION = 1
RAW, KV = 0, 1
QMAX = 255


def _is_chunk(t: torch.Tensor) -> bool:
    return t.dim() == 5 and t.shape[1] == 2 and t.numel() > 0


class CacheGenCodec:
    name: ClassVar[str] = "cachegen"
    lossless: ClassVar[bool] = False

    def __init__(self, group_size: int = 64, level: int = 3) -> None:
        if not isinstance(group_size, int) or not 1 <= group_size <= 4096:
            raise ValueError(f"cachegen group_size must be an integer in [1, 4096], got {group_size!r}")
        if not isinstance(level, int) or not 1 <= level <= 22:
            raise ValueError(f"cachegen level must be an integer in [1, 22], got {level!r}")
        self.group_size = group_size
        self.level = level

    # ------------------------------------------------------------- byte API
    def _raw(self, data: memoryview) -> bytes:
        return _HDR.pack(_MAGIC, _VERSION, RAW, self.group_size) + bytes(data)

    def encode(self, data: memoryview) -> bytes:
        return self._raw(memoryview(data).cast("B"))

    def _header(self, mv: memoryview) -> tuple[int, int]:
        if len(mv) < _HDR.size:
            raise ValueError(f"cachegen payload too short ({len(mv)} bytes)")
        magic, version, mode, group = _HDR.unpack_from(mv)
        if magic != _MAGIC or version != _VERSION or mode not in (RAW, KV) or group < 1:
            raise ValueError("not a cachegen payload (bad magic, version or header)")
        return mode, group

    def decode(self, data: memoryview, nbytes: int) -> bytes:
        mv = memoryview(data).cast("B")
        mode, _ = self._header(mv)
        if mode != RAW:
            raise ValueError("cachegen payload is quantized; it decodes only with its dtype and shape")
        if len(mv) - _HDR.size != nbytes:
            raise ValueError(f"cachegen payload holds {len(mv) - _HDR.size} bytes, expected {nbytes}")
        return bytes(mv[_HDR.size :])

    def max_encoded_size(self, nbytes: int) -> int:
        return nbytes + _HDR.size  # never larger than raw: it falls back to raw

    # ----------------------------------------------------------- tensor API
    def _lengths(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        l, _, n, h, d = shape
        g = self.group_size
        nk = l * (-(-n // g)) * h * d  # key groups: per channel, along tokens
        nv = l * n * (-(-(h * d) // g))  # value groups: per token, along channels
        return nk, nv, l * n * h * d

    def encode_tensor(self, t: torch.Tensor) -> bytes:
        t = t.detach().cpu().contiguous()
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        if not self._quantizable(t):
            return self._raw(raw)
        l, _, n, h, d = t.shape
        pk, pv = _parts(t.to(torch.float32))  # keys (L, T, H*D); values (L*T, H*D, 1)
        qk, lok, stk = _quantize(pk, self.group_size, QMAX, torch.float32)
        qv, lov, stv = _quantize(pv, self.group_size, QMAX, torch.float32)
        pieces = [lok.numpy().tobytes(), stk.numpy().tobytes(), lov.numpy().tobytes(), stv.numpy().tobytes()]
        for q in (qk.reshape(l, n, h * d), qv.reshape(l, n, h * d)):
            delta = q.to(torch.int16)
            delta[:, 1:] -= q[:, :-1].to(torch.int16)
            pieces.append(torch.remainder(delta, 256).to(torch.uint8).transpose(1, 2).contiguous().numpy().tobytes())
        body = zstandard.ZstdCompressor(level=self.level).compress(b"".join(pieces))
        if len(body) >= len(raw):
            return self._raw(raw)
        return _HDR.pack(_MAGIC, _VERSION, KV, self.group_size) + body

    def decode_tensor(self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        mv = memoryview(data).cast("B")
        mode, group = self._header(mv)
        shape = tuple(int(s) for s in shape)
        if mode == RAW:
            nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
            if len(mv) - _HDR.size != nbytes:
                raise ValueError(f"cachegen payload holds {len(mv) - _HDR.size} bytes, shape {shape} needs {nbytes}")
            out = torch.empty(shape, dtype=dtype)
            if nbytes:
                out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(mv[_HDR.size :], dtype=np.uint8)
            return out
        if len(shape) != 5 or shape[1] != 2 or not dtype.is_floating_point:
            raise ValueError(f"cachegen payload is a KV chunk; cannot decode it as {shape} {dtype}")
        saved, self.group_size = self.group_size, group  # decode with the writer's grouping
        try:
            nk, nv, ncodes = self._lengths(shape)
        finally:
            self.group_size = saved
        want = 4 * 2 * (nk + nv) + 2 * ncodes
        try:
            flat = zstandard.ZstdDecompressor().decompress(mv[_HDR.size :], max_output_size=want)
        except zstandard.ZstdError as exc:
            raise ValueError(f"cachegen payload does not decompress: {exc}") from None
        if len(flat) != want:
            raise ValueError(f"cachegen payload holds {len(flat)} bytes, shape {shape} needs {want}")
        buf = np.frombuffer(flat, dtype=np.uint8)
        off = 0

        def take(count: int, np_dtype) -> np.ndarray:
            nonlocal off
            size = count * np.dtype(np_dtype).itemsize
            out = buf[off : off + size].view(np_dtype)
            off += size
            return out

        l, _, n, h, d = shape
        ngk, ngv = -(-n // group), -(-(h * d) // group)
        lok = torch.from_numpy(take(nk, np.float32).copy()).reshape(l, ngk, h * d)
        stk = torch.from_numpy(take(nk, np.float32).copy()).reshape(l, ngk, h * d)
        lov = torch.from_numpy(take(nv, np.float32).copy()).reshape(l * n, ngv, 1)
        stv = torch.from_numpy(take(nv, np.float32).copy()).reshape(l * n, ngv, 1)
        for s in (lok, stk, lov, stv):
            if not bool(torch.isfinite(s).all()):
                raise ValueError("cachegen payload has invalid scales")
        codes = []
        for _ in range(2):
            delta = torch.from_numpy(take(ncodes, np.uint8).copy()).reshape(l, h * d, n).transpose(1, 2)
            codes.append(torch.remainder(torch.cumsum(delta.to(torch.int64), dim=1), 256).to(torch.uint8))
        k = _dequantize(codes[0], lok, stk, group)
        v = _dequantize(codes[1].reshape(l * n, h * d, 1), lov, stv, group)
        out = torch.empty(shape, dtype=torch.float32)
        out[:, 0] = k.reshape(l, n, h, d)
        out[:, 1] = v.reshape(l, n, h, d)
        return out.to(dtype)

    @staticmethod
    def _quantizable(t: torch.Tensor) -> bool:
        """Float chunks whose values are finite and below ``MAX_MAGNITUDE`` (2**126), so
        the float32 offsets and steps stay finite and the entry decodes."""
        return (t.is_floating_point() and _is_chunk(t) and bool(torch.isfinite(t).all())
                and float(t.float().abs().max()) < MAX_MAGNITUDE)

    def error_bound(self, t: torch.Tensor) -> torch.Tensor:
        """The largest absolute error of each element of ``t`` after a round trip."""

        def part_bound(part: torch.Tensor, eps: float) -> torch.Tensor:
            b, step = _bound(part, self.group_size, QMAX, torch.float32)
            return b + eps * (part.abs() + step)

        return bound_by_parts(t, self._quantizable, part_bound)
