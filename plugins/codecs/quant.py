"""Lossy group quantization of KV chunks: the ``int8`` and ``int4`` codecs (KIVI-style).

Chunk buffers are ``(layers, 2, tokens, heads, head_size)``; index 0 of axis 1 holds keys,
index 1 values. Following KIVI (Liu et al., 2024), keys are quantized **per channel**
(one scale and offset per channel for each group of ``group_size`` consecutive tokens:
key outliers live in fixed channels) and values **per token** (one scale and offset per
token for each group of ``group_size`` consecutive channels, channels being
``heads x head_size``). Any other float tensor is quantized per row along its last axis.

Quantization is asymmetric: each group stores an offset ``lo`` and a step ``step`` with
``lo <= min(group)`` and ``lo + (2**bits - 1) * step >= max(group)``; an element is kept
as the code ``q = round((x - lo) / step)`` and read back as ``x' = lo + q * step``. The
offsets and steps are stored as float16 (``scale_dtype: float16``, the default; the offset
rounded down and the step up, so they still cover the group) or exactly as float32
(``scale_dtype: float32``). So ``step`` is the group's range ``(max - min) / (2**bits - 1)``
— 1/255 of it for int8, 1/15 for int4 — enlarged by at most float16's rounding (about
2**-10 relative, plus ``|min| * 2**-10 / (2**bits - 1)`` from the rounded offset).
Error bound (what :meth:`error_bound` returns, computed from the stored steps, and what
the tests check): for every element,

    |x - x'| <= step / 2 + eps(dtype) * (|x| + step) + sub(dtype) / 2
               + 2**-20 * (|lo| + |lo + qmax * step|)

i.e. half a quantization step of its group, plus one rounding of the result to the
tensor's dtype (``eps`` = 2**-8 for bf16, 2**-11 for fp16, 2**-24 for fp32, relative;
``sub`` its smallest subnormal, 2**-24 for fp16, for results too small for ``eps`` to
hold), plus float32 arithmetic. Tensors with values of magnitude 30000 or more (float16
scales) or 2**126 or more (float32 scales, whose steps would overflow) are stored as
they are.

Tensors that are not floating point, hold NaN/inf, or would not get smaller are stored
as they are (lossless), as is everything that reaches the byte API (no dtype known),
so the codec is safe anywhere; put it first in a chain (``[int8, zstd]``) for it to act.

Encoded form: ``b"LMQ" | u8 version | u8 mode | u8 bits | u16 group_size | u8 scale
dtype`` then, for a quantized tensor, the offsets and steps of the key groups, codes of the keys, then
the same for values (or for the rows); codes are one per byte (int8) or two per byte
(int4, low nibble first). The decoder checks every length against the shape it is given.
"""

from __future__ import annotations

import struct
from typing import Callable, ClassVar

import numpy as np
import torch

_HDR = struct.Struct("<3sBBBHB")
_MAGIC = b"LMQ"
_VERSION = 1
RAW, KV, ROWS = 0, 1, 2
_SCALE_DTYPES = {"float32": (0, torch.float32, np.float32), "float16": (1, torch.float16, np.float16)}
_SCALE_CODES = {code: (t, n) for code, t, n in _SCALE_DTYPES.values()}
_EPS = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float64: 2.0**-53}
#: half the smallest subnormal of each dtype: the most one rounding to it loses near zero,
#: where the relative ``eps`` does not hold
_HALF_SUB = {torch.float32: 2.0**-150, torch.float16: 2.0**-25, torch.bfloat16: 2.0**-134, torch.float64: 0.0}
#: float32 offsets and steps of values below this magnitude stay finite (a group's range
#: ``max - min`` and ``lo + qmax * step`` below float32's 2**128); larger values are stored as they are
MAX_MAGNITUDE = 2.0**126


