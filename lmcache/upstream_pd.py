"""LMCache's prefill->decode (PD) keys, translated to our ``pd`` and ``transfer`` sections.

A part of :mod:`lmcache.upstream` (its tables take these in, and :func:`lmcache.upstream.translate`
calls :func:`translate_pd`): LMCache's 1P1D and xPyD configs (``enable_pd``, ``pd_role``,
``pd_peer_*``, ``pd_proxy_*``, ``pd_buffer_size``, ``nixl_backends``) and the production
stack's PD environment (``LMCACHE_PD_*`` with the older ``LMCACHE_NIXL_*`` twins) start
this instance as a PD sender or receiver. ``enable_pd`` false: the PD keys have no effect.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Mapping

from .config_services import _names, _ports
from .errors import ConfigError
from .settings import show, warn_once

#: LMCache's cap here on ``pd_allocation_timeout_sec`` (LMCache's default: no end)
MAX_ALLOC_WAIT = 60.0
#: the cpu tier of a PD config that asks for no cpu tier and names no ``pd_buffer_size``
DEFAULT_PD_BUFFER = 1 << 30

#: upstream PD key -> the key of ours it sets ("": accepted, sets nothing)
MAPPED: dict[str, str] = {
    "enable_pd": "pd.role", "pd_role": "pd.role",
    "pd_buffer_size": "transfer.buffer_size", "nixl_buffer_size": "transfer.buffer_size",
    "pd_buffer_device": "", "nixl_buffer_device": "",  # the transfer buffer is host memory here
    "pd_peer_host": "pd.peer_host", "pd_peer_init_port": "pd.peer_init_port",
    "pd_peer_alloc_port": "pd.peer_alloc_port", "pd_proxy_host": "pd.proxy_host", "pd_proxy_port": "pd.proxy_port",
    "pd_skip_proxy_notification": "pd.notify", "pd_allocation_timeout_sec": "transfer.alloc_wait",
    "nixl_backends": "transfer.nixl_backends",
    # LMCache's connector key (kv_connector_extra_config), and the production stack's LMCACHE_SKIP_LAST_N_TOKENS
    "skip_last_n_tokens": "vllm.skip_last_n_tokens",
}

#: why -> the PD keys that have no effect here
GROUPS: dict[str, tuple[str, ...]] = {
    "a prefiller does not probe a decoder's cache here; a receiver listens on one port per rank (pd.peer_init_port)":
        ("pd_peer_query_port",),
    "the transfer endpoint stops with the engine (its thread joined for 2 s at most)": ("pd_shutdown_timeout_sec",),
    "LMCache's asyncio PD backend's polling interval; the transfer endpoint has no such loop":
        ("pd_condition_poll_interval_sec",),
    "a transfer that does not fit transfer.buffer_size is answered full and the decoder recomputes the request":
        ("pd_max_prefill_len",),
    "LMCache's choice between its sync and async PD backends; there is one transfer endpoint here":
        ("pd_backend_mode",),
    "pd_role: both (pd.role both) sends and receives; a prefiller does not probe a decoder's cache here":
        ("pd_bidirectional",),
    "an older release's NIXL garbage-collection switch; nothing to tune here": ("nixl_enable_gc",),
}

#: old names (LMCache's ``_CONFIG_ALIASES`` and older releases' NIXL keys) -> the current key;
#: when both are set, the current one wins
ALIASES: dict[str, str] = {
    "enable_xpyd": "enable_pd", "enable_nixl": "enable_pd", "nixl_role": "pd_role",
    "nixl_buffer_size": "pd_buffer_size", "nixl_buffer_device": "pd_buffer_device",
    "nixl_peer_host": "pd_peer_host", "nixl_receiver_host": "pd_peer_host",
    "nixl_peer_init_port": "pd_peer_init_port", "nixl_peer_port": "pd_peer_init_port",
    "nixl_receiver_port": "pd_peer_init_port", "nixl_peer_alloc_port": "pd_peer_alloc_port",
    "nixl_proxy_host": "pd_proxy_host", "nixl_proxy_port": "pd_proxy_port",
    # the production stack's LMCACHE_PD_TRANSFER_CHANNEL: transfer_channel (ours) wins over it
    "pd_transfer_channel": "transfer_channel",
}

#: the keys that only matter with ``enable_pd`` true
_GATED = ("pd_role", "pd_buffer_size", "pd_buffer_device", "pd_peer_host", "pd_peer_init_port", "pd_peer_alloc_port",
          "pd_proxy_host", "pd_proxy_port", "pd_skip_proxy_notification", "pd_allocation_timeout_sec")
_ROLES = ("sender", "receiver", "both")


def _role(key: str, v: Any, src: str | None) -> str | None:
    if v is None:
        return None
    name = str(v).strip().lower() if isinstance(v, str) else None
    if name not in _ROLES:
        raise ConfigError(key, f"{show(v)} is not sender, receiver or both", src)
    return name


def _buffer_size(key: str, v: Any, src: str | None) -> int | None:
    """Bytes: an integer or a numeric string (``"58720256"``)."""
    if v is None:
        return None
    try:
        n = int(v.strip()) if isinstance(v, str) else v if isinstance(v, int) and not isinstance(v, bool) else None
    except ValueError:
        n = None
    if n is None or not 0 < n <= 1 << 50:
        raise ConfigError(key, f"expected a number of bytes from 1 to {1 << 50}, got {show(v)}", src)
    return n


def _alloc_wait(key: str, v: Any, src: str | None) -> float:
    """Seconds; ``inf`` (LMCache's default) is accepted and capped later."""
    try:
        n = float(v) if isinstance(v, (int, float, str)) and not isinstance(v, bool) else math.nan
    except ValueError:
        n = math.nan
    if not n > 0:  # NaN fails too
        raise ConfigError(key, f"expected a positive number of seconds, got {show(v)}", src)
    return n


def _port(key: str, v: Any, src: str | None) -> int | None:
    if v is None or v == "":
        return None
    ports = _ports(key, v if isinstance(v, (int, str)) else [v], src)
    if len(ports) != 1:
        raise ConfigError(key, f"expected one port, got {show(v)}", src)
    return ports[0]


def _backends(key: str, v: Any, src: str | None) -> list[str] | None:
    return None if v is None or v == "" else _names(key, v, src)


#: upstream PD key -> its converter (``(key, raw, source) -> value``); the booleans and plain
#: strings are converted by lmcache.upstream's own
CONVERT: dict[str, Callable[[str, Any, str | None], Any]] = {
    "pd_role": _role, "pd_buffer_size": _buffer_size, "pd_allocation_timeout_sec": _alloc_wait,
    "pd_peer_init_port": _ports, "pd_peer_alloc_port": _ports, "pd_proxy_port": _port, "nixl_backends": _backends,
}


def _has_cuda() -> bool:
    """Whether this host has a GPU driver (NVIDIA's, or ROCm's, which torch calls cuda too),
    without initializing CUDA in this process."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/kfd"))


def cpu_capacity(val: Mapping[str, Any]) -> int | None:
    """The cpu tier of a PD config whose storage asks for none (the production stack's
    ``LMCACHE_LOCAL_CPU=False``, ``LMCACHE_MAX_LOCAL_CPU_SIZE=0``): received KV lives in the
    top tier, so it gets ``pd_buffer_size`` (1 GiB if unset); ``None`` with PD off."""
    return (val.get("pd_buffer_size") or DEFAULT_PD_BUFFER) if val.get("enable_pd") else None


def translate_pd(settings: Mapping[str, Any], val: Mapping[str, Any],
                 put: Callable[[str, Any, str], None]) -> None:
    """``put(path, value, upstream key)`` for each PD key of ``settings`` (upstream key ->
    :class:`~lmcache.upstream.Setting`; ``val``: the converted values)."""

    if val.get("nixl_backends") is not None:
        put("transfer.nixl_backends", val["nixl_backends"], "nixl_backends")
    if val.get("skip_last_n_tokens") is not None:
        put("vllm.skip_last_n_tokens", val["skip_last_n_tokens"], "skip_last_n_tokens")
    if not val.get("enable_pd"):
        unused = [settings[k].alias or k for k in _GATED if k in settings]
        if unused:
            warn_once("upstream:pd-off", f"LMCache PD keys ({', '.join(unused)}) have no effect: enable_pd is not true")
        return
    if val.get("pd_role") is None:
        raise ConfigError("pd_role", "is required when enable_pd is true: sender, receiver or both",
                          settings["enable_pd"].source)
    put("pd.role", val["pd_role"], "pd_role")
    for key, path in (("pd_peer_host", "pd.peer_host"), ("pd_peer_init_port", "pd.peer_init_port"),
                      ("pd_peer_alloc_port", "pd.peer_alloc_port"), ("pd_proxy_host", "pd.proxy_host"),
                      ("pd_proxy_port", "pd.proxy_port"), ("pd_buffer_size", "transfer.buffer_size")):
        if val.get(key) is not None:
            put(path, val[key], key)
    if val.get("pd_skip_proxy_notification") is not None:
        put("pd.notify", not val["pd_skip_proxy_notification"], "pd_skip_proxy_notification")
    if "pd_allocation_timeout_sec" in val:
        wait = val["pd_allocation_timeout_sec"]
        if wait > MAX_ALLOC_WAIT:
            warn_once("upstream:pd_allocation_timeout_sec",
                      f"LMCache pd_allocation_timeout_sec {wait:g}: {MAX_ALLOC_WAIT:g} s here (transfer.alloc_wait); "
                      "a full buffer is never retried forever here")
            wait = MAX_ALLOC_WAIT
        put("transfer.alloc_wait", wait, "pd_allocation_timeout_sec")
    device = val.get("pd_buffer_device")
    if device and device.lower().startswith("cuda") and not _has_cuda():
        warn_once("upstream:pd_buffer_device", f"LMCache pd_buffer_device {device}: no CUDA on this host; "
                                               "the PD buffer is host memory here")
