"""Test tooling for lmcache and for plugin authors, kept out of the core package.

- :mod:`lmcache.testing.conformance`: the suites every backend, codec and policy runs
  (``BackendTests``, ``BytesBackendTests``, ``PersistentBackendTests``,
  ``FileBackendTests``, ``CodecTests``, ``PolicyTests``), re-exported here;
- :mod:`lmcache.testing.faults`: fault harnesses for networked backends;
- :mod:`lmcache.testing.stores`: real servers (Redis, Valkey, an S3 server, the Mooncake
  master, lmcache's own cache server, and any a plugin registers through
  ``lmcache_register_store_launchers``) started on free loopback ports; it finds their
  binaries and says how to install the missing ones (``requirements/install-test-servers.sh``,
  which ``make test`` runs as root, installs them: nothing here runs a package manager);
- :mod:`lmcache.testing.procs`: child processes that serve until their stdin closes.
- :mod:`lmcache.testing.pytest_plugin`: lmcache's pytest plugin (the ``pytest11`` entry point
  ``lmcache``): the fixtures ``lmcache_store``, ``lmcache_key_prefix`` and ``lmcache_engine``
  that any package's tests get by installing lmcache.

The core (``lmcache`` outside this package) never imports it (a test checks).
"""

from .conformance import (
    BackendTests,
    BytesBackendTests,
    CodecTests,
    FileBackendTests,
    PersistentBackendTests,
    PolicyTests,
    PolicyTraceTests,
    assert_rejects,
    make_key,
    make_obj,
)
from .faults import assert_hang_times_out, assert_survives_outage

__all__ = [
    "BackendTests",
    "BytesBackendTests",
    "CodecTests",
    "FileBackendTests",
    "PersistentBackendTests",
    "PolicyTests",
    "PolicyTraceTests",
    "assert_hang_times_out",
    "assert_rejects",
    "assert_survives_outage",
    "make_key",
    "make_obj",
]
