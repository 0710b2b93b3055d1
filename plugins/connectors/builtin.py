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
        "vllm",
        "lmcache.plugins.connectors.vllm:LMCacheConnector",
        extra="vllm",
        description="vLLM v1 KV connector (--kv-transfer-config kv_connector_module_path)",
    )
    registry.add(
        "sglang",
        "lmcache.plugins.connectors.sglang:LMCacheHiCacheStorage",
        extra="sglang",
        description="SGLang HiCache storage backend (--hicache-storage-backend dynamic)",
    )
