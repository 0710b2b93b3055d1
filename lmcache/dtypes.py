"""Names of tensor dtypes as they appear in keys and payload headers."""

from __future__ import annotations

import torch

_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
}
_BY_DTYPE = {v: k for k, v in _BY_NAME.items()}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(_BY_NAME)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported by lmcache") from None
