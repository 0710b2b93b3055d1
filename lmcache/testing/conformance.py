"""Conformance suites that every storage backend, codec and eviction policy runs
(re-exported by :mod:`lmcache.testing`).

Plain pytest classes: a plugin's test module subclasses one and provides a fixture.

.. code-block:: python

    from lmcache.testing import BackendTests

    class TestMyBackend(BackendTests):
        @pytest.fixture
        def backend(self, tmp_path):
            ctx = BackendContext.standalone({"path": str(tmp_path)})
            b = MyBackend(ctx)
            yield b
            b.close()

``BackendTests`` needs a ``backend`` fixture (a fresh, empty backend); ``CodecTests`` a
``codec`` fixture; ``PolicyTests`` a ``policy`` fixture (a fresh policy);
``PolicyTraceTests`` also a ``reference`` fixture (a reference model of the algorithm).

Backends that store bytes, or keep entries across processes, run more of the contract:

- :class:`BytesBackendTests` (a :class:`~lmcache.storage.BytesBackend`, the fixture's
  ``backend``; the tests read and write through ``objects``, the view a tier opens it
  through): a damaged or truncated entry is a miss, counted in ``integrity`` and removed;
- :class:`PersistentBackendTests` (entries outlive the backend object: files, a
  database, a server) also needs ``reopen``, a fixture giving a callable
  ``reopen(read_only=False)`` that opens another backend over the same storage as
  ``backend`` (the test closes it);
- :class:`FileBackendTests` (storage at a path) also needs ``open_at``, a callable
  ``open_at(path, read_only)``: a read-only open of a path that does not exist creates
  nothing there (``lmcache ls --config`` opens tiers read-only).

A class may combine them: ``class TestMine(FileBackendTests, BytesBackendTests)``.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from .objects import LONG_MODEL, REAL_CHUNK_SHAPE, make_chunk, make_key, make_obj  # noqa: F401 - re-exported
from ..encoded import open_objects
from .sizes import RealSizeTests, SplitTests


def assert_rejects(backend_cls, options, key: str, *, construct: bool = True) -> None:
    """``options`` is a config error naming ``key``, both in ``check_options`` (what
    ``lmcache config validate`` runs) and, with ``construct``, when the backend is built."""
    from ..errors import ConfigError
    from ..storage import BackendContext, check_backend_options

    with pytest.raises(ConfigError) as info:
        check_backend_options(backend_cls, options, None)
    assert info.value.key == key, f"expected a config error naming {key!r}, got {info.value}"
    if construct:
        with pytest.raises(ConfigError) as info:
            backend_cls(BackendContext.standalone(options))
        assert info.value.key == key, f"the constructor named {info.value.key!r}, not {key!r}"


class BackendTests(RealSizeTests):
    """The storage backend contract (see :mod:`lmcache.storage`), through the store a
    tier opens (``objects``: a byte store through its object view)."""

    @pytest.fixture
    def objects(self, backend):
        """``backend`` as a tier opens it: a :class:`~lmcache.storage.BytesBackend`
        through its object view, any other backend as it is."""
        from ..encoded import open_objects

        return open_objects(backend)

    def test_missing_key_is_none(self, objects):
        k = make_key(1)
        assert objects.get([k]) == [None]
        assert objects.exists([k]) == [False]

    def test_put_get_roundtrip_exact(self, objects):
        items = [(make_key(i), make_obj(i, num_tokens=5 + i)) for i in range(4)]
        sizes = objects.put(items)
        assert len(sizes) == 4 and all(s >= o.nbytes or s > 0 for s, (_, o) in zip(sizes, items))
        got = objects.get([k for k, _ in items])
        for (k, o), g in zip(items, got):
            assert g is not None, k
            assert g.shape == o.shape and g.dtype == o.dtype
            assert torch.equal(g.tensor, o.tensor)
            g.unref()

    def test_get_hands_each_hit_to_on_ready_iff_it_streams(self, objects):
        """``on_ready`` reaches only a backend declaring ``streams_gets``; that one calls
        it exactly once per hit, with the object it also returns, never for a miss."""
        o = make_obj(2)
        objects.put([(make_key(2), o)])
        keys = [make_key(1), make_key(2)]
        seen: list[tuple[int, object]] = []
        got = objects.get(keys, lambda i, obj: seen.append((i, obj))) if objects.streams_gets else objects.get(keys)
        assert got[0] is None and got[1] is not None and torch.equal(got[1].tensor, o.tensor)
        assert seen == ([(1, got[1])] if objects.streams_gets else [])
        got[1].unref()

    def test_exists_batch(self, objects):
        assert objects.exists([]) == []
        objects.put([(make_key(1), make_obj(1)), (make_key(3), make_obj(3))])
        assert objects.exists([make_key(i) for i in range(5)]) == [False, True, False, True, False]

    def test_dtypes_roundtrip(self, objects):
        for i, dt in enumerate((torch.float32, torch.bfloat16, torch.float16)):
            o = make_obj(i, dtype=dt)
            objects.put([(make_key(100 + i), o)])
            (g,) = objects.get([make_key(100 + i)])
            assert g is not None and g.dtype == dt and torch.equal(g.tensor, o.tensor)
            g.unref()

    def test_put_keeps_callers_object_intact(self, objects):
        o = make_obj(7)
        before = o.tensor.clone()
        objects.put([(make_key(7), o)])
        assert o.refcount >= 1 and torch.equal(o.tensor, before)

    def test_overwrite_same_key(self, objects):
        k = make_key(9)
        objects.put([(k, make_obj(1))])
        new = make_obj(2)
        objects.put([(k, new)])
        (g,) = objects.get([k])
        assert g is not None and torch.equal(g.tensor, new.tensor)
        g.unref()

    def test_delete(self, objects):
        objects.put([(make_key(1), make_obj(1)), (make_key(2), make_obj(2))])
        assert objects.delete([make_key(1), make_key(5)]) == [True, False]
        assert objects.exists([make_key(1), make_key(2)]) == [False, True]
        assert objects.get([make_key(1)]) == [None]

    def test_keys_and_usage(self, objects):
        items = [(make_key(i), make_obj(i)) for i in range(3)]
        sizes = objects.put(items)
        listed = dict(objects.keys())
        assert set(listed) == {k for k, _ in items}
        assert all(listed[k] == s for (k, _), s in zip(items, sizes))
        u = objects.usage()
        assert u.entries == 3 and u.used_bytes == sum(sizes)

    def test_reserve_size_is_an_upper_bound(self, objects):
        for i in range(3):
            k, o = make_key(i), make_obj(i, num_tokens=3 + 7 * i)
            assert objects.put([(k, o)])[0] <= objects.reserve_size(k, o)

    def test_many_keys_random_order(self, objects):
        rng = random.Random(0)
        objs = {make_key(i): make_obj(i, num_tokens=1 + i % 5) for i in range(40)}
        order = list(objs)
        rng.shuffle(order)
        objects.put([(k, objs[k]) for k in order])
        rng.shuffle(order)
        for k, g in zip(order, objects.get(order)):
            assert g is not None and torch.equal(g.tensor, objs[k].tensor)
            g.unref()


    def test_entries_list_what_keys_lists(self, objects):
        items = [(make_key(i), make_obj(i, num_tokens=2 + i)) for i in range(3)]
        objects.put(items)
        listed = dict(objects.keys())
        entries = list(objects.entries())
        assert {e.key: e.size for e in entries} == listed
        assert len(entries) == 3

    def test_threads_on_own_and_shared_keys(self, objects):
        """4 threads store, read, test and remove their own keys and overwrite one shared
        key: every read of an own key is exact, a read of the shared key is one of the
        objects written to it, never a mix, and nothing raises."""
        shared = make_key(10_000)
        shared_objs = [make_obj(900 + t) for t in range(4)]
        errors: list[BaseException] = []

        def work(t: int) -> None:
            try:
                for r in range(6):
                    mine = [(make_key(1000 * t + 10 * r + j), make_obj(1000 * t + 10 * r + j)) for j in range(3)]
                    objects.put(mine)
                    objects.put([(shared, shared_objs[t])])
                    for (k, o), g in zip(mine, objects.get([k for k, _ in mine])):
                        assert g is not None and torch.equal(g.tensor, o.tensor), k
                        g.unref()
                    (g,) = objects.get([shared])
                    if g is not None:
                        assert any(torch.equal(g.tensor, o.tensor) for o in shared_objs), "a mixed shared entry"
                        g.unref()
                    assert objects.exists([k for k, _ in mine]) == [True] * 3
                    objects.delete([mine[0][0]])
                    assert objects.exists([mine[0][0]]) == [False]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads), "a backend call hung under threads"
        assert not errors, errors[0]

class BytesBackendTests(SplitTests, BackendTests):
    """For :class:`~lmcache.storage.BytesBackend` subclasses: damaged bytes in the store
    are a miss (never an exception, never wrong KV), counted and removed. The damage is
    written through the byte store's own ``put``, as another process would leave it."""

    def _damage(self, backend, key: str, how: str) -> None:
        data = bytes(backend.get_one(key))
        if how == "flip":
            bad = bytearray(data)
            bad[len(bad) - 1 - len(bad) // 4] ^= 0x40  # inside the body
            data = bytes(bad)
        else:
            data = data[: len(data) // 2]
        backend.put_one(key, [data])

    def test_byte_verbs_store_the_concatenation(self, backend):
        """The store's own verbs move bytes: ``put`` stores each value's buffers joined and
        answers their length, ``get`` returns them, ``exists`` and ``keys`` agree, and
        ``delete`` says whether each key was there."""
        k1, k2, gone = make_key(1), make_key(2), make_key(3)
        assert backend.put([(k1, [b"head", memoryview(b"-body")]), (k2, [b"x" * 100])]) == [9, 100]
        assert bytes(backend.get_one(k1)) == b"head-body"
        assert [None if v is None else bytes(v) for v in backend.get([k2, gone])] == [b"x" * 100, None]
        assert backend.exists([k1, k2, gone]) == [True, True, False] and backend.exists_one(gone) is False
        assert backend.put_one(k1, [b"y" * 10]) == 10 and bytes(backend.get_one(k1)) == b"y" * 10
        assert dict(backend.keys()) == {k1: 10, k2: 100}
        assert backend.delete([k1, gone]) == [True, False]
        assert backend.delete_one(k1) is False and backend.delete_one(k2) is True and list(backend.keys()) == []

    @pytest.mark.parametrize("how", ["flip", "truncate"])
    def test_damaged_entry_is_a_counted_miss_and_removed(self, backend, objects, how):
        good = make_obj(2)
        objects.put([(make_key(1), make_obj(1)), (make_key(2), good)])
        self._damage(backend, make_key(1), how)
        before = backend.integrity.corrupt
        assert objects.get([make_key(1)]) == [None]
        assert backend.integrity.corrupt == before + 1 == objects.integrity.corrupt
        assert objects.exists([make_key(1)]) == [False], "a corrupt entry stayed in the store"
        assert backend.exists([make_key(1)]) == [False]
        (g,) = objects.get([make_key(2)])
        assert g is not None and torch.equal(g.tensor, good.tensor)
        g.unref()


class PersistentBackendTests(BackendTests):
    """For backends whose entries outlive the backend object; needs a ``reopen`` fixture
    (see the module docstring)."""

    def test_entries_survive_reopening(self, objects, reopen):
        items = [(make_key(i), make_obj(i, num_tokens=3 + i)) for i in range(3)]
        sizes = objects.put(items)
        other = open_objects(reopen())
        try:
            assert dict(other.keys()) == {k: s for (k, _), s in zip(items, sizes)}
            for (k, o), g in zip(items, other.get([k for k, _ in items])):
                assert g is not None and torch.equal(g.tensor, o.tensor), k
                g.unref()
        finally:
            other.close()

    def test_read_only_open_serves_and_changes_nothing(self, objects, reopen):
        items = [(make_key(i), make_obj(i)) for i in range(3)]
        objects.put(items)
        ro = open_objects(reopen(read_only=True))
        try:
            assert sorted(k for k, _ in ro.keys()) == sorted(k for k, _ in items)
            assert sorted(e.key for e in ro.entries()) == sorted(k for k, _ in items)
            (g,) = ro.get([items[1][0]])
            assert g is not None and torch.equal(g.tensor, items[1][1].tensor)
            g.unref()
        finally:
            ro.close()
        assert objects.exists([k for k, _ in items]) == [True] * 3


    def test_close_twice_is_harmless(self, reopen):
        other = open_objects(reopen())
        other.put([(make_key(77), make_obj(77))])
        other.close()
        other.close()


class FileBackendTests(PersistentBackendTests):
    """For backends that keep their storage at a path; needs ``reopen`` and ``open_at``
    fixtures (see the module docstring)."""

    def test_read_only_open_of_a_missing_path_creates_nothing(self, open_at, tmp_path):
        where = tmp_path / "not-yet" / "store"
        b = open_objects(open_at(where, True))
        try:
            assert list(b.keys()) == [] and list(b.entries()) == []
            assert b.get([make_key(1)]) == [None] and b.exists([make_key(1)]) == [False]
        finally:
            b.close()
        assert not where.exists() and not where.parent.exists(), "a read-only open created files"


class CodecTests:
    """The codec contract (see :mod:`lmcache.codecs`)."""

    @staticmethod
    def _samples():
        g = torch.Generator().manual_seed(0)
        yield b""
        yield bytes(range(256)) * 17
        yield torch.randn(4096, generator=g).to(torch.float16).numpy().tobytes()
        yield torch.zeros(10000, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
        yield torch.randn(2, 2, 33, 3, 8, generator=g).numpy().tobytes()

    def test_has_name(self, codec):
        assert isinstance(codec.name, str) and codec.name

    def test_roundtrip(self, codec):
        for raw in self._samples():
            enc = codec.encode(memoryview(raw))
            dec = codec.decode(memoryview(enc), len(raw))
            assert len(dec) == len(raw)
            if codec.lossless:
                assert bytes(dec) == raw

    def test_max_encoded_size_bounds(self, codec):
        for raw in self._samples():
            assert len(codec.encode(memoryview(raw))) <= codec.max_encoded_size(len(raw))

    def test_garbage_is_valueerror(self, codec):
        raw = bytes(range(256)) * 8
        enc = bytearray(codec.encode(memoryview(raw)))
        if not enc:
            return
        bad = bytes(b ^ 0xFF for b in enc[: len(enc) // 2])
        try:
            out = codec.decode(memoryview(bad), len(raw))
        except ValueError:
            return
        # a codec that cannot detect damage must still return the promised length
        assert len(out) == len(raw)

    def test_wrong_length_is_valueerror(self, codec):
        raw = bytes(range(200))
        enc = codec.encode(memoryview(raw))
        with pytest.raises(ValueError):
            codec.decode(memoryview(enc), len(raw) + 1)

    # ---- tensors: every codec, through the tensor methods where it has them
    @staticmethod
    def _tensors():
        g = torch.Generator().manual_seed(1)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            # chunk layout (layers, 2, tokens, heads, head_size); keys with outlier channels
            kv = torch.randn(3, 2, 37, 2, 16, generator=g)
            kv[:, 0, :, :, 3] *= 20
            yield kv.to(dtype)
            yield torch.randn(2, 2, 1, 1, 4, generator=g).to(dtype)  # a one-token chunk
            yield torch.randn(5, 7, generator=g).to(dtype)  # another layout
            yield torch.full((2, 2, 8, 2, 4), 1.5).to(dtype)  # constant groups
        # extremes: float32 at +-FLT_MAX (a quantizer's float32 steps would overflow), just
        # under 2**126, and float16 subnormals (where rounding error is absolute, not relative)
        fmax = torch.finfo(torch.float32).max
        big = torch.randn(2, 2, 8, 2, 4, generator=g)
        big[0, 0, 0, 0, 0], big[0, 0, 1, 0, 0], big[0, 1, 0, 0, 0], big[0, 1, 0, 0, 1] = fmax, -fmax, fmax, -fmax
        yield big
        yield torch.randn(2, 2, 8, 2, 4, generator=g).clamp(-1, 1) * 2.0**125.9
        for seed in range(8):
            sub = torch.randn(2, 2, 24, 2, 8, generator=torch.Generator().manual_seed(seed)) * 2.0**-20
            yield sub.to(torch.float16)
        yield torch.empty(0, 2, 0, 2, 8, dtype=torch.float16)
        yield torch.arange(300, dtype=torch.int32).reshape(3, 100)  # not floating point
        yield torch.tensor([1.0, float("inf"), float("nan"), -2.0])  # non-finite

    def test_tensor_roundtrip(self, codec):
        from ..codecs import decode_tensor, encode_tensor

        for t in self._tensors():
            enc = encode_tensor(codec, t)
            dec = decode_tensor(codec, memoryview(enc).cast("B"), tuple(t.shape), t.dtype)
            assert tuple(dec.shape) == tuple(t.shape) and dec.dtype == t.dtype
            if codec.lossless or not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                # lossy codecs store what they cannot quantize as it is
                assert torch.equal(dec.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
            elif hasattr(codec, "error_bound"):
                err = (dec.float() - t.float()).abs()
                bound = codec.error_bound(t)
                assert bool((err <= bound).all()), f"error {float((err - bound).max())} over the documented bound"

    def test_tensor_max_encoded_size_bounds(self, codec):
        from ..codecs import encode_tensor

        for t in self._tensors():
            nbytes = t.numel() * t.element_size()
            assert len(memoryview(encode_tensor(codec, t)).cast("B")) <= codec.max_encoded_size(nbytes)

    def test_tensor_garbage_is_valueerror(self, codec):
        from ..codecs import decode_tensor, encode_tensor

        t = torch.randn(2, 2, 40, 2, 8, generator=torch.Generator().manual_seed(2))
        enc = bytes(memoryview(encode_tensor(codec, t)).cast("B"))
        for bad in (bytes(b ^ 0xFF for b in enc[: len(enc) // 2]) + enc[len(enc) // 2 :], enc[:-3], enc + b"xyz"):
            try:
                out = decode_tensor(codec, memoryview(bad), tuple(t.shape), t.dtype)
            except ValueError:
                continue
            assert tuple(out.shape) == tuple(t.shape)

    def test_tensor_wrong_shape_is_valueerror(self, codec):
        from ..codecs import decode_tensor, encode_tensor

        t = torch.randn(2, 2, 40, 2, 8, generator=torch.Generator().manual_seed(3))
        enc = encode_tensor(codec, t)
        with pytest.raises(ValueError):
            decode_tensor(codec, memoryview(enc).cast("B"), (2, 2, 41, 2, 8), t.dtype)


class PolicyTests:
    """The eviction policy contract (see :mod:`lmcache.policies`)."""

    def test_empty(self, policy):
        assert len(policy) == 0
        assert policy.victim(lambda k: False) is None

    def test_victim_is_a_member_and_not_skipped(self, policy):
        from ..policies import eviction_order

        for k in "abcde":
            policy.on_insert(k)
        assert len(policy) == 5
        v = policy.victim(lambda k: False)
        assert v in set("abcde")
        policy.on_remove(v)  # the handshake: every victim is removed before the next call
        first = next(eviction_order(policy))
        v2 = policy.victim(lambda k: k == first)
        assert v2 in set("abcde") - {v, first}
        policy.on_remove(v2)
        assert policy.victim(lambda k: True) is None
        assert len(policy) == 3

    def test_eviction_order_starts_with_the_victim_and_lists_every_key_once(self, policy):
        from ..policies import eviction_order

        for k in "abcdef":
            policy.on_insert(k)
        policy.on_access("a")
        order = list(eviction_order(policy))
        assert sorted(order) == list("abcdef")
        assert order[0] == policy.victim(lambda k: False)
        assert len(policy) == 6

    def test_victim_or_planning_does_not_change_state(self, policy):
        """``victim`` changes nothing unless the policy declares ``victim_changes_state``;
        planning (``eviction_order``) never does, and such a policy has one."""
        from ..policies import eviction_order, victim_changes_state

        for k in "abcd":
            policy.on_insert(k)
        policy.on_access("c")
        if victim_changes_state(policy):
            assert callable(getattr(policy, "eviction_order", None))
        else:
            first = policy.victim(lambda k: False)
            assert policy.victim(lambda k: False) == first
        plan = list(eviction_order(policy))
        assert list(eviction_order(policy)) == plan
        assert policy.victim(lambda k: False) == plan[0]
        assert len(policy) == 4

    def test_remove_and_drain(self, policy):
        keys = [f"k{i}" for i in range(50)]
        for k in keys:
            policy.on_insert(k)
        for k in keys[::3]:
            policy.on_access(k)
        policy.on_remove("unknown")  # ignored
        seen = []
        while (v := policy.victim(lambda k: False)) is not None:
            seen.append(v)
            policy.on_remove(v)
        assert sorted(seen) == sorted(keys)
        assert len(policy) == 0

    def test_access_unknown_is_ignored(self, policy):
        policy.on_access("nope")
        assert len(policy) == 0


class PolicyTraceTests(PolicyTests):
    """:class:`PolicyTests`, and seeded random traces (inserts, reads, removes, re-sizes,
    evictions with keys skipped, planning) replayed on the policy and on ``reference``, a
    fixture giving a fresh, obviously-correct model of the same algorithm built like
    ``policy`` (see :mod:`lmcache.testing.policy_refs`): after every step both agree on
    the victim, the eviction order and the length, each victim followed by its
    ``on_remove`` as the core does."""

    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_trace_matches_the_reference(self, policy, reference, seed):
        from .policy_refs import replay

        replay(policy, reference, seed)
