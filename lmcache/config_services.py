"""The config sections of lmcache's network services (see :mod:`lmcache.config`): the
instance API, the controller worker, the P2P endpoint, the PD transfer endpoint and the PD
role. Each is a dataclass of :func:`~lmcache.settings.option` fields, one field of
:class:`lmcache.config.Config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from . import settings as check
from .auth import parse_tenants
from .errors import ConfigError
from .settings import option, show


@dataclass
class ApiConfig:
    """The instance API (see :mod:`lmcache.plugins.services.api`): off unless ``enabled``.

    ``port: 0`` picks a free port (``CacheEngine.api_url`` tells which); ``token``, when
    set, must be sent as ``Authorization: Bearer <token>`` on every request; ``timeout``
    bounds the time one whole request may take to arrive; ``max_connections`` bounds the
    connections served at once (one more is answered 503). ``tenants`` (``{namespace: token |
    [tokens]}``) adds tokens scoped to one namespace each (see :mod:`lmcache.auth`).
    ``allowed_hosts`` names the ``Host`` names it answers to besides IP addresses,
    ``localhost`` and the bound name (``name``, ``.domain``, ``*``; a guard against DNS
    rebinding, see :class:`lmcache.server.http.RequestGuard`).
    """

    enabled: bool = option(False, check.boolean, shorthand=bool)
    host: str = option("127.0.0.1", check.text)
    port: int = option(0, check.port)
    token: str | None = option(None, check.token, secret=True, env=True)
    timeout: float = option(10.0, check.seconds())
    tenants: dict[str, tuple[str, ...]] = option({}, parse_tenants, secret=True)
    max_connections: int = option(64, check.integer(1))
    allowed_hosts: list[str] = option([], lambda key, v, src: _host_names(key, v, src))

    def validate(self, source: str | None) -> None:
        """A tenant token may not be the admin token, whichever source set each."""
        parse_tenants("api.tenants", self.tenants, source, self.token)


def _host_names(key: str, v: Any, src: str | None) -> list[str]:
    from .server.http import check_allowed_hosts

    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, list):
        raise ConfigError(key, f"expected a list of host names, got {show(v)}", src)
    try:
        return list(check_allowed_hosts(items))
    except ValueError as exc:
        raise ConfigError(key, str(exc), src) from None


def _http_url(key: str, url: Any, src: str | None) -> str:
    try:
        parts = urlsplit(url) if isinstance(url, str) else None
        ok = parts is not None and parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(key, f"expected http://HOST:PORT or null, got {show(url)}", src)
    return url.rstrip("/")


_MAX_CONTROLLER_URLS = 16


def _controller_urls(key: str, v: Any, src: str | None) -> str:
    """One controller URL, a comma-separated string or a YAML list of them (replicas, tried
    in turn by :class:`~lmcache.plugins.services.controller_client.ControllerClient`): kept as one
    comma-separated string; an entry that is not ``http(s)://HOST:PORT`` is named."""
    items = v.split(",") if isinstance(v, str) else v if isinstance(v, list) else None
    if not items or len(items) > _MAX_CONTROLLER_URLS:
        raise ConfigError(key, f"expected http://HOST:PORT, or a list of 1-{_MAX_CONTROLLER_URLS} of them "
                               f"(comma-separated or a YAML list), got {show(v)}", src)
    urls = [_http_url(key, u.strip() if isinstance(u, str) else u, src) for u in items]
    return ",".join(dict.fromkeys(urls))


@dataclass
class ControllerConfig:
    """The controller worker (see :mod:`lmcache.plugins.services.controller`): off unless ``url``
    is set (``controller: http://...`` is short for ``{url: ...}``). ``url`` may name
    several controller replicas, comma-separated or as a YAML list: every call goes to
    the one that answered last and fails over to the next when it does not answer or
    answers 502/503 (kept as one comma-separated string).

    The worker registers this instance with the controller at ``url``, heartbeats every
    ``heartbeat_interval`` seconds and reports admit/evict events in batches of at most
    ``batch_size`` (queued up to ``queue_size``; beyond that, or while the controller is
    down, events are dropped and a full snapshot follows when it answers again).
    ``timeout`` bounds every call. ``instance_id`` defaults to ``<host>-<pid>-<random>``.
    """

    url: str | None = option(None, check.optional(_controller_urls), shorthand=str)
    token: str | None = option(None, check.token, secret=True, env=True)
    instance_id: str | None = option(None, check.optional(check.name))
    heartbeat_interval: float = option(2.0, check.seconds(minimum=0.05))  # a tiny one is a busy loop
    timeout: float = option(2.0, check.seconds())
    batch_size: int = option(1000, check.integer(1))
    queue_size: int = option(100_000, check.integer(1))


@dataclass
class P2PConfig:
    """Peer-to-peer transfer (see :mod:`lmcache.plugins.services.p2p`).

    ``enabled`` runs this instance's peer endpoint: an ``lmcache server`` on
    ``host:port`` (``port: 0`` picks a free one) whose store is this engine's own tiers,
    so peers fetch chunks from it and prefill instances push KV into it. ``fetch``: on a
    local miss, ask the controller (``controller.url``) who holds the missing chunks and
    fetch them from that peer's endpoint. ``token`` is the cluster's shared peer token:
    required by this endpoint and sent to peers. ``timeout`` bounds every peer call and
    the controller lookup; any failure is a miss.
    """

    enabled: bool = option(False, check.boolean, shorthand=bool)
    host: str = option("127.0.0.1", check.text)
    port: int = option(0, check.port)
    token: str | None = option(None, check.token, secret=True, env=True)
    timeout: float = option(2.0, check.seconds())
    fetch: bool = option(True, check.boolean)


