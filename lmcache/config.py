"""The one configuration object of lmcache.

Sources, later ones winning: a YAML file (an explicit path, or ``LMCACHE_CONFIG_FILE``),
then ``LMCACHE_<KEY>`` environment variables (values read as YAML scalars, so
``LMCACHE_TIERS='[{backend: cpu, capacity: 1GiB}]'`` works), then explicit overrides.
Every value is validated on load; an error names the key and, when the value came from a
file, the file. ``Config.sources`` records where each top-level value came from.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from .errors import ConfigError
from .units import parse_size

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write-through", "write-back")
HASH_ALGORITHMS = ("xxh3_128", "blake2b")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# Environment variables with the LMCACHE_ prefix that are not config keys.
_ENV_NOT_KEYS = {
    "CONFIG_FILE",
    "DEBUG",
    "PLUGINS",
    "DISABLED_PLUGINS",
    "DISABLE_PLUGIN_AUTOLOAD",
    "LOG_LEVEL",
    "MODEL_CACHE",
    "API_TOKEN",  # read as api.token by load_config; also the CLI's --token
    "API_URL",  # the CLI's --url
    "CONTROLLER_TOKEN",  # read as controller.token by load_config; also `lmcache controller --token`
    "CONTROLLER_URL",  # `lmcache controller --url`
    "P2P_TOKEN",  # read as p2p.token by load_config
}


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, 80, 80


def _show(v: Any) -> str:
    """A bounded repr for error messages: a YAML alias bomb or a huge nested value costs a
    few dozen characters, not its whole expansion."""
    text = _REPR.repr(v)
    return text if len(text) <= 200 else text[:200] + "..."


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


_LAYOUT_NAME = re.compile(r"[A-Za-z0-9_]+")
_SIGNATURE = re.compile(r"(?P<dtype>[a-z0-9_]+)-L(?P<layers>\d+)-H(?P<heads>\d+)-D(?P<head>\d+)"
                        r"-(?P<layout>[A-Za-z0-9_]+)-tp(?P<rank>\d+)of(?P<size>\d+)")


@dataclass(frozen=True)
class KVSpec:
    """The shape of one engine's KV cache, as the cache engine stores it.

    KV tensors handed to :meth:`CacheEngine.store` have the layout
    ``(num_layers, 2, num_tokens, num_kv_heads, head_size)``.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str = "float16"
    layout: str = "lt2hd"  # layers, k/v, tokens, heads, head_size
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "tp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"kv_spec.{name}", f"must be a positive integer, got {_show(v)}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError("kv_spec.tp_rank", f"must be in [0, tp_size), got {self.tp_rank!r}")
        from .dtypes import dtype_from_name

        try:
            dtype_from_name(self.dtype)
        except ValueError as exc:
            raise ConfigError("kv_spec.dtype", str(exc)) from None
        if not isinstance(self.layout, str) or not _LAYOUT_NAME.fullmatch(self.layout):
            # the layout is part of every key: a ':' or '-' in it would break the key format
            raise ConfigError("kv_spec.layout", f"must be a name of letters, digits and '_', got {self.layout!r}")

    @classmethod
    def from_signature(cls, signature: str) -> KVSpec:
        """The spec whose :attr:`signature` is ``signature`` (``ValueError`` if none is)."""
        m = _SIGNATURE.fullmatch(signature)
        if m is None:
            raise ValueError(f"not a kv signature: {signature!r}")
        return cls(int(m["layers"]), int(m["heads"]), int(m["head"]), m["dtype"], m["layout"],
                   int(m["rank"]), int(m["size"]))

    @property
    def signature(self) -> str:
        """Canonical string naming this shape; part of every chunk key."""
        return (
            f"{self.dtype}-L{self.num_layers}-H{self.num_kv_heads}-D{self.head_size}"
            f"-{self.layout}-tp{self.tp_rank}of{self.tp_size}"
        )

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_size)

    def bytes_per_token(self) -> int:
        from .dtypes import dtype_from_name

        itemsize = dtype_from_name(self.dtype).itemsize
        return self.num_layers * 2 * self.num_kv_heads * self.head_size * itemsize


