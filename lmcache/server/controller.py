"""The controller service: which instance holds which chunks, for KV-aware routers.

A bounded ``ThreadingHTTPServer`` (like the instance API,
:mod:`lmcache.plugins.services.api`, whose request plumbing, :mod:`lmcache.server.http`,
it shares: JSON bodies of at most 1 MiB, fields checked by name, a timeout for slow
clients) bound to ``127.0.0.1`` unless told otherwise. With a token set, every
call, the workers' included, must carry ``Authorization: Bearer <token>`` (compared in
constant time). Tenant tokens (``tenants``: ``{namespace: token}``, see
:mod:`lmcache.auth`) are scoped to one namespace: instances, health counts and lookups
cover that namespace's instances only, an instance of another namespace is answered as
unknown (404), keys of another namespace are refused (403), a worker may register an
instance of its own namespace only, and ``clear``/``compress`` without keys act on the
tenant's entries only. The OpenAPI document is served at ``/openapi.json``.

Why an index of events and not polling: a router asks on every request, so the answer
must come from memory. Each instance's worker (:mod:`lmcache.plugins.services.controller`)
registers (with its chunking, so the controller can hash a router's tokens exactly as
that instance does), heartbeats, and reports batched admit/evict events; the index maps
a chunk key to the instances holding it and in which tiers. An instance whose heartbeats
stop drops out of lookups after ``instance_timeout`` seconds, and its keys are forgotten
after ``expire_after``; a worker that lost events (or finds the controller restarted)
registers again, which resets what the controller knew of it, and resends a snapshot.

Commands (``clear``, ``pin``, ``unpin``, ``compress``, ``decompress``) go to the
instance's own API with the token the worker registered, and are answered when the
instance answered. Which ``api_url`` a registration may name, and which of an instance's
answers are passed on, is :mod:`lmcache.server.reach`; the ``Host`` and ``Origin``
checks are :class:`lmcache.server.http.RequestGuard`. ``move`` tells the source instance
(through its API's ``/v1/push``) to send the chunks to the destination instance, named
by its id: the source resolves it to its peer endpoint (``peer_url``, registered by instances with ``p2p.enabled``)
and the endpoint must prove it knows the cluster's peer token and announce that id, so a
``peer_url`` registered with a tenant token that points elsewhere gets nothing. It
answers when the source answered, i.e. when the destination has stored them; the
source tier keeps them unless ``remove_source``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any
from urllib.parse import urlsplit

from .. import web
from .http import BoundedHTTPServer, HTTPError, JSONHandler, RequestGuard
from ..auth import ADMIN, Credentials, Unauthorized
from ..errors import AdminError, ConfigError, NotFoundError, UnreachableError
from .index import (
    DEFAULT_MAX_INSTANCES_PER_TENANT, DEFAULT_MAX_KEYS_PER_INSTANCE, MAX_KEY_LEN, IndexBase, Instance, own_keys,
)
from .index_memory import Index

log = logging.getLogger(__name__)

DEFAULT_PORT = 9000

_S, _I, _B, _L = (str,), (int,), (bool,), (list,)
# path -> (fields: accepted JSON types, required fields)
_BODIES: dict[str, tuple[dict[str, tuple[type, ...]], tuple[str, ...]]] = {
    "/v1/register": (
        {"instance_id": _S, "api_url": _S, "api_token": _S, "namespace": _S, "model": _S, "kv_signature": _S,
         "chunk_size": _I, "hash_algorithm": _S, "save_unfull_chunk": _B, "tiers": _L,
         "heartbeat_interval": (int, float), "pid": _I, "version": _S, "peer_url": _S, "tier_stats": _L, "session": _S},
        ("instance_id", "namespace", "model", "chunk_size", "tiers"),
    ),
    "/v1/heartbeat": (
        {"instance_id": _S, "session": _S, "kv_signature": _S, "dropped_events": _I, "tier_stats": _L},
        ("instance_id", "session"),
    ),
    "/v1/events": ({"instance_id": _S, "session": _S, "events": _L}, ("instance_id", "session", "events")),
    "/v1/deregister": ({"instance_id": _S, "session": _S}, ("instance_id", "session")),
    "/v1/lookup": (
        {"tokens": _L, "chunk_hashes": _L, "keys": _L, "text": _S, "num_tokens": _I, "namespace": _S, "model": _S},
        (),
    ),
    "/v1/move": (
        {"src_instance": _S, "src_tier": _S, "dst_instance": _S, "dst_tier": _S, "tokens": _L, "keys": _L,
         "remove_source": _B},
        ("src_instance", "src_tier", "dst_instance", "dst_tier"),
    ),
    "/v1/clear": ({"instance": _S, "tier": _S, "tokens": _L, "keys": _L, "all": _B}, ("instance",)),
    "/v1/pin": ({"instance": _S, "tier": _S, "tokens": _L, "keys": _L}, ("instance",)),
    "/v1/unpin": ({"instance": _S, "tier": _S, "tokens": _L, "keys": _L}, ("instance",)),
    "/v1/compress": ({"instance": _S, "tier": _S, "codec": _S, "tokens": _L, "keys": _L}, ("instance", "tier", "codec")),
    "/v1/decompress": ({"instance": _S, "tier": _S, "tokens": _L, "keys": _L}, ("instance", "tier")),
}
_GETS = ("/v1/health", "/v1/instances", "/openapi.json")
#: GET paths with query parameters: path -> the parameters
_QUERIES = {"/v1/entries": ("instance", "tier", "offset", "limit")}
#: the longest text /v1/lookup tokenizes (characters)
MAX_TEXT = 256 * 1024


# ---------------------------------------------------------------- the server
class ControllerServer:
    """The controller service, serving on a daemon thread until :meth:`close`."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        *,
        token: str | None = None,
        tenants: dict[str, tuple[str, ...]] | None = None,
        instance_timeout: float = 10.0,
        expire_after: float | None = None,
        dispatch_timeout: float = 30.0,
        request_timeout: float = 10.0,
        max_connections: int = 64,
        max_keys_per_instance: int = DEFAULT_MAX_KEYS_PER_INSTANCE,
        max_instances_per_tenant: int = DEFAULT_MAX_INSTANCES_PER_TENANT,
        index: str = "memory",
        index_timeout: float = 2.0,
        allowed_hosts: tuple[str, ...] = (),
        instance_networks: tuple[str, ...] = (),
    ):
        """``max_keys_per_instance`` and ``max_instances_per_tenant`` cap the index
        (see :mod:`lmcache.server.index`): over them a call is answered 429.
        ``index`` is ``"memory"`` (this process) or a Valkey URL (``valkey://``,
        ``valkey+sentinel://``, ``valkey+cluster://``, see
        :mod:`lmcache.server.index_valkey`): then this process holds no index state,
        each Valkey call is bounded by ``index_timeout`` and Valkey unreachable is a 503."""
        expire = expire_after if expire_after is not None else max(300.0, 6 * instance_timeout)
        caps = {"max_keys_per_instance": max_keys_per_instance, "max_instances_per_tenant": max_instances_per_tenant}
        self.index: IndexBase
        if index == "memory":
            self.index = Index(instance_timeout, expire, **caps)
        else:
            from .index_valkey import ValkeyIndex, parse_url

            parse_url(index)  # a bad URL: ConfigError naming it, before anything starts
            self.index = ValkeyIndex(index, instance_timeout, expire, timeout=index_timeout, **caps)
        self.dispatch_timeout = dispatch_timeout
        self.creds = Credentials(token, tenants)
        from .reach import InstancePolicy

        try:  # which api_url hosts a registration may name; which Host names it answers to (lmcache.server.http)
            self.reach = InstancePolicy(instance_networks)
            guard = RequestGuard(host, allowed_hosts, token_required=not self.creds.open)
        except ValueError as exc:
            raise ConfigError("controller", str(exc)) from None
        handler = type("Handler", (_ControllerHandler,), {"ctl": self, "timeout": request_timeout, "guard": guard})
        try:
            self.server = BoundedHTTPServer((host, port), handler, max_connections)
        except OSError as exc:
            raise ConfigError("controller port", f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        h, p = self.server.server_address[:2]
        self.host = h if ":" not in str(h) else f"[{h}]"
        self.port = int(p)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, name="lmcache-controller", daemon=True
        )
        self._thread.start()
        self._reaper = threading.Thread(target=self._reap, name="lmcache-controller-reaper", daemon=True)
        self._reaper.start()
        log.info("lmcache controller listening on %s", self.url)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _reap(self) -> None:
        while not self._stop.wait(1.0):
            self.index.expire()  # the valkey index: nothing to do, Valkey expires its own keys

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)
        try:
            self.index.close()
        except HTTPError:
            pass  # an unreachable index has nothing to release

    def __enter__(self) -> ControllerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def scope(self, header: str | None) -> str | None:
        """The namespace the request's token is scoped to (``None``: the admin token, or
        no token configured); 401 otherwise."""
        try:
            return self.creds.check(header)
        except Unauthorized:
            raise HTTPError(
                401, "missing or wrong token: send 'Authorization: Bearer <token>'",
                {"WWW-Authenticate": 'Bearer realm="lmcache-controller"'},
            ) from None

    # ------------------------------------------------------------ routes
    def get(self, path: str, tenant: str | None = ADMIN) -> Any:
        if path == "/v1/health":
            from .. import __version__

            inst = self.index.list(tenant)
            out = {"status": "ok", "service": "controller", "version": __version__, "index": self.index.kind,
                   "instances": len(inst), "healthy_instances": sum(1 for i in inst if i["healthy"])}
            if tenant is ADMIN:  # counts over every namespace
                out.update(refused_events=self.index.refused_events,
                           refused_registrations=self.index.refused_registrations)
            return out
        if path == "/v1/instances":
            return self.index.list(tenant)
        return openapi()

    def post(self, path: str, body: dict[str, Any], tenant: str | None = ADMIN) -> Any:
        ix = self.index
        if path == "/v1/register":
            return ix.register(body, tenant)
        if path == "/v1/heartbeat":
            return ix.heartbeat(body, tenant)
        if path == "/v1/events":
            return ix.events(body, tenant)
        if path == "/v1/deregister":
            return ix.deregister(body, tenant)
        if path == "/v1/lookup":
            return self.lookup_text(body, tenant) if body.get("text") is not None else ix.lookup(body, tenant)
        if path == "/v1/move":
            return self.move(body, tenant)
        return self.command(path[len("/v1/"):], body, tenant)

    def entries(self, query: dict[str, str], tenant: str | None = ADMIN) -> dict[str, Any]:
        """One page of an instance's entries (``GET /v1/entries``), asked of its API: a
        tenant's page holds its own namespace's entries only."""
        inst = self.index.target(query.get("instance") or "", "instance", tenant)
        tier = query.get("tier")
        if tier is not None and tier not in inst.tiers:
            raise HTTPError(404, f"instance {inst.instance_id!r} has no tier {tier!r}; tiers: {', '.join(inst.tiers)}")
        page = {}
        for name in ("offset", "limit"):
            raw = query.get(name)
            if raw is not None:
                if not raw.isdigit() or len(raw) > 9:
                    raise HTTPError(400, f"query parameter {name!r} must be an integer >= 0, got {raw[:20]!r}")
                page[name] = int(raw)
        page["limit"] = min(page.get("limit", 100), 1000)
        result = self._ask(inst, lambda api: api.keys(tier, namespace=tenant, **page))
        return {"instance": inst.instance_id, "tier": tier, **result}

    def lookup_text(self, body: dict[str, Any], tenant: str | None = ADMIN) -> dict[str, Any]:
        """``/v1/lookup`` of a text: tokenized by the instances themselves (their API's
        ``/v1/tokenize``, one healthy instance per model among the candidates), then
        looked up as tokens among the instances of that model; rows of every model merged."""
        text = body["text"]
        if len(text) > MAX_TEXT:
            raise HTTPError(413, f"field 'text' is longer than {MAX_TEXT} characters")
        others = [f for f in ("tokens", "chunk_hashes", "keys") if body.get(f) is not None]
        if others:
            raise HTTPError(400, f"give the field 'text' or {others[0]!r}, not both")
        ns, model = body.get("namespace"), body.get("model")
        if tenant is not ADMIN and ns is not None and ns != tenant:
            raise HTTPError(403, f"this token is scoped to namespace {tenant!r}; namespace {ns!r} is out of its reach")
        by_model: dict[str, list[str]] = {}
        for i in self.index.list(tenant if tenant is not ADMIN else ns):
            if i["healthy"] and i["api_url"] and (model is None or i["model"] == model):
                by_model.setdefault(i["model"], []).append(i["instance_id"])
        rows: list[dict[str, Any]] = []
        considered, tokenized, why = 0, 0, "no healthy instance with an API"
        for m, ids in sorted(by_model.items()):
            tokens = None
            for iid in ids[:3]:  # a few tries per model, each bounded by the dispatch timeout
                try:
                    inst = self.index.target(iid, "instance", tenant)
                    tokens = self._ask(inst, lambda api: api.request("POST", "/v1/tokenize", body={"text": text}))["tokens"]
                    break
                except (HTTPError, KeyError, TypeError) as exc:
                    why = getattr(exc, "message", str(exc))
            if tokens is None:
                continue
            tokenized += 1
            r = self.index.lookup({"tokens": tokens, "model": m, "namespace": ns}, tenant)
            considered += r["instances_considered"]
            rows.extend(dict(row, model=m, num_tokens=len(tokens)) for row in r["results"])
        if not tokenized:
            raise HTTPError(409, f"no instance could tokenize the text (last: {why}); give 'tokens' instead")
        rows.sort(key=lambda r: (-r["hit_tokens"], r["instance_id"]))
        return {"num_tokens": rows[0]["num_tokens"] if rows else None, "best": rows[0]["instance_id"] if rows else None,
                "results": rows, "instances_considered": considered}

    def _ask(self, inst: Instance, call: Any, passed: tuple[int, ...] = (400, 403, 404, 409, 501)) -> Any:
        """``call(api)`` on ``inst``'s API with the token it registered; its errors as
        the controller's (502 for an instance that does not answer or refuses us)."""
        from .reach import InstanceClient

        if inst.api_url is None:
            raise HTTPError(409, f"instance {inst.instance_id!r} has no instance API: enable it with api: {{enabled: true}}")
        try:  # answers and errors passed on only in the instance API's own shape (lmcache.server.reach)
            with InstanceClient(inst.api_url, inst.api_token, self.dispatch_timeout) as api:
                return call(api)
        except UnreachableError as exc:  # the same line whatever the reason: no port scanner (details logged)
            log.warning("instance %s (%s) unreachable: %s", inst.instance_id, inst.api_url, exc)
            raise HTTPError(502, f"instance {inst.instance_id!r} unreachable (the controller's log says why)") from None
        except AdminError as exc:
            status = getattr(exc, "status", 400)
            said = getattr(exc, "api_message", None)
            if said is None:  # not the API's own error (e.g. a URL it cannot call)
                log.warning("instance %s (%s) cannot be called: %s", inst.instance_id, inst.api_url, exc)
                raise HTTPError(502, f"instance {inst.instance_id!r} unreachable (the controller's log says why)") from None
            said = said[:500]
            if status == 401:
                log.warning("instance %s (%s) refused the controller's call: %s", inst.instance_id, inst.api_url, exc)
                raise HTTPError(502, f"instance {inst.instance_id!r} refused the controller: {said}") from None
            raise HTTPError(status if status in passed else 502, f"instance {inst.instance_id!r}: {said}") from None

    def move(self, body: dict[str, Any], tenant: str | None = ADMIN) -> Any:
        if body.get("tokens") is None and body.get("keys") is None:
            raise HTTPError(400, "give one of the fields 'tokens' or 'keys'")
        src = self.index.target(body["src_instance"], "src_instance", tenant)
        dst = self.index.target(body["dst_instance"], "dst_instance", tenant)
        for inst, f in ((src, "src_tier"), (dst, "dst_tier")):
            if body[f] not in inst.tiers:
                raise HTTPError(404, f"instance {inst.instance_id!r} has no tier {body[f]!r} (field {f!r}); tiers: {', '.join(inst.tiers)}")
        if src.api_url is None:
            raise HTTPError(409, f"instance {src.instance_id!r} has no instance API: enable it with api: {{enabled: true}}")
        if dst.peer_url is None:
            raise HTTPError(409, f"instance {dst.instance_id!r} runs no peer endpoint: enable it with p2p: {{enabled: true}}")
        if body.get("tokens") is not None and body.get("keys") is not None:
            raise HTTPError(400, "give the field 'tokens' or 'keys', not both")
        if body.get("keys") is not None:
            keys = body["keys"]
            for i, k in enumerate(keys):
                if not isinstance(k, str) or not k or len(k) > MAX_KEY_LEN:
                    raise HTTPError(400, f"field 'keys'[{i}] must be a key string")
            if tenant is not ADMIN:
                own_keys(tenant, keys)
        else:
            keys = self.index.keys_for(src, body["tokens"])
        # the destination by id, not by the URL it registered: the source resolves it through its own
        # controller and the endpoint must prove the peer token and announce that id (lmcache.auth)
        req = {"target": dst.instance_id, "keys": keys, "tier": body["src_tier"], "target_tier": body["dst_tier"],
               "remove_source": bool(body.get("remove_source"))}
        result = self._ask(src, lambda api: api.request("POST", "/v1/push", body=req), (400, 404, 409))
        return {"src_instance": src.instance_id, "src_tier": body["src_tier"], "dst_instance": dst.instance_id,
                "dst_tier": body["dst_tier"], "command": "move", "result": result}

    def command(self, name: str, body: dict[str, Any], tenant: str | None = ADMIN) -> dict[str, Any]:
        inst = self.index.target(body["instance"], "instance", tenant)
        if inst.api_url is None:
            raise HTTPError(409, f"instance {inst.instance_id!r} has no instance API: enable it with api: {{enabled: true}}")
        tier = body.get("tier")
        if tier is not None and tier not in inst.tiers:
            raise HTTPError(404, f"instance {inst.instance_id!r} has no tier {tier!r}; tiers: {', '.join(inst.tiers)}")
        if body.get("tokens") is not None and body.get("keys") is not None:
            raise HTTPError(400, "give the field 'tokens' or 'keys', not both")
        keys: list[str] | None = None
        if body.get("tokens") is not None:
            keys = self.index.keys_for(inst, body["tokens"])
        elif body.get("keys") is not None:
            keys = body["keys"]
            for i, k in enumerate(keys):
                if not isinstance(k, str) or not k:
                    raise HTTPError(400, f"field 'keys'[{i}] must be a key string")
            if tenant is not ADMIN:
                own_keys(tenant, keys)
        if name == "clear" and body.get("all") and keys is not None:
            raise HTTPError(400, "all cannot be combined with tokens or keys")
        if name == "clear" and keys is None and tier is None and not body.get("all"):
            raise HTTPError(400, "say what to clear: tier, tokens, keys or all: true (an empty selection clears nothing)")
        if name in ("pin", "unpin") and not keys:
            raise HTTPError(400, f"{name} needs the field 'tokens' or 'keys'")

        def run(api: Any) -> Any:
            if name == "clear":
                if keys is None:  # a tenant clears its own namespace's entries only
                    return api.clear(tier, namespace=tenant, all=tier is None)
                elif not keys:
                    return {"evicted": [], "skipped": [], "bytes": 0, "dry_run": False}
                else:
                    return api.evict(tier, keys=keys)
            elif name in ("pin", "unpin"):
                done, skipped = [], []
                for k in keys or ():
                    try:
                        r = api.pin(k, tier) if name == "pin" else api.unpin(k, tier)
                    except NotFoundError as exc:
                        skipped.append({"key": k, "reason": str(exc).split(": ", 1)[-1]})
                        continue
                    done.append({"key": k, "tiers": r.get("pinned" if name == "pin" else "unpinned", [])})
                return {name + "ned": done, "skipped": skipped}
            else:  # compress / decompress
                codec = body["codec"] if name == "compress" else "raw"
                if keys is not None and not keys:  # tokens with no whole chunk, or keys: []: nothing
                    return {"tier": tier, "codec": codec, "recoded": [], "skipped": [], "bytes_before": 0,
                            "bytes_after": 0, "dry_run": False}
                else:  # a tenant's selection, keys or not, stays in its namespace
                    return api.recode(tier, codec, keys=keys, namespace=tenant)

        # the token it registered not being the one its API wants is a 502 too
        result = self._ask(inst, run, (400, 404, 409))
        return {"instance": inst.instance_id, "command": name, "tier": tier, "result": result}


