"""The kind-specific files of ``lmcache plugin new``: for each kind, a minimal but real
implementation (string templates; its tests are in :mod:`lmcache.cli.plugin_templates`).

- backend: one file per chunk in a directory (a :class:`lmcache.storage.BytesBackend`);
- codec: a byte shuffle (the two bytes of each 16-bit value in two planes) then zlib;
- policy: MRU, most recently used first;
- connector: adapts a toy engine object to :class:`lmcache.CacheEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .plugin_templates import BACKEND_TESTS, CODEC_TESTS, CONNECTOR_TESTS, POLICY_TESTS


@dataclass(frozen=True)
class Kind:
    """What one kind of plugin needs in its package."""

    hook: str  # lmcache_register_<hook>
    registry: str  # the attribute of lmcache.plugin_manager.Registries
    impl_module: str
    impl_suffix: str  # the class is $cls + this
    suite: str  # the conformance classes the tests use
    summary: str
    description: str
    usage: str
    module: str  # the implementation module's text
    tests: str  # the test module's text (DISCOVERY_TEST is appended)


BACKEND_MODULE = '''\
\"\"\"The ``$name`` storage backend: one file per entry in a directory.

A tier declares it as ``{backend: $name, path: /var/cache/lmcache/$name, capacity: 20GiB}``.

It derives from :class:`lmcache.storage.BytesBackend`: a store whose values are payload
bytes, answering the verbs of every store over them (``get``, ``put``, ``exists``,
``delete``, ``keys``). It only moves opaque bytes under opaque keys and never decodes: a
tier opens it through :class:`lmcache.encoded.Encoded`, which encodes each chunk with the
tier's codec into a self-describing payload (key, codec, dtype, shape, checksums) and
checks it on every read; an entry that fails the checks is a miss and is deleted.

A file is read and written one at a time, so this store implements the single-key forms
(``get_one``, ``put_one``, ``exists_one``, ``delete_one``) and the batch forms loop over
them; a store that can answer a batch in one request (a database, a server) implements
the batch forms instead, and the single-key ones are derived from them.

- A file's name is the SHA-256 of its key, so keys of any length (model names make them
  long) fit any file system. The file holds the key (a 4-byte length, then its UTF-8)
  followed by the value, so ``keys()`` reads keys back and a hash collision is a miss.
- A write goes to a temporary file that is renamed into place: a reader sees the old
  entry or the new one, never part of one.
- ``keys()`` lists entries oldest first (by modification time): the order in which a tier
  rebuilds its eviction policy after a restart.
- Opened ``read_only`` (``lmcache ls --config``), it creates, repairs and deletes nothing.
- Values and keys of any size (``max_value_size``/``max_key_length`` stay ``None``), and one
  process owns the directory (``shared`` stays false).
\"\"\"

from __future__ import annotations

import hashlib
import os
import struct
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from lmcache import payload
from lmcache.errors import BackendError, ConfigError, CorruptPayloadError
from lmcache.storage import BackendContext, BytesBackend, EntryInfo

SUFFIX = ".lmc"
_KEY_LEN = struct.Struct("<I")


def file_name(key: str) -> str:
    \"\"\"The file an entry is kept in: the SHA-256 of its key (64 hex digits).\"\"\"
    return hashlib.sha256(key.encode()).hexdigest() + SUFFIX


def key_prefix(key: str) -> bytes:
    \"\"\"What a file holds before the value: the key's length and the key.\"\"\"
    raw = key.encode()
    return _KEY_LEN.pack(len(raw)) + raw


def read_entry_head(path: Path, extra: int = 0) -> tuple[str, int, bytes]:
    \"\"\"``(key, value offset, up to extra bytes of the value)`` of the file at ``path``;
    ``ValueError`` for a file that is not an entry.\"\"\"
    with open(path, "rb") as f:
        head = f.read(_KEY_LEN.size)
        if len(head) < _KEY_LEN.size:
            raise ValueError(f"{path} is too short")
        (n,) = _KEY_LEN.unpack(head)
        raw = f.read(n)
        if len(raw) < n:
            raise ValueError(f"{path} is cut short in its key")
        return raw.decode(), _KEY_LEN.size + n, f.read(extra)


class ${cls}Backend(BytesBackend):
    OPTIONS = {"path": None}

    @classmethod
    def check_options(cls, options: Mapping[str, Any], capacity: int | None = None) -> dict[str, Any]:
        \"\"\"Every option is checked here, so that ``lmcache config validate`` finds a bad
        value before an engine starts; ``__init__`` only opens.\"\"\"
        opts = super().check_options(options, capacity)  # rejects keys not in OPTIONS
        path = opts["path"]
        if not path or not isinstance(path, (str, os.PathLike)):
            raise ConfigError("path", "the $name backend needs a directory, e.g. path: /var/cache/lmcache/$name")
        if Path(path).expanduser().is_file():
            raise ConfigError("path", f"{path} is a file; give a directory")
        return opts

    def __init__(self, context: BackendContext):
        super().__init__(context)  # runs check_options; self.options holds the result
        self.root = Path(self.options["path"]).expanduser()
        self.read_only = context.read_only
        if not self.read_only:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError("path", f"cannot create directory {self.root}: {exc.strerror}") from None

    def _path(self, key: str) -> Path:
        return self.root / file_name(key)

    # ------------------------------------------------ the store's verbs, over bytes
    def put_one(self, key: str, buffers: Sequence[bytes | memoryview]) -> int:
        \"\"\"Store the concatenation of ``buffers`` under ``key``; return its length.\"\"\"
        if self.read_only:
            raise BackendError(f"$name tier {self.context.tier}: opened read-only, cannot store {key}")
        final = self._path(key)
        tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
        size = 0
        try:
            with open(tmp, "xb") as f:
                f.write(key_prefix(key))
                for b in buffers:
                    f.write(b)
                    size += memoryview(b).nbytes
            os.replace(tmp, final)  # atomic: the old entry or the new one, never part of one
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise  # an OSError keeps its errno: the tier tells a full disk from an outage
        return size

    def get_one(self, key: str) -> memoryview | None:
        \"\"\"The bytes stored under ``key``, or ``None``.\"\"\"
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        prefix = key_prefix(key)
        if not data.startswith(prefix):
            return None  # another key with the same hash (or a damaged file): not this entry
        return memoryview(data)[len(prefix):]

    def delete_one(self, key: str) -> bool:
        if self.read_only:
            return False
        try:
            self._path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def exists_one(self, key: str) -> bool:
        return self._path(key).is_file()

    def keys(self) -> Iterator[tuple[str, int]]:
        \"\"\"Every ``(key, stored bytes)``, oldest first.\"\"\"
        for e in self._scan(with_codec=False):
            yield e.key, e.size

    def entries(self) -> Iterator[EntryInfo]:
        \"\"\"Every entry, oldest first, with its codec (when the value is a payload) and
        the time it was written.\"\"\"
        yield from self._scan(with_codec=True)

    def _scan(self, with_codec: bool) -> list[EntryInfo]:
        if not self.root.is_dir():
            return []
        found = []
        for f in self.root.iterdir():
            if f.name.startswith(".") or not f.name.endswith(SUFFIX):
                continue  # a temporary file, or not ours
            try:
                st = f.stat()
                key, offset, head = read_entry_head(f, payload.HEADER_READ_HINT if with_codec else 0)
            except (OSError, ValueError):
                continue  # removed meanwhile, or damaged: reading it is a miss
            if file_name(key) != f.name:
                continue
            codec = None
            if with_codec:
                try:
                    codec = payload.parse_header(head).codec
                except CorruptPayloadError:
                    pass  # not a payload, or a header longer than the hint
            found.append((st.st_mtime_ns, f.name, EntryInfo(key, st.st_size - offset, codec, st.st_mtime)))
        found.sort(key=lambda t: (t[0], t[1]))
        return [info for _, _, info in found]

    def close(self) -> None:
        pass  # no handles are kept open

    def __repr__(self) -> str:
        return f"${cls}Backend({str(self.root)!r})"
'''

CODEC_MODULE = '''\
"""The ``$name`` codec: the bytes of each 16-bit value split into two planes, then zlib.

