"""Every built-in backend, codec and policy runs the shipped conformance suites."""

from __future__ import annotations

import pytest

from lmcache.codecs import load_codec
from lmcache.memory import MemoryPool
from lmcache.plugin_manager import get_registries
from lmcache.storage import BackendContext
from lmcache.testing import BackendTests, BytesBackendTests, CodecTests, FileBackendTests, PolicyTraceTests
from lmcache.testing import policy_refs

REGS = get_registries()


class TestCPUBackend(BackendTests):
    @pytest.fixture
    def backend(self):
        pool = MemoryPool(64 << 20)
        b = REGS.backends.load("cpu")(BackendContext.standalone(pool=pool))
        yield b
        b.close()
        assert pool.used == 0, "the cpu backend leaked pool memory"


def _disk(path, codec=None, read_only=False):
    return REGS.backends.load("disk")(BackendContext.standalone({"path": str(path)}, codec=codec, read_only=read_only))


class TestDiskBackend(FileBackendTests, BytesBackendTests):
    @pytest.fixture(params=["raw", "zstd", "shuffle+zstd"])
    def codec(self, request):
        return load_codec(REGS.codecs.load, request.param)

    @pytest.fixture
    def backend(self, codec, tmp_path):
        b = _disk(tmp_path / "kv", codec)
        yield b
        b.close()

    @pytest.fixture
    def reopen(self, codec, tmp_path):
        return lambda read_only=False: _disk(tmp_path / "kv", codec, read_only)

    @pytest.fixture
    def open_at(self):
        return lambda path, read_only: _disk(path, read_only=read_only)


@pytest.mark.parametrize(
    "name",
    ["raw", "zstd", "shuffle", "int8", "int4", "fp8", "shuffle+zstd", "int8+zstd", "int4+zstd", "fp8+zstd", "raw+zstd", "cachegen"],
)
class TestBuiltinCodecs(CodecTests):
    @pytest.fixture
    def codec(self, name):
        return load_codec(REGS.codecs.load, name)


REFERENCES = {"lru": policy_refs.LRURef, "lfu": policy_refs.LFURef, "fifo": policy_refs.FIFORef,
              "s3fifo": policy_refs.S3FIFORef}


@pytest.mark.parametrize("name", ["lru", "lfu", "fifo", "s3fifo"])
class TestBuiltinPolicies(PolicyTraceTests):
    @pytest.fixture
    def policy(self, name):
        return REGS.policies.load(name)()

    @pytest.fixture
    def reference(self, name):
        return REFERENCES[name]()


@pytest.mark.parametrize("options", [{"small_ratio": 0.3, "ghost_ratio": 0.5, "capacity": 20000},
                                     {"small_ratio": 0.05, "capacity": 4096}])
class TestS3FIFOOptions(PolicyTraceTests):
    """S3-FIFO with options and a byte capacity (the trace's entries are 1-4096 bytes)."""

    @pytest.fixture
    def policy(self, options):
        return REGS.policies.load("s3fifo")(**options)

    @pytest.fixture
    def reference(self, options):
        return policy_refs.S3FIFORef(**options)


@pytest.mark.parametrize(
    "name,options",
    [("int8", {"group_size": 7, "scale_dtype": "float32"}), ("int4", {"group_size": 128}),
     ("int8+zstd", {"int8": {"group_size": 1}}), ("int4+zstd", {"int4": {"scale_dtype": "float32"}}),
     ("fp8", {"group_size": 5}), ("cachegen", {"group_size": 3, "level": 9})],
)
class TestQuantizerOptions(CodecTests):
    @pytest.fixture
    def codec(self, name, options):
        return load_codec(REGS.codecs.load, name, options)
