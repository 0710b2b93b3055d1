"""The ``valkey`` index: the controller's index in Valkey (or Redis), so that the controller
process holds no index state and any number of replicas serve the same instances.

Why this layout (``{ns}`` is the instance's namespace, a Cluster hash tag: every key a
script touches is in that namespace's slot)::

    lmc:{ns}:i:<id>    HASH  the instance's record: sess (sha1 of its session), epoch, meta (JSON),
                             tiers (JSON), model, ck (chunking), sig, prefix, stats, events,
                             dropped, refused, seen (Valkey ms), wall, kp (the key prefix its
                             key hash is compacted by)                    PEXPIRE expire_after
    lmc:{ns}:k:<id>    HASH  chunk -> bitmask of its tiers holding it: a key ``kp + <32 hex>`` by its
                             32 hex, any other key as ``=`` + key         PEXPIRE expire_after
    lmc:{ns}:leases    ZSET  id -> lease deadline (Valkey ms): healthy while deadline >= now
    lmc:{ns}:e:<id>    STRING the id's last epoch, kept expire_after past its registration and
                             its deregistration so a re-registration after a deregistration counts on
    lmc:{ns}:stats     HASH  refused_events, refused_registrations
    lmc:namespaces     SET   every namespace seen (admin listings and lookups); added to at every
                             registration and heartbeat, so a Valkey restarted empty is re-seeded
    lmc:owner:<id>     STRING the namespace of instance id <id> (ids are global)  PEXPIRE expire_after,
                             renewed by heartbeats; claimed atomically (one script) at registration

Nothing is kept for an instance id after ``expire_after`` of silence: a tenant registering
ever new ids cannot grow the index without bound (the tenant cap bounds the live ones).

Every mutation is one Lua script that first checks the caller's session (a re-registration
replaces it, so a stale re-sync or a restarted instance's old session is 404: register
again) and applies the caps atomically. A lookup is one script per namespace that reads
the leases, the candidates' records and their key hashes with Valkey's own clock: an
instance whose lease lapsed stops counting at once, with no sweep, and Valkey forgets
silent instances by itself (PEXPIRE). Every call has a timeout; Valkey unreachable is
HTTP 503 ``index unavailable: ...``. The password comes from the environment variable
``LMCACHE_CONTROLLER_INDEX_PASSWORD`` only.

What the process keeps is hints, each checked against Valkey at use (issue 44): an id's
namespace (every script checks the session), the chunkings of the namespace's live instances (each
lookup's script returns them; it asks for missing ones) and each record's parsed metadata, used only while the record's text is the
same (an epoch can restart at 1 after ``expire_after`` of silence, so it is no identity).
Lease time counts only while the index is reachable: after an outage the leases are
moved forward by the time it was away (:mod:`~lmcache.server.index_outage`).

Lookups through a failover (issue 45): over ``valkey+sentinel://``, while the primary is
away (a call failed for want of it, until the probe reaches a primary again and closes the
outage) lookups are read from a replica the Sentinels name (``Sentinel.slave_for``) with a
read-only copy of the lookup script (``EVALSHA_RO``; a replica is ``replica-read-only`` and
serves its copy while its link is down, ``replica-serve-stale-data yes``, both defaults).
That script cannot resume the leases, so it counts the ones the resume would keep live
(:data:`_LOOKUP_STALE`), and the answer says ``stale: true`` with ``stale_s``. Writes still
need the primary: they are 503 until the promotion, and the worker keeps its session and
unsent events and sends them again. A Valkey primary SIGKILLed under 4 lookup threads:
337 of 1,770 lookups failed before (multi-host suite), 0 of 2,565 after.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from typing import Any, Callable
from urllib.parse import unquote, urlsplit

from ..auth import ADMIN
from ..errors import ConfigError
from .http import HTTPError
from .index import IndexBase, Instance, Query, tier_stats, unknown_tier, wrong_session
from .index_outage import RESUME, LeaseGuard
from .valkey_scripts import (
    _REGISTER, _BEAT, _EVENTS, _DROP, _DISOWN, _CLAIM, _LOOKUP, _LOOKUP_STALE, _LOOKUP_STALE_SHA, _GET, _LIST,
)

log = logging.getLogger("lmcache.server.controller")
PASSWORD_ENV = "LMCACHE_CONTROLLER_INDEX_PASSWORD"
NAMESPACES = "lmc:namespaces"
_BATCH = 500  # keys per HMGET/HSET inside a script (Lua's unpack limit is ~8000)

def _sha(session: str) -> str:
    return hashlib.sha1(session.encode()).hexdigest()


def _tag(ns: str) -> str:
    return "lmc:{" + ns + "}:"


def connect(url: str, timeout: float = 2.0) -> Any:
    """A redis-py client for an index URL (see :func:`parse_url`), each call bounded by
    ``timeout`` seconds and retried once at most (a stale connection after a failover)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kind, nodes, name, db = parse_url(url)
    pw = os.environ.get(PASSWORD_ENV) or None
    common: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout, "password": pw,
                              "decode_responses": True, "retry": Retry(NoBackoff(), 1)}
    if kind == "standalone":
        return redis.Redis(host=nodes[0][0], port=nodes[0][1], db=db, **common)
    if kind == "sentinel":
        from redis.sentinel import Sentinel

        sent = Sentinel(nodes, socket_timeout=timeout, socket_connect_timeout=timeout,
                        sentinel_kwargs={"socket_timeout": timeout, "socket_connect_timeout": timeout})
        return sent.master_for(name, db=db, **common)
    from redis.cluster import ClusterNode, RedisCluster

    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **common)


