"""The eviction policy contract (the built-ins, LRU (default), LFU and FIFO, are the plugin
:mod:`lmcache.plugins.policies`).

A policy only records what happens to keys and proposes victims; the core accounts bytes
and decides which proposed victims may go (it skips pinned entries and entries a reader
still holds through ``skip``). ``contains`` checks are not accesses: reads never write.

A policy may also offer ``eviction_order()``: every key, next victim first, without
changing its state (``lmcache evict --bytes`` and ``--dry-run`` use it to plan). Without
it, :func:`eviction_order` asks ``victim`` repeatedly.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterator, Protocol, runtime_checkable

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
