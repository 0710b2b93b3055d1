"""vLLM's import paths into LMCache (see :mod:`lmcache.integration`)."""
