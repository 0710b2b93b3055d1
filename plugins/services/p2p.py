"""Peer-to-peer transfer: instances fetch chunks from each other (P2P) and push KV to
one another (prefill -> decode, and the controller's ``move``).

Why the peer endpoint is an ``lmcache server``: chunks already cross the network as
self-describing payloads over the framed protocol of :mod:`lmcache.server.cache` (the ``lm``
backend's), pipelined, with a token and bounded allocation. A peer endpoint is that
server with a different store (:class:`EngineStore`): the engine's own tiers. A GET
encodes the hierarchy's object as a payload on the fly (the raw codec: a header and a
view of the chunk's memory, sent without a copy and held until it is out); a PUT is
decoded, checked (payload checksums, the key's namespace, model and kv signature, the
chunk's shape) and put into the top tier, or into a named tier when the key is sent as
``@TIER|KEY``. DELETE is not served (a peer never removes another's entries); LIST
lists the tiers' keys.

Why fetching asks the controller: it already knows which instance holds which chunk.
On a local miss the engine asks it (``lookup`` by keys, for the chunks after the local
prefix), picks the instance holding the longest continuation that runs an endpoint,
fetches those chunks with the ``lm`` backend's pipelined client, checks them and puts
them into its own hierarchy, so they are cached locally from then on and the retrieve
that follows serves them as local hits.

Why every failure is a miss: a peer or the controller that is down, slow, or refuses
the token must not crash or stall the engine. Each call has ``p2p.timeout``; a peer that
failed is skipped with a growing backoff (0.5 s doubling up to 30 s), and said once per
outage, not once per call.

All peers of a cluster share one token (``p2p.token``), and it never crosses the wire:
peers run the mutual handshake of :mod:`lmcache.auth`, the endpoint proving it knows the
token before the client does, and announcing its instance id, which the client checks
against the instance it resolved (through the controller). A listener registered as a
peer without the token, or a relay to another peer, gets neither a proof nor a request.

Why a tenant cannot choose where to push: a push to an address a request names would
let any API caller point this instance at a listener of its own. A tenant token
(``api.tenants``) may push only to an instance id that the controller has registered in
the tenant's namespace; ``lm://`` addresses are for the admin token and the Python API.
The endpoint serves (GET, EXISTS, LIST) and accepts (PUT) keys of this instance's
namespace and model only, also when its tiers are shared with other namespaces.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from lmcache import payload
from lmcache.server import cache as proto
from lmcache.errors import AdminError, BackendError, CorruptPayloadError, KVShapeError, NotFoundError
from lmcache.keys import CacheKey, Chunk
from lmcache.memory import MemoryObj, MemoryPool

if TYPE_CHECKING:  # pragma: no cover
    from lmcache.config import Config, P2PConfig
    from lmcache.services import EngineView

log = logging.getLogger(__name__)

BACKOFF_START = 0.5
BACKOFF_MAX = 30.0
#: requests per pipelined round trip to a peer
BATCH = 16


def peer_url(host: str, port: int) -> str:
    return f"lm://[{host}]:{port}" if ":" in host else f"lm://{host}:{port}"


def split_tier(key: str) -> tuple[str | None, str]:
    """``@TIER|KEY`` -> (TIER, KEY); a plain key -> (None, KEY)."""
    if key.startswith("@"):
        tier, sep, rest = key[1:].partition("|")
        if sep and tier:
            return tier, rest
        raise ValueError(f"malformed tier prefix in {key[:100]!r}: expected @TIER|KEY")
    return None, key


class _Held(list):
    """A GET answer: the payload's buffers, and the object whose memory they view
    (released by the server once the buffers are sent)."""

    obj: MemoryObj


# ------------------------------------------------------------------ the endpoint's store
class EngineStore:
    """:class:`lmcache.server.ServedStore` over a cache engine's hierarchy."""

    def __init__(self, engine: EngineView):
        self.engine = engine
        self.chunks = engine.chunks
        self.hierarchy = engine.hierarchy
        self.raw = self.hierarchy.codec("raw")
        self.capacity = sum(t.capacity for t in self.hierarchy.tiers)
        self._why = threading.local()
        #: counters: chunks served to peers and received from them, refused PUTs
        self.served = self.received = self.refused = 0

    def _own(self, key: str) -> bool:
        """Whether ``key`` is of this instance's namespace and model."""
        try:
            ck = CacheKey.parse(key)
        except ValueError:
            return False
        cfg = self.engine.config
        return ck.namespace == cfg.namespace and ck.model == cfg.model

    # -- reads
    def get_one(self, key: str) -> _Held | None:
        try:
            tier, key = split_tier(key)
        except ValueError:
            return None
        if not self._own(key):
            return None
        try:  # passed on as stored: the peer's own gateway checks it
            r = self.chunks.find([key], tier=tier, prefix=False, raw=True)[0]
        except KeyError:
            return None
        if r is None:
            return None
        obj = r[0]
        try:
            out = _Held(payload.encode(key, obj, self.raw))
        except BaseException:
            obj.unref()
            raise
        out.obj = obj
        self.served += 1
        return out

    def release(self, value: _Held) -> None:
        value.obj.unref()

    def exists_one(self, key: str) -> bool:
        try:
            tier, key = split_tier(key)
            if not self._own(key):
                return False
            return self.chunks.exists([key], tier)[0]
        except (ValueError, KeyError):
            return False

    def delete_one(self, key: str) -> bool:
        return False  # a peer never removes another instance's entries

    def snapshot(self, prefix: str = "") -> list[tuple[str, int]]:
        seen: dict[str, int] = {}
        for t in self.hierarchy.tiers:
            for k, _ in t.keys():
                if k.startswith(prefix) and k not in seen and self._own(k):
                    seen[k] = t.size_of(k) or 0
        return sorted(seen.items())

    def stats(self) -> dict[str, Any]:
        tiers = self.hierarchy.tiers
        return {
            "used_bytes": sum(t.used for t in tiers), "capacity_bytes": self.capacity,
            "entries": len({k for t in tiers for k, _ in t.keys()}),
            "evictions": sum(t.stats.evictions for t in tiers),
            "served_chunks": self.served, "received_chunks": self.received, "refused_puts": self.refused,
        }

    # -- writes
    def refusal(self, value: Any) -> str:
        return getattr(self._why, "msg", "refused")

    def _refuse(self, msg: str) -> bool:
        self._why.msg = msg
        self.refused += 1
        log.info("peer endpoint: refused a PUT: %s", msg)
        return False

    def put_one(self, key: str, value: bytearray | memoryview) -> bool:
        e = self.engine
        try:
            tier_name, key = split_tier(key)
            ck = CacheKey.parse(key)
        except ValueError as exc:
            return self._refuse(str(exc))
        if ck.namespace != e.config.namespace or ck.model != e.config.model:
            return self._refuse(f"key of namespace {ck.namespace!r}, model {ck.model!r}: this instance serves "
                                f"namespace {e.config.namespace!r}, model {e.config.model!r}")
        spec = e.kv_spec
        if spec is None:
            return self._refuse("this instance does not know its KV shape yet (no kv_spec)")
        if ck.signature != spec.signature:
            return self._refuse(f"kv signature {ck.signature} differs from this instance's {spec.signature}")
        try:
            into = self.hierarchy.tier(tier_name) if tier_name is not None else self.hierarchy.tiers[0]
        except KeyError as exc:
            return self._refuse(str(exc.args[0]))

        def allocate(shape: Sequence[int], dtype: Any) -> MemoryObj:
            obj = self.chunks.allocate(shape, dtype)  # checked before a byte is allocated
            if obj is None:
                raise MemoryError("no room in the memory pool")
            return obj

        try:
            obj = payload.decode(value, key, self.hierarchy.codec, allocate)
        except (CorruptPayloadError, KVShapeError, MemoryError) as exc:
            return self._refuse(str(exc))
        ok = self.chunks.put_one(key, obj, tier=tier_name)  # (takes over obj's reference)
        if not ok and (tier_name is not None or len(self.hierarchy.tiers) == 1):  # else queued below
            return self._refuse(f"tier {into.name} did not take it (full or down)")
        self.received += 1
        return True


