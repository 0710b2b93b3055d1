"""The lossy ``fp8`` codec: float8 e4m3 with a scale per group (keys per channel, values per token).

The same grouping as ``int8``/``int4`` (:mod:`lmcache.plugins.codecs.quant`): chunk buffers
``(layers, 2, tokens, heads, head_size)`` have their keys scaled per channel (groups of
``group_size`` tokens) and their values per token (groups of ``group_size`` channels); any
other float tensor per row along its last axis. Each group stores one float16 scale
``s >= max|x| / 448`` (rounded up) and each element the e4m3 (``float8_e4m3fn``: 4 exponent,
3 mantissa bits, max 448) value nearest ``x / s``; decoding is ``code * s``.

Error bound (what :meth:`error_bound` returns and the tests check): for every element,

    |x - x'| <= |x| / 16 + s / 1024 + eps(dtype) * 2 * |x| + 2**-20 * (|x| + s)

a relative error of 2**-4 (half a unit in the last of 3 mantissa bits), an absolute
error of half e4m3's smallest subnormal step times ``s`` for values near zero, one rounding
to the tensor's dtype and float32 arithmetic. Unlike int8, the error is relative: small
values keep their precision, large ones lose more (at most 6.25%).

Tensors that are not floating point, hold NaN/inf or values of magnitude 30000 or more
(the float16 scales), or would not get smaller, are stored as they are, as is anything
that reaches the byte API. Encoded form: ``b"LF8" | u8 version | u8 mode | u16 group_size``,
then per part (keys, values, or rows) the float16 scales and one byte per element.
"""

from __future__ import annotations

import struct
from typing import ClassVar

import numpy as np
import torch

from .quant import KV, RAW, ROWS, _groups, _join, _mode, _part_shapes, _parts, _up, bound_by_parts

_HDR = struct.Struct("<3sBBH")
_MAGIC = b"LF8"
_VERSION = 1
FP8_MAX = 448.0


def _scale(xg: torch.Tensor) -> torch.Tensor:
    """float16 scale (as float32) of each group of ``xg`` (A, Ng, g, B): >= amax / 448."""
    amax = xg.abs().amax(2)
    s = _up(amax / FP8_MAX, torch.float16)
    short = s.float() * FP8_MAX < amax
    while bool(short.any()):
        s = torch.where(short, torch.nextafter(s, torch.full_like(s, float("inf"))), s)
        short = s.float() * FP8_MAX < amax
    return s.float()


