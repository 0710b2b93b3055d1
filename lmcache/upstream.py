"""LMCache's configuration vocabulary (PyPI ``lmcache`` by LMCache/LMCache, 0.5.x),
translated to ours.

Upstream deployments configure LMCache with flat keys (``local_cpu``,
``max_local_cpu_size``, ``remote_url``, ...) in a YAML file, as ``LMCACHE_<KEY>``
environment variables and as ``lmcache.<key>`` entries of vLLM's
``kv_connector_extra_config``. :func:`lmcache.config.load_config` takes them in all three
places: :func:`split` and :func:`env_settings` pick them out of each source, and
:func:`translate` turns the merged settings into fragments of our config.

Every upstream key is in exactly one table: :data:`MAPPED` (the key of ours it sets) or
:data:`NO_EFFECT` (accepted, warned about once per process, with the reason);
:data:`ALIASES` are upstream's old names for current keys. Once any upstream-only key is
set, upstream's defaults decide the storage the user did not describe (a 5 GB ``cpu``
tier); the keys both vocabularies share (``chunk_size``, ``save_unfull_chunk``) are
ours, with our defaults. Setting one thing in both vocabularies (``tiers`` and
``local_cpu``) is a :class:`~lmcache.errors.ConfigError` naming both keys. The PD keys
(``enable_pd``, ``pd_*``, the older ``nixl_*``) are :mod:`lmcache.upstream_pd`'s.
"""

from __future__ import annotations

import difflib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, NamedTuple
from urllib.parse import urlsplit

from .errors import ConfigError
from .redact import MASK, redact_text
from .settings import _warned, show, warn_once  # noqa: F401 (_warned, warn_once: re-exported)
from . import upstream_pd

log = logging.getLogger("lmcache.config")

GB = 1 << 30  # upstream's "GB" sizes are multiplied by 1024**3
#: capacity of a tier that upstream does not bound (remote stores, gds): what this instance may write
UNBOUNDED = 1 << 40
#: the cpu tier of an upstream config that asks for no storage at all (see docs/migrating.md)
NO_STORAGE_CPU = 256 << 20

#: keys both vocabularies have; ours (and our defaults) decide them
SHARED = {"chunk_size": "chunk_size", "save_unfull_chunk": "save_unfull_chunk", "transfer_channel": "transfer_channel"}

#: upstream key -> the key of ours it sets
MAPPED: dict[str, str] = {
    **SHARED,
    **dict.fromkeys(("local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size", "remote_url",
                     "remote_serde", "cache_policy", "gds_path", "use_gds", "extra_config"), "tiers"),
    "pre_caching_hash_algorithm": "hash_algorithm",
    "pin_timeout_sec": "lookup_pin_timeout",
    "use_layerwise": "vllm.layerwise",
    "enable_async_loading": "vllm.async_loads",
    "lookup_timeout_ms": "vllm.lookup_timeout",
    "internal_api_server_enabled": "api.enabled",
    "internal_api_server_host": "api.host",
    "internal_api_server_port_start": "api.port",
    "enable_controller": "controller.url",
    "controller_pull_url": "controller.url",
    "lmcache_instance_id": "controller.instance_id",
    "enable_p2p": "p2p.enabled",
    "p2p_host": "p2p.host",
    "p2p_init_ports": "p2p.port",
    "enable_kv_events": "kv_events.enabled",
    **upstream_pd.MAPPED,  # enable_pd, pd_role, pd_peer_*, pd_proxy_*, pd_buffer_size, nixl_backends, ...
}

