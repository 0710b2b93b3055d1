"""The controller's index: which registered instance holds which chunk, kept true by the
workers' registrations, heartbeats and admit/evict events, and answering lookups
(see :mod:`lmcache.server.controller` for the HTTP side and the why).

Why caps: the index lives in memory and its callers are instances, which a tenant
token can register. Without bounds one instance reporting made-up keys grew the
controller without limit (docs/benchmarks.md#measurements-behind-the-code). Each
instance may hold at most ``max_keys_per_instance`` keys (a batch of events that would
take it over is refused whole, 429, nothing applied), and a tenant token may register
at most ``max_instances_per_tenant`` instances of its namespace (429); admin
registrations are not counted. Every refusal is counted and logged (the first per
instance registration at WARNING, later ones at DEBUG)."""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

from ..auth import ADMIN, foreign
from .http import HTTPError
from ..keys import KEY_PREFIX, TokenProcessor
from .limits import TIER_STATS, Processors, check_count, check_model, check_registration

log = logging.getLogger("lmcache.server.controller")

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
    keys: KeyMap = field(default_factory=lambda: KeyMap())  # key -> bitmask of tiers holding it
    epoch: int = 0  # how many times this instance id registered (1 the first time)
    retried: bool = False  # the last register call repeated the registration in place (same session)

    def key_prefix(self) -> str | None:
        if self.kv_signature is None:
            return None
        return ":".join((KEY_PREFIX, self.namespace, quote(self.model, safe="-_.~"), self.kv_signature, ""))

    def public(self, age: float, timeout: float, keys: int | None = None) -> dict[str, Any]:
        """What ``/v1/instances`` shows of it, ``age`` seconds after its last heartbeat."""
        return {
            "instance_id": self.instance_id,
            "healthy": age <= timeout,
            "last_heartbeat": self.last_seen_wall,
            "last_heartbeat_age_s": round(max(0.0, age), 3),
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
            "keys": len(self.keys) if keys is None else keys,
            "events": self.events,
            "dropped_events": self.dropped_events,
            "refused_events": self.refused_events,
            "pid": self.pid,
            "version": self.version,
        }


class KeyMap:
    """Chunk key -> bitmask of tiers (bit i: the instance's i-th tier), held compactly.

    Why: a ``str -> set[str]`` entry took about 650 bytes, so ten million (chunk,
    instance) entries did not fit in a few GiB. The first key of the form
    ``<prefix>:<32 lowercase hex>`` fixes the map's prefix; every key of that prefix is
    then held as its 16 raw bytes and a small int, any other key as its string. The two
    kinds never collide (``bytes != str``), and the encoding of a key never changes."""

    __slots__ = ("prefix", "_d")

    def __init__(self) -> None:
        self.prefix: str | None = None
        self._d: dict[bytes | str, int] = {}

    def _enc(self, key: str, fix: bool = False) -> bytes | str:
        p = self.prefix
        if p is None:
            if not fix:
                return key
            cut = key.rfind(":") + 1
            if not cut or len(key) - cut != 32:
                return key
            p = key[:cut]
        if len(key) != len(p) + 32 or not key.startswith(p):
            return key
        tail = key[len(p):]
        try:
            raw = bytes.fromhex(tail)
        except ValueError:
            return key
        if raw.hex() != tail:  # upper case or spaces: not the canonical form
            return key
        self.prefix = p
        return raw

    def get(self, key: str) -> int:
        return self._d.get(self._enc(key), 0)

    def get_hash(self, prefix: str, h: str) -> int:
        """``get(prefix + h)`` for a chunk hash ``h`` (32 lowercase hex) without building
        that string when ``prefix`` is the map's (issue 44: a lookup built one per chunk)."""
        if prefix == self.prefix:
            return self._d.get(bytes.fromhex(h), 0)
        return 0 if self.prefix is None else self._d.get(prefix + h, 0)

    def set(self, key: str, mask: int) -> None:
        """Hold ``key`` in the tiers of ``mask``; 0 forgets it."""
        k = self._enc(key, fix=True)
        if mask:
            self._d[k] = mask
        else:
            self._d.pop(k, None)

    def __len__(self) -> int:
        return len(self._d)


def tier_bit(tiers: list[str], tier: str) -> int:
    """The bit of ``tier`` in a mask over ``tiers`` (0 when not one of them)."""
    try:
        return 1 << tiers.index(tier)
    except ValueError:
        return 0