class PeerEndpoint:
    """This engine's peer endpoint: an :class:`lmcache.server.CacheServer` over
    :class:`EngineStore`, serving on a daemon thread until :meth:`close`."""

    def __init__(self, engine: EngineView, cfg: P2PConfig):
        from lmcache.errors import ConfigError

        self.store = EngineStore(engine)
        self.server = proto.CacheServer(cfg.host, cfg.port, token=cfg.token, store=self.store,
                                        name="lmcache peer endpoint", identity=engine.instance_id,
                                        legacy_auth=False)
        try:
            self.server.bind()
        except OSError as exc:
            raise ConfigError("p2p.port", f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}") from None
        self.server.start()
        host, port = self.server.address
        if host in ("0.0.0.0", "::"):  # bound to every interface: advertise a name peers can resolve
            host = socket.getfqdn()
        self.url = peer_url(host, port)
        log.info("lmcache peer endpoint listening on %s", self.url)

    def close(self) -> None:
        self.server.close()


# ------------------------------------------------------------------ the client side
@dataclass
class _PeerHealth:
    failures: int = 0
    down_until: float = 0.0
    since: float = 0.0


class Peers:
    """Clients to other instances' endpoints (one ``lm`` backend per address and tier
    prefix, each with its connection pool), with a backoff per address."""

    def __init__(self, engine: EngineView, cfg: P2PConfig):
        self.engine = engine
        self.cfg = cfg
        self._clients: dict[tuple[str, str, str | None], Any] = {}
        self._health: dict[str, _PeerHealth] = {}
        self._lock = threading.Lock()

    def _allocate(self, shape: Sequence[int], dtype: Any) -> MemoryObj:
        obj = self.engine.hierarchy.allocate(shape, dtype)
        return obj if obj is not None else MemoryPool.allocate_unpooled(shape, dtype)

    def client(self, url: str, prefix: str = "", peer_id: str | None = None):
        """The client of the endpoint at ``url``; with ``peer_id``, the endpoint must
        announce that instance id in the handshake (see :mod:`lmcache.auth`)."""
        from lmcache.storage import BackendContext
        from lmcache.encoded import open_objects

        with self._lock:
            c = self._clients.get((url, prefix, peer_id))
            if c is None:
                h = self.engine.hierarchy
                LMBackend = h.registries.backends.load("lm")  # a peer speaks the lm server protocol
                opts = LMBackend.check_options({"url": url, "timeout": self.cfg.timeout, "token": self.cfg.token,
                                                "peer_id": peer_id, "prefix": prefix, "batch": BATCH})
                ctx = BackendContext(f"peer {url}", 1 << 62, opts, h.codec("raw"), h.codec, self._allocate,
                                     self.engine.clock)
                c = self._clients[(url, prefix, peer_id)] = open_objects(LMBackend(ctx))
            return c

    def available(self, url: str) -> bool:
        h = self._health.get(url)
        return h is None or self.engine.clock() >= h.down_until

    def failed(self, url: str, what: str, exc: BaseException) -> None:
        with self._lock:
            h = self._health.setdefault(url, _PeerHealth())
            h.failures += 1
            now = self.engine.clock()
            h.down_until = now + min(BACKOFF_START * 2 ** (h.failures - 1), BACKOFF_MAX)
            first = h.failures == 1
            if first:
                h.since = now
        if first:
            log.warning("peer %s: %s failed (%s); treating it as a miss and retrying with backoff", url, what, exc)
        else:
            log.debug("peer %s: %s failed again: %s", url, what, exc)

    def ok(self, url: str) -> None:
        h = self._health.pop(url, None)
        if h is not None and h.failures:
            log.warning("peer %s: answering again after %d failed calls", url, h.failures)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()