_GROUPS: dict[str, tuple[str, ...]] = {
    **upstream_pd.GROUPS,
    "CacheBlend is not implemented; approximate_reuse is the nearest (docs/truncation.md)":
        ("enable_blending", "blend_recompute_ratios", "blend_thresholds", "blend_check_layers", "blend_min_tokens",
         "blend_special_str"),
    "hidden states (vLLM-Omni) are not cached here":
        ("enable_hidden_state_cache", "max_hidden_state_cpu_size", "hidden_state_layers",
         "hidden_states_retrieve_mode"),
    "plugins are Python packages with entry points here (docs/plugins.md); no code is loaded by path or run by API":
        ("runtime_plugin_locations", "storage_plugins", "remote_storage_plugins", "external_lookup_client",
         "script_allowed_imports", "run_script_api_enabled"),
    "LMCache's allocator tuning; ours is sized by the cpu tiers, staging_size and memory_pool_size":
        ("local_cpu_use_hugepages", "reserve_local_cpu_size", "enable_lazy_memory_allocator",
         "lazy_memory_initial_ratio", "lazy_memory_expand_trigger_ratio", "lazy_memory_step_ratio",
         "lazy_memory_safe_size", "numa_mode", "py_enable_gc", "use_gpu_connector_v3", "pin_check_interval_sec"),
    "the order of the tiers decides where chunks are stored and read":
        ("retrieve_locations", "store_location", "local_device", "pipelined_backend"),
    "our controller is one HTTP endpoint (controller.url): no reply port, worker ports or ids":
        ("controller_reply_url", "lmcache_worker_ports", "lmcache_worker_ids", "lmcache_worker_heartbeat_delay_time"),
    "lmcache controller drops an instance silent for --instance-timeout (10 s), so the worker keeps its "
    "2 s beat (controller.heartbeat_interval); LMCache's 30 s would make it flap": ("lmcache_worker_heartbeat_time",),
    "peers are found through the controller, not on lookup ports": ("p2p_lookup_ports",),
    "LMCache's multi-process (MP) server mode is not implemented": ("mp_host", "mp_port"),
    "chunk statistics are not implemented (lmcache stats shows the tiers)":
        ("enable_chunk_statistics", "chunk_statistics_auto_start_statistics",
         "chunk_statistics_auto_exit_timeout_hours", "chunk_statistics_auto_exit_target_unique_chunks",
         "chunk_statistics_strategy"),
    "the instance API is one HTTP server per engine (api.host, api.port)":
        ("internal_api_server_include_index_list", "internal_api_server_socket_path_prefix"),
    "the processes of one engine (TP ranks) share one disk directory and its capacity; no per-GPU subdirectories":
        ("local_disk_path_sharding", "gds_path_sharding"),
    "our gds tier sizes its own buffers and picks kvikio or POSIX I/O": ("gds_buffer_size", "gds_backend"),
    "the Maru CXL backend is not implemented": ("maru_path", "maru_pool_size"),
    "the vLLM connector stores the prompt's KV only, not the decoded tokens'": ("save_decode_cache",),
    "every remote call has its own timeout (the tier's timeout option)": ("blocking_timeout_secs",),
    "configuration comes from the file, the environment and arguments only; no URL is fetched":
        ("remote_config_url", "app_id"),
    "not implemented": ("audit_actual_remote_url", "priority_limit", "min_retrieve_tokens", "hit_miss_ratio",
                        "lookup_server_worker_ids", "enable_scheduler_bypass_lookup"),
}
#: upstream key -> why it has no effect here
NO_EFFECT: dict[str, str] = {k: why for why, ks in _GROUPS.items() for k in ks}

#: upstream's old names (its ``_CONFIG_ALIASES``, and older releases' NIXL keys) -> the current
#: key; when both are set, in any order or sources, the current name's value wins (:func:`merge`)
ALIASES: dict[str, str] = {
    **upstream_pd.ALIASES,  # enable_xpyd, enable_nixl, nixl_role, nixl_peer_*, ..., pd_transfer_channel
    "controller_url": "controller_pull_url", "lmcache_worker_port": "lmcache_worker_ports",
    "plugin_locations": "runtime_plugin_locations", "external_backends": "storage_plugins",
}
#: every name upstream accepts that is not ours
KEYS = (set(MAPPED) | set(NO_EFFECT) | set(ALIASES)) - set(SHARED)

