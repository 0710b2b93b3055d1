"""Bounds on what a worker registers with the controller, and on the state the controller
keeps per chunking (issue 44, items 5 and 6).

Why: the controller keeps every registered string (in memory or in Valkey) and shows it
in listings; ``namespace``, ``model`` and ``kv_signature`` make each instance's key
prefix. ``model`` had no bound and a lookup built one ``prefix + hash`` string per chunk
and candidate instance: one tenant lookup with a long model name and many hashes grew a
memory-index controller by hundreds of MiB and took Lua memory in Valkey, outside
``maxmemory``, stalling every tenant (docs/benchmarks.md#measurements-behind-the-code). Now
every registered field has a bound (:func:`check_registration`: one 400 naming the
field), the key prefix always fits in a key, and lookups match chunk hashes without
building per-chunk strings (the memory index's :class:`~lmcache.server.index.KeyMap`
and the Valkey index's key hashes hold a chunk of the instance's prefix as its hash).

And: the token processors kept to hash lookups' tokens, one per chunking, are at most
:data:`MAX_CHUNKINGS` (least recently used dropped first); the Valkey index hashes a
lookup's tokens for the chunkings of live instances only (1,500 re-registrations with new
chunk sizes had made each admin lookup hash its tokens 1,500 times; docs/benchmarks.md#measurements-behind-the-code).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any
from urllib.parse import quote

from .http import HTTPError
from ..keys import TokenProcessor

#: what a worker reports of each tier (``tier_stats`` of register and heartbeat, shown by
#: ``/v1/instances``; the engine's worker reads the names from here): field -> JSON
#: types; counts and bytes are integers >= 0
TIER_STATS: dict[str, tuple[type, ...]] = {
    "entries": (int,), "used_bytes": (int,), "capacity_bytes": (int,), "pinned": (int,), "hits": (int,),
    "misses": (int,), "evictions": (int,), "errors": (int,), "refused_writes": (int,), "skipped_puts": (int,),
    "hit_rate": (float, int), "retry_in_s": (float, int), "available": (bool,), "write_refused": (str,),
    "backend": (str,),
}
#: the longest ``model``, in characters and in characters once URL-quoted as in keys
MAX_MODEL_LEN = 512
#: the longest ``api_url``/``peer_url``, ``api_token`` and ``version`` (characters)
MAX_URL_LEN = 512
MAX_TOKEN_LEN = 4096
MAX_VERSION_LEN = 128
#: the largest ``chunk_size`` (tokens) and ``heartbeat_interval`` (seconds)
MAX_CHUNK_SIZE = 1 << 20
MAX_HEARTBEAT_INTERVAL = 86_400.0
#: token processors (one per chunking) kept for hashing lookups' tokens
MAX_CHUNKINGS = 64


def _text(name: str, v: Any, most: int) -> None:
    if not isinstance(v, str) or not 0 < len(v) <= most:
        n = len(v) if isinstance(v, str) else 0
        raise HTTPError(400, f"field {name!r} must be 1 to {most} characters, got {n}")
    if not v.isprintable():
        raise HTTPError(400, f"field {name!r} must not contain control characters (such as a newline)")


def check_model(v: Any, name: str = "model") -> None:
    """400 unless ``v`` is 1 to :data:`MAX_MODEL_LEN` printable characters, also once quoted."""
    _text(name, v, MAX_MODEL_LEN)
    if len(quote(v, safe="-_.~")) > MAX_MODEL_LEN:
        raise HTTPError(400, f"field {name!r} must be at most {MAX_MODEL_LEN} characters once URL-quoted "
                             f"(as in keys), got {len(quote(v, safe='-_.~'))}")


def check_registration(body: dict[str, Any]) -> None:
    """400 naming the first field of a ``/v1/register`` body over its bound (lengths,
    control characters, numbers out of range); the names (``instance_id``, ``namespace``,
    ``kv_signature``, tier names) are checked by the index (1-200 name characters)."""
    check_model(body.get("model"))
    for name, most in (("api_url", MAX_URL_LEN), ("peer_url", MAX_URL_LEN), ("api_token", MAX_TOKEN_LEN),
                       ("version", MAX_VERSION_LEN)):
        if body.get(name) is not None:
            _text(name, body[name], most)
    if not 0 < body["chunk_size"] <= MAX_CHUNK_SIZE:
        raise HTTPError(400, f"field 'chunk_size' must be 1 to {MAX_CHUNK_SIZE}, got {str(body['chunk_size'])[:30]}")
    hb = body.get("heartbeat_interval")
    if hb is not None and not 0 < hb <= MAX_HEARTBEAT_INTERVAL:  # False for NaN
        raise HTTPError(400, f"field 'heartbeat_interval' must be > 0 and at most {MAX_HEARTBEAT_INTERVAL:g} "
                             f"seconds, got {str(hb)[:30]}")
    sess = body.get("session")  # chosen by the worker, so that a retried register is the same registration
    if sess is not None and not (16 <= len(sess) <= 64 and all(c in "0123456789abcdef" for c in sess)):
        raise HTTPError(400, "field 'session' must be 16 to 64 lowercase hex characters")
    pid = body.get("pid")
    if pid is not None and not 0 <= pid < 1 << 32:
        raise HTTPError(400, f"field 'pid' must be a process id (0 to 2^32-1), got {str(pid)[:30]}")


def check_count(name: str, v: Any) -> None:
    """400 unless ``v`` (a counter a worker reports) is an integer 0 <= v < 2^63."""
    if v is not None and not 0 <= v < 1 << 63:
        raise HTTPError(400, f"field {name!r} must be 0 to 2^63-1, got {str(v)[:30]}")


class Processors:
    """At most :data:`MAX_CHUNKINGS` token processors by chunking, least recently used
    dropped first (a namespace re-registering with ever new chunk sizes cannot grow it)."""

    def __init__(self, most: int = MAX_CHUNKINGS):
        self.most = most
        self._d: OrderedDict[tuple[int, str, bool], TokenProcessor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, k: tuple[int, str, bool]) -> TokenProcessor:
        with self._lock:
            tp = self._d.get(k)
            if tp is None:
                tp = self._d[k] = TokenProcessor(k[0], save_unfull_chunk=k[2], hash_algorithm=k[1])
                while len(self._d) > self.most:
                    self._d.popitem(last=False)
            else:
                self._d.move_to_end(k)
            return tp

    def __len__(self) -> int:
        return len(self._d)
