"""Built-in storage backends, registered through the same hook as third-party ones.

Their raw-client baselines for ``lmcache bench tiers --backend`` and the launchers of their
loopback servers (for tests and the benchmark; neither is part of the backend contract) are
registered here too, through ``lmcache_register_bench_baselines`` and
``lmcache_register_store_launchers`` (targets in :mod:`lmcache.testing.stores`, imported only
when a store is started).

Backends with an optional client library name the extra that installs it: loading one
without its client fails with ``pip install 'lmcache[<extra>]'``.
"""

from lmcache.hookspecs import hookimpl


@hookimpl
def lmcache_register_backends(registry):
    registry.add("cpu", "lmcache.backends.cpu:CPUBackend", description="host memory (the memory pool)")
    registry.add("disk", "lmcache.backends.disk:DiskBackend", description="one file per chunk in a local directory")
    registry.add("redis", "lmcache.backends.redis:RedisBackend", extra="redis",
                 description="Redis standalone, cluster or sentinel (redis-py)")
    registry.add("valkey", "lmcache.backends.valkey:ValkeyBackend", extra="valkey",
                 description="Valkey standalone or cluster (valkey-py)")
    registry.add("s3", "lmcache.backends.s3:S3Backend", extra="s3",
                 description="an S3 bucket or any S3-compatible store (boto3)")
    registry.add("fs", "lmcache.backends.fs:FSBackend", extra="fs",
                 description="a shared filesystem (NFS) or any fsspec URL")
    registry.add("gds", "lmcache.backends.gds:GDSBackend",
                 description="GPUDirect Storage files (kvikio when installed, else O_DIRECT)")
    registry.add("mooncake", "lmcache.backends.mooncake:MooncakeBackend", extra="mooncake",
                 description="a Mooncake distributed store")
    registry.add("lm", "lmcache.backends.lm:LMBackend", description="an lmcache server (lm://host:port)")


@hookimpl
def lmcache_register_bench_baselines(registry):
    for name in ("redis", "valkey", "s3", "fs", "mooncake", "lm"):
        registry.add(name, f"lmcache.benchmarks.raw_baselines:{name}")


@hookimpl
def lmcache_register_store_launchers(registry):
    for name, target in (
        ("redis", "redis:redis_store"),
        ("redis-cluster", "redis:redis_cluster_store"),
        ("redis-sentinel", "redis:redis_sentinel_store"),
        ("valkey", "redis:valkey_store"),
        ("valkey-cluster", "redis:valkey_cluster_store"),
        ("s3", "s3:s3_store"),
        ("mooncake", "mooncake:mooncake_store"),
        ("lm", "lm:lm_store"),
    ):
        registry.add(name, f"lmcache.testing.stores.{target}")