#: ``LMCACHE_*`` variables upstream deployments set that name no key: quiet, or one warning
#: (LMCACHE_FORCE_SKIP_SAVE is read by lmcache.integration.vllm's LMCacheConnectorV1 adapter)
QUIET_ENV = {"LMCACHE_USE_EXPERIMENTAL", "LMCACHE_SERVER_SERVICE_PORT", "LMCACHE_INSTANCE_ID",
             "LMCACHE_WORKER_PORT", "LMCACHE_FORCE_SKIP_SAVE", "LMCACHE_RPC_PORT"}
IGNORED_ENV: dict[str, str] = {}

#: ``extra_config`` keys that have a meaning here (the rest: no effect)
EXTRA_MAPPED = {"use_odirect", "s3_region", "aws_access_key_id", "aws_secret_access_key", "s3_num_io_threads",
                "valkey_mode", "master_server_address", "local_hostname", "metadata_server",
                "global_segment_size", "local_buffer_size", "protocol", "device_name", "transfer_timeout"}
_EXTRA_WHY = "an extra_config key of LMCache's with no counterpart here"
_MOONCAKE = ("local_hostname", "metadata_server", "global_segment_size", "local_buffer_size", "protocol",
             "device_name")

_HASHES = {"builtin": "xxh3_128", "xxhash": "xxh3_128", "xxhash_cbor": "xxh3_128", "sha256": "blake2b",
           "sha256_cbor": "blake2b", "sha256_cbor_64bit": "blake2b", "blake3": "blake2b"}
_POLICIES = {"lru": "lru", "lfu": "lfu", "fifo": "fifo", "mru": "lru"}
_SERDES = {"naive": "raw", "null": "raw", "none": "raw", "cachegen": "cachegen"}
#: remote_url schemes upstream accepts that have a backend here
SCHEMES = ("lm", "redis", "rediss", "redis-sentinel", "redis-cluster", "resp", "valkey", "s3", "mooncakestore", "fs")


class Setting(NamedTuple):
    """One upstream key's raw value and where it came from."""

    value: Any
    origin: str  #: what ``Config.sources`` records: ``file:<path>``, ``env:<VAR>``, ``mapping``, ``override``
    source: str | None  #: what a ConfigError names: the file, ``$VAR``, or None
    alias: str | None = None  #: the old name (:data:`ALIASES`) it was set by, if any


@dataclass
class Translation:
    """What :func:`translate` made of the upstream settings."""

    #: ``(fragment of our config, origin, source)``, applied in order after the user's own keys
    parts: list[tuple[dict[str, Any], str, str | None]] = field(default_factory=list)
    #: upstream key (``extra_config.<key>`` for those) -> why it has no effect
    no_effect: dict[str, str] = field(default_factory=dict)
    #: a path of ours (``tiers[0].capacity``) -> the upstream key and source that set it, for errors
    names: dict[str, tuple[str, str | None]] = field(default_factory=dict)


# ------------------------------------------------------------------ picking the keys out of a source
def split(data: Mapping[Any, Any], ours: Collection[str],
          src: str | None = None) -> tuple[dict[Any, Any], dict[str, Any]]:
    """``data`` as ``(our keys and unknown ones, upstream keys as written)``; :func:`merge`
    resolves the old names. An unknown key close to an upstream key (``local_cpus``) is a
    ConfigError naming it with the hint; other unknown keys stay with ours, so that our
    parser refuses them."""
    own: dict[Any, Any] = {}
    theirs: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(k, str) and k not in ours and k in KEYS:
            theirs[k] = v
            continue
        if isinstance(k, str) and k not in ours:
            hint = difflib.get_close_matches(k, [*ours, *sorted(KEYS)], n=1)
            if hint and hint[0] in KEYS:
                raise ConfigError(k, f"unknown key; did you mean '{hint[0]}' (LMCache's)?", src)
        own[k] = v
    return own, theirs


