"""A small real cache engine in a host of its own, for the multi-host suite.

``python tests/multihost/_engine.py SPEC.json``: SPEC holds ``config`` (the engine's
config: a cpu tier and ``controller.url`` naming every controller replica) and
``tokens`` (a prompt whose chunks it stores, with synthetic KV). It prints ``LOADED``
once its imports are done; with ``"wait": true`` it then waits for a line on stdin before
it opens the engine (so a restart can be timed from that moment), stores the prompt,
prints ``READY <instance_id>`` and serves until its stdin closes."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(path: str) -> None:
    import torch

    import lmcache
    from lmcache.testing import procs

    spec = json.loads(Path(path).read_text())
    print("LOADED", flush=True)
    if spec.get("wait"):
        sys.stdin.readline()
    tokens = spec["tokens"]
    with lmcache.CacheEngine.from_config(spec["config"]) as engine:
        s = engine.kv_spec
        engine.store(tokens, torch.randn(s.num_layers, 2, len(tokens), s.num_kv_heads, s.head_size))
        engine.flush()
        procs.serve_until_stdin_closes(f"READY {engine.instance_id}")


if __name__ == "__main__":
    main(sys.argv[1])