def connect_replica(url: str, timeout: float = 2.0) -> Any:
    """A redis-py client of the replicas the Sentinels name for a ``valkey+sentinel://``
    URL (``Sentinel.slave_for``: round robin over the replicas not down, the primary when
    there is none), for lookups while the primary is away; ``None`` for other URLs (a
    standalone Valkey has no replica; a Cluster's replicas are not read, see the docs)."""
    kind, nodes, name, db = parse_url(url)
    if kind != "sentinel":
        return None
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    from redis.sentinel import Sentinel

    sent = Sentinel(nodes, socket_timeout=timeout, socket_connect_timeout=timeout,
                    sentinel_kwargs={"socket_timeout": timeout, "socket_connect_timeout": timeout})
    return sent.slave_for(name, db=db, socket_timeout=timeout, socket_connect_timeout=timeout,
                          password=os.environ.get(PASSWORD_ENV) or None, decode_responses=True,
                          retry=Retry(NoBackoff(), 1))


def parse_url(url: str) -> tuple[str, list[tuple[str, int]], str, int]:
    """(kind, [(host, port)], sentinel master name, db) of ``valkey://HOST:PORT[/DB]``,
    ``valkey+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB]`` or
    ``valkey+cluster://HOST:PORT[,HOST:PORT...]`` (``redis`` for ``valkey`` alike);
    :class:`ConfigError` naming the URL otherwise. No credentials in the URL."""
    def bad(why: str) -> ConfigError:
        shown = re.sub(r"//[^/]*@", "//***@", url[:200])  # never echo a credential
        return ConfigError("index", f"bad index URL {shown!r}: {why}")

    scheme, _, rest = url.partition("://")
    kinds = {"valkey": "standalone", "redis": "standalone", "valkey+sentinel": "sentinel",
             "redis+sentinel": "sentinel", "valkey+cluster": "cluster", "redis+cluster": "cluster"}
    if scheme not in kinds or not rest:
        raise bad("expected memory, valkey://HOST:PORT[/DB], valkey+sentinel://HOST:PORT[,...]/MASTER "
                  "or valkey+cluster://HOST:PORT[,...]")
    kind = kinds[scheme]
    netloc, _, path = rest.partition("/")
    if "@" in netloc:
        raise bad(f"no credentials in the URL: set {PASSWORD_ENV}")
    nodes = []
    for part in netloc.split(","):
        try:
            p = urlsplit("//" + part)
            host, port = p.hostname, p.port
        except ValueError:
            host = port = None
        if not host or port is None:
            raise bad(f"{part!r} is not HOST:PORT")
        nodes.append((host, port))
    parts = [unquote(x) for x in path.split("/") if x]
    name = ""
    if kind == "sentinel":
        if not parts:
            raise bad("name the sentinel master: valkey+sentinel://HOST:PORT/MASTER")
        name, parts = parts[0], parts[1:]
    if kind == "cluster" and parts:
        raise bad("a cluster URL has no path")
    if len(parts) > 1 or (parts and not parts[0].isdigit()):
        raise bad("the path must be a database number")
    if kind == "standalone" and len(nodes) != 1:
        raise bad("a standalone URL names one HOST:PORT")
    return kind, nodes, name, int(parts[0]) if parts else 0


