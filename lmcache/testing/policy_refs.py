"""Reference models of the built-in eviction policies, and the trace replay that
:class:`~lmcache.testing.conformance.PolicyTraceTests` runs a policy against its reference.

A reference is the same algorithm written to be obviously right, not fast: plain lists,
whole scans. It has the policy's methods (``on_insert``, ``on_access``, ``on_remove``,
``victim``; ``on_resize`` and ``on_insert(key, size)`` if the policy declares
``takes_sizes``) and no ``eviction_order``: the replay drains a deep copy of it instead.
"""

from __future__ import annotations

import copy
import random
from typing import Any, Callable, Hashable

from ..policies import eviction_order, takes_sizes, victim_changes_state

Key = Hashable


class LRURef:
    """Least recently used: a list, oldest use first."""

    def __init__(self, reads_count: bool = True) -> None:
        self.keys: list[Key] = []
        self.reads_count = reads_count

    def on_insert(self, key: Key) -> None:
        self.keys.append(key)

    def on_access(self, key: Key) -> None:
        if self.reads_count and key in self.keys:
            self.keys.remove(key)
            self.keys.append(key)

    def on_remove(self, key: Key) -> None:
        if key in self.keys:
            self.keys.remove(key)

    def victim(self, skip: Callable[[Key], bool]) -> Key | None:
        return next((k for k in self.keys if not skip(k)), None)

    def __len__(self) -> int:
        return len(self.keys)


def FIFORef() -> LRURef:
    """First in, first out: reads change nothing."""
    return LRURef(reads_count=False)


class LFURef:
    """Fewest uses first; of those, the one whose count changed longest ago."""

    def __init__(self) -> None:
        self.count: dict[Key, int] = {}
        self.changed: dict[Key, int] = {}
        self.clock = 0

    def _use(self, key: Key) -> None:
        self.clock += 1
        self.count[key] = self.count.get(key, 0) + 1
        self.changed[key] = self.clock

    def on_insert(self, key: Key) -> None:
        self._use(key)

    def on_access(self, key: Key) -> None:
        if key in self.count:
            self._use(key)

    def on_remove(self, key: Key) -> None:
        self.count.pop(key, None)
        self.changed.pop(key, None)

    def victim(self, skip: Callable[[Key], bool]) -> Key | None:
        free = [k for k in self.count if not skip(k)]
        return min(free, key=lambda k: (self.count[k], self.changed[k]), default=None)

    def __len__(self) -> int:
        return len(self.count)


class S3FIFORef:
    """S3-FIFO as :class:`lmcache.plugins.policies.S3FIFOPolicy` documents it, with lists."""

    takes_sizes = True
    victim_changes_state = True

    def __init__(self, small_ratio: float = 0.1, ghost_ratio: float = 0.9, capacity: int | None = None):
        self.small: list[Key] = []
        self.main: list[Key] = []
        self.ghost: list[tuple[Key, int]] = []
        self.freq: dict[Key, int] = {}
        self.size: dict[Key, int] = {}
        self.small_ratio, self.ghost_ratio, self.capacity = small_ratio, ghost_ratio, capacity
        self.leaving: Key | None = None

    def _limit(self) -> int:
        return self.capacity or sum(self.size.values())

    def on_insert(self, key: Key, size: int = 1) -> None:
        ghosts = [k for k, _ in self.ghost]
        if key in ghosts:
            del self.ghost[ghosts.index(key)]
            self.main.append(key)
        else:
            self.small.append(key)
        self.freq[key], self.size[key] = 0, size

    def on_access(self, key: Key) -> None:
        if key in self.freq:
            self.freq[key] = min(self.freq[key] + 1, 3)

    def on_resize(self, key: Key, size: int) -> None:
        if key in self.size:
            self.size[key] = size

    def on_remove(self, key: Key) -> None:
        leaving, self.leaving = self.leaving, None
        if key not in self.size:
            return
        size = self.size.pop(key)
        del self.freq[key]
        if key in self.main:
            self.main.remove(key)
            return
        self.small.remove(key)
        if key == leaving:
            self.ghost.append((key, size))
            while self.ghost and sum(s for _, s in self.ghost) > self.ghost_ratio * self._limit():
                self.ghost.pop(0)

    def victim(self, skip: Callable[[Key], bool]) -> Key | None:
        self.leaving = None
        small_bytes = sum(self.size[k] for k in self.small)
        if self.small and (not self.main or small_bytes >= self.small_ratio * self._limit()):
            order = [self._from_small, self._from_main]
        else:
            order = [self._from_main, self._from_small, self._from_main]
        for take in order:
            k = take(skip)
            if k is not None:
                return k
        return None

    def _from_small(self, skip: Callable[[Key], bool]) -> Key | None:
        for k in list(self.small):
            if skip(k):
                continue
            if self.freq[k] == 0:
                self.leaving = k
                return k
            self.small.remove(k)
            self.main.append(k)
            self.freq[k] = 0
        return None

    def _from_main(self, skip: Callable[[Key], bool]) -> Key | None:
        while any(not skip(k) for k in self.main):
            for k in list(self.main):
                if skip(k):
                    continue
                if self.freq[k] == 0:
                    return k
                self.freq[k] -= 1
                self.main.remove(k)
                self.main.append(k)
        return None

    def __len__(self) -> int:
        return len(self.freq)


