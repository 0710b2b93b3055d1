"""The controller service: which instance holds which chunks, for KV-aware routers.

A bounded ``ThreadingHTTPServer`` (like the instance API, :mod:`lmcache.plugins.services.api`, whose request
plumbing it shares: JSON bodies of at most 1 MiB, fields checked by name, a timeout for
slow clients) bound to ``127.0.0.1`` unless told otherwise. With a token set, every
call, the workers' included, must carry ``Authorization: Bearer <token>`` (compared in
constant time). Tenant tokens (``tenants``: ``{namespace: token}``, see
:mod:`lmcache.auth`) are scoped to one namespace: instances, health counts and lookups
cover that namespace's instances only, an instance of another namespace is answered as
unknown (404), keys of another namespace are refused (403), a worker may register an
instance of its own namespace only, and ``clear``/``compress`` without keys act on the
tenant's entries only. The OpenAPI document is served at ``/openapi.json``.

Why an index of events and not polling: a router asks on every request, so the answer
must come from memory. Each instance's worker (:mod:`lmcache.controller.worker`)
registers (with its chunking, so the controller can hash a router's tokens exactly as
that instance does), heartbeats, and reports batched admit/evict events; the index maps
a chunk key to the instances holding it and in which tiers. An instance whose heartbeats
stop drops out of lookups after ``instance_timeout`` seconds, and its keys are forgotten
after ``expire_after``; a worker that lost events (or finds the controller restarted)
registers again, which resets what the controller knew of it, and resends a snapshot.

Commands (``clear``, ``pin``, ``unpin``, ``compress``, ``decompress``) go to the
instance's own API with the token the worker registered, and are answered when the
instance answered. ``move`` tells the source instance (through its API's ``/v1/push``)
to send the chunks to the destination's peer endpoint (``peer_url``, registered by
instances with ``p2p.enabled``) and answers when the source answered, i.e. when the
destination has stored them; the source tier keeps them unless ``remove_source``.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import quote, urlsplit

from ..http import BoundedHTTPServer, HTTPError, JSONHandler
from ..auth import ADMIN, Credentials, Unauthorized, foreign
from ..errors import AdminError, ConfigError, NotFoundError, UnreachableError
from ..keys import KEY_PREFIX, TokenProcessor

log = logging.getLogger(__name__)

DEFAULT_PORT = 9000
MAX_KEY_LEN = 1024
_HEX = set("0123456789abcdef")
HASH_ALGORITHMS = ("xxh3_128", "blake2b")

_S, _I, _B, _L = (str,), (int,), (bool,), (list,)
# path -> (fields: accepted JSON types, required fields)
_BODIES: dict[str, tuple[dict[str, tuple[type, ...]], tuple[str, ...]]] = {
    "/v1/register": (
        {"instance_id": _S, "api_url": _S, "api_token": _S, "namespace": _S, "model": _S, "kv_signature": _S,
         "chunk_size": _I, "hash_algorithm": _S, "save_unfull_chunk": _B, "tiers": _L,
         "heartbeat_interval": (int, float), "pid": _I, "version": _S, "peer_url": _S},
        ("instance_id", "namespace", "model", "chunk_size", "tiers"),
    ),
    "/v1/heartbeat": (
        {"instance_id": _S, "session": _S, "kv_signature": _S, "dropped_events": _I},
        ("instance_id", "session"),
    ),
    "/v1/events": ({"instance_id": _S, "session": _S, "events": _L}, ("instance_id", "session", "events")),
    "/v1/deregister": ({"instance_id": _S, "session": _S}, ("instance_id", "session")),
    "/v1/lookup": (
        {"tokens": _L, "chunk_hashes": _L, "keys": _L, "num_tokens": _I, "namespace": _S, "model": _S},
        (),
    ),
    "/v1/move": (
        {"src_instance": _S, "src_tier": _S, "dst_instance": _S, "dst_tier": _S, "tokens": _L, "keys": _L,
         "remove_source": _B},
        ("src_instance", "src_tier", "dst_instance", "dst_tier"),
    ),
    "/v1/clear": ({"instance": _S, "tier": _S, "tokens": _L, "keys": _L}, ("instance",)),
    "/v1/pin": ({"instance": _S, "tier": _S, "tokens": _L, "keys": _L}, ("instance",)),
    "/v1/unpin": ({"instance": _S, "tier": _S, "tokens": _L, "keys": _L}, ("instance",)),
    "/v1/compress": ({"instance": _S, "tier": _S, "codec": _S, "tokens": _L, "keys": _L}, ("instance", "tier", "codec")),
    "/v1/decompress": ({"instance": _S, "tier": _S, "tokens": _L, "keys": _L}, ("instance", "tier")),
}
_GETS = ("/v1/health", "/v1/instances", "/openapi.json")


# ---------------------------------------------------------------- the index
@dataclass
class Instance:
    """One registered cache instance, as its worker described it."""

    instance_id: str
    session: str
    api_url: str | None
    api_token: str | None
    namespace: str
    model: str
    kv_signature: str | None
    chunk_size: int
    hash_algorithm: str
    save_unfull_chunk: bool
    tiers: list[str]
    heartbeat_interval: float | None
    pid: int | None
    version: str | None
    registered_at: float  # wall clock
    last_seen: float  # the service's clock (monotonic)
    last_seen_wall: float
    events: int = 0
    dropped_events: int = 0
    peer_url: str | None = None  # lm://host:port of its peer endpoint (p2p), if it runs one
    keys: dict[str, set[str]] = field(default_factory=dict)  # key -> tiers holding it

    def key_prefix(self) -> str | None:
        if self.kv_signature is None:
            return None
        return ":".join((KEY_PREFIX, self.namespace, quote(self.model, safe="-_.~"), self.kv_signature, ""))

    def public(self, now: float, timeout: float) -> dict[str, Any]:
        age = max(0.0, now - self.last_seen)
        return {
            "instance_id": self.instance_id,
            "healthy": age <= timeout,
            "last_heartbeat": self.last_seen_wall,
            "last_heartbeat_age_s": round(age, 3),
            "registered_at": self.registered_at,
            "api_url": self.api_url,
            "peer_url": self.peer_url,
            "namespace": self.namespace,
            "model": self.model,
            "kv_signature": self.kv_signature,
            "chunk_size": self.chunk_size,
            "hash_algorithm": self.hash_algorithm,
            "tiers": list(self.tiers),
            "keys": len(self.keys),
            "events": self.events,
            "dropped_events": self.dropped_events,
            "pid": self.pid,
            "version": self.version,
        }


class Index:
    """Chunk key -> {instance id -> tiers}, with the instances themselves. Thread-safe."""

    def __init__(self, instance_timeout: float, expire_after: float, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.instance_timeout = instance_timeout
        self.expire_after = expire_after
        self.clock = clock
        self.wall_clock = wall_clock
        self.lock = threading.Lock()
        self.instances: dict[str, Instance] = {}
        self.by_key: dict[str, dict[str, set[str]]] = {}
        self._processors: dict[tuple[int, str, bool], TokenProcessor] = {}

    # ------------------------------------------------------------ the workers' side
    def register(self, body: dict[str, Any], tenant: str | None = ADMIN) -> dict[str, Any]:
        iid = body["instance_id"]
        _check_name("instance_id", iid)
        _check_name("namespace", body["namespace"])
        if foreign(tenant, body["namespace"]):
            raise HTTPError(403, f"this token is scoped to namespace {tenant!r}; it cannot register an instance of namespace {body['namespace']!r}")
        if not body["model"]:
            raise HTTPError(400, "field 'model' must not be empty")
        if body["chunk_size"] <= 0:
            raise HTTPError(400, f"field 'chunk_size' must be > 0, got {body['chunk_size']}")
        algo = body.get("hash_algorithm") or "xxh3_128"
        if algo not in HASH_ALGORITHMS:
            raise HTTPError(400, f"field 'hash_algorithm' must be one of {', '.join(HASH_ALGORITHMS)}, got {algo!r}")
        tiers = body["tiers"]
        if not tiers or not all(isinstance(t, str) and t for t in tiers) or len(set(tiers)) != len(tiers):
            raise HTTPError(400, "field 'tiers' must be a non-empty list of distinct tier names")
        sig = body.get("kv_signature")
        if sig is not None:
            _check_name("kv_signature", sig)
        api_url = body.get("api_url")
        if api_url is not None:
            _check_url("api_url", api_url)
        peer = body.get("peer_url")
        if peer is not None:
            _check_url("peer_url", peer, ("lm",))
        now, wall = self.clock(), self.wall_clock()
        inst = Instance(
            instance_id=iid, session=secrets.token_hex(8), api_url=api_url, api_token=body.get("api_token"),
            namespace=body["namespace"], model=body["model"], kv_signature=sig, chunk_size=body["chunk_size"],
            hash_algorithm=algo, save_unfull_chunk=body.get("save_unfull_chunk", True), tiers=list(tiers),
            heartbeat_interval=body.get("heartbeat_interval"), pid=body.get("pid"), version=body.get("version"),
            registered_at=wall, last_seen=now, last_seen_wall=wall, peer_url=peer,
        )
        with self.lock:
            old = self.instances.get(iid)
            if old is not None and foreign(tenant, old.namespace):
                raise HTTPError(409, f"instance id {iid!r} is taken by another namespace's instance")
            self.instances.pop(iid, None)
            if old is not None:
                self._forget_keys(old)
            self.instances[iid] = inst
        log.info("instance %s registered (%s, tiers %s)%s", iid, api_url or "no API", ", ".join(tiers),
                 " again: its index was reset" if old is not None else "")
        return {"instance_id": iid, "session": inst.session, "instance_timeout": self.instance_timeout}

    def _session(self, body: dict[str, Any], tenant: str | None = ADMIN) -> Instance:
        """The caller's instance, seen now; 404 if unknown, of another tenant or an
        older session (the worker then registers again)."""
        inst = self.instances.get(body["instance_id"])
        if inst is None or foreign(tenant, inst.namespace) or not hmac.compare_digest(inst.session, body["session"]):
            raise HTTPError(404, f"unknown instance or session {body['instance_id']!r}: register again")
        inst.last_seen = self.clock()
        inst.last_seen_wall = self.wall_clock()
        return inst

    def heartbeat(self, body: dict[str, Any], tenant: str | None = ADMIN) -> dict[str, Any]:
        sig = body.get("kv_signature")
        if sig is not None:
            _check_name("kv_signature", sig)
        with self.lock:
            inst = self._session(body, tenant)
            if sig is not None:
                inst.kv_signature = sig
            if body.get("dropped_events") is not None:
                inst.dropped_events = body["dropped_events"]
        return {"ok": True}

    def events(self, body: dict[str, Any], tenant: str | None = ADMIN) -> dict[str, Any]:
        events = body["events"]
        for i, ev in enumerate(events):  # all checked before any is applied
            if not (isinstance(ev, list) and len(ev) == 3 and all(isinstance(x, str) for x in ev)):
                raise HTTPError(400, f"field 'events'[{i}] must be [op, tier, key] strings, got {json.dumps(ev)[:100]}")
            if ev[0] not in ("admit", "evict"):
                raise HTTPError(400, f"field 'events'[{i}]: op must be 'admit' or 'evict', got {ev[0]!r}")
            if not ev[2] or len(ev[2]) > MAX_KEY_LEN:
                raise HTTPError(400, f"field 'events'[{i}]: key must be 1 to {MAX_KEY_LEN} characters")
        ignored = 0
        if tenant is not ADMIN:  # a tenant's worker reports its own namespace's keys only
            kept = [ev for ev in events if _namespace_of(ev[2]) == tenant]
            ignored, events = len(events) - len(kept), kept
        with self.lock:
            inst = self._session(body, tenant)
            known = set(inst.tiers)
            for i, (_, tier, _) in enumerate(events):
                if tier not in known:
                    raise HTTPError(400, f"field 'events'[{i}]: unknown tier {tier!r}; registered: {', '.join(inst.tiers)}")
            iid = inst.instance_id
            for op, tier, key in events:
                held = inst.keys.get(key)
                if op == "admit":
                    if held is None:
                        held = inst.keys[key] = set()
                        self.by_key.setdefault(key, {})[iid] = held
                    held.add(tier)
                elif held is not None:
                    held.discard(tier)
                    if not held:
                        self._drop(inst, key)
            inst.events += len(events)
        return {"applied": len(events), "ignored": ignored} if ignored else {"applied": len(events)}

    def deregister(self, body: dict[str, Any], tenant: str | None = ADMIN) -> dict[str, Any]:
        with self.lock:
            inst = self._session(body, tenant)
            del self.instances[inst.instance_id]
            self._forget_keys(inst)
        log.info("instance %s deregistered", inst.instance_id)
        return {"ok": True}

    def _drop(self, inst: Instance, key: str) -> None:
        del inst.keys[key]
        holders = self.by_key.get(key)
        if holders is not None:
            holders.pop(inst.instance_id, None)
            if not holders:
                del self.by_key[key]

    def _forget_keys(self, inst: Instance) -> None:
        for key in list(inst.keys):
            self._drop(inst, key)

    def expire(self) -> list[str]:
        """Forget instances silent for longer than ``expire_after`` (ids returned)."""
        now = self.clock()
        gone = []
        with self.lock:
            for iid, inst in list(self.instances.items()):
                if now - inst.last_seen > self.expire_after:
                    del self.instances[iid]
                    self._forget_keys(inst)
                    gone.append(iid)
        for iid in gone:
            log.warning("instance %s: no heartbeat for %gs; forgotten", iid, self.expire_after)
        return gone

    # ------------------------------------------------------------ the routers' side
    def healthy(self, inst: Instance, now: float) -> bool:
        return now - inst.last_seen <= self.instance_timeout

    def list(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Every instance (of ``namespace`` only, if given), by id."""
        now = self.clock()
        with self.lock:
            chosen = [i for i in self.instances.values() if namespace is None or i.namespace == namespace]
            return [i.public(now, self.instance_timeout) for i in sorted(chosen, key=lambda i: i.instance_id)]

    def _processor(self, inst: Instance) -> TokenProcessor:
        k = (inst.chunk_size, inst.hash_algorithm, inst.save_unfull_chunk)
        tp = self._processors.get(k)
        if tp is None:
            tp = self._processors[k] = TokenProcessor(k[0], save_unfull_chunk=k[2], hash_algorithm=k[1])
        return tp

    def lookup(self, body: dict[str, Any], tenant: str | None = ADMIN) -> dict[str, Any]:
        given = [f for f in ("tokens", "chunk_hashes", "keys") if body.get(f) is not None]
        if len(given) != 1:
            raise HTTPError(400, "give exactly one of the fields 'tokens', 'chunk_hashes' or 'keys'")
        what = given[0]
        num_tokens = body.get("num_tokens")
        if num_tokens is not None and num_tokens < 0:
            raise HTTPError(400, f"field 'num_tokens' must be >= 0, got {num_tokens}")
        ns, model = body.get("namespace"), body.get("model")
        if tenant is not ADMIN:
            if ns is not None and ns != tenant:
                raise HTTPError(403, f"this token is scoped to namespace {tenant!r}; namespace {ns!r} is out of its reach")
            ns = tenant
        tokens = hashes = keys = None
        if what == "tokens":
            tokens = _token_array(body["tokens"])
            num_tokens = len(tokens)
        elif what == "chunk_hashes":
            hashes = _hash_list(body["chunk_hashes"])
        else:
            keys = body["keys"]
            for i, k in enumerate(keys):
                if not isinstance(k, str) or not k or len(k) > MAX_KEY_LEN:
                    raise HTTPError(400, f"field 'keys'[{i}] must be a key string, got {json.dumps(k)[:100]}")
            if tenant is not ADMIN:
                own_keys(tenant, keys)
        now = self.clock()
        with self.lock:
            candidates = [
                i for i in self.instances.values()
                if self.healthy(i, now) and (ns is None or i.namespace == ns) and (model is None or i.model == model)
            ]
        # hashing (the costly part) outside the lock, once per distinct chunking
        chunkings: dict[tuple[int, str, bool], list[tuple[int, str]]] = {}
        plans: list[tuple[Instance, list[tuple[int, str]]]] = []  # (instance, [(end token, key)])
        for inst in candidates:
            if keys is not None:
                plans.append((inst, [((j + 1) * inst.chunk_size, k) for j, k in enumerate(keys)]))
                continue
            prefix = inst.key_prefix()
            if prefix is None:  # stored nothing yet: its signature is unknown
                continue
            if tokens is not None:
                ck = (inst.chunk_size, inst.hash_algorithm, inst.save_unfull_chunk)
                if ck not in chunkings:
                    chunkings[ck] = [(c.end, c.chunk_hash) for c in self._processor(inst).chunks(tokens)]
                plans.append((inst, [(end, prefix + h) for end, h in chunkings[ck]]))
            else:
                plans.append((inst, [((j + 1) * inst.chunk_size, prefix + h) for j, h in enumerate(hashes or [])]))
        rows = []
        with self.lock:
            for inst, chain in plans:
                if self.instances.get(inst.instance_id) is not inst:
                    continue  # re-registered or gone meanwhile
                rank = {t: r for r, t in enumerate(inst.tiers)}
                per_tier: dict[str, int] = {}
                hit = chunks = 0
                worst = -1
                for end, key in chain:
                    held = inst.keys.get(key)
                    if not held:
                        break
                    best = min(held, key=lambda t: rank.get(t, len(rank)))
                    end = end if num_tokens is None else min(end, num_tokens)
                    per_tier[best] = per_tier.get(best, 0) + end - hit
                    worst = max(worst, rank.get(best, len(rank)))
                    hit = end
                    chunks += 1
                if hit:
                    rows.append({
                        "instance_id": inst.instance_id,
                        "hit_tokens": hit,
                        "hit_chunks": chunks,
                        "tier": inst.tiers[worst] if worst < len(inst.tiers) else None,
                        "tiers": per_tier,
                        "api_url": inst.api_url,
                        "peer_url": inst.peer_url,
                        "_rank": worst,
                    })
        rows.sort(key=lambda r: (-r["hit_tokens"], r["_rank"], r["instance_id"]))
        for r in rows:
            del r["_rank"]
        return {
            "num_tokens": num_tokens,
            "best": rows[0]["instance_id"] if rows else None,
            "results": rows,
            "instances_considered": len(candidates),
        }

    # ------------------------------------------------------------ dispatch support
    def target(self, iid: str, field_name: str = "instance", tenant: str | None = ADMIN) -> Instance:
        now = self.clock()
        with self.lock:
            inst = self.instances.get(iid)
        if inst is None or foreign(tenant, inst.namespace):  # another tenant's: as if unknown
            raise HTTPError(404, f"unknown instance {iid!r} (field {field_name!r})")
        if not self.healthy(inst, now):
            raise HTTPError(409, f"instance {iid!r} is not heartbeating (last seen {now - inst.last_seen:.1f}s ago)")
        return inst

    def keys_for(self, inst: Instance, tokens: Any) -> list[str]:
        prefix = inst.key_prefix()
        if prefix is None:
            raise HTTPError(409, f"instance {inst.instance_id!r} has stored nothing yet: its kv signature is unknown")
        return [prefix + c.chunk_hash for c in self._processor(inst).chunks(_token_array(tokens))]


