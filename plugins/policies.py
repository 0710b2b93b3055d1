"""The built-in eviction policies, LRU (default), LFU, FIFO and S3-FIFO, registered through
the same hook as a third-party plugin's (the contract is
:class:`lmcache.policies.EvictionPolicy`)."""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Callable, Hashable, Iterator

from lmcache.hookspecs import hookimpl

Key = Hashable


class LRUPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._od: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key) -> None:
        self._od[key] = None
        self._od.move_to_end(key)

    def on_access(self, key: Key) -> None:
        if key in self._od:
            self._od.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._od.pop(key, None)

    def victim(self, skip: Callable[[Key], bool]) -> Key | None:
        for k in self._od:
            if not skip(k):
                return k
        return None

    def eviction_order(self) -> Iterator[Key]:
        return iter(list(self._od))

    def __len__(self) -> int:
        return len(self._od)


class FIFOPolicy(LRUPolicy):
    """First in, first out: reads do not change the order."""

    def on_access(self, key: Key) -> None:
        pass


class LFUPolicy:
    """Least frequently used first; ties go to the least recently used."""

    def __init__(self) -> None:
        self._freq: dict[Key, int] = {}
        self._buckets: dict[int, OrderedDict[Key, None]] = {}

    def _bump(self, key: Key, old: int, new: int) -> None:
        if old:
            b = self._buckets[old]
            del b[key]
            if not b:
                del self._buckets[old]
        self._buckets.setdefault(new, OrderedDict())[key] = None
        self._freq[key] = new

    def on_insert(self, key: Key) -> None:
        if key in self._freq:
            self.on_access(key)
        else:
            self._bump(key, 0, 1)

    def on_access(self, key: Key) -> None:
        f = self._freq.get(key)
        if f is not None:
            self._bump(key, f, f + 1)

    def on_remove(self, key: Key) -> None:
        f = self._freq.pop(key, None)
        if f is not None:
            b = self._buckets[f]
            del b[key]
            if not b:
                del self._buckets[f]

    def victim(self, skip: Callable[[Key], bool]) -> Key | None:
        for f in sorted(self._buckets):
            for k in self._buckets[f]:
                if not skip(k):
                    return k
        return None

    def eviction_order(self) -> Iterator[Key]:
        return iter([k for f in sorted(self._buckets) for k in self._buckets[f]])

    def __len__(self) -> int:
        return len(self._freq)


