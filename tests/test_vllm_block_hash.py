"""lmcache.vllm_block_hash writes the bytes CPython's pickler writes for block keys, without
the pickle module in product code (tests/reliability/test_security.py): compared here with
``pickle.dumps(obj, protocol=5)`` itself (serializing only)."""

from __future__ import annotations

import os
import pickle
import random

import pytest

from lmcache.vllm_block_hash import pickle5


def _cases() -> list:
    rng = random.Random(7)
    edges = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, -1, -(2**31), 2**31, 2**40, -(2**40), 2**63, 10**30]
    out: list = [None, True, False, "", "vllm-none-hash", "é" * 200, (), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4),
                 b"", b"x" * 32, b"x" * 300]
    for _ in range(200):
        toks = tuple(rng.choice(edges + [rng.randrange(0, 200_000)]) for _ in range(rng.randrange(0, 300)))
        out += [(os.urandom(32), toks, None), (os.urandom(32), toks, ("sql", ("img", 3), "tenant-1"))]
    return out


def test_pickle5_is_the_bytes_of_pickle_protocol_5():
    bad = [c for c in _cases() if pickle5(c) != pickle.dumps(c, protocol=5)]
    assert not bad, f"{len(bad)} differ, first: {bad[0]!r}"


def test_pickle5_refuses_what_it_cannot_write_alike():
    with pytest.raises(TypeError, match="cannot encode list"):
        pickle5(([1, 2],))
    with pytest.raises(ValueError, match="several frames"):
        pickle5(tuple(range(70_000)))
