"""Built-in engine connectors, registered through the same hook as third-party ones."""

from lmcache.hookspecs import hookimpl


@hookimpl
def lmcache_register_connectors(registry):
    registry.add(
        "transformers",
        "lmcache.plugins.connectors.hf:TransformersConnector",
        extra="hf",
        description="a Hugging Face causal LM (CPU or GPU)",
    )
    registry.add(
        "sglang",
        "lmcache.plugins.connectors.sglang:LMCacheHiCacheStorage",
        extra="sglang",
        description="SGLang HiCache storage backend (--hicache-storage-backend dynamic)",
    )