@dataclass
class Query:
    """A ``/v1/lookup`` body, checked: exactly one of tokens, hashes, keys."""

    tokens: Any
    hashes: list[str] | None
    keys: list[str] | None
    num_tokens: int | None
    namespace: str | None
    model: str | None


class IndexBase:
    """What every index shares: the checks of each call (fields, tenancy, caps' errors),
    the chunking of a lookup and the scoring of its hits. A storage implements the
    ``_``-methods below; :class:`Index` keeps everything in this process,
    :class:`lmcache.server.index_valkey.ValkeyIndex` in Valkey. Both answer alike."""

    kind = "memory"

    def __init__(self, instance_timeout: float, expire_after: float, *,
                 max_keys_per_instance: int = DEFAULT_MAX_KEYS_PER_INSTANCE,
                 max_instances_per_tenant: int = DEFAULT_MAX_INSTANCES_PER_TENANT):
        if max_keys_per_instance < 1 or max_instances_per_tenant < 1:
            raise ValueError("the caps on keys per instance and instances per tenant must be positive")
        self.instance_timeout = instance_timeout
        self.expire_after = expire_after
        self.max_keys_per_instance = max_keys_per_instance
        self.max_instances_per_tenant = max_instances_per_tenant
        self._processors = Processors()  # bounded: chunkings come and go (issue 44)

    # ------------------------------------------------------------ storage (per implementation)
    def _put(self, inst: Instance, tenant: str | None) -> Instance:
        """Store a new registration (replacing the id's old one and its keys): 409 for
        an id of another namespace, 429 over the tenant's cap. Sets ``inst.epoch``."""
        raise NotImplementedError

    def _beat(self, body: dict[str, Any], tenant: str | None, sig: str | None) -> None:
        raise NotImplementedError

    def _apply(self, body: dict[str, Any], tenant: str | None, events: list) -> None:
        """Apply checked events atomically: 404 for a wrong session, 400 for an unknown
        tier, 429 over the key cap (then nothing is applied)."""
        raise NotImplementedError

    def _drop(self, body: dict[str, Any], tenant: str | None) -> Instance:
        raise NotImplementedError

    def _holdings(self, q: Query) -> tuple[list[tuple[Instance, list[int], list[int]]], int]:
        """For each healthy candidate of ``q``: (instance, chunk ends, tier masks of the
        leading chunks it holds); and how many instances were considered."""
        raise NotImplementedError

    def _find(self, iid: str, tenant: str | None) -> tuple[Instance, float] | None:
        """The instance and the seconds since it was last seen; None if unknown or another tenant's."""
        raise NotImplementedError

    def list(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Every instance (of ``namespace`` only, if given), by id."""
        raise NotImplementedError

    def expire(self) -> list[str]:
        """Forget instances silent for longer than ``expire_after`` (ids returned)."""
        return []

    def close(self) -> None:
        """Release connections, if any."""

    # ------------------------------------------------------------ the workers' side
    def register(self, body: dict[str, Any], tenant: str | None = ADMIN) -> dict[str, Any]:
        iid = body["instance_id"]
        _check_name("instance_id", iid)
        _check_name("namespace", body["namespace"])
        if foreign(tenant, body["namespace"]):
            raise HTTPError(403, f"this token is scoped to namespace {tenant!r}; it cannot register an instance of namespace {body['namespace']!r}")
        check_registration(body)  # every field bounded: model, urls, token, version, numbers
        algo = body.get("hash_algorithm") or "xxh3_128"
        if algo not in HASH_ALGORITHMS:
            raise HTTPError(400, f"field 'hash_algorithm' must be one of {', '.join(HASH_ALGORITHMS)}, got {algo!r}")
        tiers = body["tiers"]
        if not tiers or not all(isinstance(t, str) and t for t in tiers) or len(set(tiers)) != len(tiers) \
                or len(tiers) > 30:
            raise HTTPError(400, "field 'tiers' must be a non-empty list of at most 30 distinct tier names")
        for i, t in enumerate(tiers):
            _check_name(f"tiers[{i}]", t)
        sig = body.get("kv_signature")
        if sig is not None:
            _check_name("kv_signature", sig)
        api_url = body.get("api_url")
        if api_url is not None:
            _check_url("api_url", api_url)
        peer = body.get("peer_url")
        if peer is not None:
            _check_url("peer_url", peer, ("lm",))
        wall = time.time()
        inst = Instance(
            instance_id=iid, session=body.get("session") or secrets.token_hex(8), api_url=api_url, api_token=body.get("api_token"),
            namespace=body["namespace"], model=body["model"], kv_signature=sig, chunk_size=body["chunk_size"],
            hash_algorithm=algo, save_unfull_chunk=body.get("save_unfull_chunk", True), tiers=list(tiers),
            heartbeat_interval=body.get("heartbeat_interval"), pid=body.get("pid"), version=body.get("version"),
            registered_at=wall, last_seen=0.0, last_seen_wall=wall, peer_url=peer,
            tier_stats=tier_stats(body.get("tier_stats"), tiers),
        )
        inst = self._put(inst, tenant)
        log.info("instance %s registered (%s, tiers %s, epoch %d)%s", iid, api_url or "no API", ", ".join(tiers),
                 inst.epoch, " again, the same registration: a retry, its keys kept" if inst.retried
                 else " again: its index was reset" if inst.epoch > 1 else "")
        return {"instance_id": iid, "session": inst.session, "epoch": inst.epoch,
                "instance_timeout": self.instance_timeout}

    def instance_cap(self, iid: str, tenant: str, n: int) -> None:
        """429 when ``tenant`` already has ``n`` >= its cap of other instances."""
        if n < self.max_instances_per_tenant:
            return
        log.warning("refused to register instance %s: namespace %s has %d instances registered with its tenant "
                    "tokens, the cap (--max-instances-per-tenant %d)", iid, tenant, n, self.max_instances_per_tenant)
        raise HTTPError(429, f"namespace {tenant!r} has {n} instances registered, the cap of "
                             f"{self.max_instances_per_tenant} (lmcache controller serve --max-instances-per-tenant); "
                             "deregister one first")

    def key_cap(self, iid: str, namespace: str, after: int, refused: int, so_far: int) -> HTTPError:
        """The 429 of a batch of ``refused`` events that would leave ``iid`` with
        ``after`` keys (``so_far``: its events refused before this batch), logged."""
        (log.warning if not so_far else log.debug)(
            "refused %d events of instance %s (namespace %s): it would hold %d keys, over the cap of %d "
            "(--max-keys-per-instance); %d events refused so far", refused, iid, namespace,
            after, self.max_keys_per_instance, so_far + refused)
        return HTTPError(429, f"instance {iid!r} would hold {after} keys, over the cap of "
                              f"{self.max_keys_per_instance} keys per instance (lmcache controller serve "
                              "--max-keys-per-instance); the batch was refused, nothing applied")

    def heartbeat(self, body: dict[str, Any], tenant: str | None = ADMIN) -> dict[str, Any]:
        check_count("dropped_events", body.get("dropped_events"))
        sig = body.get("kv_signature")
        if sig is not None:
            _check_name("kv_signature", sig)
        self._beat(body, tenant, sig)
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
        self._apply(body, tenant, events)
        return {"applied": len(events), "ignored": ignored} if ignored else {"applied": len(events)}

    def deregister(self, body: dict[str, Any], tenant: str | None = ADMIN) -> dict[str, Any]:
        inst = self._drop(body, tenant)
        log.info("instance %s deregistered", inst.instance_id)
        return {"ok": True}

    # ------------------------------------------------------------ the routers' side
    def _processor(self, inst: Instance) -> TokenProcessor:
        return self._processors.get((inst.chunk_size, inst.hash_algorithm, inst.save_unfull_chunk))

    def query(self, body: dict[str, Any], tenant: str | None = ADMIN) -> Query:
        """A lookup body checked (400/403), tokens as an array."""
        given = [f for f in ("tokens", "chunk_hashes", "keys") if body.get(f) is not None]
        if len(given) != 1:
            raise HTTPError(400, "give exactly one of the fields 'tokens', 'chunk_hashes' or 'keys'")
        num_tokens = body.get("num_tokens")
        if num_tokens is not None and num_tokens < 0:
            raise HTTPError(400, f"field 'num_tokens' must be >= 0, got {num_tokens}")
        ns, model = body.get("namespace"), body.get("model")
        if ns is not None:
            _check_name("namespace", ns)
        if model is not None:
            check_model(model)
        if tenant is not ADMIN:
            if ns is not None and ns != tenant:
                raise HTTPError(403, f"this token is scoped to namespace {tenant!r}; namespace {ns!r} is out of its reach")
            ns = tenant
        q = Query(None, None, None, num_tokens, ns, model)
        if given[0] == "tokens":
            q.tokens = _token_array(body["tokens"])
            q.num_tokens = len(q.tokens)
        elif given[0] == "chunk_hashes":
            q.hashes = _hash_list(body["chunk_hashes"])
        else:
            q.keys = body["keys"]
            for i, k in enumerate(q.keys):
                if not isinstance(k, str) or not k or len(k) > MAX_KEY_LEN:
                    raise HTTPError(400, f"field 'keys'[{i}] must be a key string, got {json.dumps(k)[:100]}")
            if tenant is not ADMIN:
                own_keys(tenant, q.keys)
        return q

    def chain(self, inst: Instance, q: Query, hashed: dict[tuple[int, str, bool], tuple[list[int], list[str]]]
              ) -> tuple[list[int], list[str], str | None] | None:
        """(chunk ends, items, prefix) of ``q`` as ``inst`` would key it: the caller's keys
        (prefix None) or the chunk hashes, each key being prefix + hash (never built: a
        long prefix made them a tenant's lever, issue 44); None when its signature is
        unknown. ``hashed`` caches the hashing (the costly part) per chunking."""
        c = inst.chunk_size
        if q.keys is not None:
            return [(j + 1) * c for j in range(len(q.keys))], q.keys, None
        prefix = inst.key_prefix()
        if prefix is None:  # stored nothing yet: its signature is unknown
            return None
        if q.tokens is not None:
            ck = (c, inst.hash_algorithm, inst.save_unfull_chunk)
            if ck not in hashed:
                chunks = self._processor(inst).chunks(q.tokens)
                hashed[ck] = ([ch.end for ch in chunks], [ch.chunk_hash for ch in chunks])
            return hashed[ck][0], hashed[ck][1], prefix
        hashes = q.hashes or []
        return [(j + 1) * c for j in range(len(hashes))], hashes, prefix

    def lookup(self, body: dict[str, Any], tenant: str | None = ADMIN) -> dict[str, Any]:
        q = self.query(body, tenant)
        held, considered = self._holdings(q)
        rows = []
        for inst, ends, masks in held:
            per_tier: dict[str, int] = {}
            hit = chunks = 0
            worst = -1
            for end, mask in zip(ends, masks):
                if not mask:
                    break
                best = (mask & -mask).bit_length() - 1  # the first tier holding it
                end = end if q.num_tokens is None else min(end, q.num_tokens)
                per_tier[inst.tiers[best]] = per_tier.get(inst.tiers[best], 0) + end - hit
                worst = max(worst, best)
                hit = end
                chunks += 1
            if hit:
                rows.append({
                    "instance_id": inst.instance_id, "hit_tokens": hit, "hit_chunks": chunks,
                    "tier": inst.tiers[worst], "tiers": per_tier, "api_url": inst.api_url,
                    "peer_url": inst.peer_url, "_rank": worst,
                })
        rows.sort(key=lambda r: (-r["hit_tokens"], r["_rank"], r["instance_id"]))
        for r in rows:
            del r["_rank"]
        return {"num_tokens": q.num_tokens, "best": rows[0]["instance_id"] if rows else None, "results": rows,
                "instances_considered": considered}

    # ------------------------------------------------------------ dispatch support
    def target(self, iid: str, field_name: str = "instance", tenant: str | None = ADMIN) -> Instance:
        found = self._find(iid, tenant)
        if found is None:  # another tenant's: as if unknown
            raise HTTPError(404, f"unknown instance {iid!r} (field {field_name!r})")
        inst, age = found
        if age > self.instance_timeout:
            raise HTTPError(409, f"instance {iid!r} is not heartbeating (last seen {age:.1f}s ago)")
        return inst

    def keys_for(self, inst: Instance, tokens: Any) -> list[str]:
        prefix = inst.key_prefix()
        if prefix is None:
            raise HTTPError(409, f"instance {inst.instance_id!r} has stored nothing yet: its kv signature is unknown")
        return [prefix + c.chunk_hash for c in self._processor(inst).chunks(_token_array(tokens))]


def wrong_session(iid: Any) -> HTTPError:
    return HTTPError(404, f"unknown instance or session {iid!r}: register again")


def unknown_tier(i: int, tier: str, tiers: list[str]) -> HTTPError:
    return HTTPError(400, f"field 'events'[{i}]: unknown tier {tier!r}; registered: {', '.join(tiers)}")


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

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}", v):  # not match(...$): it passes "a\n"
        raise HTTPError(400, f"field {name!r} may only contain letters, digits, '.', '_' and '-' (1 to 200, the "
                             f"first a letter or digit), got {v[:100]!r}{'...' if len(v) > 100 else ''}")


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
