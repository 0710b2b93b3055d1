"""Keys and memory objects the conformance suites store (re-exported by
:mod:`lmcache.testing`)."""

from __future__ import annotations

import torch

from ..keys import CacheKey
from ..memory import MemoryPool


def make_key(i: int, namespace: str = "test", model: str = "org/model") -> str:
    """A valid canonical key string, distinct for each ``i``."""
    return CacheKey(namespace, model, "float16-L2-H2-D8-lt2hd-tp0of1", f"{i:032x}").to_string()


def make_obj(seed: int, num_tokens: int = 16, dtype: torch.dtype = torch.float16):
    """A heap memory object with chunk layout and deterministic random content."""
    g = torch.Generator().manual_seed(seed)
    obj = MemoryPool.allocate_unpooled((2, 2, num_tokens, 2, 8), dtype)
    obj.tensor.copy_(torch.randn(obj.shape, generator=g).to(dtype))
    return obj


#: a real chunk: Llama-3.2-1B's KV (16 layers, 8 KV heads of 64) over 256 tokens, float16: 8 MiB
REAL_CHUNK_SHAPE = (16, 2, 256, 8, 64)
#: a Hugging Face-style model name of 200 characters; keys built from it are ~280 bytes
LONG_MODEL = ("an-organisation-with-a-rather-long-name/"
              + "Meta-Llama-3.1-8B-Instruct-abliterated-finetuned-on-long-context-code-and-math-"
              + "GPTQ-INT4-group128-act-order-true-calibrated-on-c4-with-8192-tokens-revision-main")[:200]


def make_chunk(seed: int, shape: tuple[int, ...] = REAL_CHUNK_SHAPE, dtype: torch.dtype = torch.float16):
    """A heap memory object of ``shape`` (a real chunk by default) with deterministic content."""
    g = torch.Generator().manual_seed(seed)
    obj = MemoryPool.allocate_unpooled(shape, dtype)
    obj.tensor.copy_(torch.randn(shape, generator=g).to(dtype))
    return obj
