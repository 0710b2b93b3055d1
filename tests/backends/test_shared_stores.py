"""Two engine processes sharing one store: what one stores, the other retrieves.

For every shared backend (a Redis server, a Valkey server, an S3 bucket, a directory, a
Mooncake store), a peer process (tests/backends/shared_store_peer.py) and this process each open
a CacheEngine whose only tier is that store. The peer stores prompt "a"; this process
retrieves it bit-exact, stores prompt "b"; the peer retrieves "b" bit-exact.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import lmcache
from _missing import loopback_store
from shared_store_peer import SPEC, TOKENS, check, prompt

PEER = Path(__file__).with_name("shared_store_peer.py")
STORES = ["redis", "valkey", "s3", "fs", "mooncake", "lm"]


@contextlib.contextmanager
def shared_store(name: str, tmp_path: Path):
    if name == "fs":
        yield {"url": f"file://{tmp_path / 'shared'}"}
        return
    with loopback_store(name) as store:
        yield dict(store.options)


@pytest.mark.parametrize("name", STORES)
def test_two_processes_share_one_store(name, tmp_path):
    with shared_store(name, tmp_path) as options:
        cfg = {"chunk_size": 16, "tiers": [{"backend": name, "capacity": "256MiB", **options}]}
        cfg_path = tmp_path / "lmcache.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        err_path = tmp_path / "peer.err"
        with open(err_path, "w") as err:
            peer = subprocess.Popen(
                [sys.executable, str(PEER), str(cfg_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=err, text=True, cwd=PEER.parent,
            )
        try:
            line = peer.stdout.readline().strip()
            assert line == "READY", f"peer did not start: {line!r} {err_path.read_text()[-2000:]}"
            engine = lmcache.CacheEngine.from_config(cfg, kv_spec=SPEC)
            try:
                assert check(engine, "a") == (TOKENS, True), "this process did not see the peer's chunks"
                tokens, kv = prompt("b")
                engine.store(tokens, kv)
                engine.flush()
                peer.stdin.write("CHECK b\n")
                peer.stdin.flush()
                assert peer.stdout.readline().split() == ["HIT", str(TOKENS), "True"], "the peer did not see our chunks"
            finally:
                engine.close()
        finally:
            with contextlib.suppress(Exception):
                peer.stdin.close()
            try:
                peer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                peer.kill()
                peer.wait()
        assert peer.returncode == 0, err_path.read_text()[-2000:]
