"""The ``tcp`` transfer channel: chunk bytes over the authenticated control connection.

The channel where NIXL is not installed. It speaks the control protocol of
:mod:`lmcache.transfer` (the mutual token handshake of :mod:`lmcache.auth`, bounded
frames) and adds no frame of its own: a ``write`` message is followed by exactly the
bytes of the slots it names, sent straight from the sender's pool objects
(``sendmsg`` of their memory) and received straight into the receiver's slots
(``recv_into``). Lengths come from the receiver's own allocation, never from the wire,
so a peer cannot make it read more than it allocated. A ``read`` (pull) is the same in
the other direction. The slots, deadlines, checks and commits are the endpoint's, the
same as over NIXL, so the PD code above does not care which channel runs.

Why not the ``lm`` server's PUT (p2p push): a PUT is decoded from a receive buffer into a
new pool object (one more copy and a payload header per chunk) and answers only OK; the
transfer needs slots reserved before the bytes move (bounded backpressure) and a commit
that names what landed.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from lmcache.memory import MemoryObj
from lmcache.transfer import Allocation, Channel, TransferError, byte_buffer


class TcpChannel(Channel):
    name = "tcp"

    def write(self, conn: Any, objs: Sequence[MemoryObj], slots: Sequence[Any], alloc: str, deadline: float) -> None:
        for o, s in zip(objs, slots):
            if not (isinstance(s, list) and len(s) == 2 and s[1] == o.nbytes):
                raise TransferError("alloc answered a slot of another size")
        conn.sock.settimeout(max(deadline - time.monotonic(), 0.05))
        conn.send({"op": "write", "alloc": alloc}, [byte_buffer(o) for o in objs])

    def serve_write(self, conn: Any, msg: dict[str, Any], alloc: Allocation) -> None:
        # the bytes of every slot follow the message, in order (lengths are the allocation's);
        # references of our own keep the slots' memory ours while bytes land in it, even if
        # the reaper frees the allocation meanwhile
        objs = [o.ref() for o in list(alloc.objs)]
        try:
            conn.sock.settimeout(max(alloc.deadline - time.monotonic(), 0.05))
            conn.recv_into([byte_buffer(o) for o in objs])
        finally:
            for o in objs:
                o.unref()
        alloc.written = True

    def written(self, alloc: Allocation, deadline: float) -> bool:
        return alloc.written

    def read(self, conn: Any, offer: dict[str, Any], objs: Sequence[MemoryObj], deadline: float) -> None:
        # the answer comes first (an offer gone or a bad index: its error, never bytes taken for KV)
        conn.call({"op": "read", "offer": offer["offer"], "index": list(range(len(objs)))},
                  timeout=max(deadline - time.monotonic(), 0.05))
        conn.recv_into([byte_buffer(o) for o in objs], timeout=max(deadline - time.monotonic(), 0.05))

    def serve_read(self, conn: Any, msg: dict[str, Any], objs: Sequence[MemoryObj]) -> None:
        from lmcache.transfer_wire import _send_msg

        held = [o.ref() for o in objs]  # the offer may expire while its bytes go out
        try:
            _send_msg(conn.sock, {"ok": True, "bytes": sum(o.nbytes for o in held)}, [byte_buffer(o) for o in held])
        finally:
            for o in held:
                o.unref()