class S3FIFOPolicy:
    """S3-FIFO (Yang et al., SOSP 2023), by bytes: a new key enters a small FIFO queue;
    a key evicted from it unread becomes a ghost (its key remembered), one read there
    moves to the main queue. The main queue is a FIFO with reinsertion: a key read since
    the hand last passed it goes round again with its count (at most 3) lowered by one. A
    key inserted while it is a ghost enters the main queue directly.

    The small queue is evicted from first while it holds at least ``small_ratio`` of the
    tier's capacity (of the bytes held, without a capacity) or the main queue is empty;
    ghosts are remembered up to ``ghost_ratio`` times that many bytes, oldest forgotten
    first. Skipped (pinned) keys keep their place and count.

    Written on the handshake: ``victim`` promotes the small-queue keys it passes and turns
    the main queue's hand; ``on_remove`` of a victim taken from the small queue makes it a
    ghost (an explicit remove does not). ``eviction_order`` drains a copy.
    """

    takes_sizes = True
    victim_changes_state = True
    MAX_FREQ = 3

    def __init__(self, small_ratio: float = 0.1, ghost_ratio: float = 0.9, capacity: int | None = None):
        for name, v, top in (("small_ratio", small_ratio, 1.0), ("ghost_ratio", ghost_ratio, 10.0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < top:
                raise ValueError(f"{name} must be a number in (0, {top:g}), got {v!r}")
        self.small_ratio = float(small_ratio)
        self.ghost_ratio = float(ghost_ratio)
        self.capacity = capacity
        self._small: OrderedDict[Key, None] = OrderedDict()
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, int] = OrderedDict()  # key -> its size when evicted
        self._freq: dict[Key, int] = {}
        self._size: dict[Key, int] = {}
        self._small_bytes = self._main_bytes = self._ghost_bytes = 0
        self._leaving: Key | None = None  # the small-queue victim that on_remove makes a ghost

    def _limit(self) -> int:
        return self.capacity or (self._small_bytes + self._main_bytes)

    def on_insert(self, key: Key, size: int = 1) -> None:
        if key in self._freq:
            self.on_access(key)
            return
        self._freq[key] = 0
        self._size[key] = size
        if key in self._ghost:
            self._ghost_bytes -= self._ghost.pop(key)
            self._main[key] = None
            self._main_bytes += size
        else:
            self._small[key] = None
            self._small_bytes += size

    def on_access(self, key: Key) -> None:
        f = self._freq.get(key)
        if f is not None:
            self._freq[key] = min(f + 1, self.MAX_FREQ)

    def on_resize(self, key: Key, size: int) -> None:
        old = self._size.get(key)
        if old is None:
            return
        self._size[key] = size
        if key in self._small:
            self._small_bytes += size - old
        else:
            self._main_bytes += size - old

    def on_remove(self, key: Key) -> None:
        size = self._size.pop(key, None)
        leaving, self._leaving = self._leaving, None
        if size is None:
            return
        del self._freq[key]
        if key not in self._small:
            del self._main[key]
            self._main_bytes -= size
            return
        del self._small[key]
        self._small_bytes -= size
        if key == leaving:
            self._ghost[key] = size
            self._ghost_bytes += size
            while self._ghost and self._ghost_bytes > self.ghost_ratio * self._limit():
                self._ghost_bytes -= self._ghost.popitem(last=False)[1]

    def victim(self, skip: Callable[[Key], bool]) -> Key | None:
        self._leaving = None
        if self._small and (not self._main or self._small_bytes >= self.small_ratio * self._limit()):
            k = self._from_small(skip)
            return k if k is not None else self._from_main(skip)
        k = self._from_main(skip)
        if k is None:
            k = self._from_small(skip)
            if k is None:  # the keys it promoted
                k = self._from_main(skip)
        return k

    def _from_small(self, skip: Callable[[Key], bool]) -> Key | None:
        passed: list[Key] = []
        found = None
        for k in self._small:
            if skip(k):
                continue
            if self._freq[k] == 0:
                found = self._leaving = k
                break
            passed.append(k)
        for k in passed:  # read while in the small queue: into the main queue, count cleared
            del self._small[k]
            self._main[k] = None
            self._freq[k] = 0
            self._small_bytes -= self._size[k]
            self._main_bytes += self._size[k]
        return found

    def _from_main(self, skip: Callable[[Key], bool]) -> Key | None:
        for _ in range(self.MAX_FREQ + 1):  # every pass lowers each passed count by one
            passed: list[Key] = []
            found = None
            for k in self._main:
                if skip(k):
                    continue
                if self._freq[k] == 0:
                    found = k
                    break
                passed.append(k)
            for k in passed:
                self._freq[k] -= 1
                self._main.move_to_end(k)
            if found is not None or not passed:
                return found
        return None

    def eviction_order(self) -> Iterator[Key]:
        plan = copy.copy(self)
        for name in ("_small", "_main", "_ghost", "_freq", "_size"):
            setattr(plan, name, copy.copy(getattr(self, name)))
        order: list[Key] = []
        while (k := plan.victim(_never)) is not None:
            order.append(k)
            plan.on_remove(k)
        return iter(order)

    def __len__(self) -> int:
        return len(self._freq)


def _never(key: Key) -> bool:
    return False


@hookimpl
def lmcache_register_policies(registry):
    registry.add("lru", "lmcache.plugins.policies:LRUPolicy", description="least recently used (default)")
    registry.add("lfu", "lmcache.plugins.policies:LFUPolicy", description="least frequently used")
    registry.add("fifo", "lmcache.plugins.policies:FIFOPolicy", description="first in, first out")
    registry.add("s3fifo", "lmcache.plugins.policies:S3FIFOPolicy",
                 description="S3-FIFO: small, main and ghost FIFO queues, by bytes")