@dataclass
class TierConfig:
    """One storage tier: a backend, its capacity, codec and eviction policy.

    ``options`` holds the backend-specific keys (``path`` for disk, ``url`` for redis,
    ...); the backend validates them when the tier is built.
    """

    backend: str
    capacity: int
    #: a codec name, or a chain of them joined by ``+`` (``codec: [int8, zstd]`` in YAML)
    codec: str = "raw"
    policy: str = "lru"
    name: str = ""
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name:
            self.name = self.backend


@dataclass
class ApiConfig:
    """The instance API (see :mod:`lmcache.api`): off unless ``enabled``.

    ``port: 0`` picks a free port (``CacheEngine.api_url`` tells which); ``token``, when
    set, must be sent as ``Authorization: Bearer <token>`` on every request; ``timeout``
    bounds the time one whole request may take to arrive; ``max_connections`` bounds the
    connections served at once (one more is answered 503). ``tenants`` (``{namespace: token |
    [tokens]}``) adds tokens scoped to one namespace each (see :mod:`lmcache.auth`).
    """

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    timeout: float = 10.0
    tenants: dict[str, tuple[str, ...]] = field(default_factory=dict)
    max_connections: int = 64


@dataclass
class ControllerConfig:
    """The controller worker (see :mod:`lmcache.controller.worker`): off unless ``url``
    is set.

    The worker registers this instance with the controller at ``url``, heartbeats every
    ``heartbeat_interval`` seconds and reports admit/evict events in batches of at most
    ``batch_size`` (queued up to ``queue_size``; beyond that, or while the controller is
    down, events are dropped and a full snapshot follows when it answers again).
    ``timeout`` bounds every call. ``instance_id`` defaults to ``<host>-<pid>-<random>``.
    """

    url: str | None = None
    token: str | None = None
    instance_id: str | None = None
    heartbeat_interval: float = 2.0
    timeout: float = 2.0
    batch_size: int = 1000
    queue_size: int = 100_000


# ---------------------------------------------------------------- p2p (peer endpoint, fetch on miss)
@dataclass
class P2PConfig:
    """Peer-to-peer transfer (see :mod:`lmcache.p2p`).

    ``enabled`` runs this instance's peer endpoint: an ``lmcache server`` on
    ``host:port`` (``port: 0`` picks a free one) whose store is this engine's own tiers,
    so peers fetch chunks from it and prefill instances push KV into it. ``fetch``: on a
    local miss, ask the controller (``controller.url``) who holds the missing chunks and
    fetch them from that peer's endpoint. ``token`` is the cluster's shared peer token:
    required by this endpoint and sent to peers. ``timeout`` bounds every peer call and
    the controller lookup; any failure is a miss.
    """

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    timeout: float = 2.0
    fetch: bool = True


_P2P_FIELDS = ("enabled", "host", "port", "token", "timeout", "fetch")


def _section(name: str, raw: Any, base: Any, src: str | None, example: str, shorthand: str = "enabled") -> tuple[Mapping, Any]:
    """The common start of a section's validation (``api``, ``controller``, ``p2p``,
    ``kv_events``): ``None`` is ``{}``; a bare value is short for ``{shorthand: value}``
    (``api: true``, ``controller: http://...``); anything else must be a mapping of known
    keys. Returns the mapping and a copy of ``base`` to fill in."""
    if raw is None:
        raw = {}
    if isinstance(raw, bool if shorthand == "enabled" else str):
        raw = {shorthand: raw}
    if not isinstance(raw, Mapping):
        raise ConfigError(name, f"expected a mapping such as {example}, got {_show(raw)}", src)
    fields = {f.name for f in dataclasses.fields(base)}
    for k in raw:
        if k not in fields:
            raise ConfigError(f"{name}.{k}", f"unknown key; known keys: {', '.join(sorted(fields))}", src)
    return raw, dataclasses.replace(base)


def _port(key: str, v: Any, src: str | None) -> int:
    port = _int(key, v, src, 0)
    if port > 65535:
        raise ConfigError(key, f"must be <= 65535, got {port}", src)
    return port


def _token(key: str, tok: Any, src: str | None) -> str | None:
    if tok is not None and (not isinstance(tok, str) or not tok or tok != tok.strip() or len(tok) > 4096):
        raise ConfigError(key, "expected a non-empty string without surrounding spaces, or null", src)
    return tok


