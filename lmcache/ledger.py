"""A tier's books in one place: its keys and their stored bytes, the bytes used and
reserved, the eviction policy's state and the admit/evict listeners.

Why one object: these must change together or drift apart (a missed ``on_remove`` keeps a
ghost victim, a second ``"admit"`` tells the controller twice), so every key enters
through :meth:`Ledger.admit` and leaves through :meth:`Ledger.forget`. The ledger never
touches a backend and has no lock: its :class:`~lmcache.tier.Tier` calls it under its own.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from .policies import EvictionPolicy, eviction_order, takes_sizes

#: ``listener(op, tier name, key)``, op ``"admit"`` or ``"evict"``; called under the
#: tier's lock, so it must not block
Listener = Callable[[str, str, str], None]


class Ledger:
    """The keys a tier accounts for, their bytes, its policy and its listeners."""

    def __init__(self, name: str, capacity: int, policy: EvictionPolicy):
        self.name = name
        self.capacity = capacity
        self.policy = policy
        self._sized = takes_sizes(policy)
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
            if self._sized:
                self.policy.on_insert(key, size)  # type: ignore[call-arg]
            else:
                self.policy.on_insert(key)
            self._tell("admit", key)
        elif self._sized and size != old:
            self.policy.on_resize(key, size)  # type: ignore[attr-defined]

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
        """The policy's next victim, which the caller evicts at once (then :meth:`forget`
        completes the handshake with ``on_remove``). A victim this ledger does not hold
        (a policy that drifted) gets its ``on_remove`` here and the policy is asked again,
        at most once per key it tracks, so a tier never loops on a ghost."""
        for _ in range(len(self.policy) + 1):
            k = self.policy.victim(skip)
            if k is None or k in self.sizes:
                return k  # type: ignore[return-value]
            self.policy.on_remove(k)
        return None

    def eviction_order(self) -> Iterator[str]:
        return (k for k in eviction_order(self.policy) if k in self.sizes)  # type: ignore[misc]

    def _tell(self, op: str, key: str) -> None:
        for f in self.listeners:
            f(op, self.name, key)

    def __contains__(self, key: object) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)
