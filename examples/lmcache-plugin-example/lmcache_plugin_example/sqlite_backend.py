"""The ``sqlite`` backend: every chunk is one row of a single SQLite database file.

A tier declares it as ``{backend: sqlite, path: /var/cache/lmcache/kv.db, capacity: 20GiB}``.

It derives from :class:`lmcache.storage.BytesBackend`, so it only moves opaque bytes:
the base class encodes each chunk with the tier's codec into a self-describing payload
(magic, version, codec, dtype, shape, checksums) and checks it again on every read; a row
that fails those checks is reported as a miss and deleted. Each write is one
``INSERT OR REPLACE`` inside a transaction, so a reader sees the old row or the new one,
never half of one. The database runs in WAL mode, so other processes may read it while
this one writes, and every entry survives closing and reopening the file.

Options: ``path`` (required; the database file, created with its parent directories if
missing) and ``timeout`` (seconds to wait for a lock held by another process, default 5).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from pathlib import Path
from typing import Iterator, Sequence

from lmcache.errors import BackendError, ConfigError
from lmcache.storage import BackendContext, BytesBackend, Usage

#: Version of the table layout below, kept in ``PRAGMA user_version``.
SCHEMA_VERSION = 1
_TABLE = "lmcache_payloads"
# Stay well under SQLite's limit on host parameters in one statement.
_BATCH = 500


class SQLiteBackend(BytesBackend):
    OPTIONS = {"path": None, "timeout": 5.0}

    def __init__(self, context: BackendContext):
        super().__init__(context)  # rejects keys not in OPTIONS
        path = self.options["path"]
        if not path or not isinstance(path, (str, os.PathLike)):
            raise ConfigError("path", "the sqlite backend needs a database file, e.g. path: /var/cache/lmcache/kv.db")
        timeout = self.options["timeout"]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ConfigError("timeout", f"expected a number of seconds >= 0, got {timeout!r}")
        self.path = Path(path).expanduser()
        if self.path.is_dir():
            raise ConfigError("path", f"{self.path} is a directory; give the path of a database file in it")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("path", f"cannot create directory {self.path.parent}: {exc.strerror}") from None
        # One connection shared by all threads; the lock serialises its use.
        self._lock = threading.Lock()
        try:
            self._conn: sqlite3.Connection | None = sqlite3.connect(
                self.path, timeout=float(timeout), check_same_thread=False
            )
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
        if version not in (0, SCHEMA_VERSION):
            raise ConfigError(
                "path", f"{self.path} has schema version {version}; this backend reads version {SCHEMA_VERSION}"
            )
        # WAL: readers in other processes do not block this writer, nor it them.
        conn.execute("PRAGMA journal_mode=WAL")
        # With WAL, NORMAL never corrupts the file; a power loss may drop the last writes,
        # which a cache can afford.
        conn.execute("PRAGMA synchronous=NORMAL")
        with conn:
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {_TABLE} ("
                " key TEXT PRIMARY KEY NOT NULL,"
                " data BLOB NOT NULL,"
                " size INTEGER NOT NULL)"
            )
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """The connection, held under the lock; SQLite errors become BackendError."""
        with self._lock:
            if self._conn is None:
                raise BackendError(f"sqlite tier {self.context.tier}: the backend is closed")
            try:
                yield self._conn
            except sqlite3.Error as exc:
                raise BackendError(f"sqlite tier {self.context.tier} ({self.path}): {exc}") from exc

    # ------------------------------------------------------------- BytesBackend
    def write(self, key: str, buffers: Sequence[bytes | memoryview]) -> None:
        data = b"".join(buffers)
        with self._db() as conn, conn:  # `with conn`: one transaction, committed or rolled back
            conn.execute(
                f"INSERT OR REPLACE INTO {_TABLE} (key, data, size) VALUES (?, ?, ?)",
                (key, data, len(data)),
            )

    def read(self, key: str) -> bytes | None:
        with self._db() as conn:
            row = conn.execute(f"SELECT data FROM {_TABLE} WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def delete(self, key: str) -> bool:
        with self._db() as conn, conn:
            return conn.execute(f"DELETE FROM {_TABLE} WHERE key = ?", (key,)).rowcount > 0

    def exists(self, key: str) -> bool:
        with self._db() as conn:
            return conn.execute(f"SELECT 1 FROM {_TABLE} WHERE key = ?", (key,)).fetchone() is not None

    def list(self) -> Iterator[tuple[str, int]]:
        # Read everything under the lock, then yield: the caller may call other methods
        # of this backend while iterating.
        with self._db() as conn:
            rows = conn.execute(f"SELECT key, size FROM {_TABLE}").fetchall()
        for key, size in rows:
            yield key, size

    # ------------------------------------------- batch forms: one query per batch
    def contains(self, keys: Sequence[str]) -> list[bool]:
        found: set[str] = set()
        with self._db() as conn:
            for i in range(0, len(keys), _BATCH):
                part = list(keys[i : i + _BATCH])
                marks = ",".join("?" * len(part))
                found.update(r[0] for r in conn.execute(f"SELECT key FROM {_TABLE} WHERE key IN ({marks})", part))
        return [k in found for k in keys]

    def remove(self, keys: Sequence[str]) -> None:
        with self._db() as conn, conn:
            conn.executemany(f"DELETE FROM {_TABLE} WHERE key = ?", [(k,) for k in keys])

    def usage(self) -> Usage:
        with self._db() as conn:
            n, used = conn.execute(f"SELECT COUNT(*), COALESCE(SUM(size), 0) FROM {_TABLE}").fetchone()
        return Usage(used, self.context.capacity, n)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __repr__(self) -> str:
        return f"SQLiteBackend({str(self.path)!r})"