def _namespace_of(key: str) -> str | None:
    from ..keys import CacheKey

    try:
        return CacheKey.parse(key).namespace
    except ValueError:
        return None


def own_keys(tenant: str, keys: list) -> None:
    """403 unless every key is of ``tenant``'s namespace (400 for one that is not a key)."""
    for i, k in enumerate(keys):
        ns = _namespace_of(k) if isinstance(k, str) else None
        if ns is None:
            raise HTTPError(400, f"field 'keys'[{i}] is not an lmcache key: {json.dumps(k)[:100]}")
        if ns != tenant:
            raise HTTPError(403, f"field 'keys'[{i}]: a key of namespace {ns!r}; this token is scoped to namespace {tenant!r}")


def _check_name(name: str, v: str) -> None:
    import re

    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$", v):
        raise HTTPError(400, f"field {name!r} may only contain letters, digits, '.', '_' and '-', got {v[:100]!r}")


def _check_url(name: str, v: str, schemes: tuple[str, ...] = ("http", "https")) -> None:
    parts = urlsplit(v)
    try:
        ok = parts.scheme in schemes and bool(parts.hostname) and parts.port is not None
        ok = ok and parts.path in ("", "/") and not parts.query and not parts.username
    except ValueError:
        ok = False
    if not ok:
        raise HTTPError(400, f"field {name!r} must be {schemes[0]}://HOST:PORT, got {v[:100]!r}")


