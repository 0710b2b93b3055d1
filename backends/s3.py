"""The ``s3`` backend: one object per chunk in an S3 bucket or any S3-compatible store.

Why one object per chunk under the canonical key: a chunk is written once and read
whole, S3 has no cheaper unit than an object, and naming the object after the canonical
key string (``<prefix>/lmc1:<namespace>:<model>:<signature>:<hash>``) lets every engine
instance, the CLI and the controller that point at the same bucket and prefix share the
same entries with no index of their own: ``keys()`` is a listing (names and sizes come
with it, no value is loaded), and objects that are not lmcache keys are skipped. The
listing uses ``/`` as delimiter, so a prefix never sees the entries of a longer prefix
below it. Canonical keys contain no ``/`` (the model is percent-encoded), and ``:`` and
``%`` are plain characters in an S3 key, so keys are stored as they are.

Why batch calls fan out over a thread pool: S3 has no multi-get or pipeline, and its
latency per request (tens of milliseconds on AWS) dwarfs the transfer of a chunk, so
throughput comes from many requests in flight on one shared, thread-safe boto3 client
(``concurrency`` of them, on as many pooled connections). A batch fails fast: the first
error (the store went away) cancels the requests not yet started and is raised, so the
tier degrades to misses at once instead of after one timeout per key.

Why the retry budget is small: the tier above already serves misses and retries with
backoff when a call raises, and a cache miss costs a recomputation, not data. So every
attempt is bounded by ``timeout`` (connect, and each wait for bytes), and botocore makes
``retries`` more attempts (default one: it absorbs a pooled connection that the server
closed while idle), so a call blocks for about ``(retries + 1) * timeout`` at worst
(botocore's ``max_attempts`` counts retries, not attempts). The one answer asked again
regardless is an ``InternalError`` (HTTP 500), up to three times, 50, 100 and 200 ms
apart, while the call has taken less than ``timeout``: AWS documents it as retryable,
and servers that overwrite an object's file in place answer it under concurrent
overwrites of one key. Reconnection is botocore's: the next call after an outage opens a
fresh connection.

Why multipart only above 64 MiB: typical KV chunks (2 to 100 MiB) already move in
parallel because a batch has many of them in flight, while a multipart upload costs two
extra round trips (create, complete), and on some S3-compatible servers (rclone, MinIO
on a filesystem) a server-side rename. Above ``multipart_threshold`` parts of
``multipart_chunksize`` bytes are sent concurrently, in ascending order (streaming
servers such as rclone buffer parts that arrive early), so that one very large object is
not limited by one connection, a failed part is retried alone, and the 5 GiB limit of a
single PUT does not apply.

Why checksums are only computed when the service requires them: each payload carries
its own xxh3 checksums (header and body), checked on every read, so S3's CRC trailers
would only cost CPU, and several S3-compatible servers reject them.

The bucket is checked once, at first use (not in the constructor: an engine must start
while its remote tier is down); a missing bucket is created when ``create_bucket`` is
true, otherwise every call raises an error that says so. Writes are atomic (S3 never
exposes a partial object).

It is a store of payload bytes (:class:`~lmcache.storage.BytesBackend`): ``get`` returns
each object's bytes, owned by the caller, and a tier decodes and checks them through
:class:`lmcache.encoded.Encoded` (a payload that fails its checks is a miss and is
deleted). S3 deletes a missing object without saying so, so ``delete`` learns whether
each key was there from HEADs first (concurrent ones for a batch).
"""

from __future__ import annotations

import io
import logging
import re
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator, Mapping, Sequence
from urllib.parse import urlsplit

from lmcache.errors import BackendError, ConfigError
from lmcache.keys import CacheKey
from lmcache.storage import BackendContext, BytesBackend, EntryInfo
from lmcache.units import parse_size

log = logging.getLogger(__name__)

