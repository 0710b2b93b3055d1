"""The built-in eviction policies, LRU (default), LFU and FIFO, registered through the same
hook as a third-party plugin's (the contract is :class:`lmcache.policies.EvictionPolicy`)."""

from __future__ import annotations

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


@hookimpl
def lmcache_register_policies(registry):
    registry.add("lru", "lmcache.plugins.policies:LRUPolicy", description="least recently used (default)")
    registry.add("lfu", "lmcache.plugins.policies:LFUPolicy", description="least frequently used")
    registry.add("fifo", "lmcache.plugins.policies:FIFOPolicy", description="first in, first out")
