"""Built-in storage backends, registered through the same hook as third-party ones."""

from lmcache.hookspecs import hookimpl


@hookimpl
def lmcache_register_backends(registry):
    registry.add("cpu", "lmcache.backends.cpu:CPUBackend", description="host memory (the memory pool)")
    registry.add("disk", "lmcache.backends.disk:DiskBackend", description="one file per chunk in a local directory")
