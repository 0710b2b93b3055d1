"""The other engine process of tests/backends/test_shared_stores.py.

    python tests/backends/shared_store_peer.py CONFIG.yaml

Opens a CacheEngine on CONFIG (one shared tier), stores prompt "a", prints ``READY``;
then for each line on stdin ``CHECK <name>`` retrieves prompt ``<name>`` and prints
``HIT <tokens> <exact>``; exits when stdin closes.
"""

from __future__ import annotations

import sys

import torch
import yaml

import lmcache

SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}
TOKENS = 64


def prompt(name: str) -> tuple[list[int], torch.Tensor]:
    """Deterministic tokens and KV for a prompt name (the same in every process)."""
    seed = sum(ord(c) * 31**i for i, c in enumerate(name)) % (1 << 31)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(50_000, (TOKENS,), generator=g).tolist()
    kv = torch.randn(2, 2, TOKENS, 2, 8, generator=g)
    return tokens, kv


def check(engine: lmcache.CacheEngine, name: str) -> tuple[int, bool]:
    tokens, kv = prompt(name)
    r = engine.retrieve(tokens)
    exact = r.num_tokens > 0 and torch.equal(r.kv, kv[:, :, : r.num_tokens])
    return r.num_tokens, bool(exact)


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = yaml.safe_load(f)
    engine = lmcache.CacheEngine.from_config(cfg, kv_spec=SPEC)
    try:
        tokens, kv = prompt("a")
        engine.store(tokens, kv)
        engine.flush()
        print("READY", flush=True)
        for line in sys.stdin:
            parts = line.split()
            if len(parts) == 2 and parts[0] == "CHECK":
                n, exact = check(engine, parts[1])
                print(f"HIT {n} {exact}", flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
