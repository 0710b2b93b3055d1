"""The ``memory`` controller index (:class:`Index`): every instance's record and keys in
this process, behind one lock (:mod:`lmcache.server.index` holds what the memory and
Valkey indexes share; :mod:`lmcache.server.index_valkey` the other)."""

from __future__ import annotations

import hmac
import logging
import threading
import time
from typing import Any, Callable

from ..auth import ADMIN, foreign
from .http import HTTPError
from .index import IndexBase, Instance, Query, tier_bit, tier_stats, unknown_tier, wrong_session

log = logging.getLogger("lmcache.server.controller")


class Index(IndexBase):
    """The ``memory`` index: everything in this process. Thread-safe."""

    def __init__(self, instance_timeout: float, expire_after: float, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, **caps: int):
        super().__init__(instance_timeout, expire_after, **caps)
        #: refusals by the caps: events (of refused batches) and registrations
        self.refused_events = 0
        self.refused_registrations = 0
        self.clock = clock
        self.wall_clock = wall_clock
        self.lock = threading.Lock()
        self.instances: dict[str, Instance] = {}
        self._epochs: dict[str, int] = {}

    def _put(self, inst: Instance, tenant: str | None) -> Instance:
        iid = inst.instance_id
        inst.last_seen, inst.last_seen_wall = self.clock(), self.wall_clock()
        with self.lock:
            old = self.instances.get(iid)
            if old is not None and foreign(tenant, old.namespace):
                raise HTTPError(409, f"instance id {iid!r} is taken by another namespace's instance")
            if tenant is not ADMIN:  # iid registering again does not count twice
                n = sum(1 for i in self.instances.values() if i.namespace == tenant and i.instance_id != iid)
                if n >= self.max_instances_per_tenant:
                    self.refused_registrations += 1
                self.instance_cap(iid, tenant, n)
            if old is not None and hmac.compare_digest(old.session, inst.session):
                old.last_seen, old.last_seen_wall, old.retried = inst.last_seen, inst.last_seen_wall, True
                return old  # a retry of the same registration (its session chosen by the worker)
            inst.epoch = self._epochs[iid] = self._epochs.get(iid, 0) + 1
            self.instances[iid] = inst  # the old one's keys go with it
        return inst

    def _session(self, body: dict[str, Any], tenant: str | None = ADMIN) -> Instance:
        """The caller's instance, seen now; 404 if unknown, of another tenant or an
        older session (the worker then registers again). Called under the lock."""
        inst = self.instances.get(body["instance_id"])
        if inst is None or foreign(tenant, inst.namespace) or not hmac.compare_digest(inst.session, body["session"]):
            raise wrong_session(body["instance_id"])
        inst.last_seen = self.clock()
        inst.last_seen_wall = self.wall_clock()
        return inst

    def _beat(self, body: dict[str, Any], tenant: str | None, sig: str | None) -> None:
        with self.lock:
            inst = self._session(body, tenant)
            if body.get("tier_stats") is not None:
                inst.tier_stats = tier_stats(body["tier_stats"], inst.tiers)
            if sig is not None:
                inst.kv_signature = sig
            if body.get("dropped_events") is not None:
                inst.dropped_events = body["dropped_events"]

    def _apply(self, body: dict[str, Any], tenant: str | None, events: list) -> None:
        with self.lock:
            inst = self._session(body, tenant)
            tiers, keys = inst.tiers, inst.keys
            bits = []
            for i, (_, tier, _) in enumerate(events):
                b = tier_bit(tiers, tier)
                if not b:
                    raise unknown_tier(i, tier, tiers)
                bits.append(b)
            touched: dict[str, int] = {}
            for (op, _, key), b in zip(events, bits):
                m = touched[key] if key in touched else keys.get(key)
                touched[key] = m | b if op == "admit" else m & ~b
            n = len(keys)
            after = n + sum(1 for k, m in touched.items() if m and not keys.get(k)) \
                - sum(1 for k, m in touched.items() if not m and keys.get(k))
            if after > self.max_keys_per_instance and after > n:
                err = self.key_cap(inst.instance_id, inst.namespace, after, len(events), inst.refused_events)
                inst.refused_events += len(events)
                self.refused_events += len(events)
                raise err
            for k, m in touched.items():
                keys.set(k, m)
            inst.events += len(events)

    def _drop(self, body: dict[str, Any], tenant: str | None) -> Instance:
        with self.lock:
            inst = self._session(body, tenant)
            del self.instances[inst.instance_id]
        return inst

    def expire(self) -> list[str]:
        now = self.clock()
        with self.lock:
            gone = [iid for iid, inst in self.instances.items() if now - inst.last_seen > self.expire_after]
            for iid in gone:
                del self.instances[iid]
        for iid in gone:
            log.warning("instance %s: no heartbeat for %gs; forgotten", iid, self.expire_after)
        return gone

    def list(self, namespace: str | None = None) -> list[dict[str, Any]]:
        now = self.clock()
        with self.lock:
            chosen = [i for i in self.instances.values() if namespace is None or i.namespace == namespace]
            return [i.public(now - i.last_seen, self.instance_timeout) for i in sorted(chosen, key=lambda i: i.instance_id)]

    def _holdings(self, q: Query) -> tuple[list[tuple[Instance, list[int], list[int]]], int]:
        now = self.clock()
        with self.lock:
            candidates = [
                i for i in self.instances.values()
                if now - i.last_seen <= self.instance_timeout and (q.namespace is None or i.namespace == q.namespace)
                and (q.model is None or i.model == q.model)
            ]
        hashed: dict[tuple[int, str, bool], tuple[list[int], list[str]]] = {}
        plans = [(inst, c) for inst in candidates if (c := self.chain(inst, q, hashed)) is not None]
        out = []
        with self.lock:
            for inst, (ends, items, prefix) in plans:
                if self.instances.get(inst.instance_id) is not inst:
                    continue  # re-registered or gone meanwhile
                masks = []
                for k in items:
                    m = inst.keys.get(k) if prefix is None else inst.keys.get_hash(prefix, k)
                    if not m:
                        break
                    masks.append(m)
                out.append((inst, ends, masks))
        return out, len(candidates)

    def _find(self, iid: str, tenant: str | None) -> tuple[Instance, float] | None:
        with self.lock:
            inst = self.instances.get(iid)
        if inst is None or foreign(tenant, inst.namespace):
            return None
        return inst, self.clock() - inst.last_seen


__all__ = ["Index"]
