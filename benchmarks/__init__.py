"""The benchmarks and demos behind ``lmcache bench`` and ``lmcache demo``.

One module per benchmark (``tiers``, ``matrix``, ``backends``, ``e2e``, ``vllm``, ``codecs``,
``compare``, ``dist``, ``lookup``) and per demo (``demo``, ``demo_synthetic``,
``demo_distributed``, ``demo_vllm``; ``vllm_live`` runs a live vLLM server), all on one
harness (:mod:`lmcache.benchmarks.harness`: machine info, physical limits, work dirs, child
processes, the table/JSON/plot output). Imports run one way: ``lmcache.cli`` ->
``lmcache.benchmarks`` -> ``lmcache``. The shell scripts next to them (``*.sh``) rerun the
published measurements; ``compare/lmcache_ref.py`` is a plain script run in LMCache's venv.
"""