@dataclass
class P2PStats:
    lookups: int = 0  # controller lookups for missing chunks
    fetched_chunks: int = 0
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0
    failed_fetches: int = 0
    rejected_chunks: int = 0  # wrong shape (payload checks failing count in the peer client)
    pushed_chunks: int = 0
    pushed_bytes: int = 0


class P2P:
    """An engine's peer-to-peer part (the ``p2p`` service, ``p2p.enabled``): its endpoint,
    fetch on miss (a miss filler), push."""

    @staticmethod
    def enabled(config: Config) -> bool:
        return config.p2p.enabled

    def __init__(self, engine: EngineView):
        self.engine = engine
        self.cfg = cfg = engine.config.p2p
        self.stats = P2PStats()
        self.peers = Peers(engine, cfg)
        self.endpoint = PeerEndpoint(engine, cfg)
        self._controller = None
        ctl = engine.config.controller
        if ctl.url:
            from lmcache.plugins.services.controller_client import ControllerClient

            self._controller = ControllerClient(ctl.url, ctl.token, min(cfg.timeout, ctl.timeout))
        elif cfg.fetch:
            log.info("p2p.fetch is on but no controller.url is set: this instance only serves its endpoint")
        self._ctl_down = False
        if self.fetching:
            engine.add_miss_filler(self.fill)

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def fetching(self) -> bool:
        return self.cfg.fetch and self._controller is not None

    # ------------------------------------------------------------ fetch on miss
    def fill(self, chunks: Sequence[Chunk], keys: Sequence[str], have: int) -> int:
        """Fetch the chunks after the local prefix (``keys[have:]``) from the peer that
        holds the longest run of them, and put them into the hierarchy. Returns the
        number fetched (0 on any failure)."""
        missing = list(keys[have:])
        if not missing or not self.fetching:
            return 0
        self.stats.lookups += 1
        try:
            r = self._controller.lookup(keys=missing)  # type: ignore[union-attr]
        except (AdminError, OSError, ValueError) as exc:
            if not self._ctl_down:
                log.warning("p2p: controller lookup failed (%s); local misses stay misses until it answers", exc)
                self._ctl_down = True
            return 0
        if self._ctl_down:
            log.warning("p2p: the controller answers lookups again")
            self._ctl_down = False
        me = self.engine.instance_id
        for row in r.get("results", []) if isinstance(r, dict) else []:
            url, iid = row.get("peer_url"), row.get("instance_id")
            if iid == me or not isinstance(url, str) or not isinstance(iid, str) or not self.peers.available(url):
                continue
            n = min(int(row.get("hit_chunks") or 0), len(missing))
            if n <= 0:
                continue
            got = self._fetch_from(url, chunks[have : have + n], missing[:n], peer_id=iid)
            if got:
                return got
        return 0

    def _fetch_from(self, url: str, chunks: Sequence[Chunk], keys: Sequence[str], peer_id: str | None = None) -> int:
        t0 = time.perf_counter()
        try:
            objs = self.peers.client(url, peer_id=peer_id).get(keys)
        except (BackendError, OSError) as exc:
            self.stats.failed_fetches += 1
            self.peers.failed(url, "fetch", exc)
            return 0
        self.peers.ok(url)
        got = nbytes = 0
        objs = list(objs)
        try:  # the prefix up to the first chunk missing or not of this engine's shape
            for j, (chunk, key) in enumerate(zip(chunks, keys)):
                obj, objs[j] = objs[j], None
                if obj is None:
                    break
                if not self.engine.chunks.fits(obj, chunk.num_tokens):
                    log.error("peer %s sent %s for %s; dropping it", url, obj, key)
                    self.stats.rejected_chunks += 1
                    obj.unref()
                    break
                nbytes += obj.nbytes
                self.engine.chunks.put_one(key, obj, num_tokens=chunk.num_tokens)  # (takes over obj's reference)
                got += 1
        finally:
            for obj in objs:
                if obj is not None:
                    obj.unref()
        self.stats.fetched_chunks += got
        self.stats.fetched_bytes += nbytes
        self.stats.fetch_seconds += time.perf_counter() - t0
        return got

    # ------------------------------------------------------------ push
    def resolve(self, target: str, namespace: str | None = None) -> tuple[str, str | None]:
        """``(url, instance id)`` of a push target: an instance id looked up in the
        controller's instances (the endpoint must then announce that id), or, without
        ``namespace``, a peer URL (``lm://host:port``) as given (``(url, None)``). With
        ``namespace`` (a tenant's push) only an instance of that namespace is a target:
        an address is an :class:`AdminError` of status 403, another namespace's instance
        unknown (:class:`NotFoundError`)."""
        if "://" in target:
            if namespace is not None:
                err = AdminError(f"a tenant token may push only to an instance id registered with the controller in "
                                 f"namespace {namespace!r}, not to an address ({target[:100]!r})")
                err.status = 403  # type: ignore[misc]
                raise err
            if not target.startswith("lm://"):
                raise ValueError(f"{target[:100]!r} is not an lm://host:port address")
            return target, None
        if self._controller is None:
            raise ValueError(f"{target!r} is not an lm://host:port address and no controller.url is set to resolve it")
        for inst in self._controller.instances():
            if inst.get("instance_id") == target and (namespace is None or inst.get("namespace") == namespace):
                url = inst.get("peer_url")
                if not url:
                    raise ValueError(f"instance {target!r} runs no peer endpoint (p2p.enabled)")
                return url, target
        raise NotFoundError(f"unknown instance {target!r}" + (f" in namespace {namespace!r}" if namespace else ""))

    def push_prompt(self, tokens: Any, target: str, *, keys: Sequence[str] | None = None, **kw: Any) -> dict[str, Any]:
        """:meth:`push` of the cached prefix of ``tokens``, or of ``keys`` (one of them)."""
        if (tokens is None) == (keys is None):
            raise ValueError("give tokens or keys, not both")
        if keys is None and self.engine.kv_spec is None:
            self.resolve(target, kw.get("namespace"))  # a target this caller may not name is refused all the same
            return {"target": target, "pushed": [], "missing": [], "bytes": 0, "removed": [], "skipped": []}
        keys = self.engine.chunk_keys(tokens)[1] if keys is None else keys
        return self.push(list(keys), target, prefix_only=tokens is not None, **kw)

    def push(self, keys: Sequence[str], target: str, *, tier: str | None = None, target_tier: str | None = None,
             remove_source: bool = False, prefix_only: bool = False, namespace: str | None = None) -> dict[str, Any]:
        """Send the entries of ``keys`` (from ``tier``, or whichever tier has them) to
        the endpoint ``target`` (see :meth:`resolve`; ``namespace`` restricts it to an
        instance of that namespace), into ``target_tier`` (or its top tier). With
        ``prefix_only``, stop at the first key not held. With ``remove_source``, the
        sent entries are then evicted here (from ``tier``, or from every tier)."""
        url, peer_id = self.resolve(target, namespace)
        h = self.engine.hierarchy
        src = h.tier(tier) if tier is not None else None
        # passed on as stored: the target's own gateway checks each chunk
        objs = [r[0] if r is not None else None for r in self.engine.chunks.find(keys, tier=tier, prefix=False, raw=True)]
        items: list[tuple[str, MemoryObj]] = []
        missing: list[str] = []
        try:
            for key, obj in zip(keys, objs):
                if obj is None or (prefix_only and missing):
                    missing.append(key)
                    continue
                items.append((key, obj))
            client = self.peers.client(url, f"@{target_tier}|" if target_tier else "", peer_id)
            t0 = time.perf_counter()
            try:
                sizes = client.put(items) if items else []
            except (BackendError, OSError) as exc:
                self.peers.failed(url, "push", exc)
                raise BackendError(f"push to {url} failed: {exc}") from None
            self.peers.ok(url)
            seconds = time.perf_counter() - t0
        finally:
            for obj in objs:
                if obj is not None:
                    obj.unref()
        self.stats.pushed_chunks += len(items)
        self.stats.pushed_bytes += sum(sizes)
        removed: list[str] = []
        skipped: list[dict[str, str]] = []
        if remove_source and items:
            sent = [k for k, _ in items]
            for t in [src] if src is not None else h.tiers:
                done, why = t.evict_keys(sent)
                removed += [k for k, _ in done]
                if src is not None:
                    skipped += [{"key": k, "reason": r} for k, r in why]
        return {"target": url, "target_tier": target_tier, "pushed": [k for k, _ in items], "missing": missing,
                "bytes": sum(sizes), "seconds": round(seconds, 6), "removed": sorted(set(removed)),
                "skipped": skipped}

    def info(self) -> dict[str, Any]:
        import dataclasses

        return {"url": self.url, "fetch": self.fetching, **dataclasses.asdict(self.stats),
                "endpoint": self.endpoint.store.stats()}

    def close(self) -> None:
        self.endpoint.close()
        self.peers.close()
        if self._controller is not None:
            close = getattr(self._controller, "close", None)
            if close:
                close()


__all__ = ["P2P", "PeerEndpoint", "EngineStore", "Peers", "peer_url", "split_tier"]
