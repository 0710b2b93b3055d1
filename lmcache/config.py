"""The one configuration object of lmcache.

Sources, later ones winning: a YAML file (an explicit path, or ``LMCACHE_CONFIG_FILE``),
then ``LMCACHE_<KEY>`` environment variables (values read as YAML scalars, so
``LMCACHE_TIERS='[{backend: cpu, capacity: 1GiB}]'`` works), then explicit overrides.
Every value is validated on load; an error names the key and, when the value came from a
file, the file. ``Config.sources`` records where each value came from.

Each key is declared once, as a field with its check (see :mod:`lmcache.settings`): a new
section is a dataclass of :func:`~lmcache.settings.option` fields and one field of
:class:`Config`; validation, copying, masking and the environment follow from that.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from . import settings as check
from . import upstream
from .errors import ConfigError
from .redact import redact
from .config_services import ApiConfig, ControllerConfig, P2PConfig, PDConfig, TransferConfig  # noqa: F401 (sections of Config)
from .settings import copy, env_values, keys, mask, option, parse, section_type, show, touched

# Environment variables with the LMCACHE_ prefix that are not config keys (LMCache's own
# variables, LMCACHE_LOCAL_CPU and the like, are read by lmcache.upstream).
_ENV_NOT_KEYS = {
    "LMCACHE_CONFIG_FILE", "LMCACHE_DEBUG", "LMCACHE_PLUGINS", "LMCACHE_DISABLED_PLUGINS",
    "LMCACHE_DISABLE_PLUGIN_AUTOLOAD", "LMCACHE_LOG_LEVEL", "LMCACHE_MODEL_CACHE",
    "LMCACHE_API_URL",  # the CLI's --url
    # `lmcache controller --url`, not controller.url (nor LMCache's old controller_url): no engine registers by accident
    "LMCACHE_CONTROLLER_URL",
}


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


_SIGNATURE = re.compile(r"(?P<dtype>[a-z0-9_]+)-L(?P<layers>\d+)-H(?P<heads>\d+)-D(?P<head>\d+)"
                        r"-(?P<layout>[A-Za-z0-9_]+)-tp(?P<rank>\d+)of(?P<size>\d+)")
_POSITIVE = check.rule(lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "must be a positive integer, got {}")
# the layout is part of every key: a ':' or '-' in it would break the key format
_LAYOUT = check.rule(lambda v: isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9_]+", v),
                     "must be a name of letters, digits and '_', got {}")


def _dtype(key: str, v: Any, src: str | None) -> str:
    from .dtypes import dtype_from_name  # torch, only once a KV shape is named

    v = check.text(key, v, src)
    try:
        dtype_from_name(v)
    except ValueError as exc:
        raise ConfigError(key, str(exc), src) from None
    return v


@dataclass(frozen=True)
class KVSpec:
    """The shape of one engine's KV cache, as the cache engine stores it.

    KV tensors handed to :meth:`CacheEngine.store` have the layout
    ``(num_layers, 2, num_tokens, num_kv_heads, head_size)``.
    """

    num_layers: int = option(check=_POSITIVE)
    num_kv_heads: int = option(check=_POSITIVE)
    head_size: int = option(check=_POSITIVE)
    dtype: str = option("float16", _dtype)
    layout: str = option("lt2hd", _LAYOUT)  # layers, k/v, tokens, heads, head_size
    tp_rank: int = option(0, check.integer(0))
    tp_size: int = option(1, _POSITIVE)

    def __post_init__(self) -> None:
        """Checked when built in code too: connectors build specs from engine shapes."""
        check.verify(self, "kv_spec")
        if not self.tp_rank < self.tp_size:
            raise ConfigError("kv_spec.tp_rank", f"must be in [0, tp_size), got {self.tp_rank!r}")

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


def _codec_spec(key: str, v: Any, src: str | None) -> str:
    """A codec name, or a chain: a list of names (``[int8, zstd]``) or ``"int8+zstd"``;
    returned in the ``a+b`` form that payload headers record."""
    if isinstance(v, str) and "+" in v:
        v = v.split("+")
    if isinstance(v, (list, tuple)):
        if not v:
            raise ConfigError(key, "an empty list names no codec; use raw for none", src)
        return "+".join(check.name(f"{key}[{j}]", n, src) for j, n in enumerate(v))
    return check.name(key, v, src)


_POLICY_OPTIONS = check.rule(lambda v: isinstance(v, Mapping) and all(isinstance(k, str) for k in v),
                             "expected a mapping of option names to values, got {}")


@dataclass
class TierConfig:
    """One storage tier: a backend, its capacity, codec and eviction policy (with its
    ``policy_options``).

    ``options`` holds the backend-specific keys (``path`` for disk, ``url`` for redis,
    ...); the backend validates them when the tier is built.
    """

    backend: str = option(check=check.name)
    capacity: int = option(check=check.size())
    #: a codec name, or a chain of them joined by ``+`` (``codec: [int8, zstd]`` in YAML)
    codec: str = option("raw", _codec_spec)
    policy: str = option("lru", check.name)
    #: the policy's own options (its ``__init__`` keywords), checked when the tier is built
    policy_options: dict[str, Any] = option({}, _POLICY_OPTIONS)
    name: str = option("", check.name)
    options: dict[str, Any] = option({}, rest=True)

    def __post_init__(self) -> None:
        if not self.name:
            self.name = self.backend

    def __repr__(self) -> str:  # the backend keys hold credentials: masked, as everywhere
        fields = redact({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        return f"TierConfig({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


def _tiers(key: str, value: Any, src: str | None) -> list[TierConfig]:
    if not isinstance(value, list) or not value:
        raise ConfigError(key, f"expected a non-empty list of tiers, got {show(value)}", src)
    tiers = [parse(TierConfig, v, f"{key}[{i}]", src) for i, v in enumerate(value)]
    names = [t.name for t in tiers]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(key, f"two tiers are named {dup[0]!r}; give them distinct 'name' keys", src)
    return tiers


def _media(key: str, v: Any, src: str | None) -> dict[str, str]:
    """``{tier name or backend: medium}``: short names, at most 64 entries."""
    from .kv_media import MAX_MEDIUM_LEN

    if not isinstance(v, dict) or len(v) > 64 or not all(
        isinstance(k, str) and isinstance(m, str) and 0 < len(k) <= MAX_MEDIUM_LEN and 0 < len(m) <= MAX_MEDIUM_LEN
        for k, m in v.items()
    ):
        raise ConfigError(key, f"expected a map of tier name or backend to a medium name (at most 64 entries of "
                               f"1-{MAX_MEDIUM_LEN} characters each), got {check.show(v)}", src)
    return dict(v)


@dataclass
class KVEventsConfig:
    """vLLM-compatible KV events (see :mod:`lmcache.plugins.services.kv_events`): off unless ``enabled``.

    ``endpoint`` is the ZMQ PUB address, bound (``tcp://127.0.0.1:0`` picks a free
    port) or, with ``bind: false``, connected to a router that binds a SUB socket.
    Unset, it is ``tcp://<host>:5558``: port 5558 because vLLM's own publisher
    (``--kv-events-config``) defaults to 5557 in the same pod; ``host`` is the address
    bound and named in the topic: ``kv_events.host``, else ``$POD_IP`` (Kubernetes'
    downward API: ``status.podIP``), else ``127.0.0.1``. Every message is published
    under ``topic``; unset, ``kv@<host>:<port>@<model>``, the form llm-d's subscriber
    parses (pod address, then the model; the port actually bound). ``replay_endpoint``,
    when set, is a ROUTER socket where a subscriber can ask for the last
    ``buffer_steps`` batches again. ``queue_size`` bounds the events waiting to be sent
    (beyond it they are dropped, counted, and a sequence number is skipped so that
    subscribers see the gap) and ``hwm`` the messages ZMQ holds per subscriber.
    Blocks are engine blocks of ``block_size`` tokens (vLLM's GPU default 16; its CPU
    backend uses multiples of 32), hashed as vLLM's ``prefix_caching_hash_algo``
    ``hash_algo`` does. ``block_hash_format``: ``int`` (the low 64 bits of the
    big-endian digest, vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or ``bytes``
    (the 32 digest bytes).
    """

    enabled: bool = option(False, check.boolean, shorthand=bool)
    endpoint: str | None = option(None, check.optional(check.zmq_endpoint))
    host: str | None = option(None, check.optional(check.rule(
        lambda v: isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9._:-]{1,253}", v),
        "expected a host name or IP address, got {}")))
    bind: bool = option(True, check.boolean)
    topic: str | None = option(None, check.optional(check.short_text(256)))
    replay_endpoint: str | None = option(None, check.optional(check.zmq_endpoint))
    buffer_steps: int = option(10_000, check.integer(1))
    hwm: int = option(100_000, check.integer(1))
    queue_size: int = option(100_000, check.integer(1))
    #: the medium vLLM's events name per tier name or backend (``lmcache.kv_media``:
    #: ``cpu`` -> ``CPU``, any other -> ``STORAGE`` unless set here)
    media: dict[str, str] = option({}, lambda k, v, s: _media(k, v, s))
    block_size: int = option(16, check.integer(1))
    hash_algo: str = option("sha256", check.choice("sha256", "sha256_cbor"))
    block_hash_format: str = option("int", check.choice("int", "bytes"))
    #: ``map`` (vLLM 0.32/0.33's msgspec maps) or ``array`` (upstream vLLM's
    #: ``array_like`` events, the only form llm-d decodes)
    event_form: str = option("map", check.choice("map", "array"))


_FRACTION = check.rule(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1,
                       "expected a fraction between 0 and 1, got {}")


@dataclass
class ApproximateReuseConfig:
    """Reuse of KV computed at other positions, for prompts whose older part was cut (see
    :mod:`lmcache.plugins.services.shifted` and docs/truncation.md): off unless ``enabled``.

    Exact prefix hits are never affected. With it on, chunks that match a prompt's tokens
    after its cached prefix, wherever they stood before, are reused with their keys
    re-rotated; ``recompute`` is the fraction of the reused tokens computed again at their
    new place: with ``select: leading`` the earliest ones (nearest the cut, which lost the
    most context), with ``deviation`` those whose layer-1 KV differs most from what an
    exact layer-0 pass gives (CacheBlend's criterion), with ``chunk_starts`` the first
    tokens of every chunk (EPIC's);
    ``sink_tokens`` the leading prompt tokens always computed exactly, ``index_entries``
    how many chunks the content index remembers.
    """

    enabled: bool = option(False, check.boolean, shorthand=bool)
    recompute: float = option(0.15, _FRACTION)
    select: str = option("leading", check.choice("leading", "deviation", "chunk_starts"))
    sink_tokens: int = option(4, check.integer(0))
    index_entries: int = option(65536, check.integer(1))


@dataclass
class VllmOptions:
    """How the vLLM connector (:mod:`lmcache.plugins.connectors.vllm`) loads and saves; set
    in the file as ``vllm: {layerwise: true}`` or in ``kv_connector_extra_config`` as
    ``lmcache.vllm.layerwise``. Other engines ignore it.

    ``layerwise``: load layer by layer in ``wait_for_layer_load`` and save in
    ``save_kv_layer``. ``async_loads``: ``auto`` loads a hit that reaches below the top
    tier asynchronously, ``always``, ``never``. ``lookup_wait``: seconds the scheduler
    waits for the workers' lookup answer in one pass; ``lookup_timeout``: seconds after
    which an unanswered lookup is a miss. ``load_failure_policy``: ``recompute`` sets
    vLLM's ``kv_load_failure_policy`` to recompute; ``fail`` keeps vLLM's. ``lookup``: how
    the scheduler learns what the workers' tiers hold: ``socket`` (a Unix socket per rank, one
    host), ``inband`` (the question in vLLM's connector metadata, the answer in its worker
    metadata: crosses hosts), ``auto`` (``inband`` when the workers may be on other hosts:
    ``nnodes > 1`` or the ``ray`` executor; else ``socket``; docs/architecture.md).
    ``entries``: ``auto`` stores vLLM's CPU attention blocks whole where a chunk is a whole
    number of them (keyed apart: only vLLM CPU engines of the same kernels and block size
    read them; docs/engines.md); ``tokens`` stores per-token KV everywhere, which any engine
    of the same model and KV shape reads (the CPU backend's vec kernels; its other kernels
    pack blocks with no per-token view: whole blocks, keyed apart, either way).
    ``skip_last_n_tokens``: lookups leave out a prompt's last n tokens (LMCache's connector
    key; 1 on LMCache's PD decoders).
    """

    layerwise: bool = option(False, check.boolean)
    async_loads: str = option("auto", check.choice("auto", "always", "never"))
    lookup_wait: float = option(0.005, check.seconds())
    lookup_timeout: float = option(1.0, check.seconds())
    load_failure_policy: str = option("recompute", check.choice("recompute", "fail"))
    lookup: str = option("auto", check.choice("auto", "socket", "inband"))
    entries: str = option("auto", check.choice("auto", "tokens"))
    skip_last_n_tokens: int = option(0, check.integer(0))

    def validate(self, source: str | None) -> None:
        if self.lookup_wait > self.lookup_timeout:
            raise ConfigError("vllm.lookup_wait", f"must be at most vllm.lookup_timeout ({self.lookup_timeout}), "
                                                  f"got {self.lookup_wait}", source)


@dataclass
class Config:
    """Validated lmcache configuration. Build it with :func:`load_config`.

    ``sources`` maps each top-level key, and each field of a section (``api.token``), to
    where its value came from: ``"default"``, ``"file:<path>"``, ``"env:LMCACHE_<KEY>"``,
    ``"mapping"`` (a dict given to :func:`load_config`) or ``"override"`` (a keyword argument).
    """

    chunk_size: int = option(256, check.integer(1))
    save_unfull_chunk: bool = option(True, check.boolean)
    write_policy: str = option("write-through", check.choice("write-through", "write-back"))
    namespace: str = option("default", check.name)
    model: str = option("default", check.text)
    hash_algorithm: str = option("xxh3_128", check.choice("xxh3_128", "blake2b"))
    tiers: list[TierConfig] = option([TierConfig(backend="cpu", capacity=1 << 30)], _tiers)
    # None: CPU tier capacities + staging_size
    memory_pool_size: int | None = option(None, lambda k, v, s: None if v in (None, "auto") else check.size()(k, v, s))
    staging_size: int = option(256 << 20, check.size(allow_zero=True))
    memory_pool_prefault: bool = option(True, check.boolean)  # map the pool's pages at start (see lmcache.memory)
    write_queue_size: int = option(256, check.integer(1))
    lookup_pin_timeout: float = option(30.0, check.seconds())
    # a Unix socket where the engine answers lookups from another process (the lookup service)
    lookup_socket: str | None = option(None, check.optional(check.text))
    # the longest lookup the socket accepts (tokens); a longer frame is refused unread (vLLM: max_model_len)
    lookup_max_tokens: int = option(1 << 20, check.integer(1))
    kv_spec: KVSpec | None = option(None, check.optional(lambda k, v, s: parse(KVSpec, v, k, s)))
    api: ApiConfig = field(default_factory=ApiConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    p2p: P2PConfig = field(default_factory=P2PConfig)
    # LMCache's key: the channel PD moves KV with (nixl, tcp, or a plugin's); null: no transfer endpoint
    transfer_channel: str | None = option(None, check.optional(check.name))
    transfer: TransferConfig = field(default_factory=TransferConfig)
    pd: PDConfig = field(default_factory=PDConfig)
    approximate_reuse: ApproximateReuseConfig = field(default_factory=ApproximateReuseConfig)
    vllm: VllmOptions = field(default_factory=VllmOptions)
    source: str | None = field(default=None, compare=False)
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def source_of(self, key: str) -> str:
        """Where the value of ``key`` (``chunk_size``, ``api.token``) came from; for a whole
        section, the latest source of its fields (``"default"`` if none was set)."""
        inner = [v for k, v in self.sources.items() if k.startswith(key + ".")]
        return self.sources.get(key) or (inner[-1] if inner else "default")

    @property
    def pool_size(self) -> int:
        """Bytes of the host memory pool: explicit, or CPU tiers plus staging."""
        if self.memory_pool_size is not None:
            return self.memory_pool_size
        cpu = sum(t.capacity for t in self.tiers if t.backend == "cpu")
        return cpu + self.staging_size

    def to_dict(self, *, mask_secrets: bool = False) -> dict[str, Any]:
        """The values as plain data (tiers with their backend keys inlined); with
        ``mask_secrets`` every secret reads ``"***"``: the tokens, a tier's credential
        keys (``secret_access_key``, ``token``, ``fs_options.password``...) and URL
        passwords (``redis://user:***@host``; see :mod:`lmcache.redact`)."""
        d = dataclasses.asdict(self)
        del d["source"], d["sources"]
        for t in d["tiers"]:
            t.update(t.pop("options"))
        return redact(mask(self, d)) if mask_secrets else d

    def report(self) -> dict[str, Any]:
        """The effective values (secrets masked), the source of each, per field for a
        section (``default``, ``file:<path>``, ``env:<VAR>``, ``mapping``, ``override``),
        and the file: what ``lmcache config show`` and ``/v1/config`` print."""
        values = self.to_dict(mask_secrets=True)
        sources: dict[str, str] = {}
        for key, value in values.items():
            sources[key] = self.source_of(key)
            if section_type(keys(type(self))[key]):
                sources.update({f"{key}.{sub}": self.source_of(f"{key}.{sub}") for sub in value})
        return {"file": self.source, "values": values, "sources": sources}


def _apply(cfg: Config, data: Mapping[str, Any], src: str | None, origin: str) -> Config:
    """``cfg`` with each key of ``data`` validated and set; ``origin`` is what ``sources``
    records, per field for a section: a file may enable the API and ``$LMCACHE_API_TOKEN``
    set its token. The latest source of a key is recorded last, so a section's latest is known."""
    known = keys(type(cfg))
    for k, v in data.items():
        sub = section_type(known[k]) if k in known else None
        for name in [f"{k}.{f}" for f in touched(sub, v)] if sub else [k]:
            cfg.sources.pop(name, None)
            cfg.sources[name] = origin
    return parse(type(cfg), data, "", src, cfg)


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
        raise ConfigError("<file>", f"not valid YAML: {check.yaml_problem(exc)}", str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("<file>", "the top level must be a mapping of keys to values", str(path))
    return data


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    too_big: Callable[[ConfigError], None] | None = None,
    **overrides: Any,
) -> Config:
    """Build a validated :class:`Config`.

    A memory pool larger than this machine's memory is a :class:`ConfigError`, unless
    ``too_big`` is given: then it gets that error and the config is returned (the CLI's
    ``config show``/``convert``/``validate`` inspect configs meant for bigger machines; only
    an engine, which allocates the pool, refuses).

    ``source`` is a YAML file path, a mapping, a ``Config`` (copied) or ``None`` (then
    ``LMCACHE_CONFIG_FILE`` names the file, if set). Environment variables
    ``LMCACHE_<KEY>`` override it (and a secret's own variable, ``LMCACHE_API_TOKEN``,
    taken verbatim) and keyword ``overrides`` override both.

    Every source also takes LMCache's vocabulary (``local_cpu``, ``max_local_cpu_size``,
    ``remote_url``, ... in the file, ``LMCACHE_LOCAL_CPU=True`` in the environment,
    ``local_cpu=True`` as an override), translated by :mod:`lmcache.upstream`; the same
    thing set in both vocabularies is a ConfigError naming both keys.
    """
    environ = os.environ if environ is None else environ
    layers: list[tuple[Mapping[str, Any], str | None, str]] = []
    if isinstance(source, Config):
        cfg = copy(source)
    else:
        cfg = Config()
        if source is None and environ.get("LMCACHE_CONFIG_FILE"):
            source = environ["LMCACHE_CONFIG_FILE"]
        if isinstance(source, Mapping):
            layers.append((source, None, "mapping"))
        elif source is not None:
            path = Path(source)
            cfg.source = str(path)
            layers.append((_read_yaml(path), str(path), f"file:{path}"))
    theirs: dict[str, upstream.Setting] = {}  # an old name never replaces its current name's value
    ours = keys(Config)
    for data, src, origin in layers:
        own, up = upstream.split(data, ours, src)
        cfg = _apply(cfg, own, src, origin)
        upstream.merge(theirs, {k: upstream.Setting(v, origin, src) for k, v in up.items()})
    for var, data in env_values(type(cfg), environ, not_keys=_ENV_NOT_KEYS | upstream.env_names(environ)):
        cfg = _apply(cfg, data, f"${var}", f"env:{var}")
    upstream.merge(theirs, upstream.env_settings(environ, skip=_ENV_NOT_KEYS))
    own, up = upstream.split(overrides, ours)
    cfg = _apply(cfg, own, None, "override")
    upstream.merge(theirs, {k: upstream.Setting(v, "override", None) for k, v in up.items()})
    translation = upstream.translate(theirs, cfg.sources, environ)
    for fragment, origin, src in translation.parts:
        cfg = _apply(cfg, fragment, src, origin)
    _across_sections(cfg)
    try:
        _check_memory(cfg, translation.names)
    except ConfigError as exc:
        if too_big is None:
            raise
        too_big(exc)
    return cfg


def _across_sections(cfg: Config) -> None:
    """The rules between sections, once every source is merged: PD on with no channel named
    moves KV over ``nixl`` (LMCache's only channel)."""
    if cfg.pd.role != "off" and cfg.transfer_channel is None:
        cfg.transfer_channel = "nixl"
        cfg.sources["transfer_channel"] = "default:pd.role"


def _check_memory(cfg: Config, names: Mapping[str, tuple[str, str | None]] | None = None) -> None:
    """The host memory pool must fit in this machine's memory: a CPU tier of 1 TiB passes
    every field check and then fails deep inside torch, naming no key. ``names``: the
    LMCache key (and source) that set a tier's capacity, named instead of ours."""
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
        key, source = (names or {}).get(key, (key, cfg.source))
        raise ConfigError(key, f"the memory pool would need {format_size(need)}, more than this machine has "
                               f"({format_size(total)})", source)
