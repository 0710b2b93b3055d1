from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmcache import payload
from lmcache.errors import ConfigError, CorruptPayloadError
from lmcache.memory import MemoryPool
from lmcache.plugin_manager import get_registries
from lmcache.storage import BackendContext
from lmcache.encoded import open_objects
from lmcache.testing import make_key, make_obj

REGS = get_registries()


def _codec(name):
    return REGS.codecs.load(name)()


def _lookup(name):
    return _codec(name)


def _bytes(key, obj, codec="raw"):
    return b"".join(bytes(b) for b in payload.encode(key, obj, _codec(codec)))


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_payload_roundtrip(codec):
    obj = make_obj(1, num_tokens=33, dtype=torch.bfloat16)
    data = _bytes("k", obj, codec)
    h = payload.parse_header(data)
    assert (h.key, h.codec, h.dtype, h.shape) == ("k", codec, "bfloat16", obj.shape)
    back = payload.decode(data, "k", _lookup, MemoryPool.allocate_unpooled)
    assert torch.equal(back.tensor, obj.tensor)


@pytest.mark.parametrize("where", ["magic", "version", "header", "body", "last"])
def test_any_flipped_byte_is_detected(where):
    data = bytearray(_bytes("k", make_obj(2)))
    h = payload.parse_header(data)
    pos = {"magic": 0, "version": 4, "header": payload.PREFIX_SIZE + 5, "body": h.header_len + 7, "last": len(data) - 1}[where]
    data[pos] ^= 0x01
    with pytest.raises(CorruptPayloadError):
        payload.decode(bytes(data), "k", _lookup, MemoryPool.allocate_unpooled)


def test_truncated_wrong_key_and_empty():
    data = _bytes("k", make_obj(3))
    with pytest.raises(CorruptPayloadError, match="bytes"):
        payload.decode(data[:-10], "k", _lookup, MemoryPool.allocate_unpooled)
    with pytest.raises(CorruptPayloadError, match="expected 'other'"):
        payload.decode(data, "other", _lookup, MemoryPool.allocate_unpooled)
    with pytest.raises(CorruptPayloadError, match="too short"):
        payload.decode(b"", "k", _lookup, MemoryPool.allocate_unpooled)
    with pytest.raises(CorruptPayloadError, match="magic"):
        payload.decode(b"PK\x03\x04" + data[4:], "k", _lookup, MemoryPool.allocate_unpooled)


def test_payload_is_never_pickle():
    data = _bytes("k", make_obj(4))
    assert data[:4] == b"LMCK" and b"\x80\x04" not in data[:2]


# ------------------------------------------------------------------ disk backend

def _disk(path, codec="raw", **opts):
    ctx = BackendContext.standalone({"path": str(path), **opts}, codec=_codec(codec))
    return REGS.backends.load("disk")(ctx)


def _files(path: Path):
    """Entry and temporary files (not the directory's marker, ledger and liveness files)."""
    return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".lmcache-"))