KV caches are mostly float16/bfloat16: their high bytes (sign, exponent) repeat far more
than their low bytes, so compressing the high bytes together finds more to squeeze. A tier
selects it with ``codec: $name`` and may pass ``codec_options: {level: 9}``. Lossless; the
level is not needed to decode.
"""

from __future__ import annotations

import zlib
from typing import ClassVar

# beyond zlib's compressBound() (which counts its 2-byte header and 4-byte trailer)
_SLACK = 64


def shuffle(data: bytes) -> bytes:
    """Even bytes, then odd bytes (an odd length keeps its last byte in the first plane)."""
    return data[0::2] + data[1::2]


def unshuffle(data: bytes) -> bytes:
    """The inverse of :func:`shuffle`."""
    half = (len(data) + 1) // 2
    out = bytearray(len(data))
    out[0::2] = data[:half]
    out[1::2] = data[half:]
    return bytes(out)


class ${cls}Codec:
    name: ClassVar[str] = "$name"
    lossless: ClassVar[bool] = True

    def __init__(self, level: int = 6) -> None:
        if isinstance(level, bool) or not isinstance(level, int) or not -1 <= level <= 9:
            raise ValueError(f"$name level must be an integer in [-1, 9], got {level!r}")
        self.level = level

    def encode(self, data: memoryview) -> bytes:
        raw = shuffle(bytes(data))
        out = zlib.compress(raw, self.level)
        if len(out) > self.max_encoded_size(len(raw)):
            out = zlib.compress(raw, 0)  # stored blocks never exceed the bound
        return out

    def decode(self, data: memoryview, nbytes: int) -> bytes:
        d = zlib.decompressobj()
        try:
            out = d.decompress(data, nbytes + 1)  # one byte more than promised: too long is noticed
        except zlib.error as exc:
            raise ValueError(f"$name payload does not decompress: {exc}") from None
        if len(out) != nbytes:
            raise ValueError(f"$name payload decompresses to {len(out)}{'+' if len(out) > nbytes else ''} bytes, "
                             f"expected {nbytes}")
        if not d.eof:
            raise ValueError("$name payload is truncated")
        if d.unused_data:
            raise ValueError(f"$name payload has {len(d.unused_data)} bytes after the end of its stream")
        return unshuffle(out)

    def max_encoded_size(self, nbytes: int) -> int:
        return nbytes + (nbytes >> 12) + (nbytes >> 14) + (nbytes >> 25) + 13 + _SLACK

    def __repr__(self) -> str:
        return f"${cls}Codec(level={self.level})"
'''

POLICY_MODULE = '''\
"""The ``$name`` eviction policy: most recently used first (MRU).

