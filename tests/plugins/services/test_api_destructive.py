"""Destructive endpoints of the instance API read their whole body and never take an
empty one for "everything" (issue 29, item 2): a chunked body (what ``http.client``
sends for an iterable) is read within the same 1 MiB bound as a Content-Length body,
and ``/v1/clear`` needs a selection (``tier``, ``namespace``) or an explicit ``all: true``."""

from __future__ import annotations

import http.client
import json
import socket

import pytest
from test_api import TOKEN, call, start

from lmcache.server.http import MAX_BODY


@pytest.fixture
def engine(tmp_path):
    e = start(tmp_path, token=TOKEN, timeout=2.0)
    yield e
    e.close()


def entries(engine) -> int:
    t = engine.stats()["tiers"]
    return t["cpu"]["entries"] + t["disk"]["entries"]


def chunked_post(engine, path: str, parts) -> tuple[int, dict]:
    """POST ``parts`` (an iterable of bytes) with Python's own http.client, which sends
    an iterable body as ``Transfer-Encoding: chunked`` (no Content-Length)."""
    conn = http.client.HTTPConnection("127.0.0.1", engine.api.port, timeout=10)
    try:
        conn.request("POST", path, body=iter(parts), headers={"Authorization": f"Bearer {TOKEN}",
                                                            "Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def raw_post(engine, head: bytes, body: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", engine.api.port), timeout=10) as s:
        s.sendall(head + body)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


def test_chunked_clear_of_one_tier_clears_that_tier_only(engine):
    before = engine.stats()["tiers"]["disk"]["entries"]
    status, res = chunked_post(engine, "/v1/clear", [b'{"tier":', b' "cpu"}'])
    assert status == 200, res
    assert {e["tier"] for e in res["evicted"]} == {"cpu"}
    assert engine.stats()["tiers"]["cpu"]["entries"] == 0
    assert engine.stats()["tiers"]["disk"]["entries"] == before > 0


def test_chunked_evict_is_read_like_a_content_length_body(engine):
    status, res = chunked_post(engine, "/v1/evict", [b'{"tier": "cpu", ', b'"all": true, ', b'"dry_run": true}'])
    assert status == 200 and res["dry_run"] is True and len(res["evicted"]) == 4
    assert entries(engine) == 8


@pytest.mark.parametrize("body", [{}, {"all": False}])
def test_clear_without_a_selection_clears_nothing(engine, body):
    status, err = call(engine.api_url, "/v1/clear", body)
    assert status == 400 and "say what to clear" in err["error"] and "all: true" in err["error"]
    assert entries(engine) == 8
    status, err = chunked_post(engine, "/v1/clear", [json.dumps(body).encode()])
    assert status == 400 and "say what to clear" in err["error"]
    assert entries(engine) == 8


def test_clear_all_true_clears_every_tier(engine):
    status, res = chunked_post(engine, "/v1/clear", [b'{"all": true}'])
    assert status == 200 and len(res["evicted"]) == 8 and entries(engine) == 0


def test_chunked_body_over_the_bound_is_413_and_changes_nothing(engine):
    part = b" " * (64 << 10)
    status, err = chunked_post(engine, "/v1/clear", [b'{"all": true'] + [part] * (MAX_BODY // len(part) + 1) + [b"}"])
    assert status == 413 and "larger than" in err["error"]
    assert entries(engine) == 8


@pytest.mark.parametrize(
    "head,body,status,fragment",
    [
        (b"Transfer-Encoding: chunked\r\nContent-Length: 13\r\n", b"d\r\n{\"all\": true}\r\n0\r\n\r\n", 400,
         "both Content-Length and Transfer-Encoding"),
        (b"Transfer-Encoding: gzip, chunked\r\n", b"0\r\n\r\n", 501, "Transfer-Encoding 'gzip, chunked'"),
        (b"Transfer-Encoding: chunked\r\n", b"zz\r\n{}\r\n0\r\n\r\n", 400, "bad chunk size"),
        (b"Transfer-Encoding: chunked\r\n", b"d\r\n{\"all\": true}XX0\r\n\r\n", 400, "chunk not followed by CRLF"),
        (b"Transfer-Encoding: chunked\r\n", b"d\r\n{\"all\": tr", 400, "body ended"),
        (b"Transfer-Encoding: chunked\r\n", b"fffffffffffffffff\r\n", 413, "larger than"),
    ],
)
def test_malformed_chunked_bodies_are_refused_and_change_nothing(engine, head, body, status, fragment):
    got, err = raw_post(engine, b"POST /v1/clear HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                        + b"\r\n" + head + b"\r\n", body)
    assert got == status and fragment in err["error"], err
    assert entries(engine) == 8


def test_controller_clear_cli_without_a_selection_sends_nothing():
    """``lmcache controller clear INSTANCE`` alone is refused before any request (the port is closed)."""
    import subprocess
    import sys

    from lmcache.testing.stores import free_port

    p = subprocess.run([sys.executable, "-m", "lmcache.cli.main", "controller", "clear", "eng-a", "--yes",
                        "--url", f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "say what to clear: --tier, --tokens, --key or --all" in p.stderr, p.stderr
