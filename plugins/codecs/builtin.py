"""Built-in codecs, registered through the same hook as third-party codecs."""

from lmcache.hookspecs import hookimpl


@hookimpl
def lmcache_register_codecs(registry):
    registry.add("raw", "lmcache.plugins.codecs.raw:RawCodec", description="bytes as they are (zero-copy)")
    registry.add("zstd", "lmcache.plugins.codecs.zstd:ZstdCodec", description="lossless Zstandard")
    registry.add(
        "shuffle", "lmcache.plugins.codecs.shuffle:ShuffleCodec",
        description="lossless byte-plane shuffle; use before zstd: [shuffle, zstd]",
    )
    registry.add(
        "int8", "lmcache.plugins.codecs.quant:Int8Codec",
        description="lossy 8-bit group quantization (keys per channel, values per token)",
    )
    registry.add(
        "int4", "lmcache.plugins.codecs.quant:Int4Codec",
        description="lossy 4-bit group quantization (keys per channel, values per token)",
    )
    registry.add(
        "fp8", "lmcache.plugins.codecs.fp8:Fp8Codec",
        description="lossy float8 e4m3 with a scale per group (keys per channel, values per token)",
    )
    registry.add(
        "cachegen", "lmcache.plugins.codecs.cachegen:CacheGenCodec",
        description="lossy CacheGen-style: 8-bit quantization, token deltas, zstd entropy coding",
    )
