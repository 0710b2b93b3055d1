"""The ``transfer`` service in engines: chunks pushed (or pulled) over a channel land in the
receiving engine's top tier under their keys, checked, and are served as local hits."""

from __future__ import annotations

import pytest
import torch

from tests.transfer.test_channels import CHANNELS, nixl_or_missing

CHUNK = 16
PROMPT = [(i * 7919 + 13) % 30000 for i in range(16 * CHUNK)]
KV_SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"}


def engine(channel: str, **extra):
    import lmcache

    return lmcache.CacheEngine.from_config({
        "chunk_size": CHUNK, "tiers": [{"backend": "cpu", "capacity": "64MiB"}], "kv_spec": KV_SPEC,
        "transfer_channel": channel, "transfer": {"token": "xfer-secret", "slot_timeout": 5.0}, **extra})


@pytest.mark.parametrize("channel", CHANNELS)
def test_pushed_and_pulled_chunks_are_local_hits_bit_exact(channel):
    if channel == "nixl":
        nixl_or_missing()
    a, b, c = engine(channel), engine(channel), engine(channel)
    try:
        kv = torch.randn(2, 2, len(PROMPT), 2, 8, generator=torch.Generator().manual_seed(7))
        a.store(PROMPT, kv)
        keys = a.chunk_keys(PROMPT)[1]
        assert len(keys) == 16 and b.lookup(PROMPT) == 0
        ta, tb, tc = (e.services["transfer"] for e in (a, b, c))
        r = ta.push(keys, tb.url, "req-1")
        assert r["committed"] == 16 and r["missing"] == [] and r["rejected"] == []
        assert b.lookup(PROMPT) == len(PROMPT)
        got = b.retrieve(PROMPT)
        assert got.num_tokens == len(PROMPT) and torch.equal(got.kv, kv)
        # vLLM's direction: c pulls what a offers
        offer = ta.offer(keys, "req-2")
        r = tc.pull(offer)
        assert r["committed"] == 16
        got = c.retrieve(PROMPT)
        assert torch.equal(got.kv, kv)
        st = b.stats()["transfer"]
        assert st["channel"] == channel and st["committed_chunks"] == 16 and st["open_allocations"] == 0
    finally:
        for e in (a, b, c):
            e.close()


def test_a_foreign_key_or_shape_is_refused_and_nothing_is_stored():
    a = engine("tcp")
    b = engine("tcp", namespace="other-tenant")
    c = engine("tcp", kv_spec={**KV_SPEC, "num_kv_heads": 4})
    try:
        kv = torch.randn(2, 2, len(PROMPT), 2, 8)
        a.store(PROMPT, kv)
        keys = a.chunk_keys(PROMPT)[1][:4]
        ta = a.services["transfer"]
        r = ta.push(keys, b.services["transfer"].url, "req-ns")
        assert r["committed"] == 0 and len(r["rejected"]) == 4
        assert b.stats()["transfer"]["refused_chunks"] == 4 and b.lookup(PROMPT) == 0
        from lmcache.transfer import TransferError

        with pytest.raises(TransferError, match="not KV of"):  # refused before a slot is allocated
            ta.push(keys, c.services["transfer"].url, "req-shape")
        assert c.stats()["transfer"]["allocated"] == 0
    finally:
        for e in (a, b, c):
            e.close()


def test_a_wrong_transfer_token_is_refused():
    from lmcache.transfer import TransferError

    a = engine("tcp")
    b = engine("tcp", transfer={"token": "another"})
    try:
        a.store(PROMPT[:CHUNK], torch.randn(2, 2, CHUNK, 2, 8))
        keys = a.chunk_keys(PROMPT[:CHUNK])[1]
        with pytest.raises(TransferError, match="does not know the transfer token"):
            a.services["transfer"].push(keys, b.services["transfer"].url, "req")
    finally:
        a.close()
        b.close()
