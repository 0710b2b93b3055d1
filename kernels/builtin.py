"""The built-in KV layouts, registered through the same hook as a third-party plugin's."""

from __future__ import annotations

from lmcache.hookspecs import hookimpl

BUILTIN = ("vllm_flash_attn", "blocks_first", "flashinfer_nhd", "flashinfer_hnd", "mla", "contiguous")
_CONSTANTS = {"vllm_flash_attn": "VLLM_FLASH_ATTN", "blocks_first": "BLOCKS_FIRST", "flashinfer_nhd": "FLASHINFER_NHD",
              "flashinfer_hnd": "FLASHINFER_HND", "mla": "MLA", "contiguous": "CONTIGUOUS"}


@hookimpl
def lmcache_register_layouts(registry):
    for name in BUILTIN:
        registry.add(name, f"lmcache.kernels.layouts:{_CONSTANTS[name]}", description=f"KV layout {name}")
