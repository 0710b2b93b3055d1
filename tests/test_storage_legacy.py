"""Backends written against the storage contract before its one vocabulary keep working for
one release (:mod:`lmcache.storage_legacy`), through a real tier and through
:func:`lmcache.storage.open_objects`, with exactly one :class:`DeprecationWarning` per class,
when the class is created (none when it is used):

- an object backend with ``contains_one``/``get_one``/``put_one``/``remove_one``/``keys``,
  and one that overrides the batch ``contains``/``remove`` instead;
- a byte backend with ``read``/``write``/``delete(key)``/``exists(key)``/``list``, opened
  through :class:`lmcache.encoded.Encoded` (a damaged payload in it is a counted miss).

A class that overrides neither form of a verb pair is a :class:`TypeError` naming what is
missing; a legacy byte class that also overrides ``get``/``put`` (which now move bytes)
cannot be adapted and is a :class:`TypeError` too. The classes are made inside the tests,
so that ``-W error::DeprecationWarning`` fails nothing at import.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch

from lmcache.config import TierConfig
from lmcache.encoded import Encoded
from lmcache.ledger import Ledger
from lmcache.memory import MemoryObj, MemoryPool
from lmcache.plugin_manager import get_registries
from lmcache.storage import BackendContext, BytesBackend, StorageBackend
from lmcache.encoded import open_objects
from lmcache.testing import make_key, make_obj
from lmcache.tier import Tier

CAPACITY = 1 << 30


def _created(make: Callable[[], type]) -> tuple[type, str]:
    """The class ``make()`` creates and the one DeprecationWarning its creation gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cls = make()
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in deprecations]
    message = str(deprecations[0].message)
    assert f"{cls.__module__}:{cls.__qualname__}" in message, message
    return cls, message


class _NoDeprecation:
    """Fails if a DeprecationWarning is given inside it (the class warned once already)."""

    def __enter__(self) -> None:
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error", DeprecationWarning)

    def __exit__(self, *exc: object) -> None:
        self._catch.__exit__(*exc)


def _copy(obj: MemoryObj) -> MemoryObj:
    out = MemoryPool.allocate_unpooled(obj.shape, obj.dtype)
    out.tensor.copy_(obj.tensor)
    return out


class _Copies:
    """What the legacy object backends share (no store verbs of the old names): copies of
    the objects put, a fresh copy (the caller's) per hit."""

    def __init__(self, context: BackendContext):
        super().__init__(context)  # type: ignore[call-arg]
        self.objs: dict[str, MemoryObj] = {}
        self.calls: list[tuple[str, list[str]]] = []

    def get_one(self, key: str) -> MemoryObj | None:
        obj = self.objs.get(key)
        return None if obj is None else _copy(obj)

    def put_one(self, key: str, obj: MemoryObj) -> int:
        self.objs[key] = _copy(obj)
        return obj.nbytes

    def keys(self):
        return iter([(k, o.nbytes) for k, o in self.objs.items()])


def _legacy_singles() -> type:
    class LegacySingles(_Copies, StorageBackend):
        def contains_one(self, key: str) -> bool:
            return key in self.objs

        def remove_one(self, key: str) -> bool:
            return self.objs.pop(key, None) is not None

    return LegacySingles


def _legacy_batches() -> type:
    class LegacyBatches(_Copies, StorageBackend):
        def contains(self, keys):
            self.calls.append(("contains", list(keys)))
            return [k in self.objs for k in keys]

        def remove(self, keys):  # the old batch remove returned nothing
            self.calls.append(("remove", list(keys)))
            for k in keys:
                self.objs.pop(k, None)

    return LegacyBatches


def _legacy_bytes() -> type:
    class LegacyBytes(BytesBackend):
        def __init__(self, context: BackendContext):
            super().__init__(context)
            self.data: dict[str, bytes] = {}

        def read(self, key: str) -> bytes | None:
            return self.data.get(key)

        def write(self, key: str, buffers) -> None:
            self.data[key] = b"".join(buffers)

        def exists(self, key: str) -> bool:
            return key in self.data

        def delete(self, key: str) -> bool:
            return self.data.pop(key, None) is not None

        def list(self):
            return iter([(k, len(v)) for k, v in self.data.items()])

    return LegacyBytes


LEGACY = {"singles": _legacy_singles, "batches": _legacy_batches, "bytes": _legacy_bytes}
OLD_VERBS = {"singles": "contains_one, remove_one", "batches": "contains, remove",
             "bytes": "delete, exists, list, read, write"}


def _open(cls: type) -> Any:
    return cls(BackendContext.standalone(capacity=CAPACITY))


def _tier(backend: StorageBackend) -> Tier:
    """A real tier (its ledger, the lru policy) over ``backend``, as an engine builds one."""
    policy = get_registries().policies.load("lru")()
    return Tier(TierConfig(backend="legacy", capacity=CAPACITY), backend, Ledger("legacy", CAPACITY, policy))


