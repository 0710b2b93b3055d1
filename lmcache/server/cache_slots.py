"""Who holds a connection slot of :class:`lmcache.server.CacheServer`, and who gives one up.

Why: a slot held by a socket that never authenticates, or that sent one frame and went
quiet, must never keep out a client that works. A connection is *pending* until it has
authenticated (with a token) or sent its first complete frame (without one). Pending
connections have ``auth_timeout`` to stop being so (the server's timer) and a budget of
their own, ``max_pending``. A newcomer over that budget is not refused: it closes the
oldest *stuck* pending connection (its thread waits for bytes the peer has not sent) of
the source address holding the most pending connections. So sockets reopened at each
timeout cannot hold the slots, and squatters from one address only ever close each
other while a client from another address authenticates; a client from the same address
gets in when it authenticates before ``max_pending`` newer connections arrive. A pending
connection that is not stuck (its bytes are there, its thread has not run yet) is never
closed for a newcomer: a burst of clients gets in, over the budget for a moment.

With all ``max_connections`` slots taken, a newcomer closes the oldest stuck pending
connection, else the established one idle the longest (waiting for a request with
nothing unanswered; the ``lm`` backend reconnects quietly when its pooled connection was
closed), and is refused only when every connection is in the middle of something (the
server tries again for a moment first: one may be about to go idle, having just answered).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(eq=False)
class Slot:
    """One admitted connection; its thread keeps ``stuck`` (while pending) and
    ``idle_since`` (once established) up to date without the lock."""

    sock: socket.socket
    source: str
    accepted: float
    pending: bool = True
    #: pending, and its thread waits for the peer's bytes
    stuck: bool = False
    #: established, and waiting for a request with nothing unanswered since then; else None
    idle_since: float | None = None
    #: closed by :meth:`Slots.admit` to make room
    evicted: bool = False


class Slots:
    """The admitted connections and the rules of the module docstring. Thread-safe;
    :meth:`admit` runs on the accepting thread, the rest on connection threads."""

    def __init__(self, max_connections: int, max_pending: int, clock: Callable[[], float] = time.monotonic):
        self.max_connections = max_connections
        self.max_pending = max_pending
        self.clock = clock
        self._slots: set[Slot] = set()
        self._pending: dict[str, list[Slot]] = {}  # per source address, oldest first
        self._lock = threading.Lock()
        self.stats = {"evicted_pending": 0, "evicted_idle": 0}

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def sockets(self) -> list[socket.socket]:
        with self._lock:
            return [s.sock for s in self._slots]

    def admit(self, sock: socket.socket, source: str) -> tuple[Slot | None, list[tuple[Slot, str]]]:
        """Admit ``sock`` (from address ``source``): its slot, or ``None`` when refused
        (every connection busy), and the connections closed to make room, each with what
        to tell its peer ("" for none); the caller closes them, outside this lock."""
        victims: list[tuple[Slot, str]] = []
        with self._lock:
            if sum(len(v) for v in self._pending.values()) >= self.max_pending:
                victim = self._stuck(crowded=True)
                if victim is not None:
                    victims.append((self._drop(victim), f"closed: {self.max_pending} newer connections are waiting "
                                    "to authenticate (the oldest from the address with the most goes)"))
            if len(self._slots) >= self.max_connections:
                victim = self._stuck(crowded=False) or self._idlest()
                if victim is None:
                    return None, victims
                why = ("closed: every connection slot is taken (the oldest connection waiting to authenticate goes)"
                       if victim.pending else "")
                victims.append((self._drop(victim), why))
            slot = Slot(sock, source, self.clock())
            self._slots.add(slot)
            self._pending.setdefault(source, []).append(slot)
        return slot, victims

    def _stuck(self, crowded: bool) -> Slot | None:
        """The oldest stuck pending connection (with ``crowded``: of the addresses holding
        the most pending connections, the one with the most)."""
        best: tuple[int, float] | None = None
        out = None
        for v in self._pending.values():
            s = next((s for s in v if s.stuck), None)
            if s is None:
                continue
            rank = (-len(v) if crowded else 0, s.accepted)
            if best is None or rank < best:
                best, out = rank, s
        return out

    def _idlest(self) -> Slot | None:
        idle = [s for s in self._slots if not s.pending and s.idle_since is not None]
        return min(idle, key=lambda s: s.idle_since or 0.0) if idle else None

    def _drop(self, slot: Slot) -> Slot:
        self.stats["evicted_pending" if slot.pending else "evicted_idle"] += 1
        self._unpend(slot)
        self._slots.discard(slot)
        slot.evicted = True
        return slot

    def _unpend(self, slot: Slot) -> None:
        mine = self._pending.get(slot.source)
        if mine is not None and slot in mine:
            mine.remove(slot)
            if not mine:
                del self._pending[slot.source]

    def established(self, slot: Slot) -> None:
        """``slot`` authenticated (or, without a token, sent a complete frame)."""
        with self._lock:
            if slot.pending:
                slot.pending = slot.stuck = False
                self._unpend(slot)

    def release(self, slot: Slot) -> None:
        """``slot``'s connection ended (its thread is done with it)."""
        with self._lock:
            self._unpend(slot)
            self._slots.discard(slot)


def shut(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways (its connection thread then ends and closes it)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