def merge(into: dict[str, Setting], new: Mapping[str, Setting]) -> None:
    """``new`` (upstream keys as written, old names included) over ``into`` (current names):
    a later value wins, except that an old name never replaces a value set by its current
    name, whatever the order or the sources (the production stack sets LMCACHE_ENABLE_PD=True
    with LMCACHE_ENABLE_XPYD=False, and LMCACHE_PD_ROLE with LMCACHE_NIXL_ROLE)."""
    for k, s in new.items():
        key = ALIASES.get(k, k)
        old = s.alias or (k if key != k else None)
        if old and key in into and into[key].alias is None:
            log.debug("LMCache key %s (%s) ignored: %s is set", old, s.origin, key)
            continue
        into[key] = s._replace(alias=old)


def env_names(environ: Mapping[str, str]) -> set[str]:
    """The ``LMCACHE_*`` variables in ``environ`` that upstream reads or deployments set."""
    return {v for v in environ if v.startswith("LMCACHE_") and (v[8:].lower() in KEYS or v in QUIET_ENV
                                                                 or v in IGNORED_ENV)}


def env_settings(environ: Mapping[str, str], skip: Collection[str] = ()) -> dict[str, Setting]:
    """The upstream keys set by ``LMCACHE_<KEY>`` variables (``LMCACHE_LMCACHE_INSTANCE_ID``
    for ``lmcache_instance_id``), as raw strings with upstream's quoting undone; the
    variables in ``skip`` have another meaning here. Keyed by current names: see :func:`merge`."""
    out: dict[str, Setting] = {}
    for var in sorted(env_names(environ) - set(skip)):
        if var in IGNORED_ENV:
            if environ[var]:
                warn_once(var, f"ignoring environment variable {var}: {IGNORED_ENV[var]}")
            continue
        if var in QUIET_ENV:
            continue
        merge(out, {var[8:].lower(): Setting(_unquote(environ[var]), f"env:{var}", f"${var}")})
    return out


def _unquote(raw: str) -> str:
    s = raw.strip()
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"" else s


# ------------------------------------------------------------------ upstream's value types
def _bool(key: str, v: Any, src: str | None) -> bool:
    if isinstance(v, bool):
        return v
    if not isinstance(v, (str, int)):
        raise ConfigError(key, f"expected True or False, got {show(v)}", src)
    s = str(v).strip().lower()
    if s in ("true", "1", "yes", "on"):
        return True
    if s in ("false", "0", "no", "off", "", "none", "null"):
        return False
    raise ConfigError(key, f"expected True or False, got {show(v)}", src)


def _number(kind: type, maximum: float = 1e12) -> Callable[[str, Any, str | None], Any]:
    """A number of ``kind`` from 0 to ``maximum`` (sizes in GB at most 1 PiB)."""
    def conv(key: str, v: Any, src: str | None) -> Any:
        if isinstance(v, bool) or (kind is int and isinstance(v, float)):
            raise ConfigError(key, f"expected {'an integer' if kind is int else 'a number'}, got {show(v)}", src)
        try:
            n = kind(v)
        except (TypeError, ValueError):
            raise ConfigError(key, f"expected {'an integer' if kind is int else 'a number'}, got {show(v)}", src) from None
        if not 0 <= n <= maximum:  # NaN fails too
            raise ConfigError(key, f"expected a number from 0 to {maximum:.0f}, got {show(v)}", src)
        return n
    return conv


def _text(key: str, v: Any, src: str | None) -> str | None:
    if v is None:
        return None
    if isinstance(v, (dict, list, bool)):
        raise ConfigError(key, f"expected a string, got {show(v)}", src)
    s = str(v).strip()
    return s or None


def _disk(key: str, v: Any, src: str | None) -> str | None:
    """As upstream: a YAML ``true`` is the string ``"True"``."""
    return str(v) if isinstance(v, bool) else _text(key, v, src)


def _ints(key: str, v: Any, src: str | None) -> list[int]:
    if not isinstance(v, (list, int, str)):
        raise ConfigError(key, f"expected a port or a list of ports, got {show(v)}", src)
    items = v if isinstance(v, list) else [v] if isinstance(v, int) else v.split(",")
    conv = _number(int)
    return [conv(key, x.strip() if isinstance(x, str) else x, src) for x in items if x != ""]


