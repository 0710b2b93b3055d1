"""The ``redis`` backend: one Redis string per chunk, shared by every instance that
points at the same server (standalone, Redis Cluster, or a master found through
Sentinel), with redis-py.

Why one plain string per chunk under its canonical key: any process that computes the
same key (another engine instance, the ``lmcache`` CLI) finds the entry with one GET,
Redis evicts whole chunks under ``maxmemory`` without us keeping an index, and the value
is the self-describing payload (magic, version, codec, dtype, shape, checksums), so a
reader checks what it got: the tier opens this byte store through
:class:`lmcache.encoded.Encoded`, for which a truncated or foreign value is a miss and is
deleted. The key is the canonical key string (which already holds the namespace, model and
KV signature) with the optional ``prefix`` in front; a cluster spreads keys over slots by
their hash, so nothing here pins a tenant to one node.

Why batches are pipelines: a chunk is one round trip otherwise, and the round trip, not
the bandwidth, bounds a small-chunk workload. ``get`` is MGET on one server and pipelined
GETs on a cluster (MGET may not cross slots; the cluster pipeline splits by slot and node
itself); ``put``, ``exists`` and ``delete`` are pipelined SET, TYPE and UNLINK,
``batch`` keys per round trip. ``keys()`` is SCAN (on every master of a cluster) plus
pipelined STRLEN, so listing never loads a value. A key that holds another Redis type
(a list, a hash) is foreign: ``exists`` counts it as corrupt, deletes it and reports a
miss.

Why every call raises instead of waiting: the tier above turns an exception into a miss
and backs off, so the backend's job is to fail within ``timeout`` (socket connect and
read timeout, and the wait for a pooled connection) and never retry on its own. The
client is built lazily, so an engine starts while the server is down; a standalone or
sentinel client reconnects by itself on the next call, and a cluster client is rebuilt
(topology discovery included) on the next call after any error.

Options: ``url`` (required; ``redis://[user:password@]host[:port][/db]``,
``rediss://`` for TLS, ``redis+cluster://h1:p1,h2:p2``, ``redis+sentinel://h1:p1[,h2:p2]/master[/db]``),
``timeout`` (seconds), ``prefix``, ``max_connections``, ``batch``, ``ttl`` (seconds; none by
default) and the TLS keys ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
``ssl_cert_reqs``, ``ssl_check_hostname``.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence
from urllib.parse import unquote, urlsplit

from lmcache import payload
from lmcache.errors import BackendError, ConfigError, CorruptPayloadError, MissingDependencyError
from lmcache.keys import CacheKey
from lmcache.storage import BackendContext, BytesBackend, EntryInfo

log = logging.getLogger(__name__)

DEFAULT_PORT = 6379
SENTINEL_PORT = 26379
SCAN_COUNT = 1000
CERT_REQS = ("required", "optional", "none")


# ------------------------------------------------------------------------ URLs
@dataclass(frozen=True)
class Target:
    """Where a URL points: ``mode`` is ``standalone``, ``cluster`` or ``sentinel``."""

    mode: str
    tls: bool
    nodes: tuple[tuple[str, int], ...]
    db: int = 0
    master: str | None = None
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    scheme: str = "redis"

    def describe(self) -> str:
        """The URL without credentials, for messages."""
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)
        if self.mode == "cluster":
            return f"{self.scheme}://{hosts}"
        if self.mode == "sentinel":
            return f"{self.scheme}://{hosts}/{self.master}/{self.db}"
        return f"{self.scheme}://{hosts}/{self.db}"


def parse_url(url: Any, schemes: Sequence[str] = ("redis", "valkey")) -> Target:
    """Parse a store URL; a malformed one is a :class:`ConfigError` naming ``url``.

    ``schemes`` are the base schemes accepted; each has a TLS form (``rediss``,
    ``valkeys``) and ``+cluster`` / ``+sentinel`` forms."""
    forms = ", ".join(f"{s}://host:port/db" for s in schemes)
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("url", f"a server URL is required, e.g. {forms}; got {url!r}")
    try:
        parts = urlsplit(url.strip())
    except ValueError as exc:
        raise ConfigError("url", f"malformed URL {url!r}: {exc}") from None
    base, _, mode = parts.scheme.lower().partition("+")
    tls = base.endswith("s") and base[:-1] in schemes
    if tls:
        base = base[:-1]
    if base not in schemes or mode not in ("", "cluster", "sentinel"):
        known = ", ".join(f"{s}[s][+cluster|+sentinel]://" for s in schemes)
        raise ConfigError("url", f"unsupported scheme {parts.scheme!r} in {url!r}; use {known}")
    mode = mode or "standalone"
    if parts.query or parts.fragment:
        raise ConfigError("url", f"{url!r}: query strings are not read; put settings in the tier's keys (timeout, ...)")
    netloc = parts.netloc
    username = password = None
    if "@" in netloc:
        cred, _, netloc = netloc.rpartition("@")
        user, sep, pw = cred.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if sep else None
        if not sep and username is not None:  # redis://secret@host: a password alone
            username, password = None, username
    if not netloc:
        raise ConfigError("url", f"{url!r} names no host")
    nodes = tuple(_host_port(h, url, SENTINEL_PORT if mode == "sentinel" else DEFAULT_PORT) for h in netloc.split(","))
    if mode == "standalone" and len(nodes) > 1:
        raise ConfigError("url", f"{url!r} lists {len(nodes)} hosts; several hosts need {base}+cluster:// or {base}+sentinel://")
    segs = [unquote(s) for s in parts.path.split("/")[1:]] if parts.path not in ("", "/") else []
    master = None
    if mode == "sentinel":
        if not segs or not segs[0]:
            raise ConfigError("url", f"{url!r} names no master; use {base}+sentinel://host:port/mastername[/db]")
        master, segs = segs[0], segs[1:]
    if len(segs) > 1 or (segs and segs[0] == ""):
        raise ConfigError("url", f"{url!r}: unexpected path {parts.path!r}")
    db = 0
    if segs:
        if not segs[0].isdigit():
            raise ConfigError("url", f"{url!r}: database {segs[0]!r} is not a non-negative integer")
        db = int(segs[0])
    if mode == "cluster" and db != 0:
        raise ConfigError("url", f"{url!r}: a cluster has only database 0")
    scheme = parts.scheme.lower()
    return Target(mode, tls, nodes, db, master, username, password, scheme)


def _host_port(item: str, url: str, default_port: int) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # [ipv6]:port
        host, sep, rest = item[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ConfigError("url", f"{url!r}: malformed host {item!r}")
        port_s = rest[1:]
    else:
        host, _, port_s = item.partition(":")
    if not host:
        raise ConfigError("url", f"{url!r}: empty host in {item!r}")
    if not port_s:
        return host, default_port
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ConfigError("url", f"{url!r}: bad port {port_s!r}")
    return host, int(port_s)


def _scan_pattern(prefix: str) -> str:
    """The SCAN MATCH pattern of our keys: the prefix with glob characters escaped."""
    escaped = "".join("\\" + c if c in "*?[]\\" else c for c in prefix)
    return escaped + "lmc1:*"


def _chunks(seq: Sequence[Any], n: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


# --------------------------------------------------------------------- backend
class RedisBackend(BytesBackend):
    OPTIONS = {
        "url": None,
        "timeout": 1.0,
        "prefix": "",
        "max_connections": 32,
        "batch": 64,
        "ttl": None,
        "ssl_ca_certs": None,
        "ssl_certfile": None,
        "ssl_keyfile": None,
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": True,
    }
    shared = True
    #: Redis and Valkey refuse a bulk string over proto-max-bulk-len, 512 MiB by default;
    #: keys are bounded only by that too
    max_value_size = 512 << 20
    #: the client package and the names of its classes; :class:`ValkeyBackend` swaps them
    CLIENT: ClassVar[Mapping[str, str]] = {
        "package": "redis",
        "client": "Redis",
        "cluster": "RedisCluster",
        "error": "RedisError",
        "cluster_error": "RedisClusterException",
    }
    #: base URL schemes this backend accepts (each with its TLS and +cluster/+sentinel forms)
    SCHEMES: ClassVar[tuple[str, ...]] = ("redis", "valkey")

    # ----------------------------------------------------------- options
    @classmethod
    def check_options(cls, options: Mapping[str, Any], capacity: int | None = None) -> dict[str, Any]:
        opts = super().check_options(options, capacity)
        target = parse_url(opts["url"], cls.SCHEMES)
        t = opts["timeout"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ConfigError("timeout", f"expected a positive number of seconds, got {t!r}")
        if not isinstance(opts["prefix"], str):
            raise ConfigError("prefix", f"expected a string, got {opts['prefix']!r}")
        for key in ("max_connections", "batch"):
            v = opts[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(key, f"expected a positive integer, got {v!r}")
        ttl = opts["ttl"]
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
            raise ConfigError("ttl", f"expected a positive number of seconds (or none), got {ttl!r}")
        for key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            if opts[key] is not None and not isinstance(opts[key], str):
                raise ConfigError(key, f"expected a file path, got {opts[key]!r}")
        if opts["ssl_cert_reqs"] not in CERT_REQS:
            raise ConfigError("ssl_cert_reqs", f"expected one of {', '.join(CERT_REQS)}, got {opts['ssl_cert_reqs']!r}")
        if not isinstance(opts["ssl_check_hostname"], bool):
            raise ConfigError("ssl_check_hostname", f"expected true or false, got {opts['ssl_check_hostname']!r}")
        if not target.tls:
            for key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
                if opts[key] is not None:
                    raise ConfigError(key, f"TLS settings need a TLS URL ({target.scheme.split('+')[0]}s://...)")
        return opts

    def __init__(self, context: BackendContext):
        super().__init__(context)
        self.target = parse_url(self.options["url"], self.SCHEMES)
        self.prefix: str = self.options["prefix"]
        self.batch: int = self.options["batch"]
        self.ttl: int | None = self.options["ttl"]
        self._api = self._client_api()
        self._lock = threading.Lock()
        self._client: Any = None
        self._sentinel: Any = None
        self._closed = False

    # ----------------------------------------------------------- client
    @classmethod
    def _client_api(cls) -> SimpleNamespace:
        """The client package's pieces that this module uses, by role."""
        name = cls.CLIENT["package"]
        try:
            pkg = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            raise MissingDependencyError(
                f"the {name} backend needs the Python package {name!r}, which is not installed; "
                f"install it with: pip install 'lmcache[{name}]'"
            ) from exc
        cluster = importlib.import_module(f"{name}.cluster")
        errors = importlib.import_module(f"{name}.exceptions")
        return SimpleNamespace(
            Client=getattr(pkg, cls.CLIENT["client"]),
            Cluster=getattr(cluster, cls.CLIENT["cluster"]),
            ClusterNode=cluster.ClusterNode,
            Sentinel=importlib.import_module(f"{name}.sentinel").Sentinel,
            BlockingConnectionPool=pkg.BlockingConnectionPool,
            SSLConnection=pkg.SSLConnection,
            Retry=importlib.import_module(f"{name}.retry").Retry,
            NoBackoff=importlib.import_module(f"{name}.backoff").NoBackoff,
            errors=(getattr(errors, cls.CLIENT["error"]), getattr(errors, cls.CLIENT["cluster_error"]), OSError),
        )

    @classmethod
    def _connect(cls, api: SimpleNamespace, target: Target, opts: Mapping[str, Any]) -> tuple[Any, Any]:
        """A client for ``target`` (and the sentinel manager, if any). Only a cluster
        client talks to the network here (it discovers the slot map)."""
        t = float(opts["timeout"])
        conn: dict[str, Any] = {
            "socket_timeout": t,
            "socket_connect_timeout": t,
            "retry": api.Retry(api.NoBackoff(), 0),  # the tier retries, with backoff
            "username": target.username,
            "password": target.password,
        }
        tls: dict[str, Any] = {}
        if target.tls:
            tls = {
                "ssl_ca_certs": opts["ssl_ca_certs"],
                "ssl_certfile": opts["ssl_certfile"],
                "ssl_keyfile": opts["ssl_keyfile"],
                "ssl_cert_reqs": opts["ssl_cert_reqs"],
                "ssl_check_hostname": opts["ssl_check_hostname"] and opts["ssl_cert_reqs"] != "none",
            }
        if target.mode == "cluster":
            kw = {k: v for k, v in conn.items() if k != "retry"}
            if target.tls:
                kw.update(ssl=True, **tls)
            client = api.Cluster(
                startup_nodes=[api.ClusterNode(h, p) for h, p in target.nodes],
                retry=api.Retry(api.NoBackoff(), 0),
                max_connections=opts["max_connections"],
                **kw,
            )
            return client, None
        if target.mode == "sentinel":
            skw = {k: conn[k] for k in ("socket_timeout", "socket_connect_timeout", "retry")}
            if target.tls:
                skw.update(ssl=True, **tls)
            mkw = dict(conn, **({"ssl": True, **tls} if target.tls else {}))
            sentinel = api.Sentinel(list(target.nodes), sentinel_kwargs=skw, **mkw)
            return sentinel.master_for(target.master, db=target.db, max_connections=opts["max_connections"]), sentinel
        host, port = target.nodes[0]
        extra: dict[str, Any] = {"connection_class": api.SSLConnection, **tls} if target.tls else {}
        pool = api.BlockingConnectionPool(
            host=host, port=port, db=target.db, max_connections=opts["max_connections"], timeout=t, **conn, **extra
        )
        return api.Client(connection_pool=pool), None

    @property
    def _is_cluster(self) -> bool:
        return self.target.mode == "cluster"

    def _conn(self) -> Any:
        client = self._client
        if client is None:
            with self._lock:
                if self._closed:
                    raise BackendError(f"tier {self.context.tier}: the {self._name} backend is closed")
                if self._client is None:
                    self._client, self._sentinel = self._connect(self._api, self.target, self.options)
                client = self._client
        return client

    @property
    def _name(self) -> str:
        return self.CLIENT["package"]

    def _call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)``; a client error becomes :class:`BackendError` (after dropping
        a cluster client, so that the next call rediscovers the cluster)."""
        try:
            return fn(self._conn())
        except BackendError:
            raise
        except self._api.errors as exc:
            if self._is_cluster:
                self._drop_client()
            raise BackendError(
                f"tier {self.context.tier}: {what} on {self.target.describe()} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _drop_client(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # pragma: no cover - best effort on a broken client
                pass

    def _pipeline(self, client: Any) -> Any:
        return client.pipeline(transaction=False) if not self._is_cluster else client.pipeline()

    def _k(self, key: str) -> str:
        return self.prefix + key

    # ------------------------------------------------------ the byte store
    def get(self, keys: Sequence[str], on_ready: Callable[[int, Any], None] | None = None) -> list[bytes | None]:
        """The stored payload bytes of each key (``None``: missing): MGET on one server,
        pipelined GETs on a cluster, ``batch`` keys per round trip. The bytes are the
        client's own reply objects, handed on as they are."""
        out: list[bytes | None] = []
        for part in _chunks(keys, self.batch):
            if self._is_cluster:  # MGET may not cross slots
                out.extend(self._each("GET", part))
            else:
                out.extend(self._call("MGET", lambda c, part=part: c.mget([self._k(k) for k in part])))
        return out

    def put(self, items: Sequence[tuple[str, Sequence[Any]]]) -> list[int]:
        """Pipelined SETs (with ``EX ttl`` if set), ``batch`` per round trip; each value
        goes out as its buffers, never joined (:meth:`_send_sets`). Returns the bytes of
        each value."""
        sizes: list[int] = []
        send = self._send_cluster_sets if self._is_cluster else self._send_sets
        for part in _chunks(items, self.batch):
            values = [(self._k(k), bufs) for k, bufs in part]
            self._call("SET", lambda c, values=values: send(c, values))
            sizes.extend(_nbytes(bufs) for _, bufs in part)
        return sizes

    def exists(self, keys: Sequence[str]) -> list[bool]:
        # TYPE, not EXISTS: a list or hash under one of our keys exists but can never be
        # read (GET/MGET answer nil or WRONGTYPE); promising it would make a lookup promise
        # more than a retrieve returns, and a store would skip it forever. Such a key is
        # dropped (counted as corrupt) and is a miss.
        types = self._each("TYPE", keys)
        out: list[bool] = []
        foreign: list[str] = []
        for k, t in zip(keys, types):
            t = t.decode() if isinstance(t, bytes) else str(t)
            if t == "string":
                out.append(True)
            else:
                out.append(False)
                if t != "none":
                    self.note_corrupt(k, CorruptPayloadError(f"a Redis {t}, not a string, under the key"))
                    foreign.append(k)
        if foreign:
            try:
                self.delete(foreign)
            except Exception:  # best effort: the next reader drops it again
                log.exception("tier %s: could not delete foreign entries", self.context.tier)
        return out

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Pipelined UNLINK: whether each key was there (UNLINK answers 1 or 0)."""
        return [bool(n) for n in self._each("UNLINK", keys)]

    def keys(self) -> Iterator[tuple[str, int]]:
        for key, (size, _) in self._scan(with_head=False):
            yield key, size

    def entries(self) -> Iterator[EntryInfo]:
        """SCAN plus the first bytes of each value (pipelined GETRANGE) for its codec;
        the time stored is not kept."""
        for key, (size, head) in self._scan(with_head=True):
            codec = None
            try:
                codec = payload.parse_header(head).codec
            except CorruptPayloadError:
                pass
            yield EntryInfo(key, size, codec)

    def _scan(self, *, with_head: bool) -> Iterator[tuple[str, tuple[int, bytes]]]:
        """``(key, (stored bytes, first bytes or b""))`` of every lmcache key under our
        prefix, SCAN_COUNT keys per round trip, never loading a whole value."""
        pattern = _scan_pattern(self.prefix)
        n = len(self.prefix)
        it = self._call("SCAN", lambda c: iter(c.scan_iter(match=pattern, count=SCAN_COUNT)))
        while True:
            raw = self._call("SCAN", lambda c: _take(it, SCAN_COUNT))
            if not raw:
                return
            names: list[tuple[bytes, str]] = []
            for r in raw:
                try:
                    name = r.decode() if isinstance(r, bytes) else str(r)
                    if not name.startswith(self.prefix):
                        continue
                    CacheKey.parse(name[n:])
                except ValueError:  # UnicodeDecodeError too: not one of ours
                    continue
                names.append((r, name[n:]))

            def sizes(c: Any, names: list = names) -> list:
                p = self._pipeline(c)
                for r, _ in names:
                    p.strlen(r)
                    if with_head:
                        p.getrange(r, 0, payload.HEADER_READ_HINT - 1)
                return p.execute()

            res = self._call("STRLEN", sizes) if names else []
            step = 2 if with_head else 1
            for i, (_, key) in enumerate(names):
                size = res[i * step]
                if size:  # 0: removed since the SCAN
                    yield key, (int(size), res[i * step + 1] if with_head else b"")

    def _each(self, cmd: str, keys: Sequence[str]) -> list:
        """The replies of pipelined ``cmd key`` for each key, ``batch`` per round trip."""
        out: list = []
        for part in _chunks(keys, self.batch):
            def run(c: Any, part: Sequence[str] = part) -> list:
                p = self._pipeline(c)
                for k in part:
                    p.execute_command(cmd, self._k(k))
                return p.execute()

            out.extend(self._call(cmd, run))
        return out

    def _send_cluster_sets(self, client: Any, values: Sequence[tuple[str, Sequence[Any]]]) -> None:
        """:meth:`_send_sets` to each master, for the keys whose slots it serves. A
        reply such as MOVED (the cluster is resharding) raises: the tier treats it as an
        outage and ``_call`` drops the client, so the next call rediscovers the slots."""
        by_node: dict[str, tuple[Any, list[tuple[str, Sequence[Any]]]]] = {}
        for key, bufs in values:
            node = client.get_node_from_key(key)
            by_node.setdefault(node.name, (node, []))[1].append((key, bufs))
        for node, vals in by_node.values():
            # redis-py and valkey-py name the node's client after themselves
            conn = getattr(node, "redis_connection", None) or getattr(node, "valkey_connection", None)
            if conn is None:
                getter = getattr(client, "get_redis_connection", None) or client.get_valkey_connection
                conn = getter(node)
            self._send_sets(conn, vals)

    def _send_sets(self, client: Any, values: Sequence[tuple[str, Sequence[Any]]]) -> None:
        """Pipelined SETs whose values go out as the payload's header and body buffers
        (the body is a view of the chunk's memory): no value is ever joined into one
        bytes object, which for a 32 MiB chunk costs as much as a third of the SET. The
        commands are packed here in RESP and sent on one pooled connection; replies are
        read in order, and any error drops the connection so it cannot desynchronize."""
        pool = client.connection_pool
        try:
            conn = pool.get_connection()
        except TypeError:  # valkey-py still requires the command name redis-py deprecated
            conn = pool.get_connection("SET")
        try:
            out: list[Any] = []
            ex = b"" if self.ttl is None else b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(self.ttl)), self.ttl)
            for key, bufs in values:
                k = key.encode()
                head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 if self.ttl is None else 5, len(k), k, _nbytes(bufs))
                # the first buffer (a payload's header: small) goes in one send with the command
                out.append(head + (bytes(bufs[0]) if bufs else b""))
                out.extend(bufs[1:])
                out.append(b"\r\n" + ex)
            conn.send_packed_command(out)
            for _ in values:
                reply = conn.read_response()
                if isinstance(reply, Exception):
                    raise reply
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    # ------------------------------------------------------------- rest
    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
            sentinel, self._sentinel = self._sentinel, None
        for c in [client] + (list(sentinel.sentinels) if sentinel is not None else []):
            if c is not None:
                try:
                    c.close()
                except Exception:  # pragma: no cover
                    pass


def _nbytes(buffers: Sequence[Any]) -> int:
    """The bytes of a value given as buffers (a memoryview's length counts items)."""
    return sum(b.nbytes if isinstance(b, memoryview) else len(b) for b in buffers)


def _take(it: Iterator[Any], n: int) -> list:
    out = []
    for x in it:
        out.append(x)
        if len(out) >= n:
            break
    return out