It suits a scan that never comes back to what it just read, where LRU evicts exactly the
entries about to be reused. A tier selects it with ``policy: $name``. Like every policy it
only records accesses and proposes victims: the tier accounts bytes, skips pinned and
in-use entries (``skip``) and calls ``on_remove`` once it evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Iterator

Key = Hashable


class ${cls}Policy:
    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # least recent first

    def on_insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, skip: Callable[[Key], bool]) -> Key | None:
        """The most recently used key not skipped; changes nothing."""
        for k in reversed(self._order):
            if not skip(k):
                return k
        return None

    def eviction_order(self) -> Iterator[Key]:
        return iter(list(reversed(self._order)))

    def __len__(self) -> int:
        return len(self._order)
'''

CONNECTOR_MODULE = '''\
"""The ``$name`` connector: adapts an inference engine to :class:`lmcache.CacheEngine`.

The engine here is :class:`ToyEngine`, a stand-in with the shape of a real one: it
computes the KV of a prompt's tokens, and it can start from KV it is given. The connector
asks lmcache for the longest cached prefix, has the engine compute only the rest (at least
the last token, whose logits a real engine needs), and stores what is new. Replace
``ToyEngine`` with your engine's calls; the connector's part stays the same.

.. code-block:: python

    conn = ${cls}Connector(ToyEngine(), lmcache.CacheEngine.from_config({"tiers": [...]}))
    out = conn.prefill(tokens)  # out.kv, out.cached_tokens, out.computed_tokens
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from lmcache import CacheEngine, KVSpec
from lmcache.dtypes import dtype_name


class ToyEngine:
    """A deterministic stand-in for an inference engine: the KV of token ``t`` at position
    ``i`` is a fixed function of ``(t, i)``, in lmcache's layout ``(layers, 2, tokens,
    heads, head_size)``. ``computed`` counts the tokens whose KV it computed."""

    def __init__(self, layers: int = 2, heads: int = 4, head_size: int = 64, dtype: torch.dtype = torch.float16):
        self.kv_spec = KVSpec(num_layers=layers, num_kv_heads=heads, head_size=head_size, dtype=dtype_name(dtype))
        self.dtype = dtype
        self.computed = 0
        self._grid = torch.arange(layers * 2 * heads * head_size, dtype=torch.float32).reshape(
            layers, 2, 1, heads, head_size)

    def forward(self, tokens: Sequence[int], start: int = 0) -> torch.Tensor:
        """The KV of ``tokens[start:]`` (the engine's prefill of a prompt's suffix)."""
        t = torch.as_tensor(list(tokens[start:]), dtype=torch.float32)
        pos = torch.arange(start, start + len(t), dtype=torch.float32)
        self.computed += len(t)
        x = (t * 0.001 + pos * 0.01).reshape(1, 1, -1, 1, 1)
        return torch.sin(x + self._grid * 0.1).to(self.dtype)


@dataclass
class Prefill:
    kv: torch.Tensor  # the KV of every prompt token
    cached_tokens: int  # of which read from lmcache
    computed_tokens: int  # of which computed by the engine


class ${cls}Connector:
    """One engine, one :class:`lmcache.CacheEngine`."""

    def __init__(self, engine: ToyEngine, cache: CacheEngine):
        self.engine = engine
        self.cache = cache
        if cache.kv_spec is None:
            cache.kv_spec = engine.kv_spec

    def prefill(self, tokens: Sequence[int]) -> Prefill:
        """The KV of ``tokens``, its cached prefix from lmcache and the rest computed
        (and stored for the next prompt that shares it)."""
        if not tokens:
            raise ValueError("a prompt needs at least one token")
        ids = torch.as_tensor(list(tokens))
        hit = self.cache.retrieve(ids)
        cached = min(hit.num_tokens, len(ids) - 1)  # the last token is always computed
        new = self.engine.forward(tokens, start=cached)
        kv = new if cached == 0 else torch.cat([hit.kv[:, :, :cached], new], dim=2)
        self.cache.store(ids, kv)
        return Prefill(kv, cached, len(ids) - cached)
'''

KINDS: dict[str, Kind] = {
    "backend": Kind(
        "backends", "backends", "backend", "Backend", "FileBackendTests, BytesBackendTests",
        "An lmcache storage backend: one file per chunk in a directory.",
        "one file per chunk in a directory",
        "A tier uses it by name:\n\n```yaml\ntiers:\n  - {backend: cpu, capacity: 4GiB}\n"
        "  - {backend: $name, path: /var/cache/lmcache/$name, capacity: 100GiB}\n```",
        BACKEND_MODULE, BACKEND_TESTS),
    "codec": Kind(
        "codecs", "codecs", "codec", "Codec", "CodecTests",
        "An lmcache codec: 16-bit byte planes, then zlib (lossless).",
        "16-bit byte planes, then zlib (lossless)",
        "A tier uses it by name:\n\n```yaml\ntiers:\n"
        "  - {backend: disk, path: /var/cache/lmcache, capacity: 100GiB, codec: $name}\n```",
        CODEC_MODULE, CODEC_TESTS),
    "policy": Kind(
        "policies", "policies", "policy", "Policy", "PolicyTraceTests",
        "An lmcache eviction policy: most recently used first (MRU).",
        "most recently used first (MRU)",
        "A tier uses it by name:\n\n```yaml\ntiers:\n  - {backend: cpu, capacity: 4GiB, policy: $name}\n```",
        POLICY_MODULE, POLICY_TESTS),
    "connector": Kind(
        "connectors", "connectors", "connector", "Connector", "its own tests over a real CacheEngine",
        "An lmcache engine connector: adapts an inference engine to lmcache.CacheEngine.",
        "adapts an engine to lmcache.CacheEngine",
        "Code that needs the connector asks for it by name:\n\n```python\nimport lmcache\n\n"
        "Connector = lmcache.connector(\"$name\")\nconn = Connector(engine, lmcache.CacheEngine.from_config(\"lmcache.yaml\"))\n"
        "```\n\n`$module/connector.py` adapts `ToyEngine`, a stand-in: replace its calls with your engine's.",
        CONNECTOR_MODULE, CONNECTOR_TESTS),
}
