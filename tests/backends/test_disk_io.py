"""The disk tier's I/O paths: a ``raw`` entry hashed as it is written and as it is read
(1 MiB at a time, from the CPU's cache), with every check of the payload kept; and the
write-behind writing queued chunks for a disk tier on several threads at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from lmcache import payload
from lmcache.backends.disk import DiskBackend, DiskObjects
from lmcache.backends.file_io import PIECE
from lmcache.config import load_config
from lmcache import hierarchy
from lmcache.hierarchy import StorageHierarchy
from lmcache.hookspecs import hookimpl
from lmcache.memory import MemoryPool
from lmcache.plugin_manager import Registries, create_plugin_manager, get_registries
from lmcache.storage import BackendContext
from lmcache.encoded import open_objects
from lmcache.testing import make_key

REGS = get_registries()
SHAPE = (8, 2, 256, 3, 64)  # 3 MiB of float32: the body spans several pieces
NBYTES = 8 * 2 * 256 * 3 * 64 * 4


def _disk(path: Path, **opts) -> DiskBackend:
    ctx = BackendContext.standalone({"path": str(path), **opts}, codec=REGS.codecs.load("raw")())
    return REGS.backends.load("disk")(ctx)


def _obj(pool: MemoryPool, seed: int):
    o = pool.allocate(SHAPE, torch.float32)
    o.tensor.view(torch.int32).copy_(torch.randint(-(2**31), 2**31 - 1, SHAPE, dtype=torch.int32,
                                                    generator=torch.Generator().manual_seed(seed)))
    return o


def _entry(root: Path) -> Path:
    (f,) = [p for p in root.rglob("*.lmc")]
    return f


@pytest.mark.parametrize("fsync", [False, True])
def test_a_raw_entry_is_the_payload_encode_describes_hashed_while_written(tmp_path, fsync):
    assert NBYTES > 2 * PIECE
    d = _disk(tmp_path, fsync=fsync)
    objs = open_objects(d)
    assert isinstance(objs, DiskObjects)
    pool = MemoryPool(4 * NBYTES)
    o, k = _obj(pool, 1), make_key(1)
    size = objs.put_one(k, o)
    data = _entry(tmp_path).read_bytes()
    # exactly the announced size; a header of known length whatever the checksum
    assert size == len(data) == payload.raw_header_len(k, o) + NBYTES
    h = payload.parse_header(data)
    enc = payload.parse_header(payload.encode(k, o, REGS.codecs.load("raw")())[0])
    assert (h.key, h.codec, h.shape, h.body_len, h.body_xxh3) == (k, "raw", SHAPE, NBYTES, enc.body_xxh3)
    got = payload.decode(data, k, lambda name: REGS.codecs.load(name)(), pool.allocate)  # any reader reads it
    assert torch.equal(got.tensor.view(torch.int32), o.tensor.view(torch.int32))
    back = objs.get_one(k)
    assert torch.equal(back.tensor.view(torch.int32), o.tensor.view(torch.int32))
    assert bytes(d.get_one(k)) == data  # the store's own read: the file's bytes
    for x in (got, back, o):
        x.unref()
    d.close()


@pytest.mark.parametrize("damage", ["flip in the last piece", "flip in the first piece", "torn body"])
def test_a_damaged_raw_entry_read_in_pieces_is_a_miss_and_removed(tmp_path, damage):
    d = _disk(tmp_path)
    objs = open_objects(d)
    pool = MemoryPool(4 * NBYTES)
    o, k = _obj(pool, 2), make_key(2)
    objs.put_one(k, o)
    f = _entry(tmp_path)
    raw = bytearray(f.read_bytes())
    if damage == "torn body":
        raw = raw[: len(raw) - PIECE - 7]
    else:
        raw[-5 if "last" in damage else payload.raw_header_len(k, o) + 3] ^= 0x40
    f.write_bytes(bytes(raw))
    free = pool.free_bytes
    assert objs.get_one(k) is None and not f.exists() and d.integrity.corrupt == 1
    assert d.exists([k]) == [False]
    assert pool.free_bytes == free  # the memory it was read into went back to the pool
    o.unref()
    d.close()


class _RendezvousObjects(DiskObjects):
    """The disk view whose ``put_one`` (what the tier's writer calls) notes how many run
    at once: each waits a little for a second one to start, so that writes handed out
    together overlap."""

    def put_one(self, key, obj):
        cls = _Rendezvous
        with cls.lock:
            cls.running += 1
            cls.most = max(cls.most, cls.running)
            if cls.running >= 2:
                cls.two.set()
        try:
            cls.two.wait(2.0)
            if key == cls.slow_key:
                time.sleep(0.3)
            return super().put_one(key, obj)
        finally:
            with cls.lock:
                cls.running -= 1


class _Rendezvous(DiskBackend):
    """A real disk backend opened through :class:`_RendezvousObjects`."""

    OPTIONS = {**DiskBackend.OPTIONS}
    objects_view = _RendezvousObjects
    lock = threading.Lock()
    running = 0
    most = 0
    two = threading.Event()
    slow_key: str | None = None  # its write ends last (after the rendezvous)


class _Plugin:
    @hookimpl
    def lmcache_register_backends(self, registry):
        registry.add("rendezvous-disk", _Rendezvous)


def test_the_writer_writes_queued_chunks_for_a_disk_tier_together(tmp_path):
    assert hierarchy.WRITE_BATCH >= 2
    pm = create_plugin_manager(autoload=False)
    pm.register(_Plugin(), name="tests")
    cfg = load_config({"write_policy": "write-through", "tiers": [
        {"backend": "cpu", "capacity": 8 * NBYTES},
        {"backend": "rendezvous-disk", "path": str(tmp_path / "d"), "capacity": 8 * (NBYTES + 4096)}]}, environ={})
    pool = MemoryPool(cfg.pool_size)
    h = StorageHierarchy(cfg, pool, Registries(pm))
    heard: list[tuple[str, str, str]] = []
    h.add_listener(lambda *event: heard.append(event))
    _Rendezvous.slow_key = make_key(0)
    try:
        objs = [_obj(pool, i) for i in range(4)]
        with h.storing():  # the writer holds back while a store copies: the writes queue up
            for i, o in enumerate(objs):
                h.put_one(make_key(i), o)
        h.flush()
        assert _Rendezvous.most >= 2  # before: one write at a time (most == 1)
        assert h.tiers[1].usage().entries == 4 and h.stats.dropped_writes == 0
        # the disk tier's admits are told in queue order, the slow first write's too (a
        # KV-event consumer hears a chunk after its parent); before: chunk 0 came last
        disk = h.tiers[1].name
        assert [k for op, t, k in heard if t == disk and op == "admit"] == [make_key(i) for i in range(4)]
        for i, o in enumerate(objs):  # each chunk on disk, exact
            back = h.tiers[1].backend.get_one(make_key(i))
            assert torch.equal(back.tensor.view(torch.int32), o.tensor.view(torch.int32))
            back.unref()
            o.unref()
    finally:
        h.close()


def test_a_reopened_directory_has_its_io_threads_running_before_the_first_read(tmp_path):
    """Issue 47: after a restart the first request is likely a disk hit; the backend that
    finds entries starts its I/O threads when it opens, not on that request. An empty
    directory starts none until used."""
    def io_threads() -> int:
        return sum(1 for t in threading.enumerate() if t.name.startswith("lmcache-") and "-io_" in t.name)

    before = io_threads()
    empty = _disk(tmp_path / "empty")
    assert io_threads() == before
    empty.close()
    d = _disk(tmp_path / "d")
    pool = MemoryPool(4 * NBYTES)
    objs = [_obj(pool, i) for i in range(2)]
    for i, o in enumerate(objs):
        open_objects(d).put_one(make_key(i), o)
    d.close()
    again = _disk(tmp_path / "d")
    try:
        workers = again._io_pool()._max_workers
        assert io_threads() == before + workers >= before + 2
        got = open_objects(again).get([make_key(0), make_key(1)])
        assert all(torch.equal(g.tensor.view(torch.int32), o.tensor.view(torch.int32)) for g, o in zip(got, objs))
        for g in got:
            g.unref()
    finally:
        again.close()
    for o in objs:
        o.unref()
    assert io_threads() == before


def test_a_batch_read_hands_each_hit_to_on_ready_on_the_io_thread_that_read_it(tmp_path):
    """The view a tier opens streams its gets and takes parallel puts (the tier asks it);
    ``on_ready`` is called once per hit, never for a miss, on the I/O thread that read and
    checked it, before ``get`` returns."""
    d = _disk(tmp_path)
    objs = open_objects(d)
    assert objs.streams_gets and objs.parallel_puts
    pool = MemoryPool(4 * NBYTES)
    src = [_obj(pool, i) for i in range(3)]
    assert objs.put([(make_key(i), o) for i, o in enumerate(src)]) == [payload.raw_header_len(make_key(0), src[0])
                                                                         + NBYTES] * 3
    seen: list[tuple[int, str]] = []
    keys = [make_key(0), make_key(9), make_key(1), make_key(2)]
    got = objs.get(keys, lambda i, obj: seen.append((i, threading.current_thread().name)))
    try:
        assert got[1] is None and sorted(i for i, _ in seen) == [0, 2, 3]
        assert all("-io_" in name for _, name in seen), seen
        for g, o in zip([got[0], got[2], got[3]], src):
            assert torch.equal(g.tensor.view(torch.int32), o.tensor.view(torch.int32))
    finally:
        for g in got:
            if g is not None:
                g.unref()
        for o in src:
            o.unref()
        d.close()
