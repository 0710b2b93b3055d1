"""The module named by the ``lmcache`` entry point of this package.

It only registers names: each target is a ``"module:Class"`` string that lmcache imports
the first time a tier asks for it, so discovering this plugin costs one small import.
"""

from lmcache import hookimpl


@hookimpl
def lmcache_register_backends(registry):
    registry.add(
        "sqlite",
        "lmcache_plugin_example.sqlite_backend:SQLiteBackend",
        description="payloads as rows of one SQLite database file",
    )


@hookimpl
def lmcache_register_codecs(registry):
    registry.add(
        "zlib",
        "lmcache_plugin_example.zlib_codec:ZlibCodec",
        description="lossless zlib (DEFLATE) from the standard library",
    )


@hookimpl
def lmcache_register_bench_baselines(registry):
    # what `lmcache bench tiers --backend sqlite` compares the backend with
    registry.add("sqlite", "lmcache_plugin_example.bench:raw_baseline")
