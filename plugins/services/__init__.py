"""The built-in engine services (instance API, peer-to-peer endpoint, the controller worker
in :mod:`lmcache.plugins.services.controller`, KV events, the lookup channel, shifted
reuse, the PD transfer endpoint), registered through ``lmcache_register_services`` like a
third-party plugin's (see :mod:`lmcache.services`)."""
