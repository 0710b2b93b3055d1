"""The transfer channel plugin contract (:class:`Channel`): how a channel moves a request's
chunk bytes between two memory pools; :mod:`lmcache.transfer` does the rest."""

from __future__ import annotations

from typing import Any

from .memory import MemoryObj


class Channel:
    """What a channel plugin implements: how bytes move. Built as ``Class(endpoint)``;
    the endpoint (:class:`lmcache.transfer.ChannelEndpoint`) does everything else (slots, deadlines,
    checks, control messages). Methods run on the endpoint's threads.

    * ``hello() -> dict``: what this side tells a peer when a connection opens (NIXL:
      its agent name and metadata); ``on_hello(conn, msg) -> dict`` takes the peer's.
    * ``write(conn, objs, slots, alloc_id, deadline)``: push ``objs`` into the peer's
      ``slots`` (``[[addr, nbytes], ...]`` from its ``alloc`` answer) before ``deadline``.
    * ``serve_write(conn, msg, alloc)``: the receiver's part of a write (TCP: receive the
      bytes into the slots); ``written(alloc, deadline) -> bool``: whether the bytes
      have landed (NIXL: its notification came).
    * ``read(conn, offer, objs, deadline)``: pull an offer's chunks into ``objs``;
      ``serve_read(conn, msg, objs)``: the offering side's part.
    * ``describe(obj) -> [addr, nbytes]``: where a peer can reach this pool object.
    * ``progress()``: called while transfers are open (and only then); ``close()``.
    """

    name = "?"
    #: whether :meth:`progress` must be called while transfers are open (NIXL: yes)
    needs_progress = False
    #: whether :meth:`read` needs nothing from the offering side but its memory (NIXL's
    #: one-sided READ): then a push can be made by the receiver reading (``push_by: read``)
    one_sided = False

    def __init__(self, endpoint: Any):  # the lmcache.transfer.ChannelEndpoint it serves
        self.endpoint = endpoint

    def hello(self) -> dict[str, Any]:
        return {}

    def on_hello(self, conn: Any, msg: dict[str, Any]) -> dict[str, Any]:
        return {}

    def describe(self, obj: MemoryObj) -> list[int]:
        return [obj.tensor.data_ptr(), obj.nbytes]

    def progress(self) -> None:
        pass

    def close(self) -> None:
        pass


__all__ = ["Channel"]