class Fp8Codec:
    name: ClassVar[str] = "fp8"
    lossless: ClassVar[bool] = False

    def __init__(self, group_size: int = 64) -> None:
        if not isinstance(group_size, int) or not 1 <= group_size <= 4096:
            raise ValueError(f"fp8 group_size must be an integer in [1, 4096], got {group_size!r}")
        self.group_size = group_size

    def _quantizable(self, t: torch.Tensor) -> bool:
        return (t.is_floating_point() and t.numel() > 0 and bool(torch.isfinite(t).all())
                and float(t.abs().max()) < 30000.0)

    def _raw(self, data: memoryview) -> bytes:
        return _HDR.pack(_MAGIC, _VERSION, RAW, self.group_size) + bytes(data)

    def _header(self, mv: memoryview) -> tuple[int, int]:
        if len(mv) < _HDR.size:
            raise ValueError(f"fp8 payload too short ({len(mv)} bytes)")
        magic, version, mode, group = _HDR.unpack_from(mv)
        if magic != _MAGIC or version != _VERSION or mode not in (RAW, KV, ROWS) or group < 1:
            raise ValueError("not an fp8 payload (bad magic, version or header)")
        return mode, group

    # ------------------------------------------------------------- byte API
    def encode(self, data: memoryview) -> bytes:
        return self._raw(memoryview(data).cast("B"))

    def decode(self, data: memoryview, nbytes: int) -> bytes:
        mv = memoryview(data).cast("B")
        mode, _ = self._header(mv)
        if mode != RAW:
            raise ValueError("fp8 payload is quantized; it decodes only with its dtype and shape")
        if len(mv) - _HDR.size != nbytes:
            raise ValueError(f"fp8 payload holds {len(mv) - _HDR.size} bytes, expected {nbytes}")
        return bytes(mv[_HDR.size :])

    def max_encoded_size(self, nbytes: int) -> int:
        return nbytes + _HDR.size

    # ----------------------------------------------------------- tensor API
    def encode_tensor(self, t: torch.Tensor) -> bytes:
        t = t.detach().cpu().contiguous()
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        if not self._quantizable(t):
            return self._raw(raw)
        out = [_HDR.pack(_MAGIC, _VERSION, _mode(t), self.group_size)]
        for part in _parts(t.to(torch.float32)):
            a, n, b = part.shape
            xg, ng = _groups(part, self.group_size)
            s = _scale(xg)
            safe = torch.where(s > 0, s, torch.ones_like(s))
            y = (xg / safe[:, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            codes = y.view(torch.uint8).reshape(a, ng * self.group_size, b)[:, :n]
            out += [s.to(torch.float16).numpy().tobytes(), codes.contiguous().numpy().tobytes()]
        body = b"".join(out)
        return body if len(body) < len(raw) + _HDR.size else self._raw(raw)

    def decode_tensor(self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        mv = memoryview(data).cast("B")
        mode, group = self._header(mv)
        numel = int(np.prod(shape, dtype=np.int64))
        itemsize = torch.empty((), dtype=dtype).element_size()
        if mode == RAW:
            if len(mv) - _HDR.size != numel * itemsize:
                raise ValueError(f"fp8 payload holds {len(mv) - _HDR.size} bytes, expected {numel * itemsize}")
            if not numel:
                return torch.empty(shape, dtype=dtype)
            return torch.from_numpy(np.frombuffer(mv, np.uint8, offset=_HDR.size).copy()).view(dtype).reshape(shape)
        if not dtype.is_floating_point:
            raise ValueError(f"fp8 payload is quantized but the dtype is {dtype}")
        if (KV if len(shape) == 5 and shape[1] == 2 else ROWS) != mode:
            raise ValueError(f"fp8 payload layout does not match shape {shape}")
        off = _HDR.size
        parts = []
        for a, n, b in _part_shapes(tuple(shape)):
            ng = -(-n // group)
            ns, nc = a * ng * b, a * n * b
            if off + 2 * ns + nc > len(mv):
                raise ValueError(f"fp8 payload is shorter than shape {shape} needs")
            s = torch.from_numpy(np.frombuffer(mv, np.float16, ns, off).astype(np.float32)).reshape(a, ng, b)
            if not (bool(torch.isfinite(s).all()) and bool((s >= 0).all())):
                raise ValueError("fp8 payload has invalid scales")
            codes = torch.from_numpy(np.frombuffer(mv, np.uint8, nc, off + 2 * ns).copy()).reshape(a, n, b)
            y = codes.view(torch.float8_e4m3fn).float()
            if not bool(torch.isfinite(y).all()):
                raise ValueError("fp8 payload holds NaN codes")
            full = torch.zeros((a, ng * group, b), dtype=torch.float32)
            full[:, :n] = y
            x = (full.reshape(a, ng, group, b) * s[:, :, None]).reshape(a, ng * group, b)[:, :n]
            parts.append(x)
            off += 2 * ns + nc
        if off != len(mv):
            raise ValueError(f"fp8 payload is {len(mv)} bytes, shape {shape} needs {off}")
        return _join(parts, tuple(shape)).to(dtype)

    def error_bound(self, t: torch.Tensor) -> torch.Tensor:
        """The largest absolute error of each element of ``t`` after a round trip."""

        def part_bound(part: torch.Tensor, eps: float) -> torch.Tensor:
            a, n, b = part.shape
            xg, ng = _groups(part, self.group_size)
            s = _scale(xg)[:, :, None].expand_as(xg).reshape(a, ng * self.group_size, b)[:, :n]
            ax = part.abs()
            return ax / 16 + s / 1024 + eps * 2 * ax + 2.0**-20 * (ax + s)

        return bound_by_parts(t, self._quantizable, part_bound)
