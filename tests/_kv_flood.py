"""Shared by the KV-event tests: overflow a publisher's queue through its real listener."""

from __future__ import annotations

import sys
import time

import torch


def flood(e, n: int, hang: float = 10.0) -> None:
    """``n`` admits of fresh chunks reach ``e``'s KV-event listener while the sending
    thread is starved (a huge GIL switch interval), so a small queue overflows; then
    wait (at most ``hang`` seconds) until the queue has drained, so that later events
    are not dropped too."""
    pub = e.kv_events
    chunk = e.config.chunk_size
    if e.kv_spec is None:  # keys need the KV's shape: one store first
        e.store(list(range(90000, 90000 + chunk)), torch.zeros(2, 2, chunk, 1, 4))
    toks = list(range(10**6, 10**6 + n * chunk))  # chunks no tier holds yet
    chunks, keys = e.chunk_keys(toks)
    pub.remember(toks, chunks, keys)
    old = sys.getswitchinterval()
    sys.setswitchinterval(30)
    try:
        for key in keys:
            pub.on_tier_event("admit", "cpu", key)
    finally:
        sys.setswitchinterval(old)
    deadline = time.monotonic() + hang
    while pub.stats()["queued_events"]:
        assert time.monotonic() < deadline, "the publisher's queue never drained"
        time.sleep(0.01)
