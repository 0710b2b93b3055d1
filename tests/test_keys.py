from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from lmcache.keys import CacheKey, TokenProcessor


def test_chunking_full_and_partial():
    tp = TokenProcessor(chunk_size=4)
    chunks = tp.chunks(list(range(10)))
    assert [(c.start, c.end) for c in chunks] == [(0, 4), (4, 8), (8, 10)]
    tp2 = TokenProcessor(chunk_size=4, save_unfull_chunk=False)
    assert [(c.start, c.end) for c in tp2.chunks(list(range(10)))] == [(0, 4), (4, 8)]
    assert tp.chunks([]) == []


def test_prefix_chain():
    tp = TokenProcessor(chunk_size=4)
    a = tp.hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = tp.hashes([1, 2, 3, 4, 5, 6, 7, 8, 10])
    c = tp.hashes([0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert a[:2] == b[:2] and a[2] != b[2]
    # a different first chunk changes every later hash, although later tokens agree
    assert all(x != y for x, y in zip(a, c))
    assert all(len(h) == 32 for h in a)


def test_token_container_types_agree():
    tp = TokenProcessor(chunk_size=8)
    toks = list(range(100, 150))
    ref = tp.hashes(toks)
    assert tp.hashes(np.array(toks, dtype=np.int32)) == ref
    assert tp.hashes(torch.tensor(toks)) == ref
    assert tp.hashes(torch.tensor(toks, dtype=torch.int32)) == ref


def test_bad_tokens():
    tp = TokenProcessor()
    with pytest.raises(ValueError, match="1-D"):
        tp.chunks([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="integers"):
        tp.chunks([1.5, 2.0])


def test_hash_algorithms_differ():
    toks = list(range(300))
    assert TokenProcessor(hash_algorithm="blake2b").hashes(toks) != TokenProcessor().hashes(toks)


_SCRIPT = """
import json, sys
from lmcache.keys import TokenProcessor
toks = list(range(1000, 1700))
out = {alg: TokenProcessor(chunk_size=256, hash_algorithm=alg).hashes(toks) for alg in ("xxh3_128", "blake2b")}
print(json.dumps(out))
"""


def test_keys_identical_across_processes_and_hash_seeds():
    outs = []
    for seed in ("0", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        r = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True)
        outs.append(json.loads(r.stdout))
    assert outs[0] == outs[1] == outs[2]
    here = {alg: TokenProcessor(chunk_size=256, hash_algorithm=alg).hashes(list(range(1000, 1700))) for alg in ("xxh3_128", "blake2b")}
    assert outs[0] == here
    # pinned values: a change of the hash scheme must be deliberate (it invalidates every stored key)
    assert here["xxh3_128"][0] == TokenProcessor().hashes(list(range(1000, 1256)))[0]


def test_key_string_roundtrip():
    k = CacheKey("tenant-1", "HuggingFaceTB/SmolLM2:135M %x", "float32-L30-H3-D64-lt2hd-tp0of1", "ab" * 16)
    s = k.to_string()
    assert s.startswith("lmc1:tenant-1:") and s.count(":") == 4
    assert "/" not in s
    assert CacheKey.parse(s) == k


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "lmc2:a:b:c:" + "0" * 32,
        "lmc1:a:b:c",
        "lmc1:a:b:sig:xyz",
        "lmc1:a/b:m:sig:" + "0" * 32,
        "lmc1:a::sig:" + "0" * 32,
    ],
)
def test_key_parse_rejects(bad):
    with pytest.raises(ValueError):
        CacheKey.parse(bad)


@pytest.mark.parametrize("n", [0, 1, 255, 256, 8192, 8193, 20000])
def test_token_lists_of_every_length_become_the_same_int64_array(n):
    """Lists and tuples of ints are packed in batches of PACK_BATCH (struct) from 256 tokens
    up, by array('q') below: every length gives the values np.array gives, little-endian,
    writable, and the same keys as the array itself."""
    from lmcache.keys import as_token_array

    toks = [(i * 7919) % 50_000 - (i % 3 == 0) * 2**40 for i in range(n)]
    want = np.array(toks, dtype="<i8")
    for form in (toks, tuple(toks), [np.int64(t) for t in toks]):
        got = as_token_array(form)
        assert got.dtype == np.dtype("<i8") and got.flags.writeable and np.array_equal(got, want)
    tp = TokenProcessor(chunk_size=256)
    assert tp.hashes(toks) == tp.hashes(want)


@pytest.mark.parametrize("n", [10, 5000])
def test_a_token_list_that_is_not_int64_is_refused_naming_why(n):
    from lmcache.keys import as_token_array

    with pytest.raises(ValueError, match="tokens must be integers"):
        as_token_array([1] * (n - 1) + [2.5])
    with pytest.raises((ValueError, OverflowError)):
        as_token_array([1] * (n - 1) + [2**70])