def test_disk_entries_survive_a_new_process(tmp_path):
    d = _disk(tmp_path)
    objs = {make_key(i): make_obj(i, num_tokens=9) for i in range(5)}
    open_objects(d).put(list(objs.items()))
    d.close()
    # a second interpreter reopens the directory and reads every entry back
    script = f"""
import sys, torch
from lmcache.storage import BackendContext
from lmcache.encoded import open_objects
from lmcache.plugin_manager import get_registries
from lmcache.testing import make_key, make_obj
d = open_objects(get_registries().backends.load("disk")(BackendContext.standalone({{"path": {str(tmp_path)!r}}})))
assert d.usage().entries == 5, d.usage()
for i in range(5):
    (g,) = d.get([make_key(i)])
    assert g is not None and torch.equal(g.tensor, make_obj(i, num_tokens=9).tensor), i
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_disk_corrupt_file_is_a_miss_and_removed(tmp_path):
    d = _disk(tmp_path)
    objs = open_objects(d)
    k = make_key(1)
    objs.put([(k, make_obj(1))])
    (f,) = _files(tmp_path)
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF
    f.write_bytes(bytes(raw))
    assert objs.get([k]) == [None]
    assert not f.exists()
    assert d.exists([k]) == [False] and objs.exists([k]) == [False]
    assert d.integrity.corrupt == 1


def test_disk_bad_files_removed_when_reopened(tmp_path):
    d = _disk(tmp_path)
    open_objects(d).put([(make_key(i), make_obj(i)) for i in range(3)])
    files = _files(tmp_path)
    files[0].write_bytes(files[0].read_bytes()[:100])  # truncated
    files[1].write_bytes(b"garbage" * 50)  # not a payload
    stray = files[2].parent / ".tmp-deadbeef"
    stray.write_bytes(b"half written")
    renamed = files[2].parent / ("00" * 16 + ".lmc")  # a valid payload under the wrong name
    renamed.write_bytes(files[2].read_bytes())
    d2 = _disk(tmp_path)
    assert d2.usage().entries == 1
    assert len(_files(tmp_path)) == 1
    assert d2.integrity.corrupt == 3


def test_disk_file_deleted_behind_our_back_is_a_miss(tmp_path):
    d = _disk(tmp_path)
    open_objects(d).put([(make_key(1), make_obj(1)), (make_key(2), make_obj(2))])
    for f in _files(tmp_path):
        f.unlink()
    assert open_objects(d).get([make_key(1)]) == [None]
    assert d.get_one(make_key(2)) is None  # the store's own read: a miss too
    assert d.usage().entries == 0


def test_disk_writes_are_atomic_renames(tmp_path):
    d = _disk(tmp_path, fsync=True)
    open_objects(d).put([(make_key(1), make_obj(1, num_tokens=200))])
    names = [p.name for p in _files(tmp_path)]
    assert len(names) == 1 and names[0].endswith(".lmc")
    assert not any(n.startswith(".tmp-") for n in names)


def test_disk_store_speaks_the_byte_verbs(tmp_path):
    """The disk store's own verbs move a payload's bytes as they are (the view a tier opens
    encodes and checks them): ``put_one`` writes the buffers' concatenation atomically and
    returns its size, ``get_one`` returns the file's bytes."""
    d = _disk(tmp_path)
    k, other = make_key(1), make_key(2)
    bufs = payload.encode(k, make_obj(1), _codec("zstd"))
    data = b"".join(bytes(b) for b in bufs)
    assert d.put_one(k, bufs) == len(data)
    assert bytes(d.get_one(k)) == data and d.get([k, other]) == [data, None]
    assert d.exists([k, other]) == [True, False] and d.exists_one(k)
    assert dict(d.keys()) == {k: len(data)}
    (e,) = d.entries()
    assert (e.key, e.size, e.codec) == (k, len(data), "zstd")  # the payload's own codec, not the tier's
    (g,) = open_objects(d).get([k])
    assert g is not None and torch.equal(g.tensor, make_obj(1).tensor)
    assert not any(p.name.startswith(".tmp-") for p in _files(tmp_path))
    assert d.delete([k, other]) == [True, False] and d.delete_one(k) is False
    assert d.get_one(k) is None and d.usage().entries == 0 and _files(tmp_path) == []


def test_disk_zstd_and_raw_files_read_each_other(tmp_path):
    d = _disk(tmp_path, codec="zstd")
    zero = MemoryPool.allocate_unpooled((2, 2, 64, 2, 8), torch.float16)
    zero.tensor.zero_()
    size = open_objects(d).put([(make_key(1), zero)])[0]
    assert size < zero.nbytes / 10  # zeros compress
    d.close()
    d2 = _disk(tmp_path, codec="raw")
    (g,) = open_objects(d2).get([make_key(1)])
    assert g is not None and torch.equal(g.tensor, zero.tensor)


