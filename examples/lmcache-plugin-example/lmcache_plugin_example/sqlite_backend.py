"""The ``sqlite`` backend: every chunk is one row of a single SQLite database file.

A tier declares it as ``{backend: sqlite, path: /var/cache/lmcache/kv.db, capacity: 20GiB}``.

It derives from :class:`lmcache.storage.BytesBackend`: a store whose values are payload
bytes, answering the five verbs of every store (``get``, ``put``, ``exists``, ``delete``,
``keys``) over them, each batch in one SQL statement or one transaction. It never decodes:
a tier opens it through :class:`lmcache.encoded.Encoded`, which encodes each chunk with the
tier's codec into a self-describing payload (magic, version, codec, dtype, shape,
checksums) and checks it again on every read; a row that fails those checks is reported
as a miss and deleted. Each write is a ``DELETE`` and an ``INSERT`` inside one
transaction, so a reader sees the old row or the new one, never half of one. The database
runs in WAL mode, so other processes may read it while this one writes, and every entry
survives closing and reopening the file.

Options: ``path`` (required; the database file, created with its parent directories if
missing) and ``timeout`` (seconds to wait for a lock held by another process, default 5).
Both are checked in :meth:`SQLiteBackend.check_options`, which ``lmcache config
validate`` runs without opening anything. A backend opened with ``read_only`` (``lmcache
ls --config``, ``lmcache tiers --config``) creates nothing: a database that does not
exist yet simply has no entries.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from lmcache import payload
from lmcache.errors import BackendError, ConfigError, CorruptPayloadError
from lmcache.storage import BackendContext, BytesBackend, EntryInfo, Usage

#: Version of the table layout below, kept in ``PRAGMA user_version``.
SCHEMA_VERSION = 2
_TABLE = "lmcache_payloads"
# Stay well under SQLite's limit on host parameters in one statement.
_BATCH = 500


def _batches(keys: Sequence[str]) -> Iterator[list[str]]:
    """``keys`` in lists of at most ``_BATCH`` (one statement each)."""
    for i in range(0, len(keys), _BATCH):
        yield list(keys[i : i + _BATCH])


def _marks(part: Sequence[str]) -> str:
    return ",".join("?" * len(part))


class SQLiteBackend(BytesBackend):
    OPTIONS = {"path": None, "timeout": 5.0}
    #: a BLOB is at most SQLITE_MAX_LENGTH bytes (10**9 as SQLite is built by default); the
    #: tier splits larger payloads. Keys (TEXT) are bounded only by that too.
    max_value_size = 1_000_000_000

    @classmethod
    def check_options(cls, options: Mapping[str, Any], capacity: int | None = None) -> dict[str, Any]:
        """Every option is checked here, so that ``lmcache config validate`` finds a bad
        value before an engine starts; ``__init__`` only opens. ``capacity`` is the tier's
        capacity in bytes (``None`` where no tier is known); SQLite holds any."""
        opts = super().check_options(options, capacity)  # rejects keys not in OPTIONS
        path = opts["path"]
        if not path or not isinstance(path, (str, os.PathLike)):
            raise ConfigError("path", "the sqlite backend needs a database file, e.g. path: /var/cache/lmcache/kv.db")
        timeout = opts["timeout"]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ConfigError("timeout", f"expected a number of seconds >= 0, got {timeout!r}")
        if Path(path).expanduser().is_dir():
            raise ConfigError("path", f"{path} is a directory; give the path of a database file in it")
        return opts

    def __init__(self, context: BackendContext):
        super().__init__(context)  # runs check_options
        self.path = Path(self.options["path"]).expanduser()
        self.read_only = context.read_only
        # One connection shared by all threads; the lock serialises its use.
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        self._schema = SCHEMA_VERSION
        if self.read_only and not self.path.exists():
            return  # nothing stored yet, and inspecting must not create the file
        if not self.read_only:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError("path", f"cannot create directory {self.path.parent}: {exc.strerror}") from None
        try:
            if self.read_only:  # SQLite's own read-only mode: no file, journal or WAL is created
                uri = f"{self.path.resolve().as_uri()}?mode=ro"
                self._conn = sqlite3.connect(uri, uri=True, timeout=float(self.options["timeout"]),
                                             check_same_thread=False)
            else:
                self._conn = sqlite3.connect(self.path, timeout=float(self.options["timeout"]),
                                             check_same_thread=False)
        except sqlite3.Error as exc:
            raise ConfigError("path", f"cannot open SQLite database {self.path}: {exc}") from None
        try:
            self._init_schema()
        except sqlite3.Error as exc:
            self._conn.close()
            self._conn = None
            raise ConfigError("path", f"{self.path} is not a usable SQLite database: {exc}") from None
        except ConfigError:
            self._conn.close()
            self._conn = None
            raise

    def _init_schema(self) -> None:
        conn = self._conn
        assert conn is not None
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, 1, SCHEMA_VERSION):
            raise ConfigError(
                "path", f"{self.path} has schema version {version}; this backend reads versions 1 and {SCHEMA_VERSION}"
            )
        self._schema = version
        if self.read_only:
            if version == 0:  # an empty database (or not ours yet): nothing to read
                self._conn.close()
                self._conn = None
            return
        self._schema = SCHEMA_VERSION
        # WAL: readers in other processes do not block this writer, nor it them.
        conn.execute("PRAGMA journal_mode=WAL")
        # With WAL, NORMAL never corrupts the file; a power loss may drop the last writes,
        # which a cache can afford.
        conn.execute("PRAGMA synchronous=NORMAL")
        with conn:
            # rowid order is insertion order: keys() lists oldest first, which is the
            # order a tier rebuilds its eviction policy in after a restart
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {_TABLE} ("
                " key TEXT PRIMARY KEY NOT NULL,"
                " data BLOB NOT NULL,"
                " size INTEGER NOT NULL,"
                " codec TEXT NOT NULL,"
                " stored_at REAL NOT NULL)"
            )
            if version == 1:  # version 1 had no codec or time per row: read them as unknown
                conn.execute(f"ALTER TABLE {_TABLE} ADD COLUMN codec TEXT NOT NULL DEFAULT ''")
                conn.execute(f"ALTER TABLE {_TABLE} ADD COLUMN stored_at REAL NOT NULL DEFAULT 0")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection | None]:
        """The connection, held under the lock (``None`` for a read-only backend over a
        database that does not exist); SQLite errors become BackendError."""
        with self._lock:
            if self._conn is None:
                if self.read_only and not self._closed:
                    yield None
                    return
                raise BackendError(f"sqlite tier {self.context.tier}: the backend is closed")
            try:
                yield self._conn
            except sqlite3.Error as exc:
                raise BackendError(f"sqlite tier {self.context.tier} ({self.path}): {exc}") from exc

    # ---------------------------------------- the five verbs over bytes, batch first
    # Each is one statement (or one transaction) per batch of keys, under the lock; the
    # single-key forms (get_one, put_one, exists_one, delete_one) are derived from them.
    def get(self, keys: Sequence[str], on_ready: Callable[[int, Any], None] | None = None) -> list[bytes | None]:
        """The stored payload bytes of each key (``None``: missing), one ``SELECT ... IN``
        per batch. Decoding and checking them is the object view's work, not this store's."""
        found: dict[str, bytes] = {}
        with self._db() as conn:
            for part in _batches(keys) if conn is not None else ():
                found.update(conn.execute(f"SELECT key, data FROM {_TABLE} WHERE key IN ({_marks(part)})", part))
        return [found.get(k) for k in keys]

    def put(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> list[int]:
        """Each value (a sequence of buffers) stored as their concatenation, all in one
        transaction: a reader sees the old rows or the new ones, never part of one.
        Returns the bytes each row holds."""
        rows = []
        for key, buffers in items:
            data = b"".join(buffers)
            try:  # the payload's own codec (an entry re-encoded by `lmcache compress` has another)
                codec = payload.parse_header(data).codec
            except CorruptPayloadError:  # a part of a split payload, or not a payload
                codec = self.context.codec.name
            rows.append((key, data, len(data), codec))
        now = time.time()
        with self._db() as conn:
            if conn is None:
                raise BackendError(f"sqlite tier {self.context.tier}: opened read-only, cannot store "
                                   f"{', '.join(k for k, _ in items[:3])}")
            with conn:  # one transaction, committed or rolled back
                for key, data, size, codec in rows:
                    # DELETE first: a rewritten key becomes the newest row (rowid order = age)
                    conn.execute(f"DELETE FROM {_TABLE} WHERE key = ?", (key,))
                    conn.execute(f"INSERT INTO {_TABLE} (key, data, size, codec, stored_at) VALUES (?, ?, ?, ?, ?)",
                                 (key, data, size, codec, now))
        return [size for _, _, size, _ in rows]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """One ``SELECT key ... IN`` per batch of keys."""
        found: set[str] = set()
        with self._db() as conn:
            for part in _batches(keys) if conn is not None else ():
                found.update(r[0] for r in conn.execute(f"SELECT key FROM {_TABLE} WHERE key IN ({_marks(part)})", part))
        return [k in found for k in keys]

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key was there; one transaction for the batch (a key listed twice
        is deleted by its first mention)."""
        with self._db() as conn:
            if conn is None:
                return [False] * len(keys)
            with conn:
                return [conn.execute(f"DELETE FROM {_TABLE} WHERE key = ?", (k,)).rowcount > 0 for k in keys]

    def keys(self) -> Iterator[tuple[str, int]]:
        # Read everything under the lock, then yield: the caller may call other methods
        # of this backend while iterating. Oldest first (see _init_schema).
        with self._db() as conn:
            rows = [] if conn is None else conn.execute(f"SELECT key, size FROM {_TABLE} ORDER BY rowid").fetchall()
        yield from rows

    def entries(self) -> Iterator[EntryInfo]:
        """With each entry's codec and the time it was stored (``lmcache ls`` shows them)."""
        if self._schema < 2:  # a read-only look at a version-1 database
            yield from super().entries()
            return
        with self._db() as conn:
            rows = [] if conn is None else conn.execute(
                f"SELECT key, size, codec, stored_at FROM {_TABLE} ORDER BY rowid").fetchall()
        for key, size, codec, stored_at in rows:
            yield EntryInfo(key, size, codec or None, stored_at or None)

    def usage(self) -> Usage:
        with self._db() as conn:
            n, used = (0, 0) if conn is None else conn.execute(
                f"SELECT COUNT(*), COALESCE(SUM(size), 0) FROM {_TABLE}").fetchone()
        return Usage(used, self.context.capacity, n)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __repr__(self) -> str:
        return f"SQLiteBackend({str(self.path)!r})"