class _ControllerHandler(JSONHandler):
    ctl: ControllerServer  # set on the per-server subclass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        log.debug("controller %s - %s", self.address_string(), format % args)

    def _dispatch(self, method: str) -> None:
        try:
            path = urlsplit(self.path).path.rstrip("/") or "/"
            if web.serve(self, method, path):  # the page: public, it holds no data
                return
            tenant = self.ctl.scope(self.headers.get("Authorization"))
            if path in _GETS:
                if method != "GET":
                    raise HTTPError(405, f"{path} takes GET, not {method}", {"Allow": "GET"})
                if urlsplit(self.path).query:
                    raise HTTPError(400, f"{path} takes no query parameters")
                self._send(200, self.ctl.get(path, tenant))
            elif path in _QUERIES:
                if method != "GET":
                    raise HTTPError(405, f"{path} takes GET, not {method}", {"Allow": "GET"})
                self._send(200, self.ctl.entries(self._query(urlsplit(self.path).query, _QUERIES[path]), tenant))
            elif path in _BODIES:
                if method != "POST":
                    raise HTTPError(405, f"{path} takes POST, not {method}", {"Allow": "POST"})
                fields, required = _BODIES[path]
                body = self._body(fields, required)
                if path == "/v1/register" and body.get("api_url") is not None:  # one it may call (controller.reach)
                    body["api_url"] = self.ctl.reach.admit(body["api_url"], self.client_address[0])
                self._send(200, self.ctl.post(path, body, tenant))
            else:
                raise HTTPError(404, f"no such endpoint: {method} {path}")
        except HTTPError as exc:
            self._error(exc.status, exc.message, exc.headers)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:
            log.exception("controller: %s %s failed", method, self.path)
            self._error(500, f"internal error: {type(exc).__name__}: {exc}")