def _names(key: str, v: Any, src: str | None) -> list[str]:
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, list) or not items or len(items) > 16:
        raise ConfigError(key, f"expected a list of 1-16 names, got {show(v)}", src)
    return [check.name(f"{key}[{j}]", n.strip() if isinstance(n, str) else n, src) for j, n in enumerate(items)]


@dataclass
class TransferConfig:
    """The transfer endpoint of ``transfer_channel`` (see :mod:`lmcache.transfer` and
    :mod:`lmcache.plugins.services.transfer`): how prefill->decode moves a request's KV
    chunks between two instances' memory pools.

    The endpoint listens on ``host:port`` (``port: 0`` picks a free one) for the control
    messages of peers (allocate, commit, abort, pull), which must prove ``token`` (the
    cluster's shared transfer token) first. ``buffer_size``: bytes of chunks in flight
    into this instance at most (``null``: half the memory pool); an allocation that does
    not fit is answered "full", and a sender retries for ``alloc_wait`` seconds, then
    gives up (never an endless retry). ``slot_timeout``: seconds an allocation (or an
    offer to pull) lives without commit; then it is freed and nothing of it is committed.
    ``timeout`` bounds every control call. ``verify``: ``auto`` (the channel's own:
    ``full`` over tcp, ``sample`` over nixl), ``full``, ``sample``, ``off``.
    ``nixl_backends``: the NIXL backends to start (LMCache's key; ``[UCX]``).
    ``advertise_host``: the host peers use to reach this endpoint (``null``: derived at run time).
    ``push_by``: how a push (LMCache's PD flow) moves the bytes: ``read`` (the receiver
    reads them from the sender's pool where the channel reads one-sidedly, nixl, and the
    receiver answers ``fetch``; otherwise as ``write``) or ``write`` (the sender writes).
    ``thread_nice``: how much higher than the engine's the transfer threads run (the
    endpoint's, a sender's pushes, a decoder's pulls: a nice value lower by that much),
    where the process may raise a thread's priority (root or CAP_SYS_NICE; elsewhere one
    line at info and the engine's priority); 0 leaves them alone.
    """

    host: str = option("127.0.0.1", check.text)
    port: int = option(0, check.port)
    advertise_host: str | None = option(None, check.optional(check.text))
    token: str | None = option(None, check.token, secret=True, env=True)
    buffer_size: int | None = option(None, check.optional(check.size()))
    slot_timeout: float = option(30.0, check.seconds(minimum=0.05))
    alloc_wait: float = option(5.0, check.seconds())
    timeout: float = option(5.0, check.seconds())
    verify: str = option("auto", check.choice("auto", "full", "sample", "off"))
    nixl_backends: list[str] = option(["UCX"], lambda k, v, s: _names(k, v, s))
    push_by: str = option("read", check.choice("read", "write"))
    thread_nice: int = option(-5, check.rule(lambda v: -20 <= v <= 0, "must be between -20 and 0, got {}",
                                             after=check.integer(-20)))


_PEER_PORT = check.rule(lambda v: v <= 65535, "must be <= 65535, got {}", after=check.integer(1))


def _ports(key: str, v: Any, src: str | None) -> list[int]:
    """A port, a list of ports or a comma-separated string of them (``"7300,7301"``)."""
    items = [] if v is None else [p for p in v.split(",") if p.strip()] if isinstance(v, str) else \
        v if isinstance(v, list) else [v]
    if len(items) > 1024:
        raise ConfigError(key, f"expected a port, a list of ports or \"7300,7301\", got {show(v)}", src)
    return [_PEER_PORT(key, int(p) if isinstance(p, str) and p.strip().isdigit() else p, src) for p in items]


@dataclass
class PDConfig:
    """Prefill->decode disaggregation (PD; see :mod:`lmcache.plugins.services.transfer`): this
    instance's role, over the endpoint of ``transfer_channel`` (the ``transfer`` section;
    ``nixl`` when PD is on and no channel is named). ``pd: receiver`` is short for
    ``{role: receiver}``.

    ``role``: ``off`` (no PD), ``sender`` (a prefiller: sends each request's KV), ``receiver``
    (a decoder: takes it in) or ``both``. A receiver's transfer endpoint binds to
    ``peer_host`` (LMCache's ``pd_peer_host``; ``0.0.0.0`` for every interface); TP rank r
    listens on ``peer_init_port[r]`` (empty: ``transfer.port``). ``peer_alloc_port`` is
    accepted for LMCache's configs (the endpoint uses one port per rank, the init port).
    A sender tells LMCache's proxy (ZMQ, ``proxy_host:proxy_port``) that a request's KV was
    sent, unless ``notify`` is false (LMCache's ``pd_skip_proxy_notification``), waiting
    ``notify_timeout`` seconds at most. A decoder waits ``recv_timeout`` seconds at most
    for a request's KV, then recomputes it; a prefiller holds a request's KV ``offer_ttl``
    seconds for a decoder to pull (vLLM's ``kv_transfer_params`` flow).
    """

    role: str = option("off", check.choice("off", "sender", "receiver", "both"), shorthand=str)
    peer_host: str = option("127.0.0.1", check.text)
    peer_init_port: list[int] = option([], _ports)
    peer_alloc_port: list[int] = option([], _ports)
    proxy_host: str | None = option(None, check.optional(check.text))
    proxy_port: int | None = option(None, check.optional(_PEER_PORT))
    notify: bool = option(True, check.boolean)
    notify_timeout: float = option(2.0, check.seconds())
    recv_timeout: float = option(30.0, check.seconds())
    offer_ttl: float = option(120.0, check.seconds())
