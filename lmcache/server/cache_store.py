"""What ``lmcache server`` (:class:`lmcache.server.CacheServer`) serves: the :class:`ServedStore`
protocol, and :class:`ByteStore`, opaque values within a byte capacity."""

from __future__ import annotations

import threading
from typing import Any, Protocol

#: bytes each stored entry counts beyond its key and value (the dict slot, the buffer
#: object, the eviction policy's record: docs/benchmarks.md#measurements-behind-the-code)
ENTRY_OVERHEAD = 256


class ServedStore(Protocol):
    """What a :class:`CacheServer` serves. :class:`ByteStore` keeps opaque bytes; a cache
    engine's peer endpoint (:mod:`lmcache.plugins.services.p2p`) serves its own tiers through the same
    frames. Called from the connection threads, so implementations are thread-safe.

    One key per call (a frame names one), so the verbs are the single-key forms of the
    stores' vocabulary (:mod:`lmcache.storage`). ``get_one`` returns one buffer, or a
    sequence of buffers sent back to back (a payload's header and body, never joined);
    ``release(value)``, when a store defines it, is called once the buffers ``get_one``
    returned have been sent (or the connection died), so a store may hand out views of
    memory it must keep alive until then. ``put_one`` returns True, or False after which
    ``refusal(value)`` says why (an ERROR response; the connection stays open)."""

    def put_one(self, key: str, value: bytearray | memoryview) -> bool: ...
    def refusal(self, value: bytearray | memoryview) -> str: ...
    def get_one(self, key: str) -> Any: ...
    def exists_one(self, key: str) -> bool: ...
    def delete_one(self, key: str) -> bool: ...
    def snapshot(self, prefix: str = "") -> list[tuple[str, int]]: ...
    def stats(self) -> dict[str, Any]: ...


class ByteStore:
    """Opaque values under string keys, within a byte capacity; ``policy`` (an
    :class:`lmcache.policies.EvictionPolicy`) picks what goes when a put needs room.

    Every entry costs its value's bytes, its key's UTF-8 bytes and :data:`ENTRY_OVERHEAD`
    (:meth:`cost`), so keys with empty values fill the capacity and are evicted like any
    other entry: ``used_bytes`` never exceeds ``capacity`` and memory stays bounded.
    Stored buffers are never changed after they are stored (a put replaces the object),
    so a response can send one while another thread replaces or deletes its key."""

    def __init__(self, capacity: int, policy: Any):
        self.capacity = capacity
        self.policy = policy
        self._data: dict[str, bytearray | memoryview] = {}
        self.used = 0
        self.evictions = 0
        self._lock = threading.Lock()

    @staticmethod
    def cost(key: str, value: bytearray | memoryview) -> int:
        """The bytes an entry counts against the capacity: value, key and overhead."""
        return len(value) + len(key.encode()) + ENTRY_OVERHEAD

    def put_one(self, key: str, value: bytearray | memoryview) -> bool:
        """Store ``value``; False when the entry (:meth:`cost`) is larger than the whole capacity."""
        n = self.cost(key, value)
        if n > self.capacity:
            return False
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self.used -= self.cost(key, old)
                self.policy.on_remove(key)
            while self.used + n > self.capacity:
                victim = self.policy.victim(lambda k: False)
                if victim is None:  # pragma: no cover - the policy lost track of a key
                    break
                self.policy.on_remove(victim)
                gone = self._data.pop(victim, None)
                if gone is not None:
                    self.used -= self.cost(victim, gone)
                    self.evictions += 1
            self._data[key] = value
            self.used += n
            self.policy.on_insert(key)
        return True

    def refusal(self, value: bytearray | memoryview) -> str:
        return (f"value of {len(value)} bytes (plus its key and {ENTRY_OVERHEAD} bytes of overhead) "
                f"is larger than the server's capacity ({self.capacity})")

    def get_one(self, key: str) -> bytearray | memoryview | None:
        with self._lock:
            v = self._data.get(key)
            if v is not None:
                self.policy.on_access(key)
            return v

    def exists_one(self, key: str) -> bool:
        with self._lock:
            return key in self._data

    def delete_one(self, key: str) -> bool:
        with self._lock:
            v = self._data.pop(key, None)
            if v is None:
                return False
            self.used -= self.cost(key, v)
            self.policy.on_remove(key)
            return True

    def snapshot(self, prefix: str = "") -> list[tuple[str, int]]:
        with self._lock:
            return [(k, len(v)) for k, v in self._data.items() if k.startswith(prefix)]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"used_bytes": self.used, "capacity_bytes": self.capacity, "entries": len(self._data),
                    "evictions": self.evictions}


def load_policy(name: str) -> Any:
    from ..plugin_manager import get_registries

    return get_registries().policies.load(name)()


__all__ = ["ENTRY_OVERHEAD", "ByteStore", "ServedStore", "load_policy"]