def _p2p(raw: Any, base: P2PConfig, src: str | None) -> P2PConfig:
    """Validate a ``p2p`` mapping (``p2p: true`` is ``{enabled: true}``); keys it does
    not set keep their value in ``base``."""
    if isinstance(raw, P2PConfig):
        return dataclasses.replace(raw)
    raw, c = _section("p2p", raw, base, src, "{enabled: true, port: 7200}")
    for k in ("enabled", "fetch"):
        if k in raw:
            setattr(c, k, _bool(f"p2p.{k}", raw[k], src))
    if "host" in raw:
        c.host = _str("p2p.host", raw["host"], src)
    if "port" in raw:
        c.port = _port("p2p.port", raw["port"], src)
    if "token" in raw:
        c.token = _token("p2p.token", raw["token"], src)
    if "timeout" in raw:
        c.timeout = _positive_float("p2p.timeout", raw["timeout"], src)
    return c
# ---------------------------------------------------------------- end p2p


# ---------------------------------------------------------------- kv events (vLLM-compatible ZMQ feed)
@dataclass
class KVEventsConfig:
    """vLLM-compatible KV events (see :mod:`lmcache.events`): off unless ``enabled``.

    ``endpoint`` is the ZMQ PUB address, bound (``tcp://127.0.0.1:0`` picks a free
    port) or, with ``bind: false``, connected to a router that binds a SUB socket.
    Every message is published under ``topic``. ``replay_endpoint``, when set, is a
    ROUTER socket where a subscriber can ask for the last ``buffer_steps`` batches
    again. ``queue_size`` bounds the events waiting to be sent (beyond it they are
    dropped and counted) and ``hwm`` the messages ZMQ holds per subscriber.
    ``block_hash_format``: ``int`` (the low 64 bits of the chunk hash, vLLM's default
    form) or ``bytes`` (the 16 hash bytes).
    """

    enabled: bool = False
    endpoint: str = "tcp://127.0.0.1:5557"
    bind: bool = True
    topic: str = "kv-events"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    queue_size: int = 100_000
    block_hash_format: str = "int"




def _zmq_endpoint(key: str, v: Any, src: str | None) -> str:
    ok = isinstance(v, str) and (
        (v.startswith("tcp://") and v.rpartition(":")[2].isdigit() and len(v.rpartition(":")[0]) > len("tcp://"))
        or (v.startswith(("ipc://", "inproc://")) and len(v.split("://", 1)[1]) > 0)
    )
    if not ok:
        raise ConfigError(key, f"expected a ZMQ endpoint such as tcp://127.0.0.1:5557, got {_show(v)}", src)
    return v


def _kv_events(raw: Any, base: KVEventsConfig, src: str | None) -> KVEventsConfig:
    """Validate a ``kv_events`` mapping (``kv_events: true`` is ``{enabled: true}``);
    keys it does not set keep their value in ``base``."""
    if isinstance(raw, KVEventsConfig):
        return dataclasses.replace(raw)
    raw, c = _section("kv_events", raw, base, src, "{enabled: true, endpoint: 'tcp://127.0.0.1:5557'}")
    for k in ("enabled", "bind"):
        if k in raw:
            setattr(c, k, _bool(f"kv_events.{k}", raw[k], src))
    if "endpoint" in raw:
        c.endpoint = _zmq_endpoint("kv_events.endpoint", raw["endpoint"], src)
    if "replay_endpoint" in raw:
        r = raw["replay_endpoint"]
        c.replay_endpoint = None if r is None else _zmq_endpoint("kv_events.replay_endpoint", r, src)
    if "topic" in raw:
        t = raw["topic"]
        if not isinstance(t, str) or len(t) > 256:
            raise ConfigError("kv_events.topic", f"expected a string of at most 256 characters, got {t!r}", src)
        c.topic = t
    for k in ("buffer_steps", "hwm", "queue_size"):
        if k in raw:
            setattr(c, k, _int(f"kv_events.{k}", raw[k], src, 1))
    if "block_hash_format" in raw:
        c.block_hash_format = _choice("kv_events.block_hash_format", raw["block_hash_format"], ("int", "bytes"), src)
    return c
# ---------------------------------------------------------------- end kv events


