"""The SQLite backend's raw baseline for ``lmcache bench tiers --backend sqlite``.

Registered through ``lmcache_register_bench_baselines`` (see :mod:`.plugin`); the engine
never imports this module.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence


def raw_baseline(options: Mapping[str, Any], items: Sequence[tuple[str, bytes]], batch: int) -> tuple[float, float]:
    """Plain ``sqlite3``: ``executemany`` INSERTs, ``batch`` rows per transaction, then
    SELECTs of the same rows, in a scratch database next to ``options["path"]`` that is
    removed afterwards. Returns ``(put_seconds, get_seconds)``."""
    path = Path(options["path"]).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f"{path.name}.raw-{uuid.uuid4().hex}")
    step = max(1, batch)
    conn = sqlite3.connect(scratch, timeout=float(options.get("timeout", 5.0)))
    try:
        conn.execute("CREATE TABLE raw (name TEXT PRIMARY KEY, data BLOB NOT NULL)")
        t0 = time.perf_counter()
        for i in range(0, len(items), step):
            with conn:
                conn.executemany("INSERT INTO raw (name, data) VALUES (?, ?)", items[i : i + step])
        t1 = time.perf_counter()
        got = 0
        for i in range(0, len(items), step):
            names = [n for n, _ in items[i : i + step]]
            marks = ",".join("?" * len(names))
            got += sum(len(d) for (d,) in conn.execute(f"SELECT data FROM raw WHERE name IN ({marks})", names))
        t2 = time.perf_counter()
    finally:
        conn.close()
        for p in (scratch, Path(f"{scratch}-journal")):
            p.unlink(missing_ok=True)
    want = sum(len(d) for _, d in items)
    if got != want:
        raise RuntimeError(f"sqlite raw baseline read back {got} bytes of {want}")
    return t1 - t0, t2 - t1
