"""The lookup channel carries a request's key extra (issue 29, item 13): a real engine on a
real Unix socket. A salted lookup finds the salted entries only, its pins are released
under the same extra, and an extra frame that is oversize or malformed is refused without
being read or answered as the plain tokens."""

from __future__ import annotations

import logging
import struct

from lmcache.keys import MAX_EXTRA_BYTES, KeyExtra
from lmcache.plugins.services.lookup import HEADER, MAGIC, OP_LOOKUP, VERSION_EXTRA
from lmcache.plugins.services.lookup_client import LookupClient

from test_lookup import CHUNK, HANG, D, H, L, engine, kv_for
from test_lookup_limits import closed_by_server, raw

SALT_A, SALT_B = KeyExtra(b"a" * 32), KeyExtra(b"b" * 32)


def lookup(client: LookupClient, tokens: list[int], extra: KeyExtra | None, pin: bool = False):
    got = client.result(client.submit(tokens, pin=pin, extra=extra), HANG)
    assert got is not None, "no answer within the hang guard"
    return got[0]


def test_a_lookup_over_the_channel_finds_the_entries_of_its_own_extra_only(tmp_path):
    """Before: the frame had no room for an extra, so every lookup was of the plain tokens
    (12 hits for the salted and the other-salted lookups alike); after: 12 for the same salt,
    0 for another salt and for none."""
    sock = str(tmp_path / "w0.sock")
    tokens = list(range(100, 112))
    with engine(sock) as e:
        e.store(tokens, kv_for(12), extra=SALT_A)
        client = LookupClient([sock])
        try:
            assert lookup(client, tokens, SALT_A).hit == 12
            assert lookup(client, tokens, SALT_B).hit == 0
            assert lookup(client, tokens, None).hit == 0
            image = KeyExtra(b"a" * 32, ((5, 3, b"img-1"),))  # the same salt, an image in chunk 1
            assert lookup(client, tokens, image).hit == 4
        finally:
            client.close()


def test_a_release_over_the_channel_drops_the_pins_of_its_extra(tmp_path):
    """A pinned salted lookup leases the salted chunks; the release with the same extra
    drops exactly those leases (a release of the plain tokens names other keys)."""
    sock = str(tmp_path / "w0.sock")
    a, b = list(range(12)), list(range(50, 62))
    with engine(sock, capacity=3 * L * 2 * CHUNK * H * D * 4) as e:  # room for three chunks
        e.store(a, kv_for(12), extra=SALT_A)
        client = LookupClient([sock])
        try:
            assert lookup(client, a, SALT_A, pin=True).hit == 12
            e.store(b, kv_for(12, seed=1))  # every chunk of a is leased: b finds no room
            assert e.lookup(a, extra=SALT_A) == 12 and e.lookup(b) == 0
            client.release(a)  # the plain tokens' keys: a's leases stay
            assert lookup(client, b, None).hit == 0  # one more round trip: the release has landed
            e.store(b, kv_for(12, seed=1))
            assert e.lookup(b) == 0
            client.release(a, SALT_A)
            assert lookup(client, b, None).hit == 0
            e.store(b, kv_for(12, seed=1))
            assert e.lookup(b) == 12 and e.lookup(a, extra=SALT_A) == 0
        finally:
            client.close()


def test_an_oversize_or_malformed_extra_is_refused_unread(tmp_path, caplog):
    """An extra longer than MAX_EXTRA_BYTES is refused from its length (nothing read or
    allocated), one that does not parse is refused too: the connection closes with one log
    line, nothing is answered as the plain tokens, and the engine serves on."""
    sock = str(tmp_path / "w0.sock")
    tokens = list(range(100, 112))
    body = struct.pack(f"<{len(tokens)}I", *tokens)
    with caplog.at_level(logging.WARNING, logger="lmcache"), engine(sock) as e:
        e.store(tokens, kv_for(12))
        for tail, said in ((struct.pack("<I", MAX_EXTRA_BYTES + 1), "refused"),
                           (struct.pack("<I", 3) + b"\x01\x40\x00", "bad lookup frame")):
            s = raw(sock)
            s.sendall(HEADER.pack(MAGIC, VERSION_EXTRA, OP_LOOKUP, 0, len(tokens), 1) + body + tail)
            assert closed_by_server(s)  # no reply: not answered as the plain tokens (a 12-token hit)
            s.close()
            assert any(said in r.getMessage() for r in caplog.records), said
        client = LookupClient([sock])
        try:
            assert lookup(client, tokens, None).hit == 12
        finally:
            client.close()
