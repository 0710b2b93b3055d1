"""One request, one hash: :class:`lmcache.prompt.Prompt`, the engine's prompt memo, and a
store that gathers each chunk straight into pool memory (:class:`KVGather`)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from lmcache.engine_io import KVGather
from lmcache.errors import KVShapeError
from lmcache.keys import KeyExtra, TokenProcessor
from lmcache.prompt import PromptMemo

from _digests import count_digests, count_prompt_digests
from test_engine import D, H, L, engine, kv_for


def test_one_request_hashes_its_chunks_once_per_process():
    """The calls a vLLM worker makes for one load (the lookup service's pinned lookup, the
    retrieve, the release) and for one save (lookup, store, release of the cached prefix)
    each hash the prompt's chunks once, with the tokens handed over as new lists each time.
    Before: 3 passes per load (21 digest calls for 7 chunks), 3 per save."""
    toks = list(range(100))  # 7 chunks of 16
    with engine() as e:
        e.store(toks, kv_for(toks))
        e.prompts.clear()
        built = e.prompts.built
        calls = count_digests(e)
        assert e.lookup(np.array(toks, dtype=np.uint32), pin=True) == 100  # the lookup channel's array
        out = torch.empty(L, 2, 100, H, D)
        assert e.retrieve(list(toks), out=out).num_tokens == 100
        e.release(list(toks))
        assert calls[0] == 7
        assert torch.equal(out, kv_for(toks))

        more = toks + list(range(500, 540))  # a save: 2 chunks more than cached (9 in all)
        calls[0] = 0
        skip = e.lookup(list(more), pin=True)
        assert skip == 96  # the 6 full chunks; the partial 7th differs in `more`
        res = e.store(list(more), kv_for(more))
        e.release(list(more), upto=skip)
        assert (res.skipped_tokens, res.stored_tokens) == (96, 44)
        # `more` extends the prompt the load hashed: its 6 full chunks' keys are taken from
        # there, and only the 3 chunks after them are hashed (9 before prompts were extended)
        assert calls[0] == 3
        assert e.prompts.built - built == 2


def test_a_chunked_prefills_growing_saves_hash_each_chunk_once():
    """A vLLM request prefilled in k steps saves ``prompt[:n]`` for a growing ``n`` (lookup,
    store, release each step): each chunk is hashed once in the process, plus each step's
    own partial last chunk, and no step hashes the prompt from its first token again."""
    toks = list(range(1000, 1000 + 16 * 40 + 5))  # 41 chunks of 16 (the last partial)
    kv = kv_for(toks)
    with engine() as e:
        e.store(list(range(7)), kv_for(list(range(7))))  # the engine's kv spec
        calls = count_digests(e)
        ends = [100, 250, 333, 512, len(toks)]  # 5 steps of a chunked prefill
        for end in ends:
            part = list(toks[:end])  # a new list each step, as vLLM's metadata brings it
            skip = e.lookup(part, pin=True)
            e.store(part, kv[:, :, :end])
            e.release(part, upto=skip)
        partials = sum(1 for end in ends if end % 16)  # each step's own partial last chunk
        assert calls[0] == len(toks) // 16 + partials  # 40 full chunks once, + 5 partial ones
        out = torch.empty(L, 2, len(toks), H, D)
        assert e.retrieve(list(toks), out=out).num_tokens == len(toks)
        assert torch.equal(out, kv)


def test_a_request_named_prompt_is_found_by_its_name_with_no_whole_prompt_digest():
    """Issue 46: callers that name the request (the vLLM connector: the scheduler's lookup,
    the load, each step's save of ``prompt[:n]``, the KV events) find its prompt by that
    name: no digest of the whole prompt, each chunk hashed once, a prefix converts no
    token again, an extension converts only its new tokens. The KV read back is the KV
    stored; a request id given other tokens starts over; a finished request is forgotten."""
    toks = list(range(3000, 3000 + 16 * 12 + 5))  # 13 chunks of 16 (the last partial)
    kv = kv_for(toks)
    with engine() as e:
        e.store(list(range(7)), kv_for(list(range(7))))  # the engine's kv spec
        chunks, whole = count_digests(e), count_prompt_digests(e)
        lk = e.prompt(toks[:-1], request="r1")  # the lookup leaves the last token out
        assert e.lookup(lk, pin=True) == 0
        e.release(lk)
        for end in (40, 130, len(toks)):  # a chunked prefill's growing saves
            p = e.prompt(list(toks[:end]), request="r1")
            skip = e.lookup(p, pin=True)
            e.store(p, kv[:, :, :end])
            e.release(p, upto=skip)
        assert whole[0] == 0
        # 12 full chunks once; the partial last chunks of the lookup (191 of 197 tokens) and
        # of the saves that end inside a chunk (40, 130, 197)
        assert chunks[0] == 12 + 4, chunks[0]
        out = torch.empty(L, 2, len(toks), H, D)
        hit = e.prompt(toks, request="r2")  # another request of the same prompt: a prefix's keys taken
        assert e.retrieve(hit, out=out).num_tokens == len(toks)
        assert torch.equal(out, kv)
        assert hit.keys == TokenProcessor(16).chunk_keys(toks, e._key_prefix())[1]
        assert e.prompt(toks[:100], request="r1").keys == hit.keys[:6] + [e.prompt(toks[:100]).keys[6]]
        other = [t + 1 for t in toks]  # r1's name reused for other tokens: a new prompt, right keys
        assert e.prompt(other, request="r1").keys == TokenProcessor(16).chunk_keys(other, e._key_prefix())[1]
        middle = list(other)
        middle[len(middle) // 2] = 0  # another prompt that shares all but a middle token
        assert e.prompt(middle, request="r1").keys == TokenProcessor(16).chunk_keys(middle, e._key_prefix())[1]
        assert whole[0] == 1  # the plain call above (no request) took the only whole-prompt digest
        e.forget("r1")
        e.forget("r2")
        assert not e.prompts._requests and e.prompts._request_tokens == 0


def test_request_prompts_stay_bounded():
    tp = TokenProcessor(16)
    memo = PromptMemo(tp, max_prompts=3, max_tokens=200)
    for i in range(6):
        memo.of_request(f"r{i}", list(range(i, i + 50)), "p:")
    assert len(memo._requests) == 3 and memo._request_tokens == 150
    memo.of_request("big", list(range(500)), "p:")  # over the budget alone: kept alone
    assert list(k[0] for k in memo._requests) == ["big"] and memo._request_tokens == 500
    assert memo.of_request("big", [], "p:").keys == []  # no tokens: nothing kept for it
    assert memo._request_tokens == 500


def test_release_upto_drops_exactly_what_the_prefix_lookup_leased():
    toks = list(range(64))
    with engine() as e:
        e.store(toks, kv_for(toks))
        p = e.prompt(toks)
        n = e.lookup(toks[:40], pin=True)  # leases chunks 0, 1 (the partial third is not cached)
        assert n == 32
        leased = [k for k in p.keys if e.hierarchy.tiers[0].is_pinned(k)]
        assert leased == p.keys[:2]
        e.release(toks, upto=n)
        assert not any(e.hierarchy.tiers[0].is_pinned(k) for k in p.keys)


def test_the_memo_matches_exact_content_and_stays_bounded():
    tp = TokenProcessor(16)
    memo = PromptMemo(tp, max_prompts=3, max_tokens=200)
    a = memo.get(list(range(50)), "p:")
    assert memo.get(np.arange(50), "p:") is a  # the same content in another type
    assert memo.get(torch.arange(50), "p:") is a
    assert memo.get(list(range(49)) + [7], "p:") is not a  # same length, one token differs
    assert memo.get(list(range(50)), "q:") is not a  # another key prefix (kv spec)
    salted = memo.get(list(range(50)), "p:", KeyExtra(b"tenant-2"))
    assert salted is not a and salted.keys[0] != a.keys[0]
    assert len(memo) == 3 and memo._tokens <= 200
    memo.get(list(range(150)), "p:")  # over the token budget with the others: the oldest go
    assert memo._tokens <= 200 and len(memo) <= 3
    big = memo.get(list(range(300)), "p:")  # longer than the whole budget: not kept
    assert memo.get(list(range(300)), "p:") is not big
    assert big.keys == tp.chunk_keys(list(range(300)), "p:")[1]


def test_a_prompt_hashes_only_as_far_as_a_lookup_reaches():
    toks = list(range(16 * 200))
    with engine() as e:
        e.store(toks[:32], kv_for(toks[:32]))
        calls = count_digests(e)
        assert e.lookup(toks) == 32
        assert calls[0] == 8  # the first batch of 8 chunks, not 200
        p = e.prompt(toks)
        # the rest hashed once, when asked; the 2 chunks the store hashed are not hashed again
        assert len(p.keys) == 200 and calls[0] == 198
        assert [c.end for c in p.chunks][-2:] == [16 * 199, 16 * 200]
        assert p.keys == e.chunk_keys(toks)[1]


def test_a_prompt_is_shared_by_threads():
    toks = list(range(16 * 300))
    with engine() as e:
        e.store(toks[:16], kv_for(toks[:16]))
        p = e.prompt(toks)
        seen: list[list[str]] = []
        threads = [threading.Thread(target=lambda: seen.append(list(p.keys))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(s == e.chunk_keys(toks)[1] for s in seen)


def test_a_gathered_store_fills_only_the_chunks_not_cached_straight_into_the_pool():
    toks = list(range(100))
    kv = kv_for(toks)
    asked: list[tuple[int, int]] = []

    def fill(start, end, out):
        asked.append((start, end))
        assert out.is_contiguous() and tuple(out.shape) == (L, 2, end - start, H, D)
        out.copy_(kv[:, :, start:end])

    with engine() as e:
        e.store(toks[:32], kv[:, :, :32])
        res = e.store(toks, KVGather(fill, num_tokens=100, num_layers=L, num_kv_heads=H, head_size=D,
                                     dtype=torch.float32))
        assert asked == [(32, 48), (48, 64), (64, 80), (80, 96), (96, 100)]
        assert (res.stored_tokens, res.skipped_tokens) == (68, 32)
        assert torch.equal(e.retrieve(toks).kv, kv)
        assert e.pool.live == sum(t.info()["entries"] for t in e.hierarchy.tiers)


def test_a_gathered_store_of_another_shape_or_a_failing_gather_stores_nothing_wrong():
    toks = list(range(48))
    kv = kv_for(toks)
    with engine() as e:
        e.store(toks[:16], kv[:, :, :16])
        with pytest.raises(KVShapeError, match="does not match"):
            e.store(toks, KVGather(lambda *a: None, num_tokens=48, num_layers=L, num_kv_heads=H + 1, head_size=D,
                                   dtype=torch.float32))

        def fill(start, end, out):
            if start >= 32:
                raise RuntimeError("the engine's blocks are gone")
            out.copy_(kv[:, :, start:end])

        live = e.pool.live
        with pytest.raises(RuntimeError, match="blocks are gone"):
            e.store(toks, KVGather(fill, num_tokens=48, num_layers=L, num_kv_heads=H, head_size=D, dtype=torch.float32))
        assert e.lookup(toks) == 32  # the chunk stored before the failure, nothing after it
        assert torch.equal(e.retrieve(toks).kv, kv[:, :, :32])
        assert e.pool.live == live + 1


def test_a_leased_retrieve_is_guarded_by_the_lookups_leases_alone():
    toks = list(range(64))
    kv = kv_for(toks)
    with engine() as e:
        e.store(toks, kv)
        tier = e.hierarchy.tiers[0]
        keys = e.prompt(toks).keys
        seen: list[tuple[int, bool]] = []

        def sink(chunk, got):
            seen.append((len(tier._pins), all(tier.is_pinned(k) for k in keys)))

        assert e.lookup(toks, pin=True) == 64
        assert e.retrieve(toks, into=sink, leased=True).num_tokens == 64
        assert seen == [(0, True)] * 4  # no pin beside the lease; every chunk guarded
        e.release(toks)
        assert not any(tier.is_pinned(k) for k in keys)
        assert e.retrieve(toks, into=sink).num_tokens == 64  # no lookup lease: pins (gone after the read)
        assert not tier._pins


def test_the_retrieve_of_a_lookups_hit_finds_its_keys():
    """vLLM's worker retrieves the tokens the scheduler's lookup hit (a prefix of the
    prompt it looked up): their keys come from that lookup, not a second hashing."""
    toks = list(range(100))
    with engine() as e:
        e.store(toks[:64], kv_for(toks[:64]))
        e.prompts.clear()
        calls = count_digests(e)
        n = e.lookup(np.array(toks), pin=True)
        assert n == 64 and calls[0] == 7  # the first batch: all 7 chunks
        res = e.retrieve(toks[:n], leased=True)
        e.release(toks[:n])
        assert res.num_tokens == 64 and torch.equal(res.kv, kv_for(toks[:64]))
        assert calls[0] == 7
        assert not any(t.is_pinned(k) for t in e.hierarchy.tiers for k in e.prompt(toks).keys)
        p = e.prompt(toks)
        assert p.head(50) is None and p.head(100) is p and p.head(32).keys == p.keys[:2]


def test_a_prompt_owns_its_tokens():
    """A caller's array is neither frozen nor aliased: changing it afterwards never
    changes what a remembered prompt holds, so its keys stay the keys of its tokens."""
    tp = TokenProcessor(16)
    memo = PromptMemo(tp)
    arr = np.arange(40, dtype=np.int64)
    p = memo.get(arr, "p:")
    arr[0] = 99  # the caller's array stays writable
    assert p.tokens[0] == 0
    q = memo.get(arr, "p:")
    assert q is not p and q.keys[0] != p.keys[0] and q.keys == tp.chunk_keys(arr, "p:")[1]
