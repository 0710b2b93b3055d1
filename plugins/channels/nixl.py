"""The ``nixl`` transfer channel: NIXL (UCX backend) between two registered memory pools.

Each endpoint creates one NIXL agent and registers its whole memory pool with it once
(one DRAM region: every chunk slot and every stored chunk is inside it). A push is one
NIXL WRITE per request from the sender's pool objects into the receiver's slots, then
the commit on the control connection; a pull is one NIXL READ from the offering side's
objects into the puller's slots. No byte is copied on either side; on one host UCX
moves DRAM with CMA (``process_vm_writev``: one copy, by the kernel, between the two
processes), across hosts with RDMA or TCP.

Why a push's WRITE carries no NIXL notification: NIXL reports a WRITE with one DONE only
once the notification's active message has completed, and over UCX's tcp lane (how it
carries active messages on one host) that takes the *receiver* progressing UCX, i.e. its
endpoint's polling thread, a Python thread that must win the GIL and a core from the
engine's compute: the WRITE then took as long as the receiver's polling period
(docs/benchmarks.md#measurements-behind-the-code). Without it, DONE comes after NIXL's endpoint flush (remote completion) and needs
nothing from the receiver.

Agent metadata travels in the ``hello`` message of the authenticated control
connection (:mod:`lmcache.transfer`), base64 in JSON, never pickled; descriptors are
plain ``[address, length]`` numbers checked against the lengths this side allocated.

Why the agent has no progress thread: nixl 1.5.1's UCX progress thread polls with a
zero timeout and burns a core while idle (beside vLLM's NixlConnector a prefill took twice
as long: docs/benchmarks.md#measurements-behind-the-code). This agent is created with
``enable_prog_thread=False``; progress happens only inside calls made while a transfer
is open: the initiator polls ``check_xfer_state`` until its transfer is done (pausing
between polls, up to 1 ms, so it leaves the GIL and the core to the engine), and the
target side's endpoint thread polls ``get_new_notifs`` (which also progresses UCX for a
peer's one-sided operations over TCP) every millisecond while it has an open allocation
or offer, and sleeps on a condition otherwise. Every agent call is made under one lock
(the agent is created with NIXL's default thread mode for no listener: unsynchronised).

An unusable NIXL is one line at start (:class:`lmcache.transfer.ChannelUnavailable`):
the package missing (what to install), a NIXL backend named in ``nixl_backends`` that
this NIXL does not have (the ones it has), or the agent failing to start.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, Sequence

from lmcache.memory import MemoryObj
from lmcache.transfer import (
    Allocation, Channel, ChannelUnavailable, TransferError,
)
from lmcache.transfer_wire import _b64, _unb64

log = logging.getLogger(__name__)
NOTIF = b"lmct:"
#: the initiator's polls of a transfer in flight: the first at once, then pauses doubling up to POLL_MAX
POLL_MIN, POLL_MAX = 20e-6, 0.001


def _quiet_nixl_logs() -> None:
    """NIXL logs at INFO to stdout (where a CLI prints its data); send it to stderr, and
    only errors unless ``NIXL_LOG_LEVEL`` asks for more (what goes wrong at start is our
    own one line)."""
    nl = logging.getLogger("nixl")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nl.setLevel(logging.ERROR)
    for h in nl.handlers:
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
            h.setStream(sys.stderr)


class NixlChannel(Channel):
    name = "nixl"
    #: each chunk's first, middle and last 64 KiB are hashed (lmcache.transfer.checksum):
    #: hashing every byte on both sides costs more than NIXL's move (docs/distributed.md)
    default_verify = "sample"
    needs_progress = True
    one_sided = True

    def __init__(self, endpoint: Any):
        super().__init__(endpoint)
        backends = list(endpoint.options.get("nixl_backends") or ["UCX"])
        try:
            import nixl._api as api  # noqa: F401  (ModuleNotFoundError: the endpoint names what to install)
        except ModuleNotFoundError:
            raise
        except Exception as exc:  # the package is there but does not load (a wrong CUDA build, a missing library)
            raise ChannelUnavailable(f"transfer_channel nixl: NIXL is installed but does not load here: "
                                     f"{type(exc).__name__}: {exc}") from None
        import numpy as np

        self._np = np
        self._lock = threading.RLock()
        _quiet_nixl_logs()
        try:
            # options["nixl_progress_thread"]: NIXL's own spinning thread, for comparison only (lmcache bench channel)
            cfg = api.nixl_agent_config(enable_prog_thread=bool(endpoint.options.get("nixl_progress_thread")),
                                        enable_listen_thread=False, backends=backends)
            self.agent = api.nixl_agent(f"lmcache-{endpoint.identity}", cfg)
        except Exception as exc:
            raise ChannelUnavailable(f"transfer_channel nixl: the NIXL agent did not start: {exc}") from None
        missing = [b for b in backends if b not in self.agent.backends]
        if missing:
            have = ", ".join(self.agent.get_plugin_list()) or "none"
            raise ChannelUnavailable(f"transfer_channel nixl: NIXL backend {', '.join(missing)} is not available here "
                                     f"(this NIXL has: {have}); set nixl_backends, or transfer_channel: tcp")
        addr, nbytes = endpoint.pool.region
        self._region = (addr, addr + nbytes)
        try:
            self._reg = self.agent.register_memory([(addr, nbytes, 0, "")], "DRAM")
        except Exception as exc:
            raise ChannelUnavailable(f"transfer_channel nixl: registering the memory pool ({nbytes} bytes) with "
                                     f"NIXL failed: {exc}") from None
        self._md = self.agent.get_agent_metadata()
        self._peers: dict[str, int] = {}  # remote agent -> connections using it
        self._notified: OrderedDict[str, None] = OrderedDict()

    # ------------------------------------------------------------ handshake
    def hello(self) -> dict[str, Any]:
        return {"agent": self.agent.name, "md": _b64(self._md)}

    def on_hello(self, conn: Any, msg: dict[str, Any]) -> dict[str, Any]:
        name, md = msg.get("agent"), _unb64(msg.get("md"))
        if not isinstance(name, str) or not md:
            raise TransferError("the peer sent no NIXL agent metadata (is it running transfer_channel nixl?)")
        with self._lock:
            if name not in self._peers:
                try:
                    got = self.agent.add_remote_agent(md)
                except Exception as exc:
                    raise TransferError(f"the peer's NIXL metadata was refused: {exc}") from None
                got = got.decode() if isinstance(got, bytes) else got
                if got != name:
                    raise TransferError(f"the peer's NIXL metadata names agent {got!r}, not {name!r}")
                self._peers[name] = 0
            self._peers[name] += 1
        conn.state["agent"] = name
        return self.hello()

    def on_close(self, conn: Any) -> None:
        # the peer's metadata stays loaded while another connection of it is open; the
        # slots it was writing are freed by their deadline, not here (a late write must
        # not land in reused memory)
        name = conn.state.get("agent")
        if name is None:
            return
        with self._lock:
            n = self._peers.get(name)
            if n is None:  # the channel closed first
                return
            self._peers[name] = n - 1
            if n <= 1:
                del self._peers[name]
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:  # pragma: no cover - already gone
                    pass

    # ------------------------------------------------------------ descriptors
    def describe(self, obj: MemoryObj) -> list[int]:
        addr = obj.tensor.data_ptr()
        lo, hi = self._region
        if not (lo <= addr and addr + obj.nbytes <= hi):
            raise TransferError("a chunk outside the registered memory pool cannot be offered over NIXL")
        return [addr, obj.nbytes]

    def _descs(self, rows: Sequence[Sequence[int]]) -> Any:
        arr = self._np.array([[int(a), int(n), 0] for a, n in rows], dtype=self._np.uint64)
        return self.agent.get_xfer_descs(arr, "DRAM")

    def _local(self, objs: Sequence[MemoryObj]) -> tuple[list[list[int]], list[Any]]:
        """Descriptors of ``objs``; one outside the pool (a heap object) is registered
        for this transfer alone (returned, to deregister after)."""
        rows, extra = [], []
        lo, hi = self._region
        for o in objs:
            addr = o.tensor.data_ptr()
            if not (lo <= addr and addr + o.nbytes <= hi):
                with self._lock:
                    extra.append(self.agent.register_memory([(addr, o.nbytes, 0, "")], "DRAM"))
            rows.append([addr, o.nbytes])
        return rows, extra

    @staticmethod
    def _check_remote(rows: Any, objs: Sequence[MemoryObj]) -> list[list[int]]:
        if not isinstance(rows, list) or len(rows) != len(objs):
            raise TransferError("the peer described another number of chunks")
        out = []
        for r, o in zip(rows, objs):
            if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) and x >= 0 for x in r)
                    and r[1] == o.nbytes):
                raise TransferError("the peer described a chunk of another size")
            out.append(r)
        return out

    # ------------------------------------------------------------ transfers
    def _run(self, op: str, objs: Sequence[MemoryObj], remote: list[list[int]], agent: str, notif: bytes,
             deadline: float) -> None:
        rows, extra = self._local(objs)
        try:
            with self._lock:
                h = self.agent.initialize_xfer(op, self._descs(rows), self._descs(remote), agent, notif)
                st = self.agent.transfer(h)
            try:
                pause = 0.0
                while st == "PROC":  # progress happens in these polls: no progress thread
                    if time.monotonic() > deadline:
                        raise TransferError(f"NIXL {op} of {len(objs)} chunks did not finish in time")
                    # yield between polls (GIL and core): the engine's compute thread shares both
                    time.sleep(pause)
                    pause = min(pause * 2 or POLL_MIN, POLL_MAX)
                    with self._lock:
                        st = self.agent.check_xfer_state(h)
                if st != "DONE":
                    raise TransferError(f"NIXL {op} of {len(objs)} chunks failed ({st})")
            finally:
                with self._lock:
                    try:
                        h.release()  # cancels a transfer still in flight
                    except Exception as exc:
                        log.error("transfer: releasing a NIXL %s: %s", op, exc)
        finally:
            for reg in extra:
                with self._lock:
                    self.agent.deregister_memory(reg)

    def write(self, conn: Any, objs: Sequence[MemoryObj], slots: Any, alloc: str, deadline: float) -> None:
        # no NIXL notification: with one, the WRITE completes only once the receiver has
        # progressed UCX to take it (as late as its polling thread gets the GIL and a core).
        # DONE comes after NIXL's endpoint flush (the bytes are in place remotely); the
        # commit that follows on the control connection is the receiver's signal
        self._run("WRITE", objs, self._check_remote(slots, objs), conn.state["agent"], b"", deadline)

    def read(self, conn: Any, offer: dict[str, Any], objs: Sequence[MemoryObj], deadline: float) -> None:
        self._run("READ", objs, self._check_remote(offer.get("addrs"), objs), conn.state["agent"], b"", deadline)

    def serve_write(self, conn: Any, msg: dict[str, Any], alloc: Allocation) -> None:
        raise TransferError("a nixl endpoint receives chunk bytes over NIXL, not on the control connection")

    def serve_read(self, conn: Any, msg: dict[str, Any], objs: Sequence[MemoryObj]) -> None:
        raise TransferError("a nixl endpoint serves reads over NIXL, not on the control connection")

    def written(self, alloc: Allocation, deadline: float) -> bool:
        """Whether the sender's bytes for ``alloc`` are in place: its commit comes only after
        its WRITE reported DONE, which NIXL reports after flushing the endpoint (remote
        completion), so the commit itself says so. The sampled or full checksums the
        commit carries catch a slot never written. (A notification of an older sender is
        consumed here or by :meth:`progress`.)"""
        with self._lock:
            self._notified.pop(alloc.id, None)
        return True

    def _drain(self) -> None:
        for msgs in self.agent.get_new_notifs().values():
            for m in msgs:
                if m.startswith(NOTIF):
                    self._notified[m[len(NOTIF):].decode(errors="replace")] = None
        while len(self._notified) > 65536:  # notifications of allocations that expired
            self._notified.popitem(last=False)

    def progress(self) -> None:
        with self._lock:
            self._drain()

    def close(self) -> None:
        with self._lock:
            try:
                self.agent.deregister_memory(self._reg)
            except Exception:  # pragma: no cover
                pass
            for name in list(self._peers):
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:  # pragma: no cover
                    pass
            self._peers.clear()