@dataclass
class Config:
    """Validated lmcache configuration. Build it with :func:`load_config`.

    ``sources`` maps each top-level key to where its value came from: ``"default"``,
    ``"file:<path>"``, ``"env:LMCACHE_<KEY>"``, ``"mapping"`` (a dict given to
    :func:`load_config`) or ``"override"`` (a keyword argument).
    """

    chunk_size: int = 256
    save_unfull_chunk: bool = True
    write_policy: str = "write-through"
    namespace: str = "default"
    model: str = "default"
    hash_algorithm: str = "xxh3_128"
    tiers: list[TierConfig] = field(
        default_factory=lambda: [TierConfig(backend="cpu", capacity=1 << 30)]
    )
    memory_pool_size: int | None = None  # None: CPU tier capacities + staging_size
    staging_size: int = 256 << 20
    memory_pool_prefault: bool = True  # map the pool's pages at start (see lmcache.memory)
    write_queue_size: int = 256
    lookup_pin_timeout: float = 30.0
    kv_spec: KVSpec | None = None
    api: ApiConfig = field(default_factory=ApiConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)  # kv events
    p2p: P2PConfig = field(default_factory=P2PConfig)
    source: str | None = field(default=None, compare=False)
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def source_of(self, key: str) -> str:
        """Where the value of top-level ``key`` came from (``"default"`` if not set)."""
        return self.sources.get(key, "default")

    @property
    def pool_size(self) -> int:
        """Bytes of the host memory pool: explicit, or CPU tiers plus staging."""
        if self.memory_pool_size is not None:
            return self.memory_pool_size
        cpu = sum(t.capacity for t in self.tiers if t.backend == "cpu")
        return cpu + self.staging_size

    def to_dict(self, *, mask_secrets: bool = False) -> dict[str, Any]:
        """The values as plain data (tiers with their backend keys inlined); with
        ``mask_secrets`` the API token reads ``"***"``."""
        d = dataclasses.asdict(self)
        d.pop("source")
        d.pop("sources")
        for t in d["tiers"]:
            t.update(t.pop("options"))
        if mask_secrets and d["api"]["token"] is not None:
            d["api"]["token"] = "***"
        if mask_secrets and d["api"].get("tenants"):
            d["api"]["tenants"] = {ns: ["***"] * len(toks) for ns, toks in d["api"]["tenants"].items()}
        if mask_secrets and d["controller"]["token"] is not None:
            d["controller"]["token"] = "***"
        if mask_secrets and d["p2p"]["token"] is not None:
            d["p2p"]["token"] = "***"
        return d


# ---------------------------------------------------------------- validation helpers

