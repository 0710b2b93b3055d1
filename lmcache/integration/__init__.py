"""Module paths that engines and deployments import from upstream LMCache, served by lmcache.

vLLM's built-in ``LMCacheConnectorV1`` imports
``lmcache.integration.vllm.vllm_v1_adapter.LMCacheConnectorV1Impl``; vLLM's examples import
``lmcache.integration.vllm.utils.ENGINE_NAME``. These thin modules delegate to lmcache's own
connectors (:mod:`lmcache.plugins.connectors`), so a deployment written for LMCache runs on
lmcache unchanged (docs/migrating.md).
"""
