"""A live cache instance for tests and docs: an engine with the instance API on a free
loopback port, a CPU tier and a disk tier, holding some KV.

    python tests/cli/live_instance.py --dir /tmp/x [--token T] [--prompts 3]

Writes ``<dir>/lmcache.yaml`` (the config, API section included), stores ``--prompts``
prompts of 64 tokens (16-token chunks; the first chunk is shared, so it is stored once),
retrieves the first prompt twice (hits), prints ``URL http://127.0.0.1:PORT`` and waits
until its stdin closes or it gets SIGTERM/SIGINT; then it closes the engine (which stops
the API) and exits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for _kv when run as a script
import torch
from _kv import wave
import yaml

import lmcache
from lmcache.testing.procs import serve_until_stdin_closes

CHUNK = 16
TOKENS = 64
MODEL = "org/demo-model"  # percent-encoded in keys: org%2Fdemo-model


def kv_for(tokens: list[int]) -> torch.Tensor:
    t = torch.as_tensor(tokens, dtype=torch.float32)
    base = torch.arange(2 * 2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 2, 8)
    return wave(base * 0.01 + t.reshape(1, 1, -1, 1, 1) * 0.37)


def prompt(i: int) -> list[int]:
    return list(range(CHUNK)) + [1000 * (i + 1) + j for j in range(TOKENS - CHUNK)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, type=Path)
    ap.add_argument("--token", default=None)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--namespace", default="default")
    args = ap.parse_args()

    args.dir.mkdir(parents=True, exist_ok=True)
    config = {
        "chunk_size": CHUNK,
        "model": MODEL,
        "namespace": args.namespace,
        "tiers": [
            {"backend": "cpu", "capacity": "4MiB"},
            {"backend": "disk", "path": str(args.dir / "kv"), "capacity": "64MiB"},
        ],
        "api": {"enabled": True, "host": "127.0.0.1", "port": 0, "token": args.token, "timeout": 5},
    }
    path = args.dir / "lmcache.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))

    with lmcache.CacheEngine.from_config(path) as engine:
        for i in range(args.prompts):
            toks = prompt(i)
            engine.store(toks, kv_for(toks))
        engine.flush()
        if args.prompts:
            for _ in range(2):
                engine.retrieve(prompt(0))
        engine.lookup(prompt(99))  # a miss past the shared chunk
        serve_until_stdin_closes(f"URL {engine.api_url}")
    print("closed", flush=True)


if __name__ == "__main__":
    main()