def _int(key: str, v: Any, src: str | None, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(key, f"expected an integer, got {_show(v)}", src)
    if v < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {v}", src)
    return v


def _bool(key: str, v: Any, src: str | None) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(key, f"expected true or false, got {_show(v)}", src)
    return v


def _str(key: str, v: Any, src: str | None) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(key, f"expected a non-empty string, got {_show(v)}", src)
    return v


def _choice(key: str, v: Any, choices: tuple[str, ...], src: str | None) -> str:
    if v not in choices:
        raise ConfigError(key, f"must be one of {', '.join(choices)}; got {_show(v)}", src)
    return v


def _size(key: str, v: Any, src: str | None, allow_zero: bool = False) -> int:
    try:
        n = parse_size(v)
    except ValueError as exc:
        raise ConfigError(key, str(exc), src) from None
    if n == 0 and not allow_zero:
        raise ConfigError(key, "must be larger than 0", src)
    return n


def _name(key: str, v: Any, src: str | None) -> str:
    v = _str(key, v, src)
    if not _NAME_RE.match(v):
        raise ConfigError(
            key, f"{_show(v)} may only contain letters, digits, '.', '_' and '-'", src
        )
    return v


def _codec_spec(key: str, v: Any, src: str | None) -> str:
    """A codec name, or a chain: a list of names (``[int8, zstd]``) or ``"int8+zstd"``;
    returned in the ``a+b`` form that payload headers record."""
    if isinstance(v, str) and "+" in v:
        v = v.split("+")
    if isinstance(v, (list, tuple)):
        if not v:
            raise ConfigError(key, "an empty list names no codec; use raw for none", src)
        names = [_name(f"{key}[{j}]", n, src) for j, n in enumerate(v)]
        return "+".join(names)
    return _name(key, v, src)


def _tier(i: int, raw: Any, src: str | None) -> TierConfig:
    key = f"tiers[{i}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(key, f"expected a mapping such as {{backend: cpu, capacity: 4GiB}}, got {_show(raw)}", src)
    raw = dict(raw)
    if "backend" not in raw:
        raise ConfigError(f"{key}.backend", "is required", src)
    if "capacity" not in raw:
        raise ConfigError(f"{key}.capacity", "is required (e.g. capacity: 4GiB)", src)
    tier = TierConfig(
        backend=_name(f"{key}.backend", raw.pop("backend"), src),
        capacity=_size(f"{key}.capacity", raw.pop("capacity"), src),
        codec=_codec_spec(f"{key}.codec", raw.pop("codec", "raw"), src),
        policy=_name(f"{key}.policy", raw.pop("policy", "lru"), src),
    )
    if "name" in raw:
        tier.name = _name(f"{key}.name", raw.pop("name"), src)
    for k in list(raw):
        if not isinstance(k, str):
            raise ConfigError(f"{key}.{k!r}", "keys must be strings", src)
    tier.options = raw
    return tier


_SCALARS = {
    "chunk_size": lambda k, v, s: _int(k, v, s, 1),
    "save_unfull_chunk": _bool,
    "write_policy": lambda k, v, s: _choice(k, v, WRITE_POLICIES, s),
    "namespace": _name,
    "model": _str,
    "hash_algorithm": lambda k, v, s: _choice(k, v, HASH_ALGORITHMS, s),
    "memory_pool_size": lambda k, v, s: None if v in (None, "auto") else _size(k, v, s),
    "staging_size": lambda k, v, s: _size(k, v, s, allow_zero=True),
    "memory_pool_prefault": _bool,
    "write_queue_size": lambda k, v, s: _int(k, v, s, 1),
    "lookup_pin_timeout": lambda k, v, s: _positive_float(k, v, s),
}
KEYS = tuple(_SCALARS) + ("tiers", "kv_spec", "api", "controller", "p2p")
KEYS = KEYS + ("kv_events",)  # kv events


#: the shortest controller heartbeat interval accepted (seconds)
MIN_HEARTBEAT = 0.05


def _positive_float(key: str, v: Any, src: str | None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ConfigError(key, f"expected a positive number of seconds, got {_show(v)}", src)
    return float(v)


def _kv_spec(raw: Any, src: str | None) -> KVSpec | None:
    if raw is None or isinstance(raw, KVSpec):
        return raw
    if not isinstance(raw, Mapping):
        raise ConfigError("kv_spec", f"expected a mapping, got {_show(raw)}", src)
    fields_ = {f.name for f in dataclasses.fields(KVSpec)}
    for k in raw:
        if k not in fields_:
            raise ConfigError(f"kv_spec.{k}", f"unknown key; known keys: {', '.join(sorted(fields_))}", src)
    try:
        return KVSpec(**raw)
    except TypeError as exc:
        raise ConfigError("kv_spec", str(exc), src) from None
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.problem, src) from None


_API_FIELDS = {f.name for f in dataclasses.fields(ApiConfig)}


def _api(raw: Any, base: ApiConfig, src: str | None) -> ApiConfig:
    """Validate an ``api`` mapping; keys it does not set keep their value in ``base``."""
    if isinstance(raw, ApiConfig):
        return dataclasses.replace(raw)
    raw, api = _section("api", raw, base, src, "{enabled: true, port: 8000}")
    if "enabled" in raw:
        api.enabled = _bool("api.enabled", raw["enabled"], src)
    if "host" in raw:
        api.host = _str("api.host", raw["host"], src)
    if "port" in raw:
        api.port = _port("api.port", raw["port"], src)
    if "token" in raw:
        api.token = _token("api.token", raw["token"], src)
    if "timeout" in raw:
        api.timeout = _positive_float("api.timeout", raw["timeout"], src)
    if "max_connections" in raw:
        api.max_connections = _int("api.max_connections", raw["max_connections"], src)
    if "tenants" in raw or ("token" in raw and api.tenants):
        from .auth import parse_tenants

        api.tenants = parse_tenants("api.tenants", raw.get("tenants", api.tenants), src, api.token)
    return api


_CONTROLLER_FIELDS = {f.name for f in dataclasses.fields(ControllerConfig)}


def _controller(raw: Any, base: ControllerConfig, src: str | None) -> ControllerConfig:
    """Validate a ``controller`` mapping; keys it does not set keep their value in ``base``.
    A bare string is short for ``{url: ...}``."""
    if isinstance(raw, ControllerConfig):
        return dataclasses.replace(raw)
    raw, c = _section("controller", raw, base, src, "{url: 'http://127.0.0.1:9000'}", shorthand="url")
    if "url" in raw:
        url = raw["url"]
        if url is not None:
            from urllib.parse import urlsplit

            parts = urlsplit(url) if isinstance(url, str) else None
            try:
                ok = parts is not None and parts.scheme in ("http", "https") and bool(parts.hostname)
                ok = ok and (parts.port or 0) >= 0  # type: ignore[union-attr]
            except ValueError:
                ok = False
            if not ok:
                raise ConfigError("controller.url", f"expected http://HOST:PORT or null, got {url!r}", src)
            url = url.rstrip("/")
        c.url = url
    if "token" in raw:
        tok = raw["token"]
        if tok is not None and (not isinstance(tok, str) or not tok or tok != tok.strip()):
            raise ConfigError(
                "controller.token", "expected a non-empty string without surrounding spaces, or null", src
            )
        c.token = tok
    if "instance_id" in raw:
        iid = raw["instance_id"]
        c.instance_id = None if iid is None else _name("controller.instance_id", iid, src)
    for k in ("heartbeat_interval", "timeout"):
        if k in raw:
            setattr(c, k, _positive_float(f"controller.{k}", raw[k], src))
    if c.heartbeat_interval < MIN_HEARTBEAT:  # a tiny interval is a busy loop, not a heartbeat
        raise ConfigError("controller.heartbeat_interval",
                          f"must be at least {MIN_HEARTBEAT} s, got {c.heartbeat_interval!r}", src)
    for k in ("batch_size", "queue_size"):
        if k in raw:
            setattr(c, k, _int(f"controller.{k}", raw[k], src, 1))
    return c


def _apply(cfg: Config, data: Mapping[str, Any], src: str | None, origin: str | None = None) -> None:
    """Validate and set each key of ``data``; ``origin`` is what ``cfg.sources`` records."""
    for key, value in data.items():
        if origin is not None and key in KEYS:
            if key == "api":  # recorded per field: a file may enable it and $LMCACHE_API_TOKEN set the token
                if isinstance(value, Mapping):
                    fields_ = [k for k in value if k in _API_FIELDS]
                else:
                    fields_ = ["enabled"] if isinstance(value, bool) else sorted(_API_FIELDS)
                for f in fields_:
                    cfg.sources[f"api.{f}"] = origin
            elif key == "controller":
                if isinstance(value, Mapping):
                    fields_ = [k for k in value if k in _CONTROLLER_FIELDS]
                else:
                    fields_ = ["url"] if isinstance(value, str) else sorted(_CONTROLLER_FIELDS)
                for f in fields_:
                    cfg.sources[f"controller.{f}"] = origin
                cfg.sources["controller"] = origin  # what `lmcache config` shows for the section
            elif key == "p2p":
                fields_ = [k for k in value if k in _P2P_FIELDS] if isinstance(value, Mapping) else list(_P2P_FIELDS)
                for f in fields_:
                    cfg.sources[f"p2p.{f}"] = origin
                cfg.sources["p2p"] = origin
            else:
                cfg.sources[key] = origin
        if key in _SCALARS:
            setattr(cfg, key, _SCALARS[key](key, value, src))
        elif key == "tiers":
            if not isinstance(value, list) or not value:
                raise ConfigError("tiers", f"expected a non-empty list of tiers, got {_show(value)}", src)
            tiers = [v if isinstance(v, TierConfig) else _tier(i, v, src) for i, v in enumerate(value)]
            names = [t.name for t in tiers]
            dup = {n for n in names if names.count(n) > 1}
            if dup:
                raise ConfigError(
                    "tiers", f"two tiers are named {sorted(dup)[0]!r}; give them distinct 'name' keys", src
                )
            cfg.tiers = tiers
        elif key == "kv_spec":
            cfg.kv_spec = _kv_spec(value, src)
        elif key == "api":
            cfg.api = _api(value, cfg.api, src)
        elif key == "controller":
            cfg.controller = _controller(value, cfg.controller, src)
        elif key == "p2p":
            cfg.p2p = _p2p(value, cfg.p2p, src)
        elif key == "kv_events":  # kv events
            cfg.kv_events = _kv_events(value, cfg.kv_events, src)
        else:
            import difflib

            hint = difflib.get_close_matches(str(key), KEYS, n=1)
            extra = f"; did you mean '{hint[0]}'?" if hint else f"; known keys: {', '.join(KEYS)}"
            raise ConfigError(str(key), "unknown key" + extra, src)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("<file>", f"cannot read config file: {exc.strerror}", str(path)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError("<file>", f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})",
                          str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("<file>", f"not valid YAML: {exc}", str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("<file>", "the top level must be a mapping of keys to values", str(path))
    return data


def _env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith("LMCACHE_"):
            continue
        key = name[len("LMCACHE_"):].lower()
        if key.upper() in _ENV_NOT_KEYS:
            continue
        if key not in KEYS:
            log.warning("ignoring environment variable %s: %s is not a config key", name, key)
            continue
        try:
            out[key] = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError as exc:
            raise ConfigError(key, f"cannot parse {_show(raw)}: {exc}", f"${name}") from None
    return out


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Config:
    """Build a validated :class:`Config`.

    ``source`` is a YAML file path, a mapping, a ``Config`` (copied) or ``None`` (then
    ``LMCACHE_CONFIG_FILE`` names the file, if set). Environment variables
    ``LMCACHE_<KEY>`` override it and keyword ``overrides`` override both.
    """
    environ = os.environ if environ is None else environ
    if isinstance(source, Config):
        cfg = dataclasses.replace(
            source,
            tiers=[dataclasses.replace(t, options=dict(t.options)) for t in source.tiers],
            api=dataclasses.replace(source.api),
            controller=dataclasses.replace(source.controller),
            kv_events=dataclasses.replace(source.kv_events),  # kv events
            p2p=dataclasses.replace(source.p2p),
            sources=dict(source.sources),
        )
    else:
        cfg = Config()
        if source is None and environ.get("LMCACHE_CONFIG_FILE"):
            source = environ["LMCACHE_CONFIG_FILE"]
        if isinstance(source, Mapping):
            _apply(cfg, source, None, "mapping")
        elif source is not None:
            path = Path(source)
            cfg.source = str(path)
            _apply(cfg, _read_yaml(path), str(path), f"file:{path}")
    for key, value in _env_values(environ).items():
        _apply(cfg, {key: value}, f"$LMCACHE_{key.upper()}", f"env:LMCACHE_{key.upper()}")
    if environ.get("LMCACHE_API_TOKEN"):  # a secret: taken verbatim, never parsed as YAML
        _apply(cfg, {"api": {"token": environ["LMCACHE_API_TOKEN"]}}, "$LMCACHE_API_TOKEN", "env:LMCACHE_API_TOKEN")
    if environ.get("LMCACHE_CONTROLLER_TOKEN"):  # a secret, like LMCACHE_API_TOKEN
        _apply(
            cfg, {"controller": {"token": environ["LMCACHE_CONTROLLER_TOKEN"]}},
            "$LMCACHE_CONTROLLER_TOKEN", "env:LMCACHE_CONTROLLER_TOKEN",
        )
    if environ.get("LMCACHE_P2P_TOKEN"):  # a secret, like LMCACHE_API_TOKEN
        _apply(cfg, {"p2p": {"token": environ["LMCACHE_P2P_TOKEN"]}}, "$LMCACHE_P2P_TOKEN", "env:LMCACHE_P2P_TOKEN")
    _apply(cfg, overrides, None, "override")
    _check_memory(cfg)
    return cfg


def _check_memory(cfg: Config) -> None:
    """The host memory pool must fit in this machine's memory: a CPU tier of 1 TiB passes
    every field check and then fails deep inside torch, naming no key."""
    total = _physical_memory()
    if not total:
        return
    need = cfg.pool_size
    if need > total:
        from .units import format_size

        if cfg.memory_pool_size is not None:
            key = "memory_pool_size"
        else:
            cpu = [i for i, t in enumerate(cfg.tiers) if t.backend == "cpu"]
            key = f"tiers[{cpu[0]}].capacity" if len(cpu) == 1 else "tiers"
        raise ConfigError(key, f"the memory pool would need {format_size(need)}, more than this machine has "
                               f"({format_size(total)})", cfg.source)
