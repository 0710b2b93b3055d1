"""Built-in codecs, registered through the same hook as third-party codecs."""

from lmcache.hookspecs import hookimpl


@hookimpl
def lmcache_register_codecs(registry):
    registry.add("raw", "lmcache.plugins.codecs.raw:RawCodec", description="bytes as they are (zero-copy)")
    registry.add("zstd", "lmcache.plugins.codecs.zstd:ZstdCodec", description="lossless Zstandard")
