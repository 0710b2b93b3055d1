from __future__ import annotations

import random
import threading

import pytest
import torch

from lmcache.errors import MemoryPoolError
from lmcache.memory import ALIGN, MemoryPool


def test_allocate_view_and_free():
    pool = MemoryPool(1 << 20)
    obj = pool.allocate((2, 3, 4), torch.float32)
    assert obj is not None and obj.tensor.shape == (2, 3, 4) and obj.nbytes == 96
    obj.tensor.fill_(1.5)
    assert pool.used == ALIGN and pool.live == 1
    obj.unref()
    assert pool.used == 0 and pool.live == 0


def test_bounded():
    pool = MemoryPool(4096)
    objs = [pool.allocate((1024,), torch.uint8) for _ in range(4)]
    assert all(o is not None for o in objs)
    assert pool.allocate((1,), torch.uint8) is None
    objs[1].unref()
    again = pool.allocate((1024,), torch.uint8)
    assert again is not None and again.offset == 1024


def test_double_free_and_use_after_free_raise():
    pool = MemoryPool(1 << 16)
    obj = pool.allocate((10,), torch.float16)
    obj.unref()
    with pytest.raises(MemoryPoolError, match="double free"):
        obj.unref()
    with pytest.raises(MemoryPoolError, match="use after free"):
        obj.tensor
    with pytest.raises(MemoryPoolError, match="use after free"):
        obj.ref()
    assert pool.used == 0


def test_refcount_keeps_bytes_alive():
    pool = MemoryPool(1 << 16)
    obj = pool.allocate((10,), torch.float32)
    obj.ref()
    obj.unref()
    assert pool.used > 0 and obj.tensor.numel() == 10
    obj.unref()
    assert pool.used == 0


def test_free_coalesces_into_one_extent():
    pool = MemoryPool(64 * ALIGN)
    objs = [pool.allocate((ALIGN,), torch.uint8) for _ in range(64)]
    random.Random(1).shuffle(objs)
    for o in objs:
        o.unref()
    big = pool.allocate((64 * ALIGN,), torch.uint8)
    assert big is not None


def test_objects_do_not_overlap():
    pool = MemoryPool(1 << 20)
    rng = random.Random(3)
    live = []
    for i in range(400):
        if live and rng.random() < 0.4:
            live.pop(rng.randrange(len(live)))[0].unref()
        o = pool.allocate((rng.randint(1, 5000),), torch.uint8)
        if o is not None:
            o.tensor.fill_(i % 251)
            live.append((o, i % 251))
    for o, v in live:
        assert bool((o.tensor == v).all())
    for o, _ in live:
        o.unref()
    assert pool.used == 0 and pool.live == 0


def test_threads_share_the_pool_safely():
    pool = MemoryPool(1 << 20)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(300):
                o = pool.allocate((rng.randint(1, 3000),), torch.uint8)
                if o is not None:
                    o.unref()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and pool.used == 0


def test_unpooled_objects():
    obj = MemoryPool.allocate_unpooled((4, 4), torch.bfloat16)
    assert not obj.pooled and obj.nbytes == 32
    obj.unref()
    with pytest.raises(MemoryPoolError):
        obj.unref()


def test_large_objects_are_page_aligned_and_small_ones_pack():
    """Objects of 64 KiB or more start on a 4 KiB boundary (O_DIRECT I/O goes straight
    to them); the gap in front stays free and is used by small objects; freeing all
    coalesces back to one extent."""
    pool = MemoryPool(4 << 20, prefault=False)
    assert pool._buf.data_ptr() % 4096 == 0
    small = pool.allocate((100,), torch.uint8)
    big = pool.allocate((64 << 10,), torch.uint8)
    assert big.tensor.data_ptr() % 4096 == 0 and big.offset >= small.offset + small.size
    small2 = pool.allocate((100,), torch.uint8)
    assert small2.offset < big.offset  # packed into the gap before the aligned object
    for o in (small, big, small2):
        o.unref()
    assert pool.used == 0 and pool._free_off == [0] and pool._free_len == [pool.capacity]


def test_prefault_maps_the_pool():
    """prefault (the default) makes the pool's pages resident when it is created. Measured
    in a fresh process: in this one, earlier tests leave freed heap memory resident that a
    new pool may reuse, so its RSS need not grow."""
    import subprocess
    import sys

    code = (
        "from lmcache.memory import MemoryPool\n"
        "def rss():\n"
        "    with open('/proc/self/status') as f:\n"
        "        return next(int(ln.split()[1]) << 10 for ln in f if ln.startswith('VmRSS:'))\n"
        "before = rss()\n"
        "pool = MemoryPool(64 << 20)\n"
        "assert pool.prefault_seconds is not None\n"
        "print(rss() - before)\n"
    )
    grown = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               timeout=120).stdout.split()[-1])
    assert grown >= (60 << 20), f"the prefaulted 64 MiB pool grew RSS by {grown >> 20} MiB"
    lazy = MemoryPool(64 << 20, prefault=False)
    assert lazy.prefault_seconds is None


def test_a_closed_engine_gives_its_pool_back_at_once():
    """Closing an engine frees its pool then, not when the garbage collector gets to the
    cycles around it: a process that opens and closes engines in turn (a benchmark, a
    test suite, a server reloading its config) holds one pool, not all of them. Measured in
    a fresh process, with the garbage collector off."""
    import subprocess
    import sys

    code = (
        "import gc, torch, lmcache\n"
        "gc.disable()\n"
        "def rss():\n"
        "    with open('/proc/self/status') as f:\n"
        "        return next(int(ln.split()[1]) << 10 for ln in f if ln.startswith('VmRSS:'))\n"
        "before = rss()\n"
        "for i in range(4):\n"
        "    with lmcache.CacheEngine.from_config({'tiers': [{'backend': 'cpu', 'capacity': '256MiB'}]}) as e:\n"
        "        e.store(list(range(64)), torch.ones(2, 2, 64, 2, 8))\n"
        "        kept = e.retrieve(list(range(64))).kv\n"
        "print(rss() - before, float(kept.sum()))\n"
    )
    grown, total = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                  timeout=120).stdout.split()
    assert int(grown) < (200 << 20), f"four closed 256 MiB engines left {int(grown) >> 20} MiB resident"
    assert float(total) == 2 * 2 * 64 * 2 * 8  # what a caller still holds stays valid
    pool = MemoryPool(1 << 20, prefault=False)
    obj = pool.allocate((16,), torch.float32)
    obj.tensor.fill_(3)
    pool.close()
    assert pool.allocate((16,), torch.float32) is None and float(obj.tensor.sum()) == 48
    obj.unref()