# ---------------------------------------------------------------- OpenAPI
_DOCS = {
    "/v1/register": "A worker registers its instance (resets what the controller knew of it); answers a session.",
    "/v1/heartbeat": "A worker's heartbeat; 404 means: register again.",
    "/v1/events": "A worker's batch of [op, tier, key] events, op 'admit' or 'evict'; 404 means: register again.",
    "/v1/deregister": "A worker leaves (its instance drops out of lookups at once).",
    "/v1/lookup": "Which healthy instances hold the longest cached prefix of tokens (or chunk hashes, or keys, or a text: "
                  "tokenized by an instance of each model through its API's /v1/tokenize). Over a valkey+sentinel:// "
                  "index, while the primary is away the answer is read from a replica and carries stale: true and "
                  "stale_s (seconds: how long before now the copy it read was last known current).",
    "/v1/move": "Copy (or, with remove_source, move) chunks from an instance's tier into another instance's tier "
                 "over the peer protocol; answered when the destination stored them.",
    "/v1/clear": "Evict an instance's entries (of a tier; of tokens' chunks; every entry only with all: true) "
                 "through its API.",
    "/v1/pin": "Pin the chunks of tokens (or keys) in an instance through its API.",
    "/v1/unpin": "Unpin the chunks of tokens (or keys) in an instance.",
    "/v1/compress": "Re-encode entries of an instance's byte tier with a codec.",
    "/v1/decompress": "Re-encode entries of an instance's byte tier with the raw codec.",
}
_JSON_TYPES = {str: {"type": "string"}, int: {"type": "integer"}, float: {"type": "number"},
               bool: {"type": "boolean"}, list: {"type": "array"}}


