"""The controller's index: which registered instance holds which chunk, kept true by the
workers' registrations, heartbeats and admit/evict events, and answering lookups
(see :mod:`lmcache.controller.service` for the HTTP side and the why).

Why caps: the index lives in memory and its callers are instances, which a tenant
token can register. Without bounds one instance reporting made-up keys grew the
controller by about 650 bytes per key (540k keys in 6 s: 53 -> 404 MiB RSS). Each
instance may hold at most ``max_keys_per_instance`` keys (a batch of events that would
take it over is refused whole, 429, nothing applied), and a tenant token may register
at most ``max_instances_per_tenant`` instances of its namespace (429); admin
registrations are not counted. Every refusal is counted and logged (the first per
instance registration at WARNING, later ones at DEBUG)."""

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

from ..auth import ADMIN, foreign
from ..http import HTTPError
from ..keys import KEY_PREFIX, TokenProcessor

log = logging.getLogger("lmcache.controller.service")

MAX_KEY_LEN = 1024
#: default caps (``lmcache controller serve --max-keys-per-instance``, ``--max-instances-per-tenant``)
DEFAULT_MAX_KEYS_PER_INSTANCE = 100_000
DEFAULT_MAX_INSTANCES_PER_TENANT = 16
_HEX = set("0123456789abcdef")
HASH_ALGORITHMS = ("xxh3_128", "blake2b")


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
    refused_events: int = 0  # events of batches refused by the key cap
    peer_url: str | None = None  # lm://host:port of its peer endpoint (p2p), if it runs one
    tier_stats: dict[str, dict[str, Any]] = field(default_factory=dict)  # tier -> TIER_STATS, last reported
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
            "tier_stats": {t: dict(self.tier_stats[t]) for t in self.tiers if t in self.tier_stats},
            "keys": len(self.keys),
            "events": self.events,
            "dropped_events": self.dropped_events,
            "refused_events": self.refused_events,
            "pid": self.pid,
            "version": self.version,
        }


class Index:
    """Chunk key -> {instance id -> tiers}, with the instances themselves. Thread-safe."""

    def __init__(self, instance_timeout: float, expire_after: float, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, *,
                 max_keys_per_instance: int = DEFAULT_MAX_KEYS_PER_INSTANCE,
                 max_instances_per_tenant: int = DEFAULT_MAX_INSTANCES_PER_TENANT):
        if max_keys_per_instance < 1 or max_instances_per_tenant < 1:
            raise ValueError("the caps on keys per instance and instances per tenant must be positive")
        self.instance_timeout = instance_timeout
        self.expire_after = expire_after
        self.max_keys_per_instance = max_keys_per_instance
        self.max_instances_per_tenant = max_instances_per_tenant
        #: refusals by the caps: events (of refused batches) and registrations
        self.refused_events = 0
        self.refused_registrations = 0
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
            tier_stats=tier_stats(body.get("tier_stats"), tiers),
        )
        with self.lock:
            old = self.instances.get(iid)
            if old is not None and foreign(tenant, old.namespace):
                raise HTTPError(409, f"instance id {iid!r} is taken by another namespace's instance")
            if tenant is not ADMIN:
                self._check_instance_cap(iid, tenant)
            self.instances.pop(iid, None)
            if old is not None:
                self._forget_keys(old)
            self.instances[iid] = inst
        log.info("instance %s registered (%s, tiers %s)%s", iid, api_url or "no API", ", ".join(tiers),
                 " again: its index was reset" if old is not None else "")
        return {"instance_id": iid, "session": inst.session, "instance_timeout": self.instance_timeout}

    def _check_instance_cap(self, iid: str, tenant: str) -> None:
        """429 when ``tenant`` already has its cap of instances (``iid`` registering
        again does not count twice). Called under the lock."""
        n = sum(1 for i in self.instances.values() if i.namespace == tenant and i.instance_id != iid)
        if n >= self.max_instances_per_tenant:
            self.refused_registrations += 1
            log.warning("refused to register instance %s: namespace %s has %d instances registered with its tenant "
                        "tokens, the cap (--max-instances-per-tenant %d)", iid, tenant, n, self.max_instances_per_tenant)
            raise HTTPError(429, f"namespace {tenant!r} has {n} instances registered, the cap of "
                                 f"{self.max_instances_per_tenant} (lmcache controller serve --max-instances-per-tenant); "
                                 "deregister one first")

    def _check_key_cap(self, inst: Instance, events: list) -> None:
        """429 when applying ``events`` would take ``inst`` over ``max_keys_per_instance``
        keys (a batch that does not add keys always passes). Called under the lock."""
        touched: dict[str, set[str]] = {}
        for op, tier, key in events:
            held = touched.get(key)
            if held is None:
                held = touched[key] = set(inst.keys.get(key, ()))
            if op == "admit":
                held.add(tier)
            else:
                held.discard(tier)
        after = len(inst.keys) + sum(1 for k, t in touched.items() if t and k not in inst.keys) \
            - sum(1 for k, t in touched.items() if not t and k in inst.keys)
        if after <= self.max_keys_per_instance or after <= len(inst.keys):
            return
        first = not inst.refused_events
        inst.refused_events += len(events)
        self.refused_events += len(events)
        (log.warning if first else log.debug)(
            "refused %d events of instance %s (namespace %s): it would hold %d keys, over the cap of %d "
            "(--max-keys-per-instance); %d events refused so far", len(events), inst.instance_id, inst.namespace,
            after, self.max_keys_per_instance, inst.refused_events)
        raise HTTPError(429, f"instance {inst.instance_id!r} would hold {after} keys, over the cap of "
                             f"{self.max_keys_per_instance} keys per instance (lmcache controller serve "
                             "--max-keys-per-instance); the batch was refused, nothing applied")

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
            if body.get("tier_stats") is not None:
                inst.tier_stats = tier_stats(body["tier_stats"], inst.tiers)
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
            self._check_key_cap(inst, events)
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


