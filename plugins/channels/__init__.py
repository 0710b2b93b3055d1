"""Transfer channels (``lmcache_register_channels``): how a request's KV chunks move between
two instances' memory pools (see :mod:`lmcache.transfer`)."""
