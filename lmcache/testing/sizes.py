"""The backend suites' tests at real sizes (mixed into :class:`~lmcache.testing.BackendTests`
and :class:`~lmcache.testing.BytesBackendTests`): chunks of a real model's size, keys of a
few hundred bytes built from a long model name, threads, and the
``max_value_size``/``max_key_length`` contract (:mod:`lmcache.fit`). The sizes are class
attributes a plugin's test class may change (to what its store can hold)."""

from __future__ import annotations

import math
import random
import threading

import pytest
import torch

from .objects import LONG_MODEL, REAL_CHUNK_SHAPE, make_chunk, make_key, make_obj

def _key_of_length(n: int) -> str:
    """A canonical key of exactly ``n`` bytes (its model name padded; ``n`` >= 80)."""
    return make_key(0, model="m" * (n - len(make_key(0, model="m")) + 1))


class RealSizeTests:
    """Real-size puts and gets, through the store a tier opens (:func:`lmcache.encoded.open_objects`)."""

    #: the shape of a real-size chunk (float16); 8 MiB by default
    real_chunk_shape: tuple[int, ...] = REAL_CHUNK_SHAPE
    #: the model name real-size keys are built from (200 characters by default)
    real_model: str = LONG_MODEL
    #: threads putting and reading a real-size chunk each, at once
    real_threads: int = 3

    def test_real_size_chunk_under_a_long_key(self, backend):
        """A chunk of a real model's size under a key of a few hundred bytes round-trips
        exactly, as a tier stores it (through :func:`lmcache.encoded.open_objects`, so
        within the limits the backend declares), and is listed, counted and removed as one entry."""
        from ..encoded import open_objects

        b = open_objects(backend)
        k, o = make_key(1, model=self.real_model), make_chunk(1, self.real_chunk_shape)
        (size,) = b.put([(k, o)])
        assert b.exists([k, make_key(2, model=self.real_model)]) == [True, False]
        (g,) = b.get([k])
        assert g is not None and g.shape == o.shape and torch.equal(g.tensor, o.tensor)
        g.unref()
        assert dict(b.keys()) == {k: size} and b.usage().used_bytes == size
        assert b.delete([k]) == [True]
        assert b.exists([k]) == [False] and list(b.keys()) == []

    def test_real_size_chunks_from_threads(self, backend):
        """``real_threads`` threads each put a real-size chunk under a long key and read it
        back while the others do the same: every read is exact, nothing raises."""
        from ..encoded import open_objects

        b = open_objects(backend)
        errors: list[BaseException] = []

        def work(t: int) -> None:
            try:
                mine = [(make_key(100 * t, model=self.real_model), make_chunk(100 * t, self.real_chunk_shape))]
                b.put(mine)
                for (k, o), g in zip(mine, b.get([k for k, _ in mine])):
                    assert g is not None and torch.equal(g.tensor, o.tensor), k
                    g.unref()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(self.real_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not any(th.is_alive() for th in threads), "a backend call hung under threads"
        assert not errors, errors[0]
        assert b.usage().entries == self.real_threads

    def test_declared_limits_are_honoured(self, backend):
        """``max_value_size`` and ``max_key_length`` are ``None`` or sizes a tier can fit
        entries into; a backend that declares one stores bytes, and takes a value of exactly
        its limit (up to a real chunk's size) under a key of exactly its limit (up to 4 KiB)."""
        from ..fit import MIN_KEY_LENGTH, MIN_VALUE_SIZE

        limits = {"max_value_size": (backend.max_value_size, MIN_VALUE_SIZE),
                  "max_key_length": (backend.max_key_length, MIN_KEY_LENGTH)}
        for name, (v, lo) in limits.items():
            assert v is None or (type(v) is int and v >= lo), f"{name} = {v!r}: expected None or an int >= {lo}"
        if backend.max_value_size is None and backend.max_key_length is None:
            return  # unbounded: the real-size tests above hand it everything as it is
        assert backend.supports_bytes, "a backend with size limits must store bytes (supports_bytes)"
        real = math.prod(self.real_chunk_shape) * 2
        value = random.Random(0).randbytes(min(backend.max_value_size or real, real))
        key = _key_of_length(min(backend.max_key_length or 4096, 4096))
        backend.put_one(key, [value])
        try:
            assert bytes(backend.get_one(key)) == value
        finally:
            backend.delete_one(key)


class SplitTests:
    """A real tier over a byte backend made to declare small limits: values are split and
    keys hashed, and a damaged part or a digest collision is a miss, never a wrong value."""

    #: the limits the tier-level tests below make the backend declare (tighter than its own)
    small_value_size: int = 1 << 20
    small_key_length: int = 128

    def _small_tier(self, backend):
        """A real tier over ``backend`` seen with ``small_value_size``/``small_key_length``."""
        from ..config import TierConfig
        from ..fit import fit
        from ..ledger import Ledger
        from ..plugin_manager import get_registries
        from ..tier import Tier

        view = fit(backend, max_value_size=self.small_value_size, max_key_length=self.small_key_length)
        policy = get_registries().policies.load("lru")()
        return Tier(TierConfig(backend="conformance", capacity=1 << 40), view, Ledger("conformance", 1 << 40, policy))

    def _stored_within_limits(self, backend) -> dict[str, int]:
        from ..fit import MARK

        stored = dict(backend.keys())
        stored.pop(MARK, None)  # the few bytes that say the store holds entries in parts
        for name, size in stored.items():
            assert len(name.encode()) <= self.small_key_length, f"a key of {len(name.encode())} bytes was stored"
            assert size <= self.small_value_size, f"a value of {size} bytes was stored under {name}"
        return stored

    def test_small_limits_through_a_tier(self, backend):
        """Through a tier, a real-size chunk under a long key, a 2 MiB one under a short key
        and a small one under a long key round-trip exactly over a backend limited to 1 MiB
        values and 128-byte keys, which never receives more; the tier lists each entry once
        under its full key with the bytes of all its parts; removing them leaves nothing."""
        tier = self._small_tier(backend)
        items = [(make_key(1, model=self.real_model), make_chunk(1, self.real_chunk_shape)),
                 (make_key(2), make_chunk(2, (2, 2, 256, 8, 64))),  # 2 MiB under a short key
                 (make_key(3, model=self.real_model), make_obj(3))]
        for k, o in items:
            assert tier.put_one(k, o), k
        keys = [k for k, _ in items]
        assert tier.exists(keys) == [True] * 3
        for (k, o), g in zip(items, tier.get(keys)):
            assert g is not None and torch.equal(g.tensor, o.tensor), k
            g.unref()
        stored = self._stored_within_limits(backend)
        listed = dict(tier.backend.keys())
        assert set(listed) == set(keys) and sum(listed.values()) == sum(stored.values()) == tier.usage().used_bytes
        assert tier.delete(keys) == [True] * 3
        assert tier.exists(keys) == [False] * 3 and self._stored_within_limits(backend) == {}

    @pytest.mark.parametrize("how", ["missing", "flip", "truncate"])
    def test_a_missing_or_damaged_part_is_a_counted_miss(self, backend, how):
        """A 2 MiB chunk split into parts by a tier: with one part missing, flipped or cut
        short, a read is a miss (never part of a value), counted in ``integrity``, and
        the entry's head and parts are removed; another entry is untouched."""
        from ..fit import MARK, PART

        tier = self._small_tier(backend)
        k, o = make_key(1, model=self.real_model), make_chunk(1, (2, 2, 256, 8, 64))
        other = (make_key(2), make_obj(2))
        assert tier.put_one(k, o) and tier.put_one(*other)
        part = sorted(n for n, _ in backend.keys() if n.startswith(PART) and n != MARK)[-1]
        if how == "missing":
            backend.delete_one(part)
        else:
            self._damage(backend, part, how)
        before = backend.integrity.corrupt
        assert tier.get([k]) == [None]
        assert backend.integrity.corrupt == before + 1
        assert set(dict(backend.keys())) - {MARK} == {other[0]}, "the damaged entry's head or parts stayed"
        (g,) = tier.get([other[0]])
        assert g is not None and torch.equal(g.tensor, other[1].tensor)
        g.unref()

    def test_a_hashed_key_never_reads_another_keys_value(self, backend):
        """Long keys are stored under a digest; a head found under a key's digest that names
        another key (a digest collision, made here by copying one) is a miss, not that
        key's value, and leaves the other entry intact."""
        from ..fit import fit, head_key
        from ..encoded import open_objects

        view = open_objects(fit(backend, max_value_size=self.small_value_size, max_key_length=self.small_key_length))
        a, b = make_key(1, model=self.real_model), make_key(2, model=self.real_model)
        o = make_obj(1)
        view.put([(a, o)])
        backend.put_one(head_key(b), [bytes(backend.get_one(head_key(a)))])
        assert view.get([b]) == [None]
        (g,) = view.get([a])
        assert g is not None and torch.equal(g.tensor, o.tensor)
        g.unref()
