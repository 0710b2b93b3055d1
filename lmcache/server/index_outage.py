"""Leases across an outage of the ``valkey`` index (issue 44 item 2): a lease must not
lapse because the index itself was away.

Why: a lease deadline is kept in Valkey's clock (``lmc:{ns}:leases``), and only a call
that reaches Valkey renews it. While the index is unreachable (its primary killed until a
Sentinel promotes the replica, a restart, a freeze) no heartbeat can land, yet Valkey's
clock runs on: Sentinel promoted the replica 2.2 s after the primary's SIGKILL, the
engines' 2 s leases had all run out on the new primary, and lookups answered 200
without live engines' entries until their next heartbeats.

The rule: **lease time counts only while the index is reachable.** Each controller
notices an outage itself (a call that could not reach Valkey; the reaper's probe every
second notices one with no traffic) and keeps the time of its last call that did reach
Valkey, ``s``. Before its first script on a namespace after the outage (a lookup or a
heartbeat included) it runs :data:`RESUME` there, which pauses that namespace's lease clock
over the time nobody reached it (the probe does the namespaces no call touched, then
closes the outage):

- ``m`` = the latest ``seen`` (last call that landed) of the namespace's instances whose
  lease was live at ``s``; the namespace was unreachable for at most ``now - max(s, m)``
  (a write at ``m`` proves it was reachable then, for someone);
- every lease live at ``s`` moves forward by that much (and ``seen`` with it, so
  ``healthy`` and the age in ``/v1/instances`` agree), never past ``now +
  instance_timeout``: a fresh lease, as if its heartbeat had landed at the return.

Sound against the other cases: a lease that had lapsed before ``s``, or before a later
heartbeat landed, is not revived; a controller cut off alone (the index up, other
replicas renewing leases) finds ``m`` recent and moves leases by the time since the last
landed heartbeat only; replicas that each saw the same outage do not add it twice (the
first moves ``seen`` to the return, so the next finds ``m`` there). What it costs: an
instance that died after the last heartbeat that landed in its namespace keeps the rest
of its lease, at most ``instance_timeout``, once the controller resumes. A call waits for
its own namespace only, so on a Cluster the namespaces of the nodes that answer go on.

While the primary is still away, lookups over ``valkey+sentinel://`` are read from a
replica, where nothing can be written: the read-only lookup there
(``valkey_scripts._LOOKUP_STALE``) counts exactly the leases this resume would keep live
(those live at ``s`` that hold at ``max(s, m)``), so its answers and the first ones after
the resume agree.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .http import HTTPError

log = logging.getLogger("lmcache.server.controller")

# KEYS leases; ARGV key base 'lmc:{ns}:', ms since the last call that reached the index, lease ms.
# Answers {leases moved, by ms}.
RESUME = """
local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local s = now - tonumber(ARGV[2])
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], s, '+inf', 'WITHSCORES')
local m, live = s, {}
for j = 1, #ids, 2 do
  local seen = redis.call('HGET', ARGV[1] .. 'i:' .. ids[j], 'seen')
  if seen then
    live[#live + 1] = {ids[j], tonumber(ids[j + 1])}
    if tonumber(seen) > m then m = tonumber(seen) end
  end
end
local gap = now - m
if gap <= 0 or #live == 0 then return {0, 0} end
local cap = now + tonumber(ARGV[3])
for _, x in ipairs(live) do
  redis.call('ZADD', KEYS[1], math.max(x[2], math.min(x[2] + gap, cap)), x[1])
  redis.call('HINCRBY', ARGV[1] .. 'i:' .. x[1], 'seen', gap)
end
return {#live, gap}
"""

_local = threading.local()


def away(exc: BaseException) -> bool:
    """Whether ``exc`` means Valkey could not be reached (no answer, a replica that does
    not take writes, a cluster slot not served), not an answer it gave (a script error)."""
    import redis
    from redis import exceptions as e

    return isinstance(exc, (redis.ConnectionError, redis.TimeoutError, e.ReadOnlyError, e.ClusterDownError,
                            e.TryAgainError, e.RedisClusterException, OSError))


class LeaseGuard:
    """One controller's view of the index's reachability (see the module's doc):
    :meth:`ok` and :meth:`failed` after each Valkey call; :meth:`before` before each
    namespace's script, which resumes that namespace's leases first while an outage is
    open (a call waits for its own namespace only: on a Cluster a node fails alone);
    :meth:`sweep` (the probe) resumes the others and closes the outage."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.since: float | None = None  # monotonic time of the last reaching call before an outage
        self._ok_at: float | None = None
        self._done: set[str] = set()  # namespaces resumed since the last failure
        self._failures = 0  # away-failures seen: a resume counts only if none came while it ran
        self._locks: dict[str, threading.Lock] = {}
        self._now = [0, 0]  # leases moved in the current outage, the largest move (ms)
        #: outages resumed, and leases moved in all (tests and the log show them)
        self.resumed = 0
        self.moved = 0

    def ok(self) -> None:
        self._ok_at = time.monotonic()

    def failed(self, exc: BaseException) -> None:
        if away(exc):
            if self.since is None:
                self.since = self._ok_at if self._ok_at is not None else time.monotonic()
            self._failures += 1
            self._done = set()  # away again: a namespace resumed before is resumed again (from its own m)

    def before(self, ix: Any, key: str) -> None:
        """Resume the leases of ``key``'s namespace if an outage is open and it is not yet
        done (one thread does it, others wait at most the call timeout); 503 while it
        cannot be reached."""
        if self.since is None or getattr(_local, "inside", False) or not key.startswith("lmc:{"):
            return
        ns = key[5:key.find("}:")]
        if ns in self._done:
            return
        lock = self._locks.setdefault(ns, threading.Lock())
        if not lock.acquire(timeout=self.timeout):
            raise HTTPError(503, "index unavailable: resuming the leases after an outage")
        try:
            if self.since is not None and ns not in self._done:
                self._resume(ix, ns, self.since)
        finally:
            lock.release()

    def sweep(self, ix: Any) -> None:
        """Resume every namespace not yet done, then close the outage (the probe calls it)."""
        since = self.since
        if since is None:
            return
        for ns in ix.namespaces(None):
            self.before(ix, "lmc:{" + ns + "}:leases")
        if self.since == since and self._done >= set(ix.namespaces(None)):
            log.warning("index reachable again after an outage: %d leases of %d namespaces moved forward by the "
                        "time it was away (at most %d ms)", self._now[0], len(self._done), self._now[1])
            self.since = None
            self._done, self._locks, self._now = set(), {}, [0, 0]
            self.resumed += 1

    def _resume(self, ix: Any, ns: str, since: float) -> None:
        t, failures = "lmc:{" + ns + "}:", self._failures
        _local.inside = True
        try:
            n, gap = ix._run("resume", [t + "leases"], [t, ix._ms(time.monotonic() - since),
                                                        ix._ms(ix.instance_timeout)])
        finally:
            _local.inside = False
        if failures == self._failures:
            self._done.add(ns)
        self.moved += int(n)
        self._now = [self._now[0] + int(n), max(self._now[1], int(gap))]
