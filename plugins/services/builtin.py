"""The built-in services, registered through the same hook as a third-party plugin's.

The order is the start order: the P2P endpoint starts before the controller worker,
which registers its address; closing runs backwards."""

from __future__ import annotations

from lmcache.hookspecs import hookimpl


@hookimpl
def lmcache_register_services(registry):
    registry.add("api", "lmcache.plugins.services.api:ApiService", description="the instance API (api.enabled)")
    registry.add("p2p", "lmcache.plugins.services.p2p:P2P",
                 description="the peer-to-peer endpoint, fetch on miss and push (p2p.enabled)")
    registry.add("controller", "lmcache.plugins.services.controller:ControllerWorker",
                 description="registers with the controller and reports admits/evicts (controller.url)")
    registry.add("kv_events", "lmcache.plugins.services.kv_events:KVEventsService",
                 description="vLLM-compatible KV events on ZMQ (kv_events.enabled)")
    registry.add("lookup", "lmcache.plugins.services.lookup:LookupChannel",
                 description="answers lookups of a scheduler in another process on a Unix socket (lookup_socket)")
    registry.add("approximate_reuse", "lmcache.plugins.services.shifted:ShiftedReuse",
                 description="reuse of KV computed at other positions, for truncated prompts (approximate_reuse.enabled)")
    registry.add("transfer", "lmcache.plugins.services.transfer:TransferService",
                 description="the transfer endpoint of prefill->decode: pushes and pulls over NIXL or tcp (transfer_channel)")


@hookimpl
def lmcache_register_channels(registry):
    # transfer channels (lmcache.transfer): how PD moves a request's chunks between two pools
    registry.add("tcp", "lmcache.plugins.channels.tcp:TcpChannel",
                 description="chunk bytes over the authenticated control connection, from and into pool memory")
    registry.add("nixl", "lmcache.plugins.channels.nixl:NixlChannel", requires="nixl-cu12==1.5.1",
                 description="NIXL (UCX): one WRITE or READ per request between the registered pools, no copy")
