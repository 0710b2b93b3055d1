"""Names vLLM's LMCache examples import (``from lmcache.integration.vllm.utils import ENGINE_NAME``)."""

#: the name LMCache's examples give the engine of a vLLM instance
ENGINE_NAME = "vllm-instance"

__all__ = ["ENGINE_NAME"]