def drain(reference: Any) -> list[Key]:
    """The order ``reference`` would evict every key in: a deep copy of it, drained
    through the handshake (``victim`` then ``on_remove``)."""
    ref = copy.deepcopy(reference)
    out: list[Key] = []
    while (k := ref.victim(lambda k: False)) is not None:
        out.append(k)
        ref.on_remove(k)
    return out


def replay(policy: Any, reference: Any, seed: int, ops: int = 300, keys: int = 40) -> None:
    """Run one seeded random trace of ``ops`` operations on ``policy`` and ``reference``
    as a tier would (inserts of absent keys, reads, removes, re-sizes, evictions with
    some keys skipped, each victim followed by its ``on_remove``; unknown keys read and
    removed too) and assert after each step that both agree: the same victim, the same
    ``eviction_order`` (the policy's, against a drained copy of the reference), the same
    length. Planning must not disturb the policy: the next victims still agree. A policy
    whose ``victim`` does not change state must also give the same victim twice."""
    rng = random.Random(seed)
    sized = takes_sizes(policy)
    pure = not victim_changes_state(policy)
    held: set[Key] = set()
    for step in range(ops):
        where = f"seed {seed}, step {step}"
        r = rng.random()
        absent = [f"k{i}" for i in range(keys) if f"k{i}" not in held]
        if r < 0.35 and absent:
            k = rng.choice(absent)
            args = (k, rng.randint(1, 4096)) if sized else (k,)
            policy.on_insert(*args)
            reference.on_insert(*args)
            held.add(k)
        elif r < 0.6:
            k = rng.choice(sorted(held)) if held and rng.random() < 0.9 else "unknown"
            policy.on_access(k)
            reference.on_access(k)
        elif r < 0.67:
            k = rng.choice(sorted(held)) if held and rng.random() < 0.8 else "unknown"
            policy.on_remove(k)
            reference.on_remove(k)
            held.discard(k)
        elif r < 0.72 and sized and held:
            k, size = rng.choice(sorted(held)), rng.randint(1, 4096)
            policy.on_resize(k, size)
            reference.on_resize(k, size)
        elif r < 0.92:
            pinned = {k for k in held if rng.random() < 0.2}
            skip = pinned.__contains__
            v = policy.victim(skip)
            assert v == reference.victim(skip), f"{where}: victim {v!r} differs from the reference's"
            if pure:
                assert policy.victim(skip) == v, f"{where}: a second victim() without on_remove differs"
            if v is None:
                assert held <= pinned, f"{where}: no victim, yet {sorted(held - pinned)} are not skipped"
                continue
            assert v in held and v not in pinned, f"{where}: victim {v!r} is not a held, unskipped key"
            policy.on_remove(v)
            reference.on_remove(v)
            held.discard(v)
        else:
            got = list(eviction_order(policy))
            assert got == drain(reference), f"{where}: eviction_order differs from the reference's"
        assert len(policy) == len(held) == len(reference), f"{where}: len {len(policy)}, {len(held)} held"
    assert list(eviction_order(policy)) == drain(reference), f"seed {seed}: final eviction_order differs"
