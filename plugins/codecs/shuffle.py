"""The ``shuffle`` codec: a lossless byte-plane transform for a following compressor.

Element bytes are regrouped by position: all first bytes, then all second bytes, ...
(HDF5/Blosc "shuffle"). The high bytes of fp16/bf16/fp32 values (sign, exponent) are
far more alike than the low mantissa bytes, so ``codec: [shuffle, zstd]`` compresses KV
better than ``zstd`` alone. On its own it does not shrink anything.

Encoded form: ``b"SHF" | u8 itemsize | planes | tail`` where the tail (``nbytes %
itemsize`` bytes) is kept as is. Through the tensor API the itemsize is the tensor's
element size; through the byte API it is the ``itemsize`` option (default 2).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

_MAGIC = b"SHF"
_HDR = len(_MAGIC) + 1


def _shuffle(buf: np.ndarray, itemsize: int) -> bytes:
    n = len(buf) // itemsize * itemsize
    planes = buf[:n].reshape(-1, itemsize).T.tobytes() if itemsize > 1 else buf[:n].tobytes()
    return _MAGIC + bytes([itemsize]) + planes + buf[n:].tobytes()


def _unshuffle(data: memoryview, nbytes: int) -> np.ndarray:
    mv = memoryview(data).cast("B")
    if len(mv) < _HDR or bytes(mv[:3]) != _MAGIC:
        raise ValueError("not a shuffle payload (bad magic)")
    itemsize = mv[3]
    if not 1 <= itemsize <= 16:
        raise ValueError(f"shuffle payload has a bad itemsize {itemsize}")
    if len(mv) - _HDR != nbytes:
        raise ValueError(f"shuffle payload holds {len(mv) - _HDR} bytes, expected {nbytes}")
    buf = np.frombuffer(mv, dtype=np.uint8, offset=_HDR)
    n = nbytes // itemsize * itemsize
    out = np.empty(nbytes, dtype=np.uint8)
    out[:n] = buf[:n].reshape(itemsize, -1).T.reshape(-1) if n else buf[:0]
    out[n:] = buf[n:]
    return out


class ShuffleCodec:
    name: ClassVar[str] = "shuffle"
    lossless: ClassVar[bool] = True

    def __init__(self, itemsize: int = 2) -> None:
        if not isinstance(itemsize, int) or not 1 <= itemsize <= 16:
            raise ValueError(f"shuffle itemsize must be an integer in [1, 16], got {itemsize!r}")
        self.itemsize = itemsize

    def encode(self, data: memoryview) -> bytes:
        return _shuffle(np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8), self.itemsize)

    def decode(self, data: memoryview, nbytes: int) -> bytes:
        return _unshuffle(data, nbytes).tobytes()

    def encode_tensor(self, t: torch.Tensor) -> bytes:
        buf = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        return _shuffle(buf, t.element_size())

    def decode_tensor(self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.empty((), dtype=dtype).element_size() * int(np.prod(shape, dtype=np.int64))
        out = _unshuffle(data, nbytes)
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(out).view(dtype).reshape(shape)

    def max_encoded_size(self, nbytes: int) -> int:
        return nbytes + _HDR
