"""The built-in engine services (instance API, peer-to-peer endpoint, KV events; the
controller worker lives in :mod:`lmcache.plugins.services.controller`), registered through
``lmcache_register_services`` like a third-party plugin's (see :mod:`lmcache.services`)."""
