"""The ``memory`` index's size per (chunk, instance) entry (issue 35: >= 10 M entries in
<= 2 GiB). A key of the instance's prefix is held as 16 raw bytes and a tier bitmask;
measured with tracemalloc, a structural bound (no timing)."""

from __future__ import annotations

import tracemalloc

from lmcache.server.index import KeyMap
from lmcache.server.index_memory import Index
from test_index_valkey import retried_registration

PREFIX = "lmc1:default:m:float32-L2-H2-D8-lt2hd-tp0of1:"


def test_an_index_entry_takes_under_150_bytes():
    """200k admitted keys: under 150 bytes each (a str -> set[str] entry took ~460;
    10 M entries at this bound fit in 1.4 GiB)."""
    ix = Index(10, 300, max_keys_per_instance=10**6)
    s = ix.register({"instance_id": "a", "namespace": "default", "model": "m", "chunk_size": 16,
                     "tiers": ["cpu", "disk"]})["session"]
    n = 200_000
    batches = [[["admit", "cpu", f"{PREFIX}{i:032x}"] for i in range(b, b + 10_000)] for b in range(0, n, 10_000)]
    tracemalloc.start()
    try:
        for ev in batches:
            ix.events({"instance_id": "a", "session": s, "events": ev})
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert ix.list()[0]["keys"] == n
    per_entry = used / n
    print(f"memory index: {per_entry:.0f} bytes per (chunk, instance) entry at {n} entries")
    assert per_entry < 150, per_entry


def test_the_compact_form_never_confuses_two_keys():
    """Keys of the prefix in canonical hex are compacted; upper-case hex, other prefixes
    and odd lengths stay strings; each is found as itself only."""
    m = KeyMap()
    keys = [PREFIX + "ab" * 16, PREFIX + "AB" * 16, "lmc1:other:m:s:" + "ab" * 16, PREFIX + "ab" * 15, "plain"]
    for i, k in enumerate(keys):
        m.set(k, i + 1)
    assert [m.get(k) for k in keys] == [1, 2, 3, 4, 5] and len(m) == 5
    assert m.prefix == PREFIX
    m.set(keys[0], 0)
    assert m.get(keys[0]) == 0 and m.get(keys[1]) == 2 and len(m) == 4


def test_a_retried_registration_is_the_same_registration():
    """test_index_valkey's check, over the memory index."""
    print(retried_registration(Index(5, 300)))
