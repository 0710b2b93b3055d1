"""The eviction policy contract (the built-ins, LRU (default), LFU, FIFO and S3-FIFO, are
the plugin :mod:`lmcache.plugins.policies`).

A policy only records what happens to keys and proposes victims; the core accounts bytes
and decides which entries may go (it hides pinned entries and entries a reader still
holds through ``skip``). ``contains`` checks are not accesses: reads never write.

**The handshake.** ``victim(skip)`` is an announcement, not a question: the core evicts
the key it returns and calls ``on_remove(key)`` for it before it calls the policy again
(a key the tier no longer holds is dropped the same way). So ``victim`` may change state
(advance a hand, promote entries it passes, mark the key for a ghost list that
``on_remove`` fills). A policy that does so declares ``victim_changes_state = True``.

**Planning** (``lmcache evict --bytes`` and ``--dry-run``, :meth:`Tier.eviction_order`)
never calls ``victim``: it calls :func:`eviction_order`, which uses the policy's own
``eviction_order()`` (every key, next victim first, without changing state) or, for a
policy whose ``victim`` does not change state, asks ``victim`` repeatedly. A policy with
``victim_changes_state`` must have ``eviction_order()`` (:func:`build_policy` refuses it
otherwise).

**Declared capabilities**, class attributes (absent means ``False``):

- ``victim_changes_state``: see above;
- ``takes_sizes``: the core calls ``on_insert(key, size)`` with the entry's stored bytes,
  and ``on_resize(key, size)`` when a held key is stored again with another size.
  Without it, ``on_insert(key)`` (the one-argument form of older policies).

**Options.** A policy is built with the tier's ``policy_options`` as keyword arguments
(its ``__init__`` parameters are its options), plus ``capacity=`` (the tier's capacity
in bytes) if its ``__init__`` takes a ``capacity`` parameter (:func:`build_policy`).
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable, Hashable, Iterator, Mapping, Protocol, runtime_checkable

from .errors import PluginError

Key = Hashable


@runtime_checkable
class EvictionPolicy(Protocol):
    def on_insert(self, key: Key) -> None:
        """``key`` entered the tier (it was not there); ``on_insert(key, size)`` for a
        policy that declares ``takes_sizes``."""

    def on_access(self, key: Key) -> None:
        """``key`` was read (a hit); unknown keys are ignored."""

    def on_remove(self, key: Key) -> None:
        """``key`` left the tier (evicted, removed, or the victim just returned);
        unknown keys are ignored."""

    def victim(self, skip: Callable[[Key], bool]) -> Key | None:
        """The key to evict now, one for which ``skip(key)`` is false, or ``None``.

        The core evicts it and calls ``on_remove(key)`` before any other call. Changes no
        state unless the policy declares ``victim_changes_state``.
        """

    def __len__(self) -> int: ...


def takes_sizes(policy: object) -> bool:
    """Whether ``policy`` declared ``takes_sizes`` (``on_insert(key, size)``, ``on_resize``)."""
    return bool(getattr(policy, "takes_sizes", False))


def victim_changes_state(policy: object) -> bool:
    """Whether ``policy`` declared that its ``victim`` changes its state."""
    return bool(getattr(policy, "victim_changes_state", False))


def eviction_order(policy: EvictionPolicy) -> Iterator[Key]:
    """The keys of ``policy`` in the order it would evict them (a snapshot: the policy
    is not changed). Uses the policy's own ``eviction_order()`` if it has one; a policy
    whose ``victim`` changes state must have one (``TypeError`` otherwise)."""
    own = getattr(policy, "eviction_order", None)
    if own is not None:
        yield from own()
        return
    if victim_changes_state(policy):
        raise TypeError(f"{type(policy).__name__} declares victim_changes_state but has no eviction_order()")
    seen: set[Key] = set()
    while True:
        k = policy.victim(lambda k: k in seen)
        if k is None:
            return
        seen.add(k)
        yield k


def policy_options(cls: type) -> list[str]:
    """The option names ``cls`` takes: its ``__init__`` keyword parameters but
    ``capacity`` (which the core passes)."""
    params = inspect.signature(cls).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.name != "capacity"]


def build_policy(cls: type, name: str, options: Mapping[str, Any] | None = None,
                 capacity: int | None = None) -> EvictionPolicy:
    """A fresh policy ``cls`` (registered as ``name``) with ``options`` as keyword
    arguments and ``capacity`` if its ``__init__`` takes one.

    An unknown option is a ``ValueError`` naming the policy and the key (with a "did you
    mean"); a bad value whatever the policy raises (``ValueError``/``TypeError``); a
    policy declaring ``victim_changes_state`` without ``eviction_order()`` a
    :class:`~lmcache.errors.PluginError`."""
    opts = dict(options or {})
    if "capacity" in opts:
        raise ValueError(f"policy {name!r}: 'capacity' is the tier's capacity, not an option")
    params = inspect.signature(cls).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        known = policy_options(cls)
        for k in opts:
            if k not in known:
                hint = difflib.get_close_matches(str(k), known, n=1)
                more = f"did you mean '{hint[0]}'?" if hint else (
                    f"its options: {', '.join(known)}" if known else "it takes no options")
                raise ValueError(f"unknown option {k!r} for policy {name!r}; {more}")
    if capacity is not None and "capacity" in params:
        opts["capacity"] = capacity
    if victim_changes_state(cls) and not hasattr(cls, "eviction_order"):
        raise PluginError(f"policy {name!r} declares victim_changes_state but has no eviction_order()")
    return cls(**opts)
