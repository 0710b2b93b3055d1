"""The controller worker: the part of a cache engine that keeps the controller's index
of this instance true.

Started by :class:`~lmcache.engine.CacheEngine` when the config has
``controller: {url: ...}``. It registers the instance (id, API URL and token, namespace,
model, kv signature, chunking, tiers), heartbeats on a daemon thread, and reports what
the tiers admit and drop as batched events, fed by the hierarchy's listener
(:meth:`~lmcache.hierarchy.StorageHierarchy.add_listener`).

Why it is shaped like this: the engine must never wait for the controller. The listener
only appends to a bounded queue (it runs under a tier's lock, on the engine's path); one
thread does all the talking, with a timeout on every call. Events that cannot be
delivered (the queue is full, or the controller is down or restarted and forgot us) are
dropped and counted, and the index is then healed the only way that cannot drift: the
worker re-registers (the controller forgets what it knew of this instance) and sends a
full snapshot of its keys. Events queued after the snapshot was taken are sent after
it; admit/evict are idempotent set operations, so replaying them in order converges to
the tiers' real state. A batch the controller refuses for its key cap (429: this
instance would hold more keys than ``--max-keys-per-instance``) is dropped and counted
without a resync (a snapshot would be refused the same way); the index then lacks those
keys, and lookups under-report this instance until it re-registers.

Several controller URLs (``controller.url`` as a list; replicas): the client fails over
to the next URL when one does not answer (see
:mod:`lmcache.plugins.services.controller_client`). A replica that does not know this
instance's session (its own ``memory`` index) answers 404, and the worker registers again
at once on that replica and resends its snapshot; over the shared ``valkey`` index the
session stays valid and events keep flowing.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any

from lmcache.errors import AdminError, AuthError, NotFoundError
from .controller_client import ControllerClient

if TYPE_CHECKING:  # pragma: no cover
    from lmcache.config import Config
    from lmcache.services import EngineView

log = logging.getLogger(__name__)

#: how often the sending thread wakes to ship queued events (seconds)
FLUSH_INTERVAL = 0.05


class ControllerWorker:
    """Registers ``engine`` with the controller and keeps its index up to date until
    :meth:`close`."""

    @staticmethod
    def enabled(config: Config) -> bool:
        return bool(config.controller.url)

    def __init__(self, engine: EngineView):
        self.engine = engine
        self.cfg = cfg = engine.config.controller
        assert cfg.url, "the worker needs controller.url"
        self.instance_id = engine.instance_id
        self.client = ControllerClient(cfg.url, cfg.token, cfg.timeout)
        self._queue: queue.Queue[tuple[str, str, str]] = queue.Queue(maxsize=cfg.queue_size)
        self._session: str | None = None  # None: not registered
        #: a batch whose send failed without a "register again" (no answer, 5xx): sent
        #: again, before anything queued after it, once the controller answers
        self._pending: list[list[str]] = []
        #: set when an event could not be queued: the index missed it, so resync (a flag,
        #: not ``_session = None``, so that a resync in progress cannot clear it)
        self._need_resync = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._down_since: float | None = None
        #: counters (``stats()``): events sent, dropped (queue full or undeliverable),
        #: registrations (each with a snapshot) and failed calls
        self.sent_events = 0
        self.dropped_events = 0
        self.registrations = 0
        self.failed_calls = 0
        self._cap_said = -1  # the registration count when the key cap was last reported
        engine.hierarchy.add_listener(self._on_event)
        self._thread = threading.Thread(target=self._run, name="lmcache-controller-worker", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the engine's side
    def _on_event(self, op: str, tier: str, key: str) -> None:
        """Called by a tier under its lock: never blocks."""
        if self._stop.is_set():  # closing: other listeners chained after us still run
            return
        try:
            self._queue.put_nowait((op, tier, key))
        except queue.Full:
            self.dropped_events += 1
            self._need_resync = True
        if self._queue.qsize() >= self.cfg.batch_size:
            self._wake.set()

    @property
    def registered(self) -> bool:
        return self._session is not None and not self._need_resync

    def info(self) -> dict[str, Any]:
        return self.stats()

    def stats(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "controller": self.client.url,
            "registered": self.registered,
            "queued_events": self._queue.qsize(),
            "sent_events": self.sent_events,
            "dropped_events": self.dropped_events,
            "registrations": self.registrations,
            "failed_calls": self.failed_calls,
        }

    # ------------------------------------------------------------ the thread
    def _info(self) -> dict[str, Any]:
        from lmcache import __version__

        e = self.engine
        c = e.config
        api, p2p = e.service("api"), e.service("p2p")  # started before this one
        return {
            "instance_id": self.instance_id,
            "api_url": api.url if api is not None else None,
            "api_token": c.api.token if api is not None else None,
            "peer_url": p2p.url if p2p is not None else None,
            "namespace": c.namespace,
            "model": c.model,
            "kv_signature": e.kv_spec.signature if e.kv_spec is not None else None,
            "chunk_size": c.chunk_size,
            "hash_algorithm": c.hash_algorithm,
            "save_unfull_chunk": c.save_unfull_chunk,
            "tiers": [t.name for t in e.hierarchy.tiers],
            "tier_stats": self._tier_stats(),
            "heartbeat_interval": self.cfg.heartbeat_interval,
            "pid": os.getpid(),
            "version": __version__,
        }

    def _run(self) -> None:
        next_beat = 0.0
        retry_at = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            had_session = self._session is not None
            try:
                if self._session is None or self._need_resync:
                    if now >= retry_at:
                        self._resync()
                        next_beat = time.monotonic() + self.cfg.heartbeat_interval
                else:
                    self._send_events()
                    if now >= next_beat:
                        self._heartbeat()
                        next_beat = now + self.cfg.heartbeat_interval
                if self._down_since is not None and self._session is not None:
                    if had_session:
                        log.warning("controller %s answers again after %.1fs; session kept, no event lost",
                                    self.client.url, time.monotonic() - self._down_since)
                    else:
                        log.warning(
                            "controller %s: registered again as %s after %.1fs; index resynced (%d events dropped so far)",
                            self.client.url, self.instance_id, time.monotonic() - self._down_since, self.dropped_events,
                        )
                    self._down_since = None
            except (AdminError, OSError, ValueError) as exc:
                self._failed(exc)
                # a controller that answered "register again" (404: restarted, or another
                # replica with its own index) is registered with at once; others are retried later
                # with the session kept
                again = had_session and isinstance(exc, NotFoundError)
                retry_at = time.monotonic() + (0.0 if again else self.cfg.heartbeat_interval)
            except Exception:  # never let the worker die
                log.exception("controller worker: unexpected error")
                self._session = None
                retry_at = time.monotonic() + self.cfg.heartbeat_interval
            wait = FLUSH_INTERVAL if self._session is not None else max(0.0, retry_at - time.monotonic())
            self._wake.wait(min(wait, self.cfg.heartbeat_interval))
            self._wake.clear()

    def _failed(self, exc: BaseException) -> None:
        """A call failed. Only "register again" (404) ends the session: a controller that
        did not answer, or answered 5xx (its index unavailable: Valkey failing over), still
        knows it, so the session and the unsent batch are kept and sent again later. A
        lease does not lapse while the index itself is away (the Valkey index extends live
        leases by its outage); while only this worker cannot reach the controllers it may,
        and lookups then skip this instance until the next heartbeat renews it. Re-registering instead would start a new epoch whose entries count
        only once the whole snapshot is sent again."""
        self.failed_calls += 1
        if isinstance(exc, NotFoundError) or self._session is None:
            self._session = None
            if self._pending:
                self.dropped_events += len(self._pending)  # the snapshot that follows holds them
                self._pending = []
        if self._down_since is None:
            self._down_since = time.monotonic()
            if isinstance(exc, AuthError):
                log.error("controller %s refused this instance's token: %s", self.client.url, exc)
            elif self._session is None:
                log.warning("controller %s: %s; retrying every %gs, then registering again with a snapshot of "
                            "every key", self.client.url, exc, self.cfg.heartbeat_interval)
            else:
                log.warning("controller %s: %s; keeping this session and its unsent events, retrying every %gs",
                            self.client.url, exc, self.cfg.heartbeat_interval)
        else:
            log.debug("controller %s still failing: %s", self.client.url, exc)

    def _resync(self) -> None:
        """Register (the controller forgets what it knew of us) and send every key."""
        self._need_resync = False  # before the snapshot: a drop after this point resyncs again
        dropped = 0
        while True:  # events before the snapshot are in the snapshot
            try:
                self._queue.get_nowait()
                dropped += 1
            except queue.Empty:
                break
        if self.registrations:
            self.dropped_events += dropped + len(self._pending)
        self._pending = []
        snapshot = [["admit", t.name, k] for t in self.engine.hierarchy.tiers for k, _ in t.keys()]
        # the session is ours: a register retried on another replica after a timeout is then
        # the same registration there, not a second one that voids the session we hold
        r = self.client.register({**self._info(), "session": secrets.token_hex(16)})
        session = r.get("session") if isinstance(r, dict) else None
        if not isinstance(session, str):
            raise AdminError(f"controller {self.client.url} answered register without a session: {r!r}")
        for i in range(0, len(snapshot), self.cfg.batch_size):
            part = snapshot[i : i + self.cfg.batch_size]
            try:
                self.client.events(self.instance_id, session, part)
            except AdminError as exc:
                if not self._over_cap(exc, len(snapshot) - i):
                    raise
                break
        self.sent_events += len(snapshot)
        self.registrations += 1
        self._session = session
        log.info("registered %s with controller %s (%d keys)", self.instance_id, self.client.url, len(snapshot))

    def _send_events(self) -> None:
        while self._session is not None:
            batch, self._pending = self._pending, []
            while len(batch) < self.cfg.batch_size:
                try:
                    batch.append(list(self._queue.get_nowait()))
                except queue.Empty:
                    break
            if not batch:
                return
            try:
                self.client.events(self.instance_id, self._session, batch)
            except AdminError as exc:
                if self._over_cap(exc, len(batch)):
                    continue
                if isinstance(exc, NotFoundError):
                    self.dropped_events += len(batch)  # register again: the snapshot holds them
                else:
                    self._pending = batch  # admit/evict are idempotent: sending it twice is harmless
                raise
            except (OSError, ValueError):
                self._pending = batch
                raise
            self.sent_events += len(batch)

    def _over_cap(self, exc: AdminError, n: int) -> bool:
        """Whether ``exc`` is the controller's key cap (429); then the ``n`` events are
        dropped and counted, said once per registration, and no resync follows."""
        if getattr(exc, "status", None) != 429:
            return False
        self.dropped_events += n
        if self._cap_said != self.registrations:
            self._cap_said = self.registrations
            log.warning("controller %s refused events of %s: %s; lookups will miss some of this instance's keys",
                        self.client.url, self.instance_id, exc)
        return True

    def _tier_stats(self) -> list[dict[str, Any]]:
        """Per tier what the controller shows of it (``TIER_STATS`` of
        :mod:`lmcache.server.limits`): usage, counters, hit rate, backoff."""
        from lmcache.server.limits import TIER_STATS

        out = []
        for t in self.engine.hierarchy.tiers:
            info = t.info()
            row = {k: info.get(k) for k in TIER_STATS if k in info}
            row.update(name=t.name, retry_in_s=round(t.retry_in(), 3))
            if row.get("write_refused") is not None:
                row["write_refused"] = str(row["write_refused"])[:200]
            out.append(row)
        return out

    def _heartbeat(self) -> None:
        assert self._session is not None
        spec = self.engine.kv_spec
        try:
            self.client.heartbeat(
                self.instance_id, self._session,
                kv_signature=spec.signature if spec is not None else None,
                dropped_events=self.dropped_events, tier_stats=self._tier_stats(),
            )
        except NotFoundError:  # the controller restarted or expired us: register again
            self._session = None
            raise

    # ------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop the thread, ship what is queued (one try) and deregister, so that the
        instance leaves lookups at once rather than after the heartbeat timeout. The
        hierarchy's listener stays in place (the KV-event publisher may be chained after
        ours); ours ignores events from now on."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=self.cfg.timeout * 3 + 1)
        session = self._session
        if session is None:
            return
        try:
            self._send_events()
            self.client.deregister(self.instance_id, session)
        except (AdminError, OSError, ValueError) as exc:
            log.debug("controller %s: deregister failed: %s", self.client.url, exc)
        self._session = None


__all__ = ["ControllerWorker"]