def _groups(x: torch.Tensor, g: int) -> tuple[torch.Tensor, int]:
    """``x`` (A, N, B) -> (A, Ng, g, B), padding N with its last element."""
    a, n, b = x.shape
    ng = -(-n // g)
    pad = ng * g - n
    if pad:
        x = torch.cat([x, x[:, -1:].expand(a, pad, b)], 1)
    return x.reshape(a, ng, g, b), ng


def _down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) in ``dtype``, rounded toward -inf."""
    y = x.to(dtype)
    return torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, float("-inf"))), y)


def _up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = x.to(dtype)
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def _scales(xg: torch.Tensor, qmax: int, sdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Offset and step of each group of ``xg`` (A, Ng, g, B), as stored in ``sdt``: the offset
    rounded down and the step up, so that ``[lo, lo + qmax * step]`` covers the group."""
    lo = xg.amin(2)
    hi = xg.amax(2)
    if sdt == torch.float32:
        return lo, (hi - lo) / qmax
    lo_s = _down(lo, sdt)
    step = _up((hi - lo_s.float()) / qmax, sdt)
    # float32 arithmetic may leave the top of the range a hair short: widen until it covers
    short = lo_s.float() + step.float() * qmax < hi
    while bool(short.any()):
        step = torch.where(short, torch.nextafter(step, torch.full_like(step, float("inf"))), step)
        short = lo_s.float() + step.float() * qmax < hi
    return lo_s.float(), step.float()