def _json(key: str, v: Any, src: str | None) -> dict[str, Any]:
    if v is None or v == "":
        return {}
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as exc:  # the text is not shown: it holds credentials (aws_secret_access_key)
            raise ConfigError(key, f"expected a JSON object, got text that is not JSON ({exc})", src) from None
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise ConfigError(key, f"expected a mapping of names to values, got {type(v).__name__}", src)
    return v


_CONVERT: dict[str, Callable[[str, Any, str | None], Any]] = {
    **dict.fromkeys(("local_cpu", "use_layerwise", "enable_async_loading", "internal_api_server_enabled",
                     "enable_controller", "enable_p2p", "enable_kv_events", "use_gds"), _bool),
    **dict.fromkeys(("max_local_cpu_size", "max_local_disk_size"), _number(float, 1 << 20)),
    **dict.fromkeys(("pin_timeout_sec", "lookup_timeout_ms", "internal_api_server_port_start"), _number(int)),
    "local_disk": _disk,
    **dict.fromkeys(("remote_url", "remote_serde", "cache_policy", "gds_path",
                     "pre_caching_hash_algorithm", "internal_api_server_host", "controller_pull_url",
                     "lmcache_instance_id", "p2p_host"), _text),
    "p2p_init_ports": _ints,
    "extra_config": _json,
    **dict.fromkeys(("enable_pd", "pd_skip_proxy_notification"), _bool),
    **dict.fromkeys(("pd_peer_host", "pd_proxy_host", "pd_buffer_device"), _text),
    "skip_last_n_tokens": _number(int),
    **upstream_pd.CONVERT,  # pd_role, pd_buffer_size, the ports, pd_allocation_timeout_sec, nixl_backends
}


# ------------------------------------------------------------------ the translation
def translate(settings: Mapping[str, Setting], ours: Mapping[str, str],
              environ: Mapping[str, str] | None = None) -> Translation:
    """Our config fragments for the upstream ``settings`` (key -> latest value; aliases
    resolved, shared keys left out). ``ours`` maps each path the user set in our
    vocabulary to its origin (``Config.sources``): the same thing set both ways is a
    ConfigError naming both keys. ``environ`` is read for what upstream reads from it
    (``REDIS_SERVICE_NAME``). Empty ``settings`` translate to nothing."""
    tr = Translation()
    channel = settings.get("transfer_channel")  # LMCACHE_PD_TRANSFER_CHANNEL: ours, unless ours names it
    name = _text("transfer_channel", channel.value, channel.source) if channel is not None else None
    if name is not None and "transfer_channel" not in ours:
        tr.parts.append(({"transfer_channel": name}, channel.origin, channel.source))
    # the connector's own skip_last_n_tokens (vllm.skip_last_n_tokens) wins over LMCACHE_SKIP_LAST_N_TOKENS, quietly
    settings = {k: s for k, s in settings.items()
                if k != "transfer_channel" and not (k == "skip_last_n_tokens" and MAPPED[k] in ours)}
    if not settings:
        return tr
    val = {k: _CONVERT[k](k, s.value, s.source) for k, s in settings.items() if k in _CONVERT}
    extra = val.get("extra_config", {})
    for k in settings:
        if k in NO_EFFECT:
            tr.no_effect[k] = NO_EFFECT[k]
    for k in extra:
        if k not in EXTRA_MAPPED:
            tr.no_effect[f"extra_config.{k}"] = _EXTRA_WHY
    for k, why in tr.no_effect.items():
        warn_once(f"upstream:{k}", f"LMCache config key {k} has no effect here: {why}")
    _refuse_mixing(settings, ours, bool(extra.keys() & EXTRA_MAPPED))

    def put(path: str, value: Any, key: str) -> None:
        s = settings[key]
        head, _, sub = path.partition(".")
        tr.parts.append(({head: {sub: value}} if sub else {head: value}, s.origin, s.source))

    if "tiers" not in ours:
        _storage(tr, settings, val, extra, environ or {})
    if "pre_caching_hash_algorithm" in val:
        put("hash_algorithm", _pick("pre_caching_hash_algorithm", val, _HASHES, settings), "pre_caching_hash_algorithm")
    for key, path, scale in (("pin_timeout_sec", "lookup_pin_timeout", 1), ("lookup_timeout_ms", "vllm.lookup_timeout", 1000)):
        if key in val:
            put(path, val[key] / scale, key)
    for key, path in (("use_layerwise", "vllm.layerwise"), ("internal_api_server_enabled", "api.enabled"),
                      ("internal_api_server_host", "api.host"), ("internal_api_server_port_start", "api.port"),
                      ("lmcache_instance_id", "controller.instance_id"), ("enable_p2p", "p2p.enabled"),
                      ("p2p_host", "p2p.host"), ("enable_kv_events", "kv_events.enabled")):
        if val.get(key) is not None:
            put(path, val[key], key)
    if "enable_async_loading" in val:
        # True: our "auto" already loads what lies below the top tier asynchronously, and keeps a
        # CPU-tier hit on the faster synchronous path; an explicit False asks for blocking loads
        put("vllm.async_loads", "auto" if val["enable_async_loading"] else "never", "enable_async_loading")
    if val.get("p2p_init_ports"):
        put("p2p.port", val["p2p_init_ports"][0], "p2p_init_ports")
    if val.get("enable_controller"):
        if not val.get("controller_pull_url"):
            s = settings["enable_controller"]
            raise ConfigError("controller_pull_url", "is required when enable_controller is true "
                                                     "(host:port of `lmcache controller`)", s.source)
        put("controller.url", _controller_url(val["controller_pull_url"], settings["controller_pull_url"]),
            "controller_pull_url")
    upstream_pd.translate_pd(settings, val, put)
    return tr