def openapi() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the controller's HTTP API."""
    from .. import __version__

    err = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    paths: dict[str, Any] = {
        "/v1/health": {"get": {"summary": "Liveness and instance counts", "responses": {"200": {"description": "ok"}}}},
        "/v1/instances": {"get": {"summary": "Registered instances: healthy, last heartbeat, tiers, keys, and "
                                             "tier_stats (per tier: the usage and counters its worker last reported)",
                                  "responses": {"200": {"description": "a list of instances"}}}},
        "/v1/entries": {"get": {
            "summary": "One page of an instance's entries (of a tier), asked of its API; a tenant token sees its "
                       "namespace's entries only",
            "parameters": [{"name": n, "in": "query", "required": n == "instance", "schema": {"type": t}}
                           for n, t in (("instance", "string"), ("tier", "string"), ("offset", "integer"),
                                        ("limit", "integer"))],
            "responses": {"200": {"description": "{instance, tier, entries: [{key, size, ...}], total, next_offset}"},
                          "404": err, "409": err, "502": err}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI"}}}},
        "/": {"get": {"summary": "The operator page (HTML; its files at /static/app.js and /static/app.css): public, "
                                 "it holds no data and reads the endpoints here with the token typed into it",
                      "security": [], "responses": {"200": {"description": "text/html"}}}},
    }
    for path, (fields, required) in _BODIES.items():
        props = {}
        for name, types in fields.items():
            alts = [_JSON_TYPES[t] for t in types]
            props[name] = alts[0] if len(alts) == 1 else {"oneOf": alts}
        schema = {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}
        paths[path] = {"post": {
            "summary": _DOCS[path],
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {"200": {"description": "done"}, "400": err, "401": err, "403": err, "404": err, "409": err,
                          "413": err, "415": err, "501": err, "502": err},
        }}
    return {
        "openapi": "3.1.0",
        "info": {"title": "lmcache controller", "version": __version__},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": {"type": "object", "properties": {"error": {"type": "string"}, "status": {"type": "integer"}}}},
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }


__all__ = ["ControllerServer", "Index", "Instance", "openapi", "DEFAULT_PORT"]
