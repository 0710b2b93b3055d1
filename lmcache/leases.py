"""Lookup leases: what keeps an entry a lookup promised from eviction until its caller
releases it or the lease ends (``lookup_pin_timeout``). One :class:`Leases` per tier."""

from __future__ import annotations

import math
from collections import deque
from typing import Callable


class Leases:
    """Lookup leases, counted per key: :meth:`take` adds one that ends after ``seconds``
    unless :meth:`drop` ends it first (the live lease that ends first, as releases are
    anonymous). Per key, runs of ``[end, count]`` in order of their end, each end rounded
    up to ``1/GRAIN`` of the lease time: a key stores at most ``GRAIN + 1`` runs however
    many leases it has (a hot key whose callers never release stays bounded), and ended
    runs are dropped on every take, drop and check, so each costs O(1) amortised. A lease
    may last up to ``seconds / GRAIN`` longer than asked, never shorter. Not thread-safe:
    the tier calls it under its lock."""

    GRAIN = 32

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self._runs: dict[str, deque[list]] = {}
        self._prune_at = 4096  # keys at which ended ones are swept (doubles with the live ones)

    def take(self, key: str, seconds: float) -> None:
        now = self.clock()
        grain = seconds / self.GRAIN
        end = math.ceil((now + seconds) / grain) * grain if grain > 0 else now + seconds
        runs = self._live(key, now)
        if runs is None:
            if len(self._runs) >= self._prune_at:
                for k in list(self._runs):
                    self._live(k, now)
                self._prune_at = max(4096, 2 * len(self._runs))
            runs = self._runs[key] = deque()
        if runs and runs[-1][0] >= end:  # same grain (or a shorter lease after a longer one)
            runs[-1][1] += 1
        else:
            runs.append([end, 1])

    def drop(self, key: str) -> None:
        runs = self._live(key, self.clock())
        if runs is not None:
            runs[0][1] -= 1
            if not runs[0][1]:
                runs.popleft()
                if not runs:
                    del self._runs[key]

    def held(self, key: str) -> bool:
        return key in self._runs and self._live(key, self.clock()) is not None

    def count(self, key: str) -> int:
        """Live leases of ``key``."""
        runs = self._live(key, self.clock())
        return sum(n for _, n in runs) if runs else 0

    def records(self) -> int:
        """Lease ends stored, all keys together (what the leases cost in memory)."""
        return sum(len(r) for r in self._runs.values())

    def _live(self, key: str, now: float) -> deque[list] | None:
        """``key``'s runs with the ended ones dropped; ``None`` (and forgotten) if none is left."""
        runs = self._runs.get(key)
        if runs is None:
            return None
        while runs and runs[0][0] <= now:
            runs.popleft()
        if not runs:
            del self._runs[key]
            return None
        return runs

    def __len__(self) -> int:
        return len(self._runs)

    def __repr__(self) -> str:
        return f"Leases({ {k: list(v) for k, v in self._runs.items()} })"