def _refuse_mixing(settings: Mapping[str, Setting], ours: Mapping[str, str], extra_maps: bool) -> None:
    for key, s in settings.items():
        path = MAPPED.get(key)
        if path is None or (key == "extra_config" and not extra_maps):
            continue
        if path in ours:
            raise ConfigError(key, f"LMCache's {key} and our {path} ({ours[path]}) both set {path}; "
                                   f"use one of the two vocabularies for it (docs/migrating.md)", s.source)


def _pick(key: str, val: Mapping[str, Any], table: Mapping[str, str], settings: Mapping[str, Setting]) -> str:
    name = str(val[key]).lower()
    if name not in table:
        raise ConfigError(key, f"{show(val[key])} is not one of {', '.join(table)}", settings[key].source)
    return table[name]


def _storage(tr: Translation, settings: Mapping[str, Setting], val: Mapping[str, Any], extra: Mapping[str, Any],
             environ: Mapping[str, str]) -> None:
    """The tiers, top first: cpu, disk, gds, remote, with upstream's defaults for what is unset."""
    policy = _pick("cache_policy", val, _POLICIES, settings) if val.get("cache_policy") else "lru"
    if str(val.get("cache_policy", "")).lower() == "mru":
        warn_once("upstream:cache_policy", "LMCache cache_policy MRU: no MRU policy here, LRU is used")
    tiers: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # our tier capacity path -> upstream key

    def add(tier: dict[str, Any], size_key: str | None) -> None:
        tier.setdefault("policy", policy)
        if size_key:
            names[f"tiers[{len(tiers)}].capacity"] = size_key
        tiers.append(tier)

    cpu = val.get("max_local_cpu_size", 5.0)
    pd_cpu = upstream_pd.cpu_capacity(val)
    if val.get("local_cpu", True) and cpu > 0:
        add({"backend": "cpu", "capacity": max(1, int(cpu * GB))}, "max_local_cpu_size")
    elif pd_cpu is not None:  # PD: received KV lives in the top tier, the size of LMCache's PD buffer
        add({"backend": "cpu", "capacity": pd_cpu}, "pd_buffer_size" if "pd_buffer_size" in val else None)
    disks = _local_disk(val.get("local_disk"), settings)
    disk_size = val.get("max_local_disk_size", 0.0)
    if disks and disk_size > 0:
        for i, path in enumerate(disks):
            tier = {"backend": "disk", "name": "disk" if i == 0 else f"disk-{i}", "path": path,
                    "capacity": max(1, int(disk_size * GB / len(disks)))}
            if "use_odirect" in extra:
                tier["o_direct"] = _bool("extra_config.use_odirect", extra["use_odirect"],
                                         settings["extra_config"].source)
            add(tier, "max_local_disk_size")
    elif disks or disk_size > 0:
        warn_once("upstream:local_disk", "LMCache local_disk needs both a path and max_local_disk_size > 0: "
                                         "no disk tier (as in LMCache)")
    if val.get("gds_path"):
        tier = {"backend": "gds", "path": val["gds_path"], "capacity": UNBOUNDED}
        if val.get("use_gds") is False:
            tier["use_kvikio"] = False
        add(tier, None)
    if val.get("remote_url"):
        tier = remote_tier(val["remote_url"], extra, environ, settings["remote_url"].source)
        serde = settings.get("remote_serde")
        tier["codec"] = _SERDES.get(str(serde.value).strip().lower() if serde and serde.value is not None else "null")
        if tier["codec"] is None:
            raise ConfigError("remote_serde", f"{show(serde.value)} is not naive, cachegen or NULL", serde.source)
        add(tier, None)
    if not tiers:
        warn_once("upstream:no-storage", "the LMCache settings ask for no storage (no local_cpu, local_disk, "
                  "gds_path or remote_url): a 256 MiB cpu tier keeps the engine running (docs/migrating.md)")
        tiers.append({"backend": "cpu", "capacity": NO_STORAGE_CPU, "policy": policy})
    used = [k for k in ("local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size", "gds_path",
                        "use_gds", "remote_url", "remote_serde", "cache_policy", "extra_config")
            + (("enable_pd", "pd_buffer_size") if pd_cpu is not None else ()) if k in settings]
    origin = ", ".join(dict.fromkeys(settings[k].origin for k in used)) or "default:LMCache"
    source = settings[used[-1]].source if used else None
    tr.parts.insert(0, ({"tiers": tiers}, origin, source))
    for path, key in names.items():
        tr.names[path] = (key, settings[key].source if key in settings else None)


