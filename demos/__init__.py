"""The demos of ``lmcache demo`` (:mod:`lmcache.demos.commands`, an entry point of the group
``lmcache.commands``): the model demo (:mod:`~lmcache.demos.model`), the storage-only one
(:mod:`~lmcache.demos.synthetic`), the distributed walk-through
(:mod:`~lmcache.demos.distributed`) and a live ``vllm serve`` (:mod:`~lmcache.demos.vllm_serve`).

They import the benchmarks' harness and workload (:mod:`lmcache.benchmarks.harness`,
:mod:`lmcache.benchmarks.handbook`) and the core; nothing imports them but the command's
entry point.
"""
