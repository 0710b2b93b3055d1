"""An example lmcache plugin: the ``sqlite`` storage backend and the ``zlib`` codec.

Importing this package imports nothing heavy; lmcache imports
:mod:`lmcache_plugin_example.sqlite_backend` and :mod:`lmcache_plugin_example.zlib_codec`
only when a tier uses them.
"""

__version__ = "0.1.0"