def _local_disk(v: str | None, settings: Mapping[str, Setting]) -> list[str]:
    """Upstream's parse: comma-separated paths, each maybe ``file://``; ``"True"`` is,
    as there, the directory ``True`` in the working directory; ``"False"`` is none."""
    if v is None or v.lower() in ("false", "none", "null"):
        return []
    if v == "True":
        warn_once("upstream:local_disk=True", "LMCache local_disk 'True' is the directory 'True' in the working "
                                              "directory, as in LMCache; give a path to choose one")
    paths = [p.strip()[7:] if p.strip().startswith("file://") else p.strip() for p in v.split(",") if p.strip()]
    for p in paths:
        if not p:
            raise ConfigError("local_disk", f"{show(v)} names no directory", settings["local_disk"].source)
    return paths


def _hostport(url: str, scheme: str, src: str | None, *, need_host: bool = True) -> tuple[str, int | None, str]:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError("remote_url", f"malformed {scheme}:// URL {show(redact_text(url))}: {exc}", src) from None
    if need_host and not parts.hostname:
        raise ConfigError("remote_url", f"the {scheme}:// URL {show(redact_text(url))} names no host", src)
    return parts.hostname or "", port, parts.path


def remote_tier(url: str, extra: Mapping[str, Any], environ: Mapping[str, str], src: str | None) -> dict[str, Any]:
    """Our bottom tier for upstream's ``remote_url`` (and the ``extra_config`` keys its
    connector reads); a scheme we have no backend for, or a malformed URL, is a
    ConfigError naming ``remote_url`` and the scheme."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or not scheme:
        shown = f"{MASK}@{url.rpartition('@')[2]}" if "@" in url else url  # user info without a scheme
        raise ConfigError("remote_url", f"{show(shown)} has no scheme; expected e.g. lm://host:port", src)
    if scheme not in SCHEMES:
        raise ConfigError("remote_url", f"scheme '{scheme}' has no backend here (supported: "
                                        f"{', '.join(SCHEMES)})", src)
    tier: dict[str, Any] = {"capacity": UNBOUNDED}
    if scheme == "fs":
        _, _, path = _hostport(url, scheme, src, need_host=False)
        if not path or "," in path:
            raise ConfigError("remote_url", f"fs:// URL {show(url)}: expected one directory, fs://[host:port]/path", src)
        return {**tier, "backend": "fs", "url": "file://" + path}
    multi = scheme in ("redis-sentinel", "redis-cluster")
    _hostport(url.split(",")[0] if multi else url, scheme, src)
    if scheme in ("lm", "redis", "rediss"):
        return {**tier, "backend": scheme if scheme == "lm" else "redis", "url": url}
    if scheme == "resp":
        return {**tier, "backend": "redis", "url": "redis://" + rest}
    if scheme == "redis-cluster":
        return {**tier, "backend": "redis", "url": "redis+cluster://" + rest}
    if scheme == "redis-sentinel":
        hosts, slash, master = rest.partition("/")
        master = master if slash and master else environ.get("REDIS_SERVICE_NAME") or "redismaster"
        return {**tier, "backend": "redis", "url": f"redis+sentinel://{hosts}/{master}"}
    if scheme == "valkey":
        cluster = str(extra.get("valkey_mode", "")).lower() == "cluster"
        return {**tier, "backend": "valkey", "url": ("valkey+cluster://" + rest) if cluster else url}
    if scheme == "mooncakestore":
        master = extra.get("mooncake_master_server_address") or extra.get("master_server_address")
        host, port, _ = _hostport(url, scheme, src)
        tier.update({"backend": "mooncake", "url": f"mooncake://{master or f'{host}:{port or 50051}'}"})
        for k in _MOONCAKE:
            v = extra.get(f"mooncake_{k}", extra.get(k))
            if v is not None:
                tier[k] = v
        if "transfer_timeout" in extra:
            tier["timeout"] = extra["transfer_timeout"]
        return tier
    # s3://bucket[.s3[express...].region.amazonaws.com][/prefix]
    host, _, path = _hostport(url, scheme, src)
    bucket = host.split(".s3", 1)[0]
    tier.update({"backend": "s3", "url": f"s3://{bucket}{path.rstrip('/')}"})
    for ours_key, key in (("region", "s3_region"), ("access_key_id", "aws_access_key_id"),
                          ("secret_access_key", "aws_secret_access_key"), ("concurrency", "s3_num_io_threads")):
        if extra.get(key) is not None:
            tier[ours_key] = extra[key]
    return tier


def _controller_url(v: str, s: Setting) -> str:
    """``host:port`` (upstream's ZMQ address, no scheme) -> ``http://host:port``."""
    text = v.split("://", 1)[1] if v.startswith("tcp://") else v
    url = text if "://" in text else f"http://{text}"
    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port is not None
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError("controller_pull_url", f"expected host:port of `lmcache controller`, got "
                                                 f"{show(redact_text(url))}", s.source)
    return url.rstrip("/")


def no_effect_keys(data: Mapping[Any, Any], ours: Collection[str]) -> dict[str, str]:
    """The keys of a raw upstream mapping that have no effect here, with the reason (for
    ``lmcache config convert``); ``ours``: our config's keys (``settings.keys(Config)``)."""
    _, theirs = split(data, ours)
    out = {k: NO_EFFECT[ALIASES.get(k, k)] for k in theirs if ALIASES.get(k, k) in NO_EFFECT}
    extra = theirs.get("extra_config")
    if isinstance(extra, (dict, str)):
        try:
            extra = _json("extra_config", extra, None)
        except ConfigError:
            extra = {}
        out.update({f"extra_config.{k}": _EXTRA_WHY for k in extra if k not in EXTRA_MAPPED})
    return out
