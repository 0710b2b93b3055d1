"""Chunk keys with a KeyExtra (issue 29, item 13): what besides the tokens decides the KV."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import xxhash

from lmcache.keys import MAX_EXTRA_BYTES, MAX_ITEMS, KeyExtra, TokenProcessor

TOKENS = list(range(1000))
IMAGE = KeyExtra(items=((100, 50, b"image-1"),))
SALTED = KeyExtra(b"s" * 32, ((100, 50, b"image-1"), (400, 10, b"image-2")))


def reference(tokens: list[int], chunk: int, algo: str) -> list[str]:
    """The keys of before request extras existed, written out: a chain from 16 zero bytes."""
    prev, out = b"\0" * 16, []
    for s in range(0, len(tokens), chunk):
        data = prev + np.asarray(tokens[s : s + chunk], dtype="<i8").tobytes()
        prev = xxhash.xxh3_128_digest(data) if algo == "xxh3_128" else hashlib.blake2b(data, digest_size=16).digest()
        out.append(prev.hex())
    return out


@pytest.mark.parametrize("algo", ["xxh3_128", "blake2b"])
def test_no_extra_keeps_the_keys_bit_exact(algo):
    tp = TokenProcessor(64, hash_algorithm=algo)
    want = reference(TOKENS, 64, algo)
    for extra in (None, KeyExtra()):
        assert [c.chunk_hash for c in tp.chunks(TOKENS, extra)] == want
        assert tp.chunk_keys(TOKENS, "p:", extra)[1] == ["p:" + h for h in want]
        assert [k for b in tp.key_batches(TOKENS, "p:", extra=extra) for k in b] == ["p:" + h for h in want]


def test_a_scope_changes_every_chunk_and_an_item_every_chunk_from_its_own():
    tp = TokenProcessor(64)
    plain = tp.chunk_keys(TOKENS, "p:")[1]
    salted = tp.chunk_keys(TOKENS, "p:", KeyExtra(b"s" * 32))[1]
    assert not set(plain) & set(salted)
    image = tp.chunk_keys(TOKENS, "p:", IMAGE)[1]
    assert image[0] == plain[0] and not set(image[1:]) & set(plain)  # the image starts in chunk 1
    other = tp.chunk_keys(TOKENS, "p:", KeyExtra(items=((100, 50, b"image-9"),)))[1]
    moved = tp.chunk_keys(TOKENS, "p:", KeyExtra(items=((102, 50, b"image-1"),)))[1]
    assert other[0] == plain[0] and not set(other[1:]) & set(image[1:])
    assert moved[0] == plain[0] and not set(moved[1:]) & set(image[1:])
    # lazily hashed batches agree with the whole chain, whatever the batch boundaries
    for first, growth in ((1, 2), (3, 1), (8, 4)):
        assert [k for b in tp.key_batches(TOKENS, "p:", first, growth, extra=SALTED) for k in b] == \
            tp.chunk_keys(TOKENS, "p:", SALTED)[1]


def test_the_wire_form_round_trips_and_refuses_anything_else():
    assert KeyExtra.from_bytes(SALTED.to_bytes()) == SALTED
    raw = SALTED.to_bytes()
    for bad, said in ((raw[:-1], "truncated"), (raw + b"x", "trailing"), (b"", "truncated"),
                      (b"\x02" + raw[1:], "version"), (b"\0" * (MAX_EXTRA_BYTES + 1), "at most")):
        with pytest.raises(ValueError, match=said):
            KeyExtra.from_bytes(bad)
    full = KeyExtra(b"s" * 64, tuple((i, 1, b"i" * 64) for i in range(MAX_ITEMS)))
    assert len(full.to_bytes()) == MAX_EXTRA_BYTES  # the bound is the largest legal extra
    for bad, said in (({"scope": b"s" * 65}, "scope"), ({"items": ((0, 1, b"i"),) * (MAX_ITEMS + 1)}, "items"),
                      ({"items": ((0, 0, b"i"),)}, "token range"), ({"items": ((0, 1, b""),)}, "id")):
        with pytest.raises(ValueError, match=said):
            KeyExtra(**bad)


def test_chunks_stored_with_an_extra_never_reach_the_content_index():
    """Shifted reuse indexes stored chunks by their tokens alone: a salted chunk there would
    be offered to any prompt with those tokens. The engine's store observers hear only of
    chunks stored with no extra."""
    import torch

    from lmcache.engine import CacheEngine

    tokens = list(range(100, 132))
    kv = torch.randn(2, 2, len(tokens), 1, 4)
    with CacheEngine.from_config({"chunk_size": 8, "approximate_reuse": {"enabled": True}}) as e:
        index = e.services["approximate_reuse"]
        e.store(tokens, kv, extra=KeyExtra(b"s" * 32))
        assert e.lookup(tokens, extra=KeyExtra(b"s" * 32)) == 32 and e.lookup(tokens) == 0
        assert index.find(tokens, 0, len(tokens)) == []
        e.store(tokens, kv)
        assert len(index.find(tokens, 0, len(tokens))) == 4