#: what a worker reports of each tier (``tier_stats`` of register and heartbeat, shown by
#: ``/v1/instances``): field -> JSON types; counts and bytes are integers >= 0
TIER_STATS: dict[str, tuple[type, ...]] = {
    "entries": (int,), "used_bytes": (int,), "capacity_bytes": (int,), "pinned": (int,), "hits": (int,),
    "misses": (int,), "evictions": (int,), "errors": (int,), "refused_writes": (int,), "skipped_puts": (int,),
    "hit_rate": (float, int), "retry_in_s": (float, int), "available": (bool,), "write_refused": (str,),
    "backend": (str,),
}


def tier_stats(raw: Any, tiers: list[str]) -> dict[str, dict[str, Any]]:
    """A worker's ``tier_stats`` (a list of ``{name, <TIER_STATS fields>}``, one per
    registered tier) checked: 400 for a tier it did not register, a field of the wrong
    type or a negative number; fields not in :data:`TIER_STATS` are dropped."""
    if raw is None:
        return {}
    if not isinstance(raw, list) or len(raw) > len(tiers):
        raise HTTPError(400, f"field 'tier_stats' must be a list of at most {len(tiers)} objects, one per tier")
    out: dict[str, dict[str, Any]] = {}
    for i, row in enumerate(raw):
        if not isinstance(row, dict) or row.get("name") not in tiers:
            raise HTTPError(400, f"field 'tier_stats'[{i}] must be an object whose 'name' is a registered tier")
        kept: dict[str, Any] = {}
        for k, types in TIER_STATS.items():
            v = row.get(k)
            if v is None:
                kept[k] = None
                continue
            ok = any(isinstance(v, t) and not (isinstance(v, bool) and t is not bool) for t in types)
            if not ok or (isinstance(v, (int, float)) and not isinstance(v, bool) and not 0 <= v < 1 << 63) \
                    or (isinstance(v, str) and len(v) > 200):
                raise HTTPError(400, f"field 'tier_stats'[{i}].{k} has a bad value: {json.dumps(v)[:50]}")
            kept[k] = v
        out[row["name"]] = kept
    return out


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