def _quantize(x: torch.Tensor, g: int, qmax: int, sdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` float32 (A, N, B), groups of ``g`` along N -> codes u8 (A, N, B), lo, step (A, Ng, B)."""
    a, n, b = x.shape
    xg, ng = _groups(x, g)
    lo, step = _scales(xg, qmax, sdt)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round((xg - lo[:, :, None]) / safe[:, :, None]).clamp_(0, qmax).to(torch.uint8)
    return q.reshape(a, ng * g, b)[:, :n], lo, step


def _dequantize(q: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, g: int) -> torch.Tensor:
    a, n, b = q.shape
    ng = lo.shape[1]
    full = torch.zeros((a, ng * g, b), dtype=torch.float32)
    full[:, :n] = q
    x = full.reshape(a, ng, g, b) * step[:, :, None] + lo[:, :, None]
    return x.reshape(a, ng * g, b)[:, :n]


def _bound(x: torch.Tensor, g: int, qmax: int, sdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    a, n, b = x.shape
    xg, ng = _groups(x, g)
    lo, step = _scales(xg, qmax, sdt)
    lo, step = lo[:, :, None], step[:, :, None]
    extra = 2.0**-20 * (lo.abs() + (lo + step * qmax).abs())
    return (step / 2 + extra).expand_as(xg).reshape(a, ng * g, b)[:, :n], step.expand_as(xg).reshape(a, ng * g, b)[:, :n]


def _part_shapes(shape: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """The (A, N, B) arrays a tensor of ``shape`` is quantized as; groups run along N."""
    if len(shape) == 5 and shape[1] == 2:
        l, _, n, h, d = shape
        return [(l, n, h * d), (l * n, h * d, 1)]  # keys: per channel; values: per token
    c = shape[-1] if shape else 1
    numel = int(np.prod(shape, dtype=np.int64))
    return [(numel // c if c else 0, c, 1)]


def _parts(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` as the (A, N, B) arrays of :func:`_part_shapes` (copies where needed)."""
    shapes = _part_shapes(tuple(t.shape))
    if len(shapes) == 2:
        return [t[:, 0].reshape(shapes[0]), t[:, 1].reshape(shapes[1])]
    return [t.reshape(shapes[0])]


def _join(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`_parts`."""
    if len(parts) == 2:
        out = torch.empty(shape, dtype=parts[0].dtype)
        sub = (shape[0], shape[2], shape[3], shape[4])
        out[:, 0] = parts[0].reshape(sub)
        out[:, 1] = parts[1].reshape(sub)
        return out
    return parts[0].reshape(shape)


def bound_by_parts(
    t: torch.Tensor,
    quantizable: Callable[[torch.Tensor], bool],
    part_bound: Callable[[torch.Tensor, float], torch.Tensor],
) -> torch.Tensor:
    """Per-element error bound of a lossy codec: zeros for a tensor it stores as it is,
    else ``part_bound(part, eps)`` of each float32 part of :func:`_parts`, joined back,
    plus half the dtype's smallest subnormal; ``eps`` (relative) and that half step
    (absolute, for results near zero) bound together one rounding to the tensor's dtype."""
    t = t.detach().cpu()
    if not quantizable(t):
        return torch.zeros(t.shape, dtype=torch.float32)
    eps = _EPS.get(t.dtype, 2.0**-8)
    parts = _parts(t.to(torch.float32).contiguous())
    return _join([part_bound(p, eps) for p in parts], tuple(t.shape)) + _HALF_SUB.get(t.dtype, 0.0)


def _mode(t: torch.Tensor) -> int:
    return KV if t.dim() == 5 and t.shape[1] == 2 else ROWS


class _GroupQuantCodec:
    name: ClassVar[str]
    lossless: ClassVar[bool] = False
    bits: ClassVar[int]

    def __init__(self, group_size: int = 64, scale_dtype: str = "float16") -> None:
        if not isinstance(group_size, int) or not 1 <= group_size <= 4096:
            raise ValueError(f"{self.name} group_size must be an integer in [1, 4096], got {group_size!r}")
        if scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"{self.name} scale_dtype must be one of {', '.join(_SCALE_DTYPES)}, got {scale_dtype!r}")
        self.group_size = group_size
        self.scale_dtype = scale_dtype
        self._scode, self._sdt, self._snp = _SCALE_DTYPES[scale_dtype]
        self.qmax = (1 << self.bits) - 1

    def _fits_scales(self, x: torch.Tensor) -> bool:
        """Offsets and steps need values well inside their dtype's range: below 30000
        for float16, below :data:`MAX_MAGNITUDE` for float32 (else a step is inf and the
        entry could never decode)."""
        return float(x.abs().max()) < (MAX_MAGNITUDE if self._sdt == torch.float32 else 30000.0)

    # -------------------------------------------------------------- packing
    def _pack(self, q: torch.Tensor) -> bytes:
        flat = q.reshape(-1).numpy()
        if self.bits == 8:
            return flat.tobytes()
        if len(flat) % 2:
            flat = np.append(flat, np.uint8(0))
        return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8).tobytes()

    def _packed_len(self, n: int) -> int:
        return n if self.bits == 8 else (n + 1) // 2

    def _unpack(self, buf: np.ndarray, n: int) -> np.ndarray:
        if self.bits == 8:
            return buf
        out = np.empty(len(buf) * 2, dtype=np.uint8)
        out[0::2] = buf & 0x0F
        out[1::2] = buf >> 4
        return out[:n]

    # ------------------------------------------------------------- byte API
    def _raw(self, data: memoryview) -> bytes:
        return _HDR.pack(_MAGIC, _VERSION, RAW, self.bits, self.group_size, self._scode) + bytes(data)

    def encode(self, data: memoryview) -> bytes:
        return self._raw(memoryview(data).cast("B"))

    def _header(self, mv: memoryview) -> tuple[int, int, int]:
        if len(mv) < _HDR.size:
            raise ValueError(f"{self.name} payload too short ({len(mv)} bytes)")
        magic, version, mode, bits, group, scode = _HDR.unpack_from(mv)
        if magic != _MAGIC or version != _VERSION:
            raise ValueError(f"not a {self.name} payload (bad magic or version)")
        if mode not in (RAW, KV, ROWS) or bits != self.bits or group < 1 or scode not in _SCALE_CODES:
            raise ValueError(f"{self.name} payload has a bad header (mode {mode}, bits {bits}, group {group})")
        return mode, scode, group

    def decode(self, data: memoryview, nbytes: int) -> bytes:
        mv = memoryview(data).cast("B")
        mode, _, _ = self._header(mv)
        if mode != RAW:
            raise ValueError(f"{self.name} payload is quantized; it decodes only with its dtype and shape")
        if len(mv) - _HDR.size != nbytes:
            raise ValueError(f"{self.name} payload holds {len(mv) - _HDR.size} bytes, expected {nbytes}")
        return bytes(mv[_HDR.size :])

    def max_encoded_size(self, nbytes: int) -> int:
        return nbytes + _HDR.size

    # ----------------------------------------------------------- tensor API
    def _quantizable(self, t: torch.Tensor) -> bool:
        return (t.is_floating_point() and t.numel() > 0 and bool(torch.isfinite(t).all())
                and self._fits_scales(t.float()))

    def encode_tensor(self, t: torch.Tensor) -> bytes:
        t = t.detach().cpu().contiguous()
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        if not self._quantizable(t):
            return self._raw(raw)
        x = t.to(torch.float32)
        out = [_HDR.pack(_MAGIC, _VERSION, _mode(t), self.bits, self.group_size, self._scode)]
        for part in _parts(x):
            q, lo, step = _quantize(part, self.group_size, self.qmax, self._sdt)
            out += [lo.to(self._sdt).numpy().tobytes(), step.to(self._sdt).numpy().tobytes(), self._pack(q)]
        body = b"".join(out)
        return body if len(body) < len(raw) + _HDR.size else self._raw(raw)

    def decode_tensor(self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        mv = memoryview(data).cast("B")
        mode, scode, group = self._header(mv)
        _, snp = _SCALE_CODES[scode]
        ssize = np.dtype(snp).itemsize
        numel = int(np.prod(shape, dtype=np.int64))
        itemsize = torch.empty((), dtype=dtype).element_size()
        if mode == RAW:
            if len(mv) - _HDR.size != numel * itemsize:
                raise ValueError(f"{self.name} payload holds {len(mv) - _HDR.size} bytes, expected {numel * itemsize}")
            if not numel:
                return torch.empty(shape, dtype=dtype)
            buf = np.frombuffer(mv, dtype=np.uint8, offset=_HDR.size).copy()
            return torch.from_numpy(buf).view(dtype).reshape(shape)
        if not dtype.is_floating_point:
            raise ValueError(f"{self.name} payload is quantized but the dtype is {dtype}")
        if (KV if len(shape) == 5 and shape[1] == 2 else ROWS) != mode:
            raise ValueError(f"{self.name} payload layout does not match shape {shape}")
        off = _HDR.size
        parts = []
        for a, n, b in _part_shapes(tuple(shape)):
            ng = -(-n // group)
            nlo = a * ng * b
            ncode = a * n * b
            need = 2 * ssize * nlo + self._packed_len(ncode)
            if off + need > len(mv):
                raise ValueError(f"{self.name} payload is shorter than shape {shape} needs")
            lo = torch.from_numpy(np.frombuffer(mv, snp, nlo, off).astype(np.float32)).reshape(a, ng, b)
            step = torch.from_numpy(np.frombuffer(mv, snp, nlo, off + ssize * nlo).astype(np.float32)).reshape(a, ng, b)
            codes = self._unpack(np.frombuffer(mv, np.uint8, self._packed_len(ncode), off + 2 * ssize * nlo), ncode)
            if self.bits == 4 and ncode % 2 and codes.size and (np.frombuffer(mv, np.uint8, 1, off + need - 1)[0] >> 4):
                raise ValueError(f"{self.name} payload has a bad padding nibble")
            q = torch.from_numpy(codes.astype(np.uint8)).reshape(a, n, b)
            if not (bool(torch.isfinite(lo).all()) and bool(torch.isfinite(step).all()) and bool((step >= 0).all())):
                raise ValueError(f"{self.name} payload has invalid scales")
            parts.append(_dequantize(q, lo, step, group))
            off += need
        if off != len(mv):
            raise ValueError(f"{self.name} payload is {len(mv)} bytes, shape {shape} needs {off}")
        return _join(parts, tuple(shape)).to(dtype)

    def error_bound(self, t: torch.Tensor) -> torch.Tensor:
        """The largest absolute error of each element of ``t`` after a round trip."""

        def part_bound(part: torch.Tensor, eps: float) -> torch.Tensor:
            b, step = _bound(part, self.group_size, self.qmax, self._sdt)
            return b + eps * (part.abs() + step)

        return bound_by_parts(t, self._quantizable, part_bound)


class Int8Codec(_GroupQuantCodec):
    name: ClassVar[str] = "int8"
    bits: ClassVar[int] = 8


class Int4Codec(_GroupQuantCodec):
    name: ClassVar[str] = "int4"
    bits: ClassVar[int] = 4
