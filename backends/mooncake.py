"""The ``mooncake`` backend: one object per chunk in a Mooncake distributed store.

Why Mooncake: its store pools the host memory of every client that joins it (each client
mounts a *global segment* of its own memory into the store), with one master that places
objects and hands out their locations; a read moves the bytes straight from the segment
that holds them (TCP here, RDMA where the hardware has it). Every engine instance that
points at the same master sees the same entries, so it is a shared tier
(``shared = True``): one object per chunk under the canonical key string (plus the
optional ``prefix``), each a self-describing payload, so instances, the CLI and the
benchmark read each other's entries and a corrupt or truncated one is a miss and is
removed.

Why the calls run on worker threads: the client (``MooncakeDistributedStore`` from the
``mooncake-transfer-engine`` wheels) has no per-call timeout and blocks for seconds when
the master is gone (about 4 s per RPC, and ``setup`` retries 20 times). Every call is
therefore made on a small pool of worker threads and waited for at most ``timeout``
seconds; a call that does not return in time raises :class:`TimeoutError` (the tier
turns that into misses and retries with backoff) and keeps running in the background.
While such a stuck call is still running, later calls fail at once instead of queueing
behind it, so an outage never piles up threads. The client reconnects by itself: it pings
the master and, once a restarted master answers, mounts its segment again; a client that
never got set up (the master was down when it was first needed) is set up on the next
call, after a quick TCP check of the master that fails fast while it is down. The engine
therefore starts while the store is down: nothing is contacted until the first call.

Why writes are upserts and removals forced: ``put`` of an existing key is silently a
no-op in Mooncake, and ``remove`` refuses a key that a reader looked at in the last
``default_kv_lease_ttl`` (10 s), which would make both ``overwrite`` and ``remove`` lie.

Why batches are split: every transfer is staged through the client's *local buffer*
(``local_buffer_size``); a batch whose values do not fit fails as a whole. Puts are cut
into groups of at most half the local buffer; gets ask for the whole batch and fetch the
values that did not fit one at a time. A single value larger than the local buffer
cannot be stored or read at all, so the local buffer is the store's ``max_value_size``: a
tier stores a larger payload in parts (:mod:`lmcache.fit`); size the buffer above the
largest chunk payload to keep each chunk one object.

Bytes and objects: the backend is a store of payload bytes
(:class:`~lmcache.storage.BytesBackend`); its ``get`` copies each value out of the
client's buffer. A tier opens it through :class:`MooncakeObjects`, which checks and
decodes each payload straight from the buffer the client lends, with no copy in between.

Listing: the client cannot enumerate keys, so :meth:`keys` asks the master's HTTP admin
server (``admin_url``: ``/get_all_keys``, then ``/batch_query_keys`` for the sizes); it
never loads values and skips anything that is not an lmcache key under ``prefix``.

Options: ``url`` (``mooncake://master-host[:rpc-port]``, port 50051 by default),
``prefix``, ``timeout`` (seconds), ``global_segment_size`` (memory this process adds to
the store; 0 adds none), ``local_buffer_size``, ``protocol`` (``tcp``), ``device_name``
(RDMA devices), ``local_hostname`` (the address other clients reach this one's segment
at; default: 127.0.0.1 for a master on loopback, else the local address that routes to
the master), ``metadata_server`` (default ``http://master-host:8080/metadata``, the
master's own HTTP metadata server) and ``admin_url`` (default ``http://master-host:9003``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from typing import Any, Callable, Iterator, Mapping, Sequence

from lmcache.encoded import Encoded, release
from lmcache.errors import BackendError, ConfigError
from lmcache.keys import CacheKey
from lmcache.memory import MemoryObj
from lmcache.storage import BackendContext, BytesBackend
from lmcache.units import parse_size

from .mooncake_client import (  # noqa: F401 (re-exported: tests and lmcache bench import them from here)
    DEFAULT_ADMIN_PORT, DEFAULT_METADATA_PORT, OBJECT_NOT_FOUND, QUERY_BATCH, UPSERT_STRIPES, WORKERS, _PROTOCOL,
    BoundedCalls, MooncakeError, _groups, _http_url, _reachable, _setup_args, _url_host, _view, import_client,
    parse_url,
)

log = logging.getLogger(__name__)


class MooncakeObjects(Encoded):
    """The mooncake store as a tier opens it (:attr:`MooncakeBackend.objects_view`): each
    payload is checked and decoded straight from the client's buffer while the client
    lends it (:meth:`MooncakeBackend._fetch`), with no intermediate copy; a corrupt or
    truncated one is a miss and is removed (in one batch)."""

    raw: MooncakeBackend

    def get_native(self, keys: Sequence[str]) -> list[MemoryObj | None]:
        out: list[MemoryObj | None] = [None] * len(keys)
        if not keys:
            return out
        corrupt: list[str] = []

        def use(i: int, data: memoryview) -> None:
            out[i] = self.decode_checked(keys[i], data)
            if out[i] is None:
                corrupt.append(keys[i])

        try:
            self.raw._fetch([self.raw._name(k) for k in keys], use)
        except BaseException:
            release(out)
            raise
        if corrupt:  # in one batch; should that fail, every reader still finds them corrupt
            self.drop_corrupt(corrupt)
        return out


class MooncakeBackend(BytesBackend):
    OPTIONS = {
        "url": None,
        "prefix": "",
        "timeout": 5.0,
        "global_segment_size": "1GiB",
        "local_buffer_size": "256MiB",
        "protocol": "tcp",
        "device_name": "",
        "local_hostname": None,
        "metadata_server": None,
        "admin_url": None,
    }
    shared = True
    objects_view = MooncakeObjects

    @classmethod
    def check_options(cls, options: Mapping[str, Any], capacity: int | None = None) -> dict[str, Any]:
        opts = super().check_options(options, capacity)
        host, _ = parse_url(opts["url"])
        prefix = opts["prefix"]
        if not isinstance(prefix, str) or any(c in prefix for c in ",\n\r"):
            raise ConfigError("prefix", f"expected a string without commas or line breaks, got {prefix!r}")
        t = opts["timeout"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t != t:
            raise ConfigError("timeout", f"expected a positive number of seconds, got {t!r}")
        for key in ("global_segment_size", "local_buffer_size"):
            try:
                n = parse_size(opts[key])
            except ValueError as exc:
                raise ConfigError(key, str(exc)) from None
            if key == "local_buffer_size" and n <= 0:
                raise ConfigError(key, "the local buffer stages every transfer; it must hold the largest chunk payload")
        if not isinstance(opts["protocol"], str) or not _PROTOCOL.match(opts["protocol"]):
            raise ConfigError(
                "protocol", f"expected a Mooncake transport name such as tcp or rdma, got {opts['protocol']!r}"
            )
        if not isinstance(opts["device_name"], str):
            raise ConfigError(
                "device_name", f"expected a string (RDMA device names, comma-separated), got {opts['device_name']!r}"
            )
        local = opts["local_hostname"]
        if local is not None and (not isinstance(local, str) or not local or any(c.isspace() for c in local)):
            raise ConfigError("local_hostname", f"expected a host name or address, got {local!r}")
        meta = opts["metadata_server"]
        if meta is not None:
            if not isinstance(meta, str) or not (
                meta == "P2PHANDSHAKE" or urllib.parse.urlsplit(meta).scheme in ("http", "https", "etcd", "redis")
            ):
                raise ConfigError(
                    "metadata_server",
                    "expected http://host:port/metadata, etcd://host:port, redis://host:port or "
                    f"P2PHANDSHAKE, got {meta!r}",
                )
        if opts["admin_url"] is not None:
            _http_url("admin_url", opts["admin_url"], f"http://{_url_host(host)}:{DEFAULT_ADMIN_PORT}")
        return opts

    def __init__(self, context: BackendContext):
        super().__init__(context)
        self._client_mod = import_client()  # a missing wheel or libibverbs is an error now, not a miss later
        self.host, self.port = parse_url(self.options["url"])
        self.prefix: str = self.options["prefix"]
        self.timeout = float(self.options["timeout"])
        self.local_buffer = parse_size(self.options["local_buffer_size"])
        #: every transfer is staged in the local buffer: a larger value cannot be put or read
        self.max_value_size = self.local_buffer
        admin = self.options["admin_url"] or f"http://{_url_host(self.host)}:{DEFAULT_ADMIN_PORT}"
        self.admin_url = admin.rstrip("/")
        self._calls = BoundedCalls(self.timeout, name=f"lmcache-mooncake-{id(self):x}")
        self._store: Any = None
        self._connect_lock = threading.Lock()
        self._closed = False
        self._oversize_warned = False
        #: one key's upserts from this process one at a time (:meth:`_upsert`)
        self._upsert_locks = tuple(threading.Lock() for _ in range(UPSERT_STRIPES))

    # ------------------------------------------------------------ client
    def _name(self, key: str) -> str:
        return self.prefix + key

    def _client(self, deadline: float) -> Any:
        """The set-up client; set it up on first use (or after a failed setup), all
        within ``deadline`` (``time.monotonic()``)."""
        store = self._store
        if store is not None:
            return store
        if self._closed:
            raise BackendError(f"mooncake tier {self.context.tier} is closed")
        if not self._connect_lock.acquire(timeout=max(deadline - time.monotonic(), 0.001)):
            raise TimeoutError(f"mooncake tier {self.context.tier}: still connecting")
        try:
            if self._store is None:
                # fail fast while the master is down, instead of starting a setup that
                # retries for minutes on a worker
                _reachable(self.host, self.port, max(deadline - time.monotonic(), 0.001), "master")
                meta = self.options["metadata_server"]
                if meta is None or meta.startswith(("http://", "https://")):
                    parts = urllib.parse.urlsplit(meta or f"http://{_url_host(self.host)}:{DEFAULT_METADATA_PORT}")
                    port = parts.port or (443 if parts.scheme == "https" else 80)
                    _reachable(parts.hostname, port, max(deadline - time.monotonic(), 0.001), "metadata server")
                self._calls.run("setup", self._setup, timeout=deadline - time.monotonic())
            if self._store is None:
                raise BackendError(f"mooncake tier {self.context.tier} is closed")
            return self._store
        finally:
            self._connect_lock.release()

    def _setup(self) -> None:
        """On a worker: set up a new client; publish it only if it works (a setup that
        finishes after its caller timed out still serves the next call)."""
        args = _setup_args(self.options, segment=0 if self.context.read_only else None)
        store = self._client_mod.MooncakeDistributedStore()
        rc = store.setup(*args)
        if rc != 0:
            try:
                store.close()
            except Exception:  # pragma: no cover - best effort
                pass
            raise MooncakeError(f"setup (master {args[6]}, metadata {args[1]})", rc)
        if self._closed:
            store.close()
            return
        self._store = store
        log.info("mooncake tier %s: connected to master %s as %s", self.context.tier, args[6], args[0])

    def _call(self, what: str, method: str, *args: Any) -> Any:
        """One client call, bounded by ``timeout`` (connecting first if needed)."""
        return self._call_with(what, lambda store: getattr(store, method)(*args))

    def _call_with(self, what: str, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)`` (a few client calls in a row), bounded by ``timeout`` as one."""
        deadline = time.monotonic() + self.timeout
        store = self._client(deadline)
        return self._calls.run(what, fn, store, timeout=deadline - time.monotonic())

    # ------------------------------------------------------------ the five verbs, over bytes
    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        codes = self._call("batch_is_exist", "batch_is_exist", [self._name(k) for k in keys])
        out = []
        for c in codes:
            if c < 0:
                raise MooncakeError("batch_is_exist", c)
            out.append(c == 1)
        return out

    def _fetch(self, names: list[str], use: Callable[[int, memoryview], None]) -> None:
        """Read ``names``, calling ``use(i, bytes)`` for each one found while its buffer
        is alive. Values that did not fit the local buffer together are fetched again
        one at a time; a miss is checked so that an outage raises instead of missing."""
        handles = self._call("batch_get_buffer", "batch_get_buffer", names)
        again: list[int] = []
        try:
            for i, h in enumerate(handles):
                if h is None:
                    again.append(i)
                else:
                    use(i, _view(h))
        finally:
            del handles
        if not again:
            return
        codes = self._call("batch_is_exist", "batch_is_exist", [names[i] for i in again])
        for i, c in zip(again, codes):
            if c < 0:
                raise MooncakeError("batch_is_exist", c)
            if c == 0:
                continue
            h = self._call("get_buffer", "get_buffer", names[i])
            if h is None:
                if not self._oversize_warned:
                    self._oversize_warned = True
                    log.warning(
                        "mooncake tier %s: could not read %s (%s bytes) through the local buffer of %d bytes; "
                        "treating it as a miss (raise local_buffer_size if payloads are this large)",
                        self.context.tier, names[i], self._size_or_unknown(names[i]), self.local_buffer,
                    )
                continue
            try:
                use(i, _view(h))
            finally:
                del h

    def _size_or_unknown(self, name: str) -> str:
        try:
            n = self._call("get_size", "get_size", name)
        except Exception:
            return "?"
        return str(n) if n >= 0 else "?"

    def get(self, keys: Sequence[str], on_ready: Callable[[int, Any], None] | None = None) -> list[bytes | None]:
        """Each value's bytes, copied out of the client's buffer (the caller's own). A
        tier reads through :class:`MooncakeObjects`, which decodes from the buffer itself."""
        out: list[bytes | None] = [None] * len(keys)
        if keys:
            self._fetch([self._name(k) for k in keys], lambda i, data: out.__setitem__(i, bytes(data)))
        return out

    def put(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> list[int]:
        """Each value's buffers (a payload's header and body) sent as the parts of one
        object, upserted, in groups that fit half the local buffer; a value larger than
        the local buffer raises (a tier never hands one over: ``max_value_size``)."""
        if not items:
            return []
        # header and body go out as parts of one object: joining them into one bytes
        # object first cost more than the transfer itself (docs/benchmarks.md#measurements-behind-the-code)
        parts = [[b for b in bufs if memoryview(b).nbytes] or [b""] for _, bufs in items]
        sizes = [sum(memoryview(b).nbytes for b in p) for p in parts]
        last = {k: i for i, (k, _) in enumerate(items)}  # a key given twice: the last one wins
        order = [i for i in range(len(items)) if last[items[i][0]] == i]
        for i in order:
            if sizes[i] > self.local_buffer:
                raise MooncakeError(
                    f"put of {items[i][0]} ({sizes[i]} bytes, more than local_buffer_size {self.local_buffer})", -600
                )
        for group in _groups([sizes[i] for i in order], max(self.local_buffer // 2, 1)):
            idx = [order[j] for j in group]

            def run(store: Any, idx: list[int] = idx) -> list[int]:
                return [self._upsert(store, self._name(items[i][0]), parts[i]) for i in idx]

            codes = self._call_with("upsert_parts", run)
            bad = [c for c in codes if c != 0]
            if bad:
                raise MooncakeError(f"upsert_parts of {len(idx)} entries", bad[0])
        return sizes

    def _upsert(self, store: Any, name: str, parts: Sequence[Any]) -> int:
        """An upsert, one at a time per key in this process, again on OBJECT_NOT_FOUND. Two
        upserts of one key at once race inside the store: the replaced object vanishes
        under the other's update (the retry makes the later write win), and once, under
        load, the loser's bytes landed in another key's object written then (its reader's
        checks made it a miss). Across processes only those checks keep it from an engine."""
        upsert = store.upsert_parts
        with self._upsert_locks[zlib.crc32(name.encode()) % UPSERT_STRIPES]:
            rc = upsert(name, *parts)
            for _ in range(3):
                if rc != OBJECT_NOT_FOUND:
                    break
                rc = upsert(name, *parts)
            return rc

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Forced removals (a reader's lease does not keep an entry); whether each was there."""
        if not keys:
            return []
        codes = self._call("batch_remove", "batch_remove", [self._name(k) for k in keys], True)
        out = []
        for c in codes:
            if c < 0 and c != OBJECT_NOT_FOUND:
                raise MooncakeError("batch_remove", c)
            out.append(c == 0)
        return out

    def keys(self) -> Iterator[tuple[str, int]]:
        """From the master's admin server: every key, then the sizes of ours in batches."""
        names = self._http("/get_all_keys").decode("utf-8", "replace").splitlines()
        ours: list[str] = []
        for name in names:
            if not name.startswith(self.prefix):
                continue
            try:
                CacheKey.parse(name[len(self.prefix):])
            except ValueError:
                continue
            ours.append(name)
        out: list[tuple[str, int]] = []
        for i in range(0, len(ours), QUERY_BATCH):
            part = ours[i : i + QUERY_BATCH]
            q = ",".join(urllib.parse.quote(n, safe="") for n in part)
            try:
                data = json.loads(self._http(f"/batch_query_keys?keys={q}")).get("data") or {}
            except ValueError as exc:
                raise BackendError(f"mooncake admin server {self.admin_url}: unreadable answer: {exc}") from None
            for name in part:
                info = data.get(name) or {}
                values = info.get("values") or []
                if info.get("ok") and values:  # gone meanwhile otherwise
                    out.append((name[len(self.prefix):], int(values[0].get("size_", 0))))
        return iter(out)

    def _http(self, path: str) -> bytes:
        url = self.admin_url + path
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as r:
                return r.read()
        except urllib.error.HTTPError as exc:
            where = path.split("?")[0]
            raise BackendError(f"mooncake admin server {self.admin_url}: {where} answered {exc.code}") from None
        except (OSError, ValueError) as exc:
            raise ConnectionError(f"mooncake admin server {self.admin_url} is unreachable: {exc}") from None

    def close(self) -> None:
        """Unmount this client's segment (its entries leave the store) and stop the
        client, waiting at most ``timeout``: the client's own close takes 0.5-2 s (it
        joins its heartbeat thread) and longer while the master is unreachable; past the
        timeout it finishes in the background (interpreter exit still waits for it)."""
        self._closed = True
        store, self._store = self._store, None
        if store is not None:
            try:
                self._calls.run("close", self._close_client, store)
            except TimeoutError as exc:
                log.warning("mooncake tier %s: %s; it goes on in the background", self.context.tier, exc)
        self._calls.shutdown()

    def _close_client(self, store: Any) -> None:
        try:
            rc = store.close()
        except Exception as exc:  # pragma: no cover - best effort
            rc = exc
        if rc not in (0, None):
            log.warning("mooncake tier %s: close returned %s", self.context.tier, rc)
