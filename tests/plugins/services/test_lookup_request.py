"""The lookup channel carries the request's id (issue 46): the worker's engine keeps the
request's prompt by it, so its load and save find the keys by the id, never by a digest of
the whole prompt. A real engine on a real Unix socket; an id that is too long or not UTF-8
is refused unread or unanswered, and the engine serves on."""

from __future__ import annotations

import logging
import struct

from lmcache.plugins.services.lookup import (
    EXTRA_LEN, HEADER, MAGIC, MAX_REQUEST_ID, OP_LOOKUP, REQUEST_LEN, VERSION_REQUEST,
)
from lmcache.plugins.services.lookup_client import LookupClient

from _digests import count_prompt_digests
from test_lookup import HANG, engine, kv_for
from test_lookup_extra import SALT_A
from test_lookup_limits import closed_by_server, raw


def test_a_lookup_named_by_its_request_leaves_the_prompt_under_that_name(tmp_path):
    """A pinned lookup naming request r1 over the channel: the hit, the engine keeps r1's
    prompt (the load's prompt of the same tokens is found by the id, no whole-prompt
    digest), and the release naming r1 drops the pins. With an extra, the same. An id longer
    than MAX_REQUEST_ID is left out of the frame: the lookup still answers."""
    sock = str(tmp_path / "w0.sock")
    tokens = list(range(100, 112))
    with engine(sock) as e:
        e.store(tokens, kv_for(12))
        e.store(tokens, kv_for(12, seed=1), extra=SALT_A)
        whole = count_prompt_digests(e)
        client = LookupClient([sock])
        try:
            for rid, extra in (("r1", None), ("r2", SALT_A)):
                got = client.result(client.submit(tokens, pin=True, extra=extra, request=rid), HANG)
                assert got is not None and got[0].hit == 12
                p = e.prompt(tokens, extra, request=rid)  # the load's, in the worker's process
                assert any(k[0] == rid for k in e.prompts._requests)
                assert e.hierarchy.tiers[0].is_pinned(p.keys[0])
                client.release(tokens, extra, request=rid)
                client.result(client.submit(tokens, pin=False, request=rid), HANG)  # the release has landed
                assert not e.hierarchy.tiers[0].is_pinned(p.keys[0])
            assert whole[0] == 0
            long_id = "x" * (MAX_REQUEST_ID + 1)
            got = client.result(client.submit(tokens, pin=False, request=long_id), HANG)
            assert got is not None and got[0].hit == 12
            assert not any(k[0] == long_id for k in e.prompts._requests)
        finally:
            client.close()


def test_a_request_id_too_long_empty_or_not_utf8_is_refused(tmp_path, caplog):
    sock = str(tmp_path / "w0.sock")
    tokens = list(range(100, 112))
    body = struct.pack(f"<{len(tokens)}I", *tokens) + EXTRA_LEN.pack(0)
    with caplog.at_level(logging.WARNING, logger="lmcache"), engine(sock) as e:
        e.store(tokens, kv_for(12))
        for tail, said in ((REQUEST_LEN.pack(MAX_REQUEST_ID + 1), "refused"),
                           (REQUEST_LEN.pack(0), "refused"),
                           (REQUEST_LEN.pack(2) + b"\xff\xfe", "not UTF-8")):
            s = raw(sock)
            s.sendall(HEADER.pack(MAGIC, VERSION_REQUEST, OP_LOOKUP, 0, len(tokens), 1) + body + tail)
            assert closed_by_server(s)  # no reply: not answered as the tokens alone
            s.close()
            assert any(said in r.getMessage() for r in caplog.records), said
        assert not e.prompts._requests
        client = LookupClient([sock])
        try:
            got = client.result(client.submit(tokens, pin=False, request="ok"), HANG)
            assert got is not None and got[0].hit == 12
        finally:
            client.close()
