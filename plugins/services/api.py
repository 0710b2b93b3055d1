"""The instance API: a small HTTP/JSON server inside a cache engine.

Off unless the config says ``api: {enabled: true}``; the engine starts it as the ``api``
service (a ``ThreadingHTTPServer`` on a daemon thread) and :meth:`CacheEngine.close` stops it.
Bound to ``127.0.0.1`` by default; ``port: 0`` picks a free port
(``CacheEngine.api_url``). With ``token`` set, every request must carry
``Authorization: Bearer <token>`` (compared in constant time), ``/metrics`` included.
``tenants`` (``{namespace: token}``) adds tokens scoped to one namespace
(:mod:`lmcache.auth`): with one, ``/v1/keys``, ``/v1/pins`` and ``/v1/tiers`` show that
namespace's entries only, evict/clear/recode act on them only, a key or namespace of
another tenant is refused with 403, ``/v1/push`` takes as ``target`` only an instance id
that the controller registered in the tenant's namespace (an ``lm://`` address is 403:
a request never chooses where this instance connects), and ``/v1/stats``,
``/v1/config`` and ``/metrics`` (which cover every namespace) need the admin token.

=======  ================  ==================================================
method   path              what
=======  ================  ==================================================
GET      /v1/health        ``{"status": "ok", "version": ...}``
GET      /v1/tiers         per tier: backend, entries, bytes, counters, hit rate
GET      /v1/stats         ``CacheEngine.stats()``
GET      /v1/config        effective config and the source of each value
GET      /v1/keys          entries, paged: ``?tier=&namespace=&model=&offset=&limit=``
GET      /v1/pins          the pins made through the API
POST     /v1/evict         ``{tier, keys | bytes | older_than | all, namespace, model, dry_run}``
POST     /v1/clear         ``{tier, namespace, all}``: every entry (of the tier, of the namespace; of every tier with ``all: true``), pins dropped; ``{}`` is 400
POST     /v1/pin           ``{key, tier}``
POST     /v1/unpin         ``{key, tier}``
POST     /v1/recode        ``{tier, codec, keys, namespace, model, dry_run}``: re-encode in place
POST     /v1/push          ``{target, tokens | keys, tier, target_tier, remove_source}``: send entries to a peer
POST     /v1/tokenize      ``{text}``: ``{tokens, model}`` with the model's tokenizer (501 when no connector gave one)
GET      /                 the operator page (:mod:`lmcache.web`; public, it holds no data), ``/static/app.{js,css}``
GET      /metrics          Prometheus text format (needs ``prometheus_client``)
=======  ================  ==================================================

Errors are JSON ``{"error": "...", "status": n}``: 400 for a malformed request (the
message names the field), 401 for a missing or wrong token, 403 for what a tenant token
may not reach (and, before any route, for a ``Host`` name it does not answer to with no
token set, or a write from another ``Origin``: :class:`lmcache.server.http.RequestGuard`,
``api.allowed_hosts``), 404 for an unknown path,
tier or key, 405 for a wrong method, 413 for a body over 1 MiB, 503 when
``api.max_connections`` connections are open already. A client that does not finish
sending its whole request (line, headers and body) within ``api.timeout`` seconds is
disconnected, however slowly its bytes trickle in.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlsplit

from lmcache import web
from lmcache.auth import ADMIN, Credentials, Unauthorized, foreign
from lmcache.config import ApiConfig
from lmcache.errors import AdminError, ConfigError
from lmcache.server.http import BoundedHTTPServer, HTTPError, JSONHandler, RequestGuard

if TYPE_CHECKING:  # pragma: no cover
    from lmcache.admin import Admin
    from lmcache.config import Config
    from lmcache.services import EngineView

log = logging.getLogger(__name__)

# field -> accepted JSON types, per POST endpoint
_EVICT_FIELDS = {
    "tier": (str,),
    "keys": (list,),
    "bytes": (int, str),
    "older_than": (int, float, str),
    "all": (bool,),
    "namespace": (str,),
    "model": (str,),
    "dry_run": (bool,),
}
_BODIES: dict[str, tuple[dict[str, tuple[type, ...]], tuple[str, ...]]] = {
    "/v1/evict": (_EVICT_FIELDS, ()),
    "/v1/clear": ({"tier": (str,), "namespace": (str,), "all": (bool,)}, ()),
    "/v1/pin": ({"key": (str,), "tier": (str,)}, ("key",)),
    "/v1/unpin": ({"key": (str,), "tier": (str,)}, ("key",)),
    "/v1/recode": (
        {"tier": (str,), "codec": (str,), "keys": (list,), "namespace": (str,), "model": (str,),
         "codec_options": (dict,), "dry_run": (bool,)},
        ("tier", "codec"),
    ),
    "/v1/push": (
        {"target": (str,), "tokens": (list,), "keys": (list,), "tier": (str,), "target_tier": (str,),
         "remove_source": (bool,)},
        ("target",),
    ),
    "/v1/tokenize": ({"text": (str,)}, ("text",)),
}
#: the longest text ``/v1/tokenize`` takes (characters)
MAX_TEXT = 256 * 1024
_QUERIES = {
    "/v1/keys": ("tier", "namespace", "model", "offset", "limit"),
    "/v1/tiers": (),
    "/v1/stats": (),
    "/v1/config": (),
    "/v1/health": (),
    "/v1/pins": (),
    "/metrics": (),
}


class ApiServer:
    """Serves an :class:`~lmcache.admin.Admin` over HTTP until :meth:`close`."""

    def __init__(self, admin: Admin, cfg: ApiConfig):
        self.admin = admin
        self.cfg = cfg
        self.creds = Credentials(cfg.token, cfg.tenants)
        self._metrics: tuple[Any, Callable[[Any], bytes], str] | None = None
        self._metrics_lock = threading.Lock()
        # Host and Origin checked before any route (DNS rebinding, cross-origin writes: lmcache.server.http)
        guard = RequestGuard(cfg.host, cfg.allowed_hosts, token_required=not self.creds.open)
        handler = type("Handler", (_Handler,), {"api": self, "timeout": cfg.timeout, "guard": guard})
        try:
            self.server = BoundedHTTPServer((cfg.host, cfg.port), handler, cfg.max_connections)
        except OSError as exc:
            raise ConfigError(
                "api.port", f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}"
            ) from None
        host, port = self.server.server_address[:2]
        self.host = host if ":" not in str(host) else f"[{host}]"
        self.port = int(port)
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, name="lmcache-api", daemon=True
        )
        self._thread.start()
        log.info("lmcache instance API listening on %s", self.url)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------ helpers
    def scope(self, header: str | None) -> str | None:
        """The namespace the request's token is scoped to, ``None`` for the admin token
        (or when no token is configured); :class:`HTTPError` 401 otherwise."""
        try:
            return self.creds.check(header)
        except Unauthorized:
            raise HTTPError(
                401,
                "missing or wrong token: send 'Authorization: Bearer <token>'",
                {"WWW-Authenticate": 'Bearer realm="lmcache"'},
            ) from None

    def metrics(self) -> tuple[bytes, str]:
        with self._metrics_lock:
            if self._metrics is None:
                try:
                    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
                except ImportError:
                    raise HTTPError(
                        501, "/metrics needs the Python package 'prometheus_client': pip install 'lmcache[api]'"
                    ) from None
                registry = CollectorRegistry(auto_describe=False)  # this engine's own, not the global one
                registry.register(_Collector(self.admin))
                self._metrics = (registry, generate_latest, CONTENT_TYPE_LATEST)
            registry, generate, ctype = self._metrics
        return generate(registry), ctype

    def tokenize(self, text: str) -> dict[str, Any]:
        """``{"tokens": [...], "model": ...}``: ``text`` tokenized as the engine's connector
        does it (501 when the connector gave no tokenizer; 413 over :data:`MAX_TEXT`)."""
        if len(text) > MAX_TEXT:
            raise HTTPError(413, f"field 'text' is longer than {MAX_TEXT} characters")
        e = self.admin.engine
        encode = e.tokenize if e is not None else None
        if encode is None:
            raise HTTPError(501, "this instance has no tokenizer (its connector gave none); look up token ids instead")
        tokens = [int(t) for t in encode(text)]
        return {"tokens": tokens, "model": self.admin.config.model if self.admin.config is not None else None}

    # ------------------------------------------------------------ routes
    def get(self, path: str, query: dict[str, str], tenant: str | None = ADMIN) -> Any:
        a = self.admin
        if path == "/v1/health":
            from lmcache import __version__

            e = a.engine
            return {"status": "ok", "service": "instance", "version": __version__, "live": a.live,
                    "instance_id": e.instance_id if e is not None else None,
                    "model": a.config.model if a.config is not None else None,
                    "namespace": a.config.namespace if a.config is not None else None}
        if path == "/v1/tiers":
            return a.tiers() if tenant is ADMIN else a.tiers(namespace=tenant)
        if path in ("/v1/stats", "/v1/config", "/metrics"):
            _admin_only(tenant, path)
        if path == "/v1/stats":
            return a.stats()
        if path == "/v1/config":
            return a.config_report()
        if path == "/v1/pins":
            pins = a.pins()
            return pins if tenant is ADMIN else [p for p in pins if _namespace_of(p["key"]) == tenant]
        if path == "/v1/keys":
            return a.keys(
                query.get("tier"),
                namespace=_narrow(tenant, query.get("namespace")),
                model=query.get("model"),
                offset=_int_param(query, "offset", 0),
                limit=_int_param(query, "limit", 1000),
            )
        raise HTTPError(404, f"no such endpoint: GET {path}")  # pragma: no cover - routed before

    def post(self, path: str, body: dict[str, Any], tenant: str | None = ADMIN) -> Any:
        a = self.admin
        if path == "/v1/tokenize":  # no entry is read or named: any token may
            return self.tokenize(body["text"])
        if tenant is not ADMIN:
            body = _scoped_body(path, body, tenant, a)
        if path == "/v1/evict":
            body = dict(body)
            tier = body.pop("tier", None)
            dry_run = bool(body.pop("dry_run", False))
            body.setdefault("all", False)
            if body["all"] is None:
                body["all"] = False
            return a.evict(tier, dry_run=dry_run, **body)
        if path == "/v1/clear":
            return a.clear(body.get("tier"), namespace=body.get("namespace"), all=bool(body.get("all")))
        if path == "/v1/pin":
            return a.pin(body["key"], body.get("tier"))
        if path == "/v1/unpin":
            return a.unpin(body["key"], body.get("tier"))
        if path == "/v1/recode":
            body = dict(body)
            return a.recode(body.pop("tier"), body.pop("codec"), **body)
        if path == "/v1/push":  # a tenant pushes to its namespace's registered instances only
            body = dict(body)
            return a.push(body.pop("target"), **body, namespace=None if tenant is ADMIN else tenant)
        raise HTTPError(404, f"no such endpoint: POST {path}")  # pragma: no cover


# ---------------------------------------------------------------- tenant scoping
def _admin_only(tenant: str | None, path: str) -> None:
    if tenant is not ADMIN:
        raise HTTPError(403, f"{path} needs the admin token: it covers every namespace, and this token is scoped to namespace {tenant!r}")


def _namespace_of(key: str) -> str | None:
    from lmcache.keys import CacheKey

    try:
        return CacheKey.parse(key).namespace
    except ValueError:
        return None


def _narrow(tenant: str | None, namespace: str | None) -> str | None:
    """The namespace a request may act on: the tenant's own (a different one named in
    the request is refused), or what an admin request said."""
    if tenant is ADMIN:
        return namespace
    if namespace is not None and namespace != tenant:
        raise HTTPError(403, f"this token is scoped to namespace {tenant!r}; namespace {namespace!r} is out of its reach")
    return tenant


def _own_keys(tenant: str, keys: Any, field_name: str) -> None:
    from lmcache.admin import parse_key

    items = [keys] if isinstance(keys, str) else keys
    for i, k in enumerate(items):
        ns = parse_key(k).namespace  # a malformed key: AdminError, 400
        if foreign(tenant, ns):
            where = field_name if isinstance(keys, str) else f"{field_name}[{i}]"
            raise HTTPError(403, f"field {where!r}: a key of namespace {ns!r}; this token is scoped to namespace {tenant!r}")


def _scoped_body(path: str, body: dict[str, Any], tenant: str, admin: Admin) -> dict[str, Any]:
    """A POST body as a tenant may send it: keys of its namespace only, and namespace
    selections narrowed to its own."""
    body = dict(body)
    if path in ("/v1/pin", "/v1/unpin"):
        _own_keys(tenant, body["key"], "key")
    elif path == "/v1/clear":
        if body.get("tier") is not None or body.get("namespace") is not None or body.get("all"):
            body["namespace"] = _narrow(tenant, body.get("namespace"))  # nothing selected stays a 400
    elif path == "/v1/evict":
        if body.get("keys") is not None:
            _own_keys(tenant, body["keys"], "keys")
            _narrow(tenant, body.get("namespace"))  # a foreign namespace is refused even beside keys
        else:
            body["namespace"] = _narrow(tenant, body.get("namespace"))
    elif path == "/v1/recode":
        if body.get("keys") is not None:
            _own_keys(tenant, body["keys"], "keys")
        # always narrowed, keys or not: the selection can never leave the tenant's namespace
        body["namespace"] = _narrow(tenant, body.get("namespace"))
    elif path == "/v1/push":
        if body.get("keys") is not None:
            _own_keys(tenant, body["keys"], "keys")
        if body.get("tokens") is not None:
            engine = admin.engine
            ns = engine.config.namespace if engine is not None else None
            if foreign(tenant, ns):
                raise HTTPError(403, f"this instance caches namespace {ns!r}; this token is scoped to namespace {tenant!r}")
    return body


def _int_param(query: dict[str, str], name: str, default: int) -> int:
    raw = query.get(name)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise HTTPError(400, f"query parameter {name!r} must be an integer, got {raw!r}") from None
    if v < 0:
        raise HTTPError(400, f"query parameter {name!r} must be >= 0, got {v}")
    return v


class ApiService(ApiServer):
    """The instance API as an engine service (``api.enabled``): it serves the engine's
    :class:`~lmcache.admin.Admin`."""

    @staticmethod
    def enabled(config: Config) -> bool:
        return config.api.enabled

    def __init__(self, engine: EngineView):
        super().__init__(engine.admin, engine.config.api)

    def info(self) -> None:
        return None


class _Handler(JSONHandler):
    api: ApiServer  # set on the per-server subclass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        log.debug("api %s - %s", self.address_string(), format % args)

    # ------------------------------------------------------------ plumbing
    def _dispatch(self, method: str) -> None:
        try:
            parts = urlsplit(self.path)
            path = parts.path.rstrip("/") or "/"
            if web.serve(self, method, path):  # the page: public, it holds no data
                return
            tenant = self.api.scope(self.headers.get("Authorization"))
            if path in _QUERIES:
                if method != "GET":
                    raise HTTPError(405, f"{path} takes GET, not {method}", {"Allow": "GET"})
                query = self._query(parts.query, _QUERIES[path])
                if path == "/metrics":
                    _admin_only(tenant, path)
                    text, ctype = self.api.metrics()
                    self._send(200, text, ctype)
                    return
                self._send(200, self.api.get(path, query, tenant))
            elif path in _BODIES:
                if method != "POST":
                    raise HTTPError(405, f"{path} takes POST, not {method}", {"Allow": "POST"})
                fields, required = _BODIES[path]
                body = self._body(fields, required)
                self._send(200, self.api.post(path, body, tenant))
            else:
                raise HTTPError(404, f"no such endpoint: {method} {path}")
        except HTTPError as exc:
            self._error(exc.status, exc.message, exc.headers)
        except AdminError as exc:  # 400 or 404, from the admin layer
            self._error(exc.status, str(exc))
        except (BrokenPipeError, ConnectionResetError):  # the client went away
            pass
        except Exception as exc:
            log.exception("instance API: %s %s failed", method, self.path)
            self._error(500, f"internal error: {type(exc).__name__}: {exc}")


class _Collector:
    """Prometheus metrics read from the admin's stats at each scrape."""

    def __init__(self, admin: Admin):
        self.admin = admin

    def collect(self):  # pragma: no branch - a generator
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.admin.stats()
        tiers = stats["tiers"]
        counters = [
            ("hits", "hits", "Gets that this tier served"),
            ("misses", "misses", "Gets that this tier could not serve"),
            ("bytes_in", "bytes_in", "Bytes written into this tier"),
            ("bytes_out", "bytes_out", "Bytes read from this tier by hits"),
            ("evictions", "evictions", "Entries evicted from this tier"),
            ("puts", "puts", "Entries written into this tier"),
            ("skipped_puts", "skipped_puts", "Writes that did not fit into this tier"),
            ("errors", "errors", "Backend errors of this tier"),
            ("corrupt", "corrupt", "Entries of this tier dropped because they failed their checks"),
            ("lost", "lost", "Entries a shared store no longer held when this tier came back from an outage"),
        ]
        for field, name, doc in counters:
            m = CounterMetricFamily(f"lmcache_tier_{name}", doc, labels=["tier", "backend"])
            for tname, t in tiers.items():
                m.add_metric([tname, t["backend"]], t[field])
            yield m
        gauges = [
            ("used_bytes", "used_bytes", "Bytes stored in this tier"),
            ("capacity_bytes", "capacity_bytes", "Capacity of this tier in bytes"),
            ("entries", "entries", "Entries in this tier"),
            ("pinned", "pinned_entries", "Pinned entries in this tier"),
        ]
        for field, name, doc in gauges:
            m = GaugeMetricFamily(f"lmcache_tier_{name}", doc, labels=["tier", "backend"])
            for tname, t in tiers.items():
                m.add_metric([tname, t["backend"]], t[field])
            yield m
        pool = stats.get("pool")
        if pool:
            g = GaugeMetricFamily("lmcache_pool_used_bytes", "Bytes of the memory pool in use")
            g.add_metric([], pool["used"])
            yield g
            g = GaugeMetricFamily("lmcache_pool_capacity_bytes", "Bytes of the memory pool")
            g.add_metric([], pool["capacity"])
            yield g
        h = stats.get("hierarchy")
        if h:
            for field, doc in (
                ("dropped_writes", "Lower-tier writes dropped: over the write queue's bound, their memory "
                                   "needed by the pool, or still waiting for their tier at close"),
                ("deferred_writes", "Lower-tier writes that waited for their tier to come back from an outage"),
                ("skipped_no_memory", "Chunks not stored because the memory pool was exhausted"),
                ("promotions", "Hits in a lower tier copied into an upper one"),
            ):
                c = CounterMetricFamily(f"lmcache_{field}", doc)
                c.add_metric([], h[field])
                yield c
            g = GaugeMetricFamily("lmcache_pending_writes", "Lower-tier writes waiting in the queue")
            g.add_metric([], h["pending_writes"])
            yield g


__all__ = ["ApiServer", "ApiService"]