def _o_direct_supported(path) -> bool:
    try:
        fd = os.open(path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        os.close(fd)
        return True
    except OSError:
        return False
    finally:
        (path / "probe").unlink(missing_ok=True)


def test_disk_o_direct(tmp_path):
    if not _o_direct_supported(tmp_path):
        with pytest.raises(ConfigError, match="does not support O_DIRECT"):
            _disk(tmp_path, o_direct=True)
        return
    d = open_objects(_disk(tmp_path, o_direct=True))
    objs = [(make_key(i), make_obj(i, num_tokens=37 + i)) for i in range(3)]
    d.put(objs)
    for (k, o), g in zip(objs, d.get([k for k, _ in objs])):
        assert g is not None and torch.equal(g.tensor, o.tensor)
    # files written with O_DIRECT are exact-size payloads that a buffered reader accepts
    d2 = _disk(tmp_path)
    assert d2.usage().entries == 3


def test_disk_o_direct_moves_bodies_between_pool_memory_and_the_file(tmp_path):
    """With o_direct, a raw chunk of whole blocks goes from pool memory to the file and
    back without a bounce buffer: the header is padded to a block, the body read into
    page-aligned pool memory and checked there. Old-layout files, odd sizes and corrupt
    bodies take the other path or are refused, as before."""
    if not _o_direct_supported(tmp_path):  # then the tier refuses o_direct, naming the option
        with pytest.raises(ConfigError, match="does not support O_DIRECT"):
            _disk(tmp_path, o_direct=True)
        return
    pool = MemoryPool(16 << 20)
    ctx = BackendContext.standalone({"path": str(tmp_path), "o_direct": True}, codec=_codec("raw"), pool=pool)
    d = REGS.backends.load("disk")(ctx)
    objs = open_objects(d)
    g = torch.Generator().manual_seed(3)
    small = pool.allocate((2, 2, 8, 2, 8), torch.float16)  # first, so that the next one needs aligning
    obj = pool.allocate((2, 2, 256, 8, 16), torch.float16)  # 256 KiB: whole blocks
    assert small is not None and obj is not None and obj.tensor.data_ptr() % 4096 == 0
    obj.tensor.copy_(torch.randn(obj.shape, generator=g).half())
    key = make_key(7)
    objs.put([(key, obj)])
    path = d._path(key)
    h = payload.parse_header(path.read_bytes()[:4096])
    assert h.header_len == 4096 and path.stat().st_size == 4096 + obj.nbytes
    (got,) = objs.get([key])
    assert got is not None and got.pooled and torch.equal(got.tensor, obj.tensor)
    got.unref()
    # an entry in the buffered layout (header not padded), and an odd-sized one: exact too
    old = open_objects(_disk(tmp_path / "old"))
    odd = make_obj(8, num_tokens=37)
    old.put([(make_key(8), obj), (make_key(9), odd)])
    reader = open_objects(REGS.backends.load("disk")(BackendContext.standalone(
        {"path": str(tmp_path / "old"), "o_direct": True}, codec=_codec("raw"), pool=pool)))
    a, b = reader.get([make_key(8), make_key(9)])
    assert torch.equal(a.tensor, obj.tensor) and torch.equal(b.tensor, odd.tensor)
    # a flipped body byte: refused by the checksum, the file removed
    data = bytearray(path.read_bytes())
    data[4096 + 1000] ^= 0x40
    path.write_bytes(bytes(data))
    assert objs.get([key]) == [None] and d.integrity.corrupt == 1 and not path.exists()
    assert pool.live == 4  # small, obj, a, b: nothing leaked by the refused read
    for o in (small, obj, a, b):
        o.unref()
    assert pool.used == 0


def test_disk_option_errors(tmp_path):
    with pytest.raises(ConfigError, match="path"):
        _disk("")
    with pytest.raises(ConfigError, match="fsync"):
        _disk(tmp_path, fsync="yes")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot create directory"):
        _disk(blocker / "sub")
