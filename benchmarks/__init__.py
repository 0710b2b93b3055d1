"""The benchmarks behind ``lmcache bench`` (:mod:`lmcache.benchmarks.commands`, an entry point
of the group ``lmcache.commands``: the command itself never imports them).

One module per benchmark (``tiers``, ``matrix``, ``backends``, ``e2e``, ``vllm``, ``codecs``,
``compare``, ``dist``, ``lookup``, ``truncation``, ``channel``, ``pd``; ``vllm_live`` runs a
live vLLM server), all on one harness (:mod:`lmcache.benchmarks.harness`: machine info,
physical limits, work dirs, child processes; the table/JSON/plot output comes from
:mod:`lmcache.cli.console`) and, for the model, one workload (:mod:`lmcache.benchmarks.handbook`,
shared with :mod:`lmcache.demos`). Imports run one way: ``lmcache.demos`` ->
``lmcache.benchmarks`` -> ``lmcache.cli.console`` -> ``lmcache``. The shell scripts next to
them (``*.sh``) rerun the published measurements; ``compare/lmcache_ref.py`` is a plain
script run in LMCache's venv.
"""