MiB = 1 << 20
#: the smallest part S3 accepts (except the last one of an upload)
MIN_PART = 5 * MiB
#: the largest single PUT and the largest part S3 accepts
MAX_PART = 5 << 30
MAX_PARTS = 10000
#: keys per DeleteObjects call (the S3 limit)
DELETE_BATCH = 1000
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_REGION = re.compile(r"^[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?$")
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_NO_BUCKET = {"NoSuchBucket"}
_INTERNAL = {"500", "InternalError"}
_SESSION = None
_SESSION_LOCK = threading.Lock()


def _parse_url(url: Any) -> tuple[str, str]:
    """``s3://bucket[/prefix]`` -> ``(bucket, prefix)`` (prefix without outer slashes)."""
    if not isinstance(url, str) or not url:
        raise ConfigError("url", f"expected an URL such as s3://bucket/prefix, got {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError("url", f"malformed URL {url!r}: {exc}") from None
    if parts.scheme != "s3":
        raise ConfigError("url", f"expected an URL such as s3://bucket/prefix, got {url!r}")
    if parts.query or parts.fragment:
        raise ConfigError("url", f"{url!r}: an s3 URL takes no query or fragment; use the tier's keys")
    if parts.username is not None or parts.password is not None or port is not None:
        raise ConfigError(
            "url", f"{url!r}: put credentials in access_key_id/secret_access_key and the server in endpoint_url"
        )
    bucket = parts.hostname or ""
    if not bucket:
        raise ConfigError("url", f"{url!r} names no bucket (expected s3://bucket/prefix)")
    if not _BUCKET.match(parts.netloc):
        raise ConfigError(
            "url",
            f"bad bucket name {parts.netloc!r}: 3 to 63 lowercase letters, digits, '.' and '-', "
            "starting and ending with a letter or digit",
        )
    prefix = parts.path.strip("/")
    if "//" in prefix:
        raise ConfigError("url", f"{url!r}: empty path segment in the prefix")
    return parts.netloc, prefix


def _code(exc: BaseException) -> str:
    resp = getattr(exc, "response", None)
    if not isinstance(resp, Mapping):
        return ""
    return str(resp.get("Error", {}).get("Code", "")) or str(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


class _Slice:
    """A read-only, seekable file over bytes ``[start, end)`` of a list of buffers.

    botocore takes bytes or files as a request body, not memoryviews; this sends a
    payload (header and body buffers, the body zero-copy for the ``raw`` codec) and each
    multipart part without first copying them into one bytes object."""

    def __init__(self, bufs: Sequence[memoryview], start: int, end: int):
        self._bufs = bufs
        self._start = start
        self._end = end
        self._pos = start

    def __len__(self) -> int:
        return self._end - self._start

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos - self._start

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: self._start, io.SEEK_CUR: self._pos, io.SEEK_END: self._end}[whence]
        self._pos = min(max(base + offset, self._start), self._end)
        return self.tell()

    def read(self, n: int = -1) -> bytes:
        stop = self._end if n is None or n < 0 else min(self._end, self._pos + n)
        out = []
        off = 0
        for b in self._bufs:
            lo, hi = off, off + len(b)
            off = hi
            if hi <= self._pos or lo >= stop:
                continue
            out.append(b[max(self._pos, lo) - lo : min(stop, hi) - lo])
        self._pos = stop
        if len(out) == 1:
            return bytes(out[0])
        return b"".join(out)

    def close(self) -> None:
        pass


class S3Backend(BytesBackend):
    OPTIONS = {
        "url": None,
        "prefix": None,
        "endpoint_url": None,
        "region": None,
        "access_key_id": None,
        "secret_access_key": None,
        "session_token": None,
        "addressing_style": "auto",
        "verify": None,
        "timeout": 5.0,
        "retries": 1,
        "concurrency": 16,
        "multipart_threshold": 64 * MiB,
        "multipart_chunksize": 16 * MiB,
        "create_bucket": False,
    }
    shared = True

    # ------------------------------------------------------------------ options
    @staticmethod
    def location(opts: Mapping[str, Any]) -> tuple[str, str]:
        """``(bucket, prefix)`` of checked options: the prefix comes from the URL's path
        or from the ``prefix`` key (not both), without outer slashes."""
        bucket, prefix = _parse_url(opts["url"])
        extra = opts.get("prefix")
        if extra is not None:
            if not isinstance(extra, str):
                raise ConfigError("prefix", f"expected a string, got {extra!r}")
            if prefix and extra.strip("/"):
                raise ConfigError("prefix", "the url already has a prefix (s3://bucket/prefix); give it in one place")
            prefix = prefix or extra.strip("/")
            if "//" in prefix:
                raise ConfigError("prefix", f"empty path segment in {extra!r}")
        return bucket, prefix

    @classmethod
    def check_options(cls, options: Mapping[str, Any], capacity: int | None = None) -> dict[str, Any]:
        opts = super().check_options(options, capacity)
        cls.location(opts)
        ep = opts["endpoint_url"]
        if ep is not None:
            try:
                p = urlsplit(ep) if isinstance(ep, str) else None
                if p is not None:
                    p.port  # noqa: B018 - raises on a bad port
            except ValueError:
                p = None
            if p is None or p.scheme not in ("http", "https") or not p.hostname:
                raise ConfigError("endpoint_url", f"expected an http(s) URL such as http://127.0.0.1:9000, got {ep!r}")
        for name in ("region", "access_key_id", "secret_access_key", "session_token"):
            v = opts[name]
            if v is not None and (not isinstance(v, str) or not v):
                got = repr(v) if name == "region" else f"a {type(v).__name__}"  # a credential: never its value
                raise ConfigError(name, f"expected a non-empty string, got {got}")
        if opts["region"] is not None and not _REGION.match(opts["region"]):
            raise ConfigError("region", f"expected a region name such as us-east-1, got {opts['region']!r}")
        if (opts["access_key_id"] is None) != (opts["secret_access_key"] is None):
            missing = "secret_access_key" if opts["secret_access_key"] is None else "access_key_id"
            raise ConfigError(missing, "access_key_id and secret_access_key go together; give both or neither")
        if opts["addressing_style"] not in ("auto", "path", "virtual"):
            raise ConfigError("addressing_style", f"expected auto, path or virtual, got {opts['addressing_style']!r}")
        if opts["verify"] is not None and not isinstance(opts["verify"], (bool, str)):
            raise ConfigError("verify", f"expected true, false or the path of a CA bundle, got {opts['verify']!r}")
        t = opts["timeout"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise ConfigError("timeout", f"expected a number of seconds in (0, 3600], got {t!r}")
        opts["timeout"] = float(t)
        for name, lo, hi in (("retries", 0, 10), ("concurrency", 1, 1024)):
            v = opts[name]
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigError(name, f"expected an integer in [{lo}, {hi}], got {v!r}")
        for name in ("multipart_threshold", "multipart_chunksize"):
            try:
                opts[name] = parse_size(opts[name])
            except ValueError as exc:
                raise ConfigError(name, str(exc)) from None
            if not MIN_PART <= opts[name] <= MAX_PART:
                raise ConfigError(name, f"must be between 5MiB and 5GiB (S3's part limits), got {opts[name]}")
        if not isinstance(opts["create_bucket"], bool):
            raise ConfigError("create_bucket", f"expected true or false, got {opts['create_bucket']!r}")
        return opts

    @classmethod
    def _client(cls, opts: Mapping[str, Any], pool_size: int):
        """A boto3 client whose every attempt is bounded by ``timeout`` (opens nothing)."""
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:  # pragma: no cover - the registry names the extra
            raise BackendError("the s3 backend needs boto3: pip install 'lmcache[s3]'") from exc
        cfg = Config(
            connect_timeout=opts["timeout"],
            read_timeout=opts["timeout"],
            retries={"max_attempts": opts["retries"], "mode": "standard"},  # retries after the first
            max_pool_connections=pool_size,
            s3={"addressing_style": opts["addressing_style"]},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            tcp_keepalive=True,
        )
        global _SESSION
        try:
            with _SESSION_LOCK:  # a session is not thread-safe; one shared session loads
                if _SESSION is None:  # botocore's service models once per process
                    _SESSION = boto3.session.Session()
                return _SESSION.client(
                    "s3",
                    endpoint_url=opts["endpoint_url"],
                    region_name=opts["region"],
                    aws_access_key_id=opts["access_key_id"],
                    aws_secret_access_key=opts["secret_access_key"],
                    aws_session_token=opts["session_token"],
                    verify=opts["verify"],
                    config=cfg,
                )
        except ValueError as exc:  # e.g. an endpoint or region botocore cannot use
            raise ConfigError("endpoint_url" if opts["endpoint_url"] else "region", str(exc)) from None

    def __init__(self, context: BackendContext):
        super().__init__(context)
        o = self.options
        self.bucket, self.prefix = self.location(o)
        self._obj_prefix = f"{self.prefix}/" if self.prefix else ""
        #: S3 object names are at most 1024 bytes of UTF-8, the prefix included, and stores
        #: that keep objects as files (MinIO, rclone serve s3) refuse a /-separated segment
        #: over 255 bytes: a key (no '/' in it) is one segment. Values, written in multipart
        #: uploads, are bounded only by S3's 5 TiB.
        self.max_key_length = min(255, 1024 - len(self._obj_prefix.encode()))
        self.concurrency: int = o["concurrency"]
        self.threshold: int = o["multipart_threshold"]
        self.chunksize: int = o["multipart_chunksize"]
        self.read_only = context.read_only
        # one connection per request in flight, plus one per multipart part in flight
        self.client = self._client(o, 2 * self.concurrency)
        self._lock = threading.Lock()
        self._bucket_ok = False
        self._pool: ThreadPoolExecutor | None = None
        self._part_pool: ThreadPoolExecutor | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"S3Backend(s3://{self.bucket}/{self.prefix}, endpoint={self.options['endpoint_url']})"

    # ------------------------------------------------------------------ helpers
    def _name(self, key: str) -> str:
        return self._obj_prefix + key

    def _executor(self, parts: bool = False) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise BackendError(f"tier {self.context.tier}: the s3 backend is closed")
            if parts:
                if self._part_pool is None:
                    self._part_pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="lmcache-s3-part")
                return self._part_pool
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="lmcache-s3")
            return self._pool

    def _ensure_bucket(self) -> None:
        """Check the bucket once (creating it if allowed); raise while it is missing."""
        if self._bucket_ok:
            return
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            code = _code(exc)
            if code in ("403", "AccessDenied", "Forbidden"):
                raise BackendError(
                    f"s3 tier {self.context.tier}: access to bucket {self.bucket!r} denied; check the credentials"
                ) from None
            if code not in _NOT_FOUND | _NO_BUCKET:
                raise
            if not self.options["create_bucket"] or self.read_only:
                raise BackendError(
                    f"s3 tier {self.context.tier}: bucket {self.bucket!r} does not exist; "
                    "create it or set create_bucket: true"
                ) from None
            kw: dict[str, Any] = {}
            region = self.client.meta.region_name
            if region and region != "us-east-1" and not self.options["endpoint_url"]:
                kw["CreateBucketConfiguration"] = {"LocationConstraint": region}
            try:
                self.client.create_bucket(Bucket=self.bucket, **kw)
                log.info("s3 tier %s: created bucket %s", self.context.tier, self.bucket)
            except ClientError as exc2:
                if _code(exc2) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise
        self._bucket_ok = True

    def _call(self, fn: Callable[..., Any], **kw: Any) -> Any:
        """One S3 call; a vanished bucket is re-checked (and recreated) on the next call.

        An ``InternalError`` (HTTP 500) is asked again up to three times, 50, 100 and
        200 ms apart, then raised (the request body is rewound first). AWS documents the
        error as retryable, and servers that replace an object's file non-atomically
        (``rclone serve s3``) answer it to a GET, or a concurrent PUT, that falls inside
        an overwrite of the same key. It is asked again only while the call has taken
        less than ``timeout``, so a server that answers 500 slowly still ends the call
        within about ``(retries + 2) * timeout``. The calls made through here are
        idempotent (HEAD, GET, PUT and DELETE of objects), or, for the start of a
        multipart upload, leave at most an empty upload that the store's lifecycle rules
        reclaim."""
        self._ensure_bucket()
        t0 = time.monotonic()
        for attempt in range(4):
            try:
                return fn(Bucket=self.bucket, **kw)
            except Exception as exc:
                code = _code(exc)
                if code in _NO_BUCKET:
                    self._bucket_ok = False
                if code not in _INTERNAL or attempt == 3 or time.monotonic() - t0 >= self.options["timeout"]:
                    raise
                log.debug("s3 tier %s: %s answered %s, attempt %d", self.context.tier, kw.get("Key"), code, attempt + 1)
                body = kw.get("Body")
                if body is not None:
                    body.seek(0)
                time.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def _map(self, fn: Callable[[Any], Any], args: Sequence[Any]) -> list:
        """``[fn(a) for a in args]``, ``concurrency`` at a time; the first error cancels
        what has not started and is raised."""
        if len(args) <= 1:
            return [fn(a) for a in args]
        self._ensure_bucket()  # once, not once per thread
        futs = [self._executor().submit(fn, a) for a in args]
        try:
            done, _ = wait(futs, return_when=FIRST_EXCEPTION)
            for f in futs:
                if f in done and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            return [f.result() for f in futs]
        except BaseException:
            for f in futs:
                f.cancel()
            raise

    # ------------------------------------------------------------- the five verbs
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Concurrent HEADs."""
        return self._map(self.exists_one, list(keys))

    def exists_one(self, key: str) -> bool:
        try:
            self._call(self.client.head_object, Key=self._name(key))
        except Exception as exc:
            if _code(exc) in _NOT_FOUND:
                return False
            raise
        return True

    def get(self, keys: Sequence[str], on_ready: Callable[[int, Any], None] | None = None) -> list[bytes | None]:
        """Concurrent GETs, each the object's bytes (the caller's own) or ``None``."""
        return self._map(self.get_one, list(keys))

    def get_one(self, key: str) -> bytes | None:
        """The object's bytes, or ``None``. A body cut short while it streams (the object
        was replaced under the read: S3 servers may end the old stream early) is read
        again, twice at most, then a miss: one key being overwritten is not an outage."""
        torn = _torn_read_errors()
        for attempt in range(3):
            try:
                resp = self._call(self.client.get_object, Key=self._name(key))
            except Exception as exc:
                if _code(exc) in _NOT_FOUND:
                    return None
                raise
            try:
                with resp["Body"] as body:
                    return body.read()
            except torn as exc:
                log.debug("s3 tier %s: read of %s cut short (%s), attempt %d", self.context.tier, key, exc, attempt + 1)
        return None

    def put(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> list[int]:
        """Concurrent PUTs (multipart above ``multipart_threshold``)."""
        return self._map(lambda kv: self.put_one(kv[0], kv[1]), list(items))

    def put_one(self, key: str, buffers: Sequence[bytes | memoryview]) -> int:
        """The concatenation of ``buffers`` as one object, sent without joining them first."""
        bufs = [memoryview(b).cast("B") for b in buffers if len(b)]
        total = sum(len(b) for b in bufs)
        if total <= self.threshold:
            self._call(self.client.put_object, Key=self._name(key), Body=_Slice(bufs, 0, total))
        else:
            self._multipart(self._name(key), bufs, total)
        return total

    def _multipart(self, name: str, bufs: Sequence[memoryview], total: int) -> None:
        size = max(self.chunksize, -(-total // MAX_PARTS))
        ranges = [(i + 1, off, min(off + size, total)) for i, off in enumerate(range(0, total, size))]
        upload = self._call(self.client.create_multipart_upload, Key=name)["UploadId"]

        def send(part: tuple[int, int, int]) -> dict:
            num, lo, hi = part
            r = self.client.upload_part(
                Bucket=self.bucket, Key=name, UploadId=upload, PartNumber=num, Body=_Slice(bufs, lo, hi)
            )
            return {"PartNumber": num, "ETag": r["ETag"]}

        pool = self._executor(parts=True)
        futs = [pool.submit(send, r) for r in ranges]  # in ascending order
        try:
            done = [f.result() for f in futs]
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=name, UploadId=upload, MultipartUpload={"Parts": done}
            )
        except BaseException:
            for f in futs:
                f.cancel()
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload)
            except Exception as exc:  # the store's lifecycle rules reclaim what is left
                log.debug("s3 tier %s: could not abort upload of %s: %s", self.context.tier, name, exc)
            raise

    def delete_one(self, key: str) -> bool:
        """HEAD then DELETE: S3 deletes a missing object without saying so, and the
        caller wants to know whether something was removed."""
        if not self.exists_one(key):
            return False
        self._call(self.client.delete_object, Key=self._name(key))
        return True

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key was there, from concurrent HEADs (S3 deletes a missing
        object without saying so); then DeleteObjects of those that were, 1000 keys a
        call. A key stored between its HEAD and the delete stays, reported absent."""
        keys = list(keys)
        if len(keys) <= 1:
            return [self.delete_one(k) for k in keys]
        here = self.exists(keys)
        names = list(dict.fromkeys(self._name(k) for k, h in zip(keys, here) if h))
        batches = [names[i : i + DELETE_BATCH] for i in range(0, len(names), DELETE_BATCH)]

        def delete(batch: list[str]) -> None:
            r = self._call(
                self.client.delete_objects, Delete={"Objects": [{"Key": n} for n in batch], "Quiet": True}
            )
            errors = [e for e in r.get("Errors", ()) if e.get("Code") not in _NOT_FOUND]
            if errors:
                e = errors[0]
                raise BackendError(
                    f"s3 tier {self.context.tier}: could not delete {len(errors)} objects, "
                    f"e.g. {e.get('Key')!r}: {e.get('Code')} {e.get('Message', '')}"
                )

        self._map(delete, batches)
        return here

    def _listing(self) -> Iterator[dict]:
        self._ensure_bucket()
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._obj_prefix, Delimiter="/"
        )
        n = len(self._obj_prefix)
        for page in pages:
            for o in page.get("Contents", ()):
                key = o["Key"][n:]
                try:
                    CacheKey.parse(key)
                except ValueError:
                    continue  # not ours: another tool's object, or a temporary
                o["lmcache_key"] = key
                yield o

    def keys(self) -> Iterator[tuple[str, int]]:
        for o in self._listing():
            yield o["lmcache_key"], int(o["Size"])

    def entries(self) -> Iterator[EntryInfo]:
        """From the listing: the time stored is the object's LastModified; the codec is
        in each payload's header, which a listing does not load."""
        for o in self._listing():
            lm = o.get("LastModified")
            yield EntryInfo(o["lmcache_key"], int(o["Size"]), None, lm.timestamp() if lm is not None else None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools, self._pool, self._part_pool = (self._pool, self._part_pool), None, None
        for p in pools:
            if p is not None:
                p.shutdown(wait=True, cancel_futures=True)
        self.client.close()


def _torn_read_errors() -> tuple[type[BaseException], ...]:
    """What a response body that ends early raises (through botocore, urllib3 or http.client)."""
    import http.client

    out: list[type[BaseException]] = [http.client.IncompleteRead]
    try:
        from urllib3.exceptions import ProtocolError

        out.append(ProtocolError)
    except ImportError:  # pragma: no cover
        pass
    try:
        from botocore.exceptions import ResponseStreamingError

        out.append(ResponseStreamingError)
    except ImportError:  # pragma: no cover - older botocore
        pass
    return tuple(out)
