"""``lmcache bench lookup`` run small as a user runs it, and the fast key paths it measures.

The bench's numbers are not asserted; what is: the JSON holds every length for both index
sizes, hits returned the whole prompt and misses nothing, the limits were measured in the
same run, and the fast hashing paths give exactly the keys ``CacheKey`` spells.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lmcache.keys import CacheKey, TokenProcessor, key_prefix

ROOT = Path(__file__).resolve().parents[2]
HANG = 180  # a guard against a hung run, not a timing assertion


def lmcache(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}  # the tables' width, so that no header wraps
    return subprocess.run([sys.executable, "-m", "lmcache.cli.main", *args], check=False, capture_output=True,
                          text=True, cwd=ROOT, timeout=HANG, env=env)


def test_quick_run_json_shape_hits_and_misses(tmp_path):
    png = tmp_path / "lookup.png"
    r = lmcache("bench", "lookup", "--quick", "--json", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)  # nothing but JSON on stdout
    assert d["bench"] == "lookup" and d["hash_algorithm"] == "xxh3_128" and d["chunk_size"] == 256
    lengths = d["lengths"]
    assert lengths == [1024, 4096] and d["input"] == "list"
    assert d["fill"]["chunks"] == d["indexed"] > 0 and d["fill"]["seconds"] > 0

    assert [h["tokens"] for h in d["hashing"]] == lengths
    for h in d["hashing"]:
        assert h["chunks"] == -(-h["tokens"] // 256)
        assert 0 < h["chunks_ms"]["p50"] <= h["chunks_ms"]["p99"] and 0 < h["keys_ms"]["p50"] <= h["keys_ms"]["p99"]
        assert h["limit"]["hash_gbps"] > 0 and h["limit_ms"] > 0 and h["ratio"] > 0

    rows = {(r["index"], r["tokens"]): r for r in d["lookup"]}
    assert set(rows) == {(idx, n) for idx in ("prompt", "large") for n in lengths}
    for (idx, n), row in rows.items():
        assert row["hit_tokens"] == n and row["locate_tokens"] == n and row["locate_tiers"] == ["cpu"]
        assert row["miss_tokens"] == 0
        for k in ("hit_ms", "locate_ms", "miss_ms"):
            assert 0 < row[k]["p50"] <= row[k]["p99"]
        assert row["limit"]["hit_ms"] > 0 and row["limit"]["miss_ms"] > 0
        assert row["ratio_hit"] > 0 and row["ratio_miss"] > 0
        chunks = -(-n // 256)
        if idx == "prompt":  # a fresh engine holding just this prompt
            assert row["indexed_chunks"] == chunks and row["limit"]["dict_entries"] == chunks
        else:
            assert row["indexed_chunks"] >= d["indexed"] + chunks
            assert row["limit"]["dict_entries"] == d["indexed"] + chunks
    assert d["machine"]["cpus"] >= 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and d["plot"] == str(png)


def test_partial_chunk_blake2b_numpy_and_table():
    r = lmcache("bench", "lookup", "--lengths", "300", "--indexed", "10", "--budget", "0.001",
                "--hash-algorithm", "blake2b", "--input", "numpy")
    assert r.returncode == 0, r.stderr
    assert "hashing" in r.stdout and "prefix lookup" in r.stdout and "blake2b GB/s" in r.stdout
    assert "every hit returned the whole prompt and every miss 0 tokens: True" in r.stdout


def test_bad_options():
    for args, opt in ((["--lengths", "1k"], "--lengths"), (["--hash-algorithm", "md5"], "--hash-algorithm"),
                      (["--input", "tensor"], "--input")):
        r = lmcache("bench", "lookup", *args)
        assert r.returncode != 0 and opt in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------- the fast key paths measured above
@pytest.mark.parametrize("unfull", [True, False])
def test_fast_key_paths_spell_the_same_keys(unfull):
    rng = random.Random(7)
    sig = "float16-L1-H1-D1-lt2hd-tp0of1"
    prefix = key_prefix("ns", "org/model x", sig)
    for n in (0, 1, 255, 256, 257, 3000, 9000):
        toks = [rng.randrange(0, 1 << 17) for _ in range(n)]
        tp = TokenProcessor(256, unfull)
        chunks, keys = tp.chunk_keys(toks, prefix)
        assert chunks == tp.chunks(np.array(toks)) and [c.chunk_hash for c in chunks] == tp.hashes(toks)
        assert keys == [CacheKey("ns", "org/model x", sig, c.chunk_hash).to_string() for c in chunks]
        for given in (toks, np.array(toks, dtype=np.int32)):
            for first, growth in ((1, 2), (8, 4), (3, 1)):
                batches = list(tp.key_batches(given, prefix, first=first, growth=growth))
                assert [k for b in batches for k in b] == keys and all(batches)
        # chunk i ends at min((i + 1) * chunk_size, n): what a lookup returns for i + 1 chunks
        assert [c.end for c in chunks] == [min((i + 1) * 256, n) for i in range(len(chunks))]
    with pytest.raises(ValueError, match="namespace"):
        key_prefix("bad ns", "m", sig)


def test_list_fast_path_keeps_the_checks():
    tp = TokenProcessor(chunk_size=4)
    with pytest.raises(ValueError, match="integers"):
        tp.chunks([1, 2, 2.5])
    with pytest.raises(ValueError, match="1-D"):
        list(tp.key_batches([[1, 2], [3, 4]], "p:"))
    assert tp.hashes((1, 2, 3, 4, 5)) == tp.hashes([1, 2, 3, 4, 5]) == tp.hashes(np.arange(1, 6))