def _token_array(tokens: list) -> Any:
    import numpy as np

    for i, t in enumerate(tokens):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 1 << 63:
            raise HTTPError(400, f"field 'tokens'[{i}] must be a non-negative integer token id, got {json.dumps(t)[:50]}")
    return np.asarray(tokens, dtype="<i8")


def _hash_list(hashes: list) -> list[str]:
    for i, h in enumerate(hashes):
        if not isinstance(h, str) or len(h) != 32 or not set(h) <= _HEX:
            raise HTTPError(400, f"field 'chunk_hashes'[{i}] must be 32 lowercase hex digits, got {json.dumps(h)[:50]}")
    return hashes


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
    ):
        self.index = Index(instance_timeout, expire_after if expire_after is not None else max(300.0, 6 * instance_timeout))
        self.dispatch_timeout = dispatch_timeout
        self.creds = Credentials(token, tenants)
        handler = type("Handler", (_ControllerHandler,), {"ctl": self, "timeout": request_timeout})
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
            self.index.expire()

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)

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
            return {"status": "ok", "version": __version__, "instances": len(inst),
                    "healthy_instances": sum(1 for i in inst if i["healthy"])}
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
            return ix.lookup(body, tenant)
        if path == "/v1/move":
            return self.move(body, tenant)
        return self.command(path[len("/v1/"):], body, tenant)

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
        from ..api_client import ApiClient

        req = {"target": dst.peer_url, "keys": keys, "tier": body["src_tier"], "target_tier": body["dst_tier"],
               "remove_source": bool(body.get("remove_source"))}
        try:
            with ApiClient(src.api_url, src.api_token, self.dispatch_timeout) as api:
                result = api.request("POST", "/v1/push", body=req)
        except UnreachableError as exc:
            raise HTTPError(502, f"instance {src.instance_id!r} did not answer: {exc}") from None
        except AdminError as exc:
            status = getattr(exc, "status", 400)
            if status == 401:
                raise HTTPError(502, f"instance {src.instance_id!r} refused the controller: {exc}") from None
            raise HTTPError(status if status in (400, 404, 409) else 502, f"instance {src.instance_id!r}: {exc}") from None
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
        if name in ("pin", "unpin") and not keys:
            raise HTTPError(400, f"{name} needs the field 'tokens' or 'keys'")
        from ..api_client import ApiClient

        api = ApiClient(inst.api_url, inst.api_token, self.dispatch_timeout)
        try:
            if name == "clear":
                if keys is None:  # a tenant clears its own namespace's entries only
                    result: Any = api.clear(tier, namespace=tenant)
                elif not keys:
                    result = {"evicted": [], "skipped": [], "bytes": 0, "dry_run": False}
                else:
                    result = api.evict(tier, keys=keys)
            elif name in ("pin", "unpin"):
                done, skipped = [], []
                for k in keys or ():
                    try:
                        r = api.pin(k, tier) if name == "pin" else api.unpin(k, tier)
                    except NotFoundError as exc:
                        skipped.append({"key": k, "reason": str(exc).split(": ", 1)[-1]})
                        continue
                    done.append({"key": k, "tiers": r.get("pinned" if name == "pin" else "unpinned", [])})
                result = {name + "ned": done, "skipped": skipped}
            else:  # compress / decompress
                codec = body["codec"] if name == "compress" else "raw"
                if keys is not None and not keys:  # tokens with no whole chunk, or keys: []: nothing
                    result = {"tier": tier, "codec": codec, "recoded": [], "skipped": [], "bytes_before": 0,
                              "bytes_after": 0, "dry_run": False}
                else:  # a tenant's selection, keys or not, stays in its namespace
                    result = api.recode(tier, codec, keys=keys, namespace=tenant)
        except UnreachableError as exc:
            raise HTTPError(502, f"instance {inst.instance_id!r} did not answer: {exc}") from None
        except AdminError as exc:
            status = getattr(exc, "status", 400)
            if status == 401:  # the token it registered is not the one its API wants
                raise HTTPError(502, f"instance {inst.instance_id!r} refused the controller: {exc}") from None
            raise HTTPError(status if status in (400, 404, 409) else 502, f"instance {inst.instance_id!r}: {exc}") from None
        return {"instance": inst.instance_id, "command": name, "tier": tier, "result": result}


