"""The ``cpu`` backend: memory objects in host memory (the memory pool).

It stores references, not copies: a hit hands out another reference to the same pool
bytes, so readers must not write into what they get. An entry that a reader still holds
is reported ``in_use`` and is never chosen for eviction.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator, Sequence

from lmcache.memory import MemoryObj
from lmcache.storage import BackendContext, EntryInfo, StorageBackend, Usage


class CPUBackend(StorageBackend):
    holds_memory_objects = True

    def __init__(self, context: BackendContext):
        super().__init__(context)
        self._objs: dict[str, MemoryObj] = {}
        self._stored_at: dict[str, float] = {}  # wall-clock time of each put
        self._lock = threading.Lock()
        self._used = 0

    def exists(self, keys: Sequence[str]) -> list[bool]:
        objs = self._objs
        return [k in objs for k in keys]

    def get_one(self, key: str) -> MemoryObj | None:
        with self._lock:
            obj = self._objs.get(key)
            return obj.ref() if obj is not None else None

    def put_one(self, key: str, obj: MemoryObj) -> int:
        obj.ref()
        with self._lock:
            old = self._objs.pop(key, None)
            self._objs[key] = obj
            self._stored_at[key] = time.time()
            self._used += obj.nbytes - (old.nbytes if old is not None else 0)
        if old is not None:
            old.unref()
        return obj.nbytes

    def delete_one(self, key: str) -> bool:
        with self._lock:
            obj = self._objs.pop(key, None)
            self._stored_at.pop(key, None)
            if obj is not None:
                self._used -= obj.nbytes
        if obj is None:
            return False
        obj.unref()
        return True

    def keys(self) -> Iterator[tuple[str, int]]:
        with self._lock:
            items = [(k, o.nbytes) for k, o in self._objs.items()]
        return iter(items)

    def entries(self) -> Iterator[EntryInfo]:
        with self._lock:
            items = [EntryInfo(k, o.nbytes, "raw", self._stored_at.get(k)) for k, o in self._objs.items()]
        return iter(items)

    def in_use(self, key: str) -> bool:
        obj = self._objs.get(key)
        # the tier's own reference and queued lower-tier writes are not readers
        return obj is not None and obj.refcount - obj.writer_refs > 1

    def usage(self) -> Usage:
        return Usage(self._used, self.context.capacity, len(self._objs))

    def close(self) -> None:
        with self._lock:
            objs, self._objs = list(self._objs.values()), {}
            self._stored_at = {}
            self._used = 0
        for o in objs:
            o.unref()
