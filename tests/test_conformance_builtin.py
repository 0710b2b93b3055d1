"""Every built-in backend, codec and policy runs the shipped conformance suites."""

from __future__ import annotations

import pytest

from lmcache.codecs import load_codec
from lmcache.memory import MemoryPool
from lmcache.plugin_manager import get_registries
from lmcache.storage import BackendContext
from lmcache.testing import BackendTests, CodecTests, PolicyTests

REGS = get_registries()


class TestCPUBackend(BackendTests):
    @pytest.fixture
    def backend(self):
        pool = MemoryPool(64 << 20)
        b = REGS.backends.load("cpu")(BackendContext.standalone(pool=pool))
        yield b
        b.close()
        assert pool.used == 0, "the cpu backend leaked pool memory"


class TestDiskBackend(BackendTests):
    @pytest.fixture(params=["raw", "zstd", "shuffle+zstd"])
    def backend(self, request, tmp_path):
        codec = load_codec(REGS.codecs.load, request.param)
        b = REGS.backends.load("disk")(BackendContext.standalone({"path": str(tmp_path)}, codec=codec))
        yield b
        b.close()


@pytest.mark.parametrize(
    "name",
    ["raw", "zstd", "shuffle", "int8", "int4", "fp8", "shuffle+zstd", "int8+zstd", "int4+zstd", "fp8+zstd", "raw+zstd", "cachegen"],
)
class TestBuiltinCodecs(CodecTests):
    @pytest.fixture
    def codec(self, name):
        return load_codec(REGS.codecs.load, name)


@pytest.mark.parametrize("name", ["lru", "lfu", "fifo"])
class TestBuiltinPolicies(PolicyTests):
    @pytest.fixture
    def policy(self, name):
        return REGS.policies.load(name)()


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