class _ControllerHandler(JSONHandler):
    ctl: ControllerServer  # set on the per-server subclass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        log.debug("controller %s - %s", self.address_string(), format % args)

    def _dispatch(self, method: str) -> None:
        try:
            path = urlsplit(self.path).path.rstrip("/") or "/"
            tenant = self.ctl.scope(self.headers.get("Authorization"))
            if path in _GETS:
                if method != "GET":
                    raise HTTPError(405, f"{path} takes GET, not {method}", {"Allow": "GET"})
                if urlsplit(self.path).query:
                    raise HTTPError(400, f"{path} takes no query parameters")
                self._send(200, self.ctl.get(path, tenant))
            elif path in _BODIES:
                if method != "POST":
                    raise HTTPError(405, f"{path} takes POST, not {method}", {"Allow": "POST"})
                fields, required = _BODIES[path]
                self._send(200, self.ctl.post(path, self._body(fields, required), tenant))
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
    "/v1/lookup": "Which healthy instances hold the longest cached prefix of tokens (or chunk hashes, or keys).",
    "/v1/move": "Copy (or, with remove_source, move) chunks from an instance's tier into another instance's tier "
                 "over the peer protocol; answered when the destination stored them.",
    "/v1/clear": "Evict an instance's entries (of a tier; of tokens' chunks) through its API.",
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
        "/v1/instances": {"get": {"summary": "Registered instances: healthy, last heartbeat, tiers, keys",
                                  "responses": {"200": {"description": "a list of instances"}}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI"}}}},
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
                          "413": err, "501": err, "502": err},
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
