"""Eviction policies: LRU (default), LFU and FIFO.

A policy only records what happens to keys and proposes victims; the core accounts bytes
and decides which proposed victims may go (it skips pinned entries and entries a reader
still holds through ``skip``). ``contains`` checks are not accesses: reads never write.

A policy may also offer ``eviction_order()``: every key, next victim first, without
changing its state (``lmcache evict --bytes`` and ``--dry-run`` use it to plan). Without
it, :func:`eviction_order` asks ``victim`` repeatedly.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Iterator, Protocol, runtime_checkable

from .hookspecs import hookimpl

Key = Hashable


@runtime_checkable
class EvictionPolicy(Protocol):
    def on_insert(self, key: Key) -> None:
        """``key`` entered the tier (it was not there)."""

    def on_access(self, key: Key) -> None:
        """``key`` was read (a hit)."""

    def on_remove(self, key: Key) -> None:
        """``key`` left the tier (evicted or removed); unknown keys are ignored."""

    def victim(self, skip: Callable[[Key], bool]) -> Key | None:
        """The next key to evict for which ``skip(key)`` is false, or ``None``.

        Must not change the policy's state: the core calls ``on_remove`` once it evicted.
        """

    def __len__(self) -> int: ...


def eviction_order(policy: EvictionPolicy) -> Iterator[Key]:
    """The keys of ``policy`` in the order it would evict them (a snapshot: the policy
    is not changed). Uses the policy's own ``eviction_order()`` if it has one."""
    own = getattr(policy, "eviction_order", None)
    if own is not None:
        yield from own()
        return
    seen: set[Key] = set()
    while True:
        k = policy.victim(lambda k: k in seen)
        if k is None:
            return
        seen.add(k)
        yield k


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


@hookimpl
def lmcache_register_policies(registry):
    registry.add("lru", "lmcache.policies:LRUPolicy", description="least recently used (default)")
    registry.add("lfu", "lmcache.policies:LFUPolicy", description="least frequently used")
    registry.add("fifo", "lmcache.policies:FIFOPolicy", description="first in, first out")