def _items(n: int = 3) -> list[tuple[str, MemoryObj]]:
    return [(make_key(i), make_obj(i, num_tokens=4 + i)) for i in range(n)]


def _assert_exact(got: list[MemoryObj | None], items: list[tuple[str, MemoryObj]]) -> None:
    assert len(got) == len(items)
    for (k, o), g in zip(items, got):
        assert g is not None, k
        assert g.shape == o.shape and g.dtype == o.dtype and torch.equal(g.tensor, o.tensor), k
        g.unref()


# ------------------------------------------------------------------ the warning


@pytest.mark.parametrize("kind", LEGACY)
def test_a_legacy_class_warns_once_when_created_and_never_when_used(kind):
    cls, message = _created(LEGACY[kind])
    assert f"old storage verbs ({OLD_VERBS[kind]})" in message and "one more release" in message, message
    with _NoDeprecation():
        store = open_objects(_open(cls))
        store.put(_items(1))
        _assert_exact(store.get([make_key(0)]), _items(1))
        assert store.exists([make_key(0)]) == [True] and store.delete([make_key(0)]) == [True]

        class Quiet(cls):  # a subclass that adds no old verb is not warned about again
            pass

    assert issubclass(Quiet, cls)


def test_each_class_is_warned_about_once():
    """Two classes made by the same code: one warning each, each naming its class."""
    a, _ = _created(_legacy_singles)
    b, _ = _created(_legacy_singles)
    assert a is not b


# ------------------------------------------------------------- object backends


@pytest.mark.parametrize("kind", ["singles", "batches"])
def test_a_legacy_object_backend_through_open_objects(kind):
    cls, _ = _created(LEGACY[kind])
    backend = _open(cls)
    store = open_objects(backend)
    assert store is backend  # a store of objects is opened as it is
    items = _items()
    keys = [k for k, _ in items]
    assert store.put(items) == [o.nbytes for _, o in items]
    assert store.exists([*keys, make_key(9)]) == [True, True, True, False]
    assert store.exists_one(keys[0]) and not store.exists_one(make_key(9))
    _assert_exact(store.get(keys), items)
    assert store.get([make_key(9)]) == [None]
    assert dict(store.keys()) == {k: o.nbytes for k, o in items}
    assert store.delete(keys[:2]) == [True, True]
    assert store.delete_one(keys[2]) is True
    assert store.exists(keys) == [False] * 3 and list(store.keys()) == []
    if kind == "singles":
        assert store.delete([make_key(9)]) == [False]
    else:  # its batch overrides answer the batch verbs, one call per batch
        assert ("contains", [*keys, make_key(9)]) in backend.calls and ("remove", keys[:2]) in backend.calls


@pytest.mark.parametrize("kind", ["singles", "batches"])
def test_a_legacy_object_backend_through_a_tier(kind):
    cls, _ = _created(LEGACY[kind])
    backend = _open(cls)
    tier = _tier(backend)
    items = _items()
    keys = [k for k, _ in items]
    with _NoDeprecation():
        assert [tier.put_one(k, o) for k, o in items] == [o.nbytes for _, o in items]
        assert tier.exists([*keys, make_key(9)]) == [True, True, True, False]
        _assert_exact(tier.get(keys), items)
        assert tier.get([make_key(9)]) == [None]
        assert dict(tier.keys()) == {k: o.nbytes for k, o in items} and tier.usage().entries == 3
        again = _tier(backend)  # a tier opened over the store lists what it holds
        assert dict(again.keys()) == dict(tier.keys())
        assert tier.delete(keys[:2]) == [True, True]
        assert tier.exists(keys) == [False, False, True] and set(backend.objs) == {keys[2]}
    assert tier.info()["hits"] == 3 and tier.info()["errors"] == 0


# --------------------------------------------------------------- byte backends


def test_a_legacy_byte_backend_through_open_objects():
    cls, _ = _created(_legacy_bytes)
    backend = _open(cls)
    store = open_objects(backend)
    assert isinstance(store, Encoded) and store.raw is backend
    items = _items()
    keys = [k for k, _ in items]
    with _NoDeprecation():
        sizes = store.put(items)
        assert sizes == [len(backend.data[k]) for k in keys]  # the payloads' bytes, header included
        assert all(s > o.nbytes for s, (_, o) in zip(sizes, items))
        assert store.exists([*keys, make_key(9)]) == [True, True, True, False]
        _assert_exact(store.get(keys), items)
        assert store.get([make_key(9)]) == [None]
        assert dict(store.keys()) == dict(zip(keys, sizes))
        # the store itself speaks today's verbs over bytes
        assert bytes(backend.get_one(keys[0])) == backend.data[keys[0]]
        assert backend.get([keys[0], make_key(9)]) == [backend.data[keys[0]], None]
        assert backend.exists([keys[0], make_key(9)]) == [True, False] and backend.exists_one(keys[1])
        assert backend.put_one(make_key(8), [b"ab", memoryview(b"cd")]) == 4 and backend.data[make_key(8)] == b"abcd"
        assert backend.delete([make_key(8), make_key(8)]) == [True, False]
        assert store.delete([keys[0], make_key(9)]) == [True, False]
        assert store.delete_one(keys[1]) is True
        assert list(store.keys()) == [(keys[2], sizes[2])]


