"""A tier's books in one place: its keys and their stored bytes, the bytes used and
reserved, the eviction policy's state and the admit/evict listeners.

Why one object: these must change together or drift apart (a missed ``on_remove`` keeps a
ghost victim, a second ``"admit"`` tells the controller twice), so every key enters
through :meth:`Ledger.admit` and leaves through :meth:`Ledger.forget`. The ledger never
touches a backend and has no lock: its :class:`~lmcache.tier.Tier` calls it under its own.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from .policies import EvictionPolicy, eviction_order

#: ``listener(op, tier name, key)``, op ``"admit"`` or ``"evict"``; called under the
#: tier's lock, so it must not block
Listener = Callable[[str, str, str], None]


class Ledger:
    """The keys a tier accounts for, their bytes, its policy and its listeners."""

    def __init__(self, name: str, capacity: int, policy: EvictionPolicy):
        self.name = name
        self.capacity = capacity
        self.policy = policy
        self.sizes: dict[str, int] = {}  # key -> stored bytes
        self.used = 0
        self.reserved = 0  # bytes held for puts under way (an upper bound each)
        self.listeners: tuple[Listener, ...] = ()
        #: key -> the number of the admit that stored it: a read that misses may forget
        #: a key only if it was not admitted again while the read ran
        self.born: dict[str, int] = {}
        self._admits = 0

    def admit(self, key: str, size: int) -> None:
        """``key`` is stored with ``size`` bytes (new, or a new size for a known key)."""
        old = self.sizes.get(key)
        self.sizes[key] = size
        self.used += size - (old or 0)
        self._admits += 1
        self.born[key] = self._admits
        if old is None:
            self.policy.on_insert(key)
            self._tell("admit", key)

    def forget(self, key: str) -> int | None:
        """Drop ``key`` from the books; its size, or ``None`` if it was not there."""
        size = self.sizes.pop(key, None)
        self.born.pop(key, None)
        if size is None:
            return None
        self.used -= size
        self.policy.on_remove(key)
        self._tell("evict", key)
        return size

    @property
    def admits(self) -> int:
        """How many admits there have been: the number the next one gets is larger."""
        return self._admits

    def access(self, keys: Sequence[str]) -> None:
        """A use of each held key (a hit, or a store that found it cached)."""
        for k in keys:
            if k in self.sizes:
                self.policy.on_access(k)

    def over(self, need: int) -> bool:
        """Whether ``need`` more bytes would pass the capacity."""
        return self.used + self.reserved + need > self.capacity

    def victim(self, skip: Callable[[str], bool]) -> str | None:
        return self.policy.victim(skip)  # type: ignore[return-value]

    def eviction_order(self) -> Iterator[str]:
        return (k for k in eviction_order(self.policy) if k in self.sizes)  # type: ignore[misc]

    def _tell(self, op: str, key: str) -> None:
        for f in self.listeners:
            f(op, self.name, key)

    def __contains__(self, key: object) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)