class ValkeyIndex(IndexBase):
    """The index in Valkey: same answers as :class:`~lmcache.server.index_memory.Index`."""

    kind = "valkey"

    def __init__(self, url: str, instance_timeout: float, expire_after: float, *, timeout: float = 2.0,
                 **caps: int):
        super().__init__(instance_timeout, expire_after, **caps)
        self.url, self.timeout = url, timeout
        self._client: Any = None  # connected on first use: a controller starts while Valkey is down
        self._lock = threading.Lock()
        self._scripts: dict[str, Any] = {}
        self._owner: dict[str, str] = {}  # instance id -> namespace (a hint, checked by every script)
        # (ns, id) -> (the record's meta text, its Instance): a memo of the record as Valkey holds it, used
        # only while that text and epoch are the same (issue 44: keyed by epoch, which restarts at 1, a
        # replica served a re-registered id's old tiers, API URL and token)
        self._meta: dict[tuple[str, str], tuple[str, Instance]] = {}
        self._guard = LeaseGuard(timeout)  # leases across an outage of the index (index_outage)
        self._chunkings: dict[str, set[str]] = {}  # ns -> chunkings of its instances seen
        # lookups while the primary is away: read from a replica (valkey+sentinel:// only)
        self._sentinel = parse_url(url)[0] == "sentinel"
        self._replica: Any = None
        self._stale = threading.local()  # this request's lookup: ms its stale answers lag at most, or None
        #: lookups answered from a replica since the start (tests and the log show them)
        self.stale_lookups = 0

    # ------------------------------------------------------------ plumbing
    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` with Valkey's failures as one-line 503s (each noted: after an outage,
        :meth:`_run` resumes a namespace's leases before its first script)."""
        import redis

        try:
            out = fn()
        except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
            self._guard.failed(exc)
            why = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise HTTPError(503, f"index unavailable: {type(exc).__name__}: {why}") from None
        self._guard.ok()
        return out

    @property
    def r(self) -> Any:
        """The redis-py client (connected, and the scripts registered, on first use)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    client = self.call(lambda: connect(self.url, self.timeout))
                    self._scripts = {n: client.register_script(s) for n, s in (
                        ("register", _REGISTER), ("beat", _BEAT), ("events", _EVENTS), ("drop", _DROP),
                        ("disown", _DISOWN), ("lookup", _LOOKUP), ("list", _LIST), ("get", _GET),
                        ("claim", _CLAIM), ("resume", RESUME))}
                    self._client = client
        return self._client

    def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        script = self._scripts.get(name) or (self.r and self._scripts[name])
        self._guard.before(self, keys[0])  # after an outage: this namespace's leases resumed first
        return self.call(lambda: script(keys=keys, args=args))

    def _ms(self, seconds: float) -> int:
        return max(1, int(seconds * 1000))

    def close(self) -> None:
        for c in (self._client, self._replica):
            if c is not None:
                try:
                    c.close()
                except Exception:  # an unreachable index has nothing to release
                    pass

    def _read(self, primary: Callable[[], Any], stale: Callable[[], Any]) -> Any:
        """``primary()``; while the primary is away (a Sentinel failover: the call failed for
        want of it, or an outage is still open) ``stale()`` instead, which reads a replica
        (:meth:`_on_replica`). With the primary up this costs one attribute test: the same
        call as without replicas."""
        if self._guard.since is None or not self._sentinel:
            try:
                return primary()
            except HTTPError as exc:
                if exc.status != 503 or not self._sentinel or self._guard.since is None:
                    raise  # not the primary's absence (an error it answered): as before
        return stale()

    def _on_replica(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(replica client)``, Valkey's failures as 503s. Not :meth:`call`: what a replica
        answers says nothing of the primary (the outage stays open until the probe reaches it)."""
        import redis

        try:
            if self._replica is None:
                with self._lock:
                    if self._replica is None:
                        self._replica = connect_replica(self.url, self.timeout)
            return fn(self._replica)
        except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
            why = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise HTTPError(503, f"index unavailable: the primary is away and no replica answered: "
                                 f"{type(exc).__name__}: {why}") from None

    def _lookup_stale(self, keys: list[str], args: list[Any]) -> Any:
        """The lookup script's answer read from a replica (:data:`_LOOKUP_STALE`), noted as
        stale for this request (:meth:`lookup` marks the answer)."""
        import redis

        since = self._guard.since
        back = self._ms(time.monotonic() - since) if since is not None else 0
        argv = [*args[:3], back, *args[3:]]

        def run(r: Any) -> Any:
            try:
                return r.evalsha_ro(_LOOKUP_STALE_SHA, len(keys), *keys, *argv)
            except redis.exceptions.NoScriptError:  # a replica's script cache is its own
                return r.eval_ro(_LOOKUP_STALE, len(keys), *keys, *argv)

        got = self._on_replica(run)
        lag = getattr(self._stale, "ms", None)
        self._stale.ms = max(int(got[0]), lag or 0)
        return got

    def lookup(self, body: dict[str, Any], tenant: str | None = ADMIN) -> dict[str, Any]:
        """:meth:`IndexBase.lookup`; answered from a replica while the primary is away, then
        marked ``stale: true`` with ``stale_s``: how long before now the copy it read was
        last known current (the later of this controller's last call that reached the
        primary and the namespace's last write in the copy; at least the replica's lag)."""
        self._stale.ms = None
        out = super().lookup(body, tenant)
        ms = self._stale.ms
        if ms is not None:
            self.stale_lookups += 1
            out["stale"], out["stale_s"] = True, round(ms / 1000, 3)
        return out

    def expire(self) -> list[str]:
        """Valkey expires its own keys; this (the reaper, every second) probes it, so
        that an outage is noticed, and the leases resumed, with no call in flight."""
        try:
            self.call(lambda: self.r.ping())
            self._guard.sweep(self)
        except HTTPError:
            pass  # noticed: the next call (or probe) resumes the leases once Valkey answers
        except Exception:  # never let the reaper die
            log.exception("controller: probing the index failed")
        return []

    def _ns_of(self, iid: str, tenant: str | None, fresh: bool = False) -> str | None:
        if tenant is not ADMIN:
            return tenant
        if not fresh and iid in self._owner:
            return self._owner[iid]
        ns = self.call(lambda: self.r.get("lmc:owner:" + iid))
        if ns is not None:
            if len(self._owner) > 100_000:  # a hint only: bounded
                self._owner.clear()
            self._owner[iid] = ns
        return ns

    def _session_call(self, name: str, body: dict[str, Any], tenant: str | None, extra_keys: int,
                      args: list[Any]) -> tuple[str, list[Any]]:
        """Run a script that checks the caller's session, trying the id's current namespace
        once more when the cached one is stale; 404 for a wrong session."""
        iid = body["instance_id"]
        for fresh in (False, True):
            ns = self._ns_of(iid, tenant, fresh)
            if ns is None:
                break
            t = _tag(ns)
            keys = [t + "i:" + iid, t + "k:" + iid, t + "leases", t + "stats"][:3 + extra_keys]
            got = self._run(name, keys, [_sha(body["session"]), iid, *args])
            if got[0] != "session":
                return ns, got
            if tenant is not ADMIN:
                break
        raise wrong_session(iid)

    def _lease_args(self) -> list[int]:
        return [self._ms(self.instance_timeout), self._ms(self.expire_after)]

    # ------------------------------------------------------------ the workers' side
    def _put(self, inst: Instance, tenant: str | None) -> Instance:
        ns, iid = inst.namespace, inst.instance_id
        claimed = self._claim(iid, ns, tenant)
        meta = {k: getattr(inst, k) for k in ("api_url", "api_token", "model", "chunk_size", "hash_algorithm",
                                              "save_unfull_chunk", "tiers", "heartbeat_interval", "pid", "version",
                                              "registered_at", "peer_url")}
        fields = {"meta": json.dumps(meta), "tiers": json.dumps(inst.tiers), "model": inst.model, "ck": _ck(inst),
                  "sig": inst.kv_signature or "", "prefix": inst.key_prefix() or "",
                  "stats": json.dumps(inst.tier_stats), "events": 0, "dropped": 0, "refused": 0,
                  "wall": inst.registered_at}
        t = _tag(ns)
        capped = tenant is not ADMIN
        try:
            got = self._run("register", [t + "i:" + iid, t + "k:" + iid, t + "leases", t + "e:" + iid, t + "stats"],
                            [_sha(inst.session), iid, *self._lease_args(), int(capped), self.max_instances_per_tenant,
                             *[x for kv in fields.items() for x in kv]])
            if got[0] == "cap":
                self.instance_cap(iid, ns, int(got[1]))
        except HTTPError:
            if claimed:  # a new id that did not register: free for others at once
                try:
                    self._run("disown", ["lmc:owner:" + iid], [ns])
                except HTTPError:
                    pass  # then it expires
            raise
        inst.epoch, inst.retried = int(got[1]), got[0] == "same"
        self._owner[iid] = ns
        # at every registration, not once per process: a Valkey restarted empty had lost it, and
        # admins saw no instance until the controller restarted (issue 44)
        self.call(lambda: self.r.sadd(NAMESPACES, ns))
        return inst

    def _claim(self, iid: str, ns: str, tenant: str | None) -> bool:
        """Make ``ns`` the owner of id ``iid`` atomically (True: it had none): 409 for a
        tenant when another namespace's instance holds it, or claimed it less than a grace
        period ago (registering); the admin takes it over, dropping that instance."""
        owner, expire = "lmc:owner:" + iid, self._ms(self.expire_after)
        got = self._run("claim", [owner], [ns, expire, ""])
        if got[0] == "ok":
            return int(got[1]) == 1
        prev, age = got[1], int(got[2])
        o = _tag(prev)
        live = self.call(lambda: self.r.exists(o + "i:" + iid))
        if tenant is not ADMIN and (live or age < self._ms(max(10.0, 5 * self.timeout))):
            raise HTTPError(409, f"instance id {iid!r} is taken by another namespace's instance")
        if live:
            self.call(lambda: (self.r.delete(o + "i:" + iid, o + "k:" + iid), self.r.zrem(o + "leases", iid)))
        got = self._run("claim", [owner], [ns, expire, prev])  # only if still prev's
        if got[0] != "ok":
            raise HTTPError(409, f"instance id {iid!r} is taken by another namespace's instance")
        return True

    def _beat(self, body: dict[str, Any], tenant: str | None, sig: str | None) -> None:
        iid = body["instance_id"]
        pairs: list[Any] = []
        if body.get("tier_stats") is not None or sig is not None:
            found = self._find(iid, tenant, fresh=False) or self._find(iid, tenant)  # the cached namespace first
            if found is None:
                raise wrong_session(iid)
            inst = found[0]
            if body.get("tier_stats") is not None:
                pairs += ["stats", json.dumps(tier_stats(body["tier_stats"], inst.tiers))]
            if sig is not None:
                inst.kv_signature = sig
                pairs += ["sig", sig, "prefix", inst.key_prefix()]
        if body.get("dropped_events") is not None:
            pairs += ["dropped", body["dropped_events"]]
        pairs += ["wall", time.time()]
        ns, _ = self._session_call("beat", body, tenant, 0, [*self._lease_args(), *pairs])
        # the owner key lives in no namespace's slot (ids are global): renewed beside the script, with the
        # namespace listed again in the same round trip (lmc:namespaces lost alone heals at the next beat)
        def renew() -> Any:
            p = self.r.pipeline(transaction=False)
            p.pexpire("lmc:owner:" + iid, self._ms(self.expire_after))
            p.sadd(NAMESPACES, ns)
            return p.execute()

        self.call(renew)

    def _apply(self, body: dict[str, Any], tenant: str | None, events: list) -> None:
        flat = [x for ev in events for x in ev]
        ns, got = self._session_call("events", body, tenant, 1,
                                     [*self._lease_args(), self.max_keys_per_instance, *flat])
        if got[0] == "tier":
            found = self._find(body["instance_id"], tenant)
            raise unknown_tier(int(got[1]), got[2], found[0].tiers if found else [])
        if got[0] == "cap":
            raise self.key_cap(body["instance_id"], ns, int(got[1]), len(events), int(got[2]))

    def _drop(self, body: dict[str, Any], tenant: str | None) -> Instance:
        found = self._find(body["instance_id"], tenant)
        ns, _ = self._session_call("drop", body, tenant, 0, [self._ms(self.expire_after)])
        self._meta.pop((ns, body["instance_id"]), None)
        self._run("disown", ["lmc:owner:" + body["instance_id"]], [ns])
        self._owner.pop(body["instance_id"], None)
        if found is None:
            raise wrong_session(body["instance_id"])
        return found[0]

    # ------------------------------------------------------------ reading
    def namespaces(self, namespace: str | None) -> list[str]:
        if namespace is not None:
            return [namespace]
        return sorted(self.call(lambda: self.r.smembers(NAMESPACES)))

    def _lookup_namespaces(self, namespace: str | None) -> list[str]:
        """:meth:`namespaces` for a lookup: a replica's list while the primary is away (the
        probe's resume keeps asking the primary: it closes the outage only when the primary's
        namespaces are all resumed)."""
        if namespace is not None:
            return [namespace]
        return self._read(lambda: self.namespaces(None),
                          lambda: sorted(self._on_replica(lambda r: r.smembers(NAMESPACES))))

    def _instance(self, ns: str, iid: str, epoch: int, meta: str, sig: str) -> Instance:
        got = self._meta.get((ns, iid))
        if got is not None and got[0] == meta and got[1].epoch == epoch:
            inst = got[1]
        else:  # first seen, or registered again since (whatever its epoch): built from the record
            if len(self._meta) > 10_000:
                self._meta.clear()
            m = json.loads(meta)
            inst = Instance(instance_id=iid, session="", namespace=ns, kv_signature=None, last_seen=0.0,
                            last_seen_wall=m["registered_at"], epoch=epoch, **m)
            self._meta[(ns, iid)] = (meta, inst)
        inst.kv_signature = sig or None
        return inst

    def _records(self, ns: str) -> tuple[int, list[tuple[Instance, int, dict[str, str]]]]:
        t = _tag(ns)
        got = self._run("list", [t + "leases"], [t, self._ms(self.expire_after), self._ms(self.instance_timeout)])
        out = []
        for iid, nkeys, flat in got[1:]:
            rec = dict(zip(flat[::2], flat[1::2]))
            inst = self._instance(ns, iid, int(rec["epoch"]), rec["meta"], rec.get("sig", ""))
            inst.last_seen_wall = float(rec.get("wall", inst.registered_at))
            inst.tier_stats = json.loads(rec.get("stats") or "{}")
            inst.events, inst.dropped_events = int(rec.get("events", 0)), int(rec.get("dropped", 0))
            inst.refused_events = int(rec.get("refused", 0))
            out.append((inst, int(nkeys), rec))
        return int(got[0]), out

    def list(self, namespace: str | None = None) -> list[dict[str, Any]]:
        rows = []
        for ns in self.namespaces(namespace):
            now, recs = self._records(ns)
            rows += [inst.public((now - int(rec["seen"])) / 1000, self.instance_timeout, nkeys)
                     for inst, nkeys, rec in recs]
        return sorted(rows, key=lambda r: r["instance_id"])

    def _find(self, iid: str, tenant: str | None, fresh: bool = True) -> tuple[Instance, float] | None:
        ns = self._ns_of(iid, tenant, fresh)
        if ns is None:
            return None
        now, r = self._run("get", [_tag(ns) + "i:" + iid], [])
        if r[0] is None:
            return None
        meta, epoch, sig, seen, wall, stats = r
        inst = self._instance(ns, iid, int(epoch), meta, sig)
        inst.last_seen_wall, inst.tier_stats = float(wall), json.loads(stats or "{}")
        return inst, (int(now) - int(seen)) / 1000

    def _stat(self, name: str) -> int:
        return sum(int(self.call(lambda: self.r.hget(_tag(ns) + "stats", name)) or 0) for ns in self.namespaces(None))

    @property
    def refused_events(self) -> int:
        return self._stat("refused_events")

    @property
    def refused_registrations(self) -> int:
        return self._stat("refused_registrations")

    def lookup_namespace(self, ns: str, q: Query) -> tuple[list[tuple[Instance, list[int], list[int]]], int]:
        """One namespace's holdings of ``q``: one script call (two the first time an
        instance of a new chunking is seen). Callable without HTTP (benchmarks)."""
        hashed: dict[str, tuple[list[int], list[str]]] = {}
        for _ in range(2):
            mode, groups = self._groups(ns, q, hashed)
            t = _tag(ns)
            keys, args = [t + "leases"], [t, q.model or "", mode, *groups]
            got = self._read(lambda: self._run("lookup", keys, args), lambda: self._lookup_stale(keys, args))
            # the chunkings of the namespace's live instances only: one no instance uses any more
            # is not hashed again (1,500 chunkings once seen slowed each lookup down: issue 44,
            # docs/benchmarks.md#measurements-behind-the-code)
            live = [ck for row in got[1:] if row[0] == "*ck" for ck in row[1:]]
            if live:
                self._chunkings[ns] = set(live)
            else:
                self._chunkings.pop(ns, None)
            if not any(row[0] != "*ck" and row[1] == "need" for row in got[1:]):
                break
        out, considered = [], 0
        for row in got[1:]:
            if row[0] == "*ck" or row[1] == "need":
                continue
            considered += 1
            if row[1] == "skip":
                continue
            iid, epoch, meta, sig, masks = row
            inst = self._instance(ns, iid, int(epoch), meta, sig)
            ck = _ck(inst)
            ends = hashed[ck][0] if ck in hashed else [(j + 1) * inst.chunk_size for j in range(len(masks))]
            out.append((inst, ends, [int(m) for m in masks]))
        return out, considered

    def _groups(self, ns: str, q: Query, hashed: dict[str, tuple[list[int], list[str]]]) -> tuple[str, list[Any]]:
        if q.keys is not None:
            return "k", ["*", len(q.keys), *q.keys]
        if q.hashes is not None:
            return "h", ["*", len(q.hashes), *q.hashes]
        groups: list[Any] = []
        for ck in sorted(self._chunkings.get(ns, ())):
            if ck not in hashed:
                size, algo, unfull = ck.split("|")
                k = (int(size), algo, unfull == "1")
                chunks = self._processors.get(k).chunks(q.tokens)  # bounded (limits.Processors)
                hashed[ck] = ([c.end for c in chunks], [c.chunk_hash for c in chunks])
            groups += [ck, len(hashed[ck][1]), *hashed[ck][1]]
        return "h", groups

    def _holdings(self, q: Query) -> tuple[list[tuple[Instance, list[int], list[int]]], int]:
        out, considered = [], 0
        for ns in self._lookup_namespaces(q.namespace):
            rows, n = self.lookup_namespace(ns, q)
            out += rows
            considered += n
        return out, considered


def _ck(inst: Instance) -> str:
    return f"{inst.chunk_size}|{inst.hash_algorithm}|{int(inst.save_unfull_chunk)}"