def test_a_legacy_byte_backend_through_a_tier():
    cls, _ = _created(_legacy_bytes)
    backend = _open(cls)
    tier = _tier(backend)
    items = _items()
    keys = [k for k, _ in items]
    with _NoDeprecation():
        sizes = [tier.put_one(k, o) for k, o in items]
        assert sizes == [len(backend.data[k]) for k in keys]
        assert tier.exists([*keys, make_key(9)]) == [True, True, True, False]
        _assert_exact(tier.get(keys), items)
        assert dict(tier.keys()) == dict(zip(keys, sizes))
        again = _tier(backend)  # its old list() rebuilds a tier's books
        assert dict(again.keys()) == dict(zip(keys, sizes)) and again.usage().used_bytes == sum(sizes)
        assert tier.delete([keys[0], make_key(9)]) == [True, False]
        assert tier.exists(keys) == [False, True, True] and keys[0] not in backend.data


def _damage(backend: Any, key: str) -> None:
    data = bytearray(backend.data[key])
    data[len(data) - 1 - len(data) // 4] ^= 0x40  # inside the body
    backend.data[key] = bytes(data)


@pytest.mark.parametrize("through", ["open_objects", "tier"])
def test_a_damaged_payload_in_a_legacy_byte_backend_is_a_counted_miss(through):
    cls, _ = _created(_legacy_bytes)
    backend = _open(cls)
    store = open_objects(backend) if through == "open_objects" else _tier(backend)
    items = _items(2)
    for k, o in items:
        assert store.put_one(k, o) > 0
    _damage(backend, items[0][0])
    with _NoDeprecation():
        assert store.get([items[0][0]]) == [None]
    assert backend.integrity.corrupt == 1
    assert items[0][0] not in backend.data, "the corrupt payload stayed in the store"
    assert store.exists([items[0][0]]) == [False]
    _assert_exact(store.get([items[1][0]]), items[1:])
    if through == "tier":
        assert store.info()["corrupt"] == 1 and store.info()["misses"] == 1


# ---------------------------------------------------------- what cannot be adapted


class _ReadsNothing:
    """The get/put/keys of a store that holds nothing (the pairs the tests below leave in place)."""

    def get_one(self, key):
        return None

    def put_one(self, key, obj):
        return 0

    def keys(self):
        return iter(())


def test_a_class_overriding_neither_form_of_a_pair_is_a_type_error():
    with pytest.raises(TypeError) as info:

        class HalfStore(_ReadsNothing, StorageBackend):
            pass

    msg = str(info.value)
    assert "HalfStore" in msg and "exists or exists_one" in msg and "delete or delete_one" in msg, msg
    assert "get or get_one" not in msg and "put or put_one" not in msg, msg


@pytest.mark.parametrize("kind", ["objects", "bytes"])
def test_a_legacy_class_missing_a_pair_is_a_type_error_after_its_warning(kind):
    """Adapting renames what is there; a pair still missing after it is named."""

    def make() -> type:
        if kind == "objects":

            class NoRemove(_ReadsNothing, StorageBackend):  # contains_one, but no remove_one
                def contains_one(self, key):
                    return False

            return NoRemove

        class NoExists(BytesBackend):  # read/write/list, but no exists(key) nor delete(key)
            def read(self, key):
                return None

            def write(self, key, buffers):
                pass

            def list(self):
                return iter(())

        return NoExists

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TypeError) as info:
            make()
    msg = str(info.value)
    assert "delete or delete_one" in msg and ("exists or exists_one" in msg) == (kind == "bytes"), msg
    assert "get or get_one" not in msg and "put or put_one" not in msg, msg
    assert len([w for w in caught if issubclass(w.category, DeprecationWarning)]) == 1


@pytest.mark.parametrize("verb", ["get", "get_one", "put", "put_one"])
def test_a_legacy_byte_class_that_overrides_get_or_put_is_a_type_error(verb):
    body: dict[str, Any] = {
        "read": lambda self, key: None,
        "write": lambda self, key, buffers: None,
        "exists": lambda self, key: False,
        "delete": lambda self, key: False,
        "list": lambda self: iter(()),
        verb: lambda self, *args: None,
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TypeError) as info:
            type("Mixed", (BytesBackend,), body)
    msg = str(info.value)
    assert "Mixed" in msg and "old byte contract" in msg and verb in msg.split("overrides", 1)[1], msg
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]  # refused, not adapted
