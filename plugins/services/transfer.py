"""The ``transfer`` service: an engine's transfer endpoint (config ``transfer_channel``).

What the PD connector builds on: this engine's side of :mod:`lmcache.transfer` on its own
memory pool (registered once with the channel), receiving pushes into its top tier and
serving pulls of what it offers, and the calls that send this engine's chunks:

* :meth:`TransferService.push` (``keys``, a peer's endpoint URL, a request id): LMCache's
  PD direction (the prefiller writes into the decoder's slots);
* :meth:`TransferService.offer` / :meth:`TransferService.pull`: vLLM's direction (the
  prefiller offers, the decoder reads).

A chunk that arrives is checked as a p2p PUT is (:class:`lmcache.plugins.services.p2p.EngineStore`):
its key must be of this instance's namespace and model and of its kv signature, its
shape and dtype this engine's (checked before a slot is allocated, through the chunk
gateway), its checksum the sender's (``transfer.verify``); then it is put into the top
tier (no copy: the slot becomes the tier's entry), so the retrieve that follows serves
it as a local hit. A chunk that fails is dropped and counted (``rejected_chunks``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

from lmcache.errors import KVShapeError
from lmcache.keys import CacheKey
from lmcache.memory import MemoryObj

if TYPE_CHECKING:  # pragma: no cover
    from lmcache.transfer import ChannelEndpoint
    from lmcache.config import Config
    from lmcache.services import EngineView

log = logging.getLogger(__name__)


class TransferService:
    """This engine's transfer endpoint (``transfer_channel`` set)."""

    @staticmethod
    def enabled(config: Config) -> bool:
        return config.transfer_channel is not None

    def __init__(self, view: EngineView):
        self.view = view
        cfg = view.config
        t = cfg.transfer
        self.refused = 0
        from lmcache.transfer import open_channel  # only where enabled: the module costs ~4 MiB of RSS

        host, port = t.host, t.port
        pd = cfg.pd
        if port == 0 and pd.role in ("receiver", "both") and pd.peer_init_port:  # LMCache's keys: where senders push
            host, port = pd.peer_host, pd.peer_init_port[0]

        self.endpoint: ChannelEndpoint = open_channel(
            cfg.transfer_channel, view.hierarchy.pool, sink=self._sink, allocate=self._allocate,
            host=host, port=port, token=t.token, buffer_size=t.buffer_size, slot_timeout=t.slot_timeout,
            alloc_wait=t.alloc_wait, timeout=t.timeout, verify=None if t.verify == "auto" else t.verify,
            identity=view.instance_id, options={"nixl_backends": list(t.nixl_backends)},
            registries=view.hierarchy.registries, thread_nice=t.thread_nice, push_by=t.push_by)
        log.info("lmcache transfer endpoint (%s) listening on %s", self.endpoint.name, self.endpoint.url)

    @property
    def url(self) -> str:
        return self.endpoint.url

    # ------------------------------------------------------------ receiving
    def _allocate(self, shape: Sequence[int], dtype: Any) -> MemoryObj | None:
        return self.view.chunks.allocate(shape, dtype)  # KVShapeError before anything is allocated

    def _sink(self, key: str, obj: MemoryObj) -> bool:
        cfg = self.view.config
        try:
            ck = CacheKey.parse(key)
        except ValueError as exc:
            obj.unref()
            return self._refuse(key, str(exc))
        if ck.namespace != cfg.namespace or ck.model != cfg.model:
            obj.unref()
            return self._refuse(key, f"namespace {ck.namespace!r}, model {ck.model!r}: this instance serves "
                                     f"{cfg.namespace!r}, {cfg.model!r}")
        spec = self.view.kv_spec
        if spec is None or ck.signature != spec.signature:
            obj.unref()
            return self._refuse(key, "kv signature differs from this instance's (or it has none yet)")
        try:
            return self.view.chunks.put_one(key, obj)  # takes over the reference
        except KVShapeError as exc:
            return self._refuse(key, str(exc))

    def _refuse(self, key: str, why: str) -> bool:
        self.refused += 1
        log.info("transfer: refused chunk %s: %s", key[:100], why)
        return False

    # ------------------------------------------------------------ sending
    def _objs(self, keys: Sequence[str]) -> tuple[list[tuple[str, MemoryObj]], list[str]]:
        hits = self.view.chunks.find(list(keys), prefix=False, raw=True)
        items, missing = [], []
        for k, h in zip(keys, hits):
            if h is None:
                missing.append(k)
            else:
                items.append((k, h[0]))
        return items, missing

    def push(self, keys: Sequence[str], url: str, request: str, *, alloc_wait: float | None = None) -> dict[str, Any]:
        """Write the chunks of ``keys`` this engine holds into the endpoint at ``url`` as
        ``request`` (see :meth:`lmcache.transfer.ChannelEndpoint.push`); ``missing`` lists
        the keys not held here."""
        items, missing = self._objs(keys)
        try:
            r = self.endpoint.push(url, request, items, alloc_wait=alloc_wait)
        finally:
            for _, o in items:
                o.unref()
        return {**r, "missing": missing}

    def offer(self, keys: Sequence[str], request: str, ttl: float | None = None, *,
              name: str | None = None) -> dict[str, Any]:
        """Hold the chunks of ``keys`` for a peer to :meth:`pull` (or, by ``name``,
        :meth:`pull_named`); the description to hand it."""
        items, missing = self._objs(keys)
        try:
            r = self.endpoint.offer(request, items, ttl, name=name)
        finally:
            for _, o in items:
                o.unref()
        return {**r, "missing": missing}

    def pull(self, offer: dict[str, Any], *, alloc_wait: float | None = None) -> dict[str, Any]:
        """Read a peer's offer into this engine's top tier."""
        return self.endpoint.pull(offer, alloc_wait=alloc_wait)

    def pull_named(self, url: str, name: str, *, identity: str | None = None,
                   deadline: float | None = None) -> dict[str, Any]:
        """Read the offer ``name`` of the endpoint at ``url`` into this engine's top tier
        (see :meth:`lmcache.transfer.ChannelEndpoint.pull_named`)."""
        return self.endpoint.pull_named(url, name, identity=identity, deadline=deadline)

    def info(self) -> dict[str, Any]:
        return {**self.endpoint.info(), "refused_chunks": self.refused}

    def close(self) -> None:
        self.endpoint.close()


__all__ = ["TransferService"]
