"""The medium a consumer of vLLM's KV events reads for each lmcache tier, and when a
block's presence on a medium begins and ends.

vLLM names three media in its events (``vllm.distributed.kv_events``): ``GPU`` (its own
block pool), ``CPU`` and ``STORAGE``. lmcache's ``cpu`` tiers are ``CPU``; every other
tier (local disk, fs, GDS, Redis, Valkey, S3, Mooncake, an lm server) is ``STORAGE``.
``kv_events.media`` overrides this per tier name or backend (``{disk: STORAGE, redis:
REMOTE}``), for consumers that weigh named media.

Several tiers may map to one medium (a disk tier and a Redis tier are both ``STORAGE``),
so a tier's eviction is not the medium's: :class:`MediaTracker` follows which tiers
hold each key and reports a medium's ``BlockStored`` when its first tier admits the key
and its ``BlockRemoved`` only when its last tier drops it. After a removal it also names
the media that still hold the key, so a publisher can repeat their ``BlockStored``: a
consumer that drops a block from every medium on any removal (whatever the ``medium``
field says) learns again that the block is still here.
"""

from __future__ import annotations

from typing import Mapping, Sequence

CPU = "CPU"
STORAGE = "STORAGE"
#: longest medium name accepted from the configuration
MAX_MEDIUM_LEN = 64


def medium_of(tier_name: str, backend: str, overrides: Mapping[str, str] | None = None) -> str:
    """The medium of a tier: an override by tier name, then by backend, then ``CPU`` for
    a ``cpu`` backend and ``STORAGE`` for any other."""
    if overrides:
        for k in (tier_name, backend):
            if k in overrides:
                return overrides[k]
    return CPU if backend == "cpu" else STORAGE


def tier_media(tiers: Sequence, overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{tier name: medium}`` for a hierarchy's tiers (objects with ``name`` and
    ``cfg.backend``)."""
    return {t.name: medium_of(t.name, t.cfg.backend, overrides) for t in tiers}


class MediaTracker:
    """Which tiers hold each key; turns tier admits and evictions into medium
    transitions. Not thread-safe: the caller serializes (a tier listener runs under that
    tier's lock only, so the caller holds its own lock around these calls)."""

    def __init__(self, media: Mapping[str, str]):
        self.media = dict(media)
        self._held: dict[str, set[str]] = {}

    def holders(self, key: str) -> set[str]:
        """The tiers known to hold ``key``."""
        return set(self._held.get(key, ()))

    def media_of(self, key: str) -> list[str]:
        """The media holding ``key``, in the order of the tiers."""
        held = self._held.get(key, ())
        return list(dict.fromkeys(m for t, m in self.media.items() if t in held))

    def admit(self, tier: str, key: str) -> str | None:
        """``tier`` now holds ``key``: the medium that starts holding it (``None`` if the
        medium held it already through another tier, or the tier is unknown)."""
        medium = self.media.get(tier)
        if medium is None:
            return None
        held = self._held.setdefault(key, set())
        before = any(self.media.get(t) == medium for t in held)
        held.add(tier)
        return None if before else medium

    def evict(self, tier: str, key: str) -> tuple[str | None, list[str]]:
        """``tier`` dropped ``key``: ``(medium that no longer holds it or None, media that
        still hold it)``."""
        held = self._held.get(key)
        if held is None or tier not in held:
            return None, []
        held.discard(tier)
        medium = self.media.get(tier)
        still = [m for m in dict.fromkeys(self.media[t] for t in self.media if t in held)]
        if not held:
            del self._held[key]
        return (None if medium in still else medium), still

    def __len__(self) -> int:
        return len(self._held)
