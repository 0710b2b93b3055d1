"""The frames of lmcache's binary protocol: what ``lmcache server``
(:mod:`lmcache.server.cache`), the ``lm`` backend and the peer endpoint speak over TCP.

Frames (requests and responses have the same 24-byte header, little-endian)::

    magic  b"LMCS"  4 bytes
    version         u8   (1)
    op              u8   (AUTH, HEALTH, PUT, GET, EXISTS, DELETE, LIST)
    status          u8   (responses: OK, NOT_FOUND, ERROR, FATAL; requests: 0)
    flags           u8   (responses to LIST: MORE when another page follows)
    seq             u32  (the request's number; its response echoes it)
    key length      u32  (<= MAX_KEY)
    value length    u64  (<= the server's max value size)
    key bytes (UTF-8), then value bytes

The value is opaque: the server stores and returns the bytes a client sent (the ``lm``
backend sends self-describing payloads, so a reader checks what it got). Nothing is
pickled or evaluated; HEALTH answers a small JSON object.

Why batches are pipelining, not a BATCH frame: a client writes any number of requests
and then reads the responses, which come back in request order (``seq`` lets it check).
That is one round trip per batch, like a multi-key frame, without a second encoding of
keys and values inside a frame, and values go out as they are, straight from the stored
buffer. A client must keep the bytes of its unanswered requests small or read while it
writes (the ``lm`` backend pipelines at most ``batch`` requests; GET requests are a key
each, and PUT responses are 24 bytes each, so neither side blocks the other).
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from .errors import LMCacheError

MAGIC = b"LMCS"
VERSION = 1
HEADER = struct.Struct("<4sBBBBIIQ")
HEADER_SIZE = HEADER.size  # 24

# ops
AUTH, HEALTH, PUT, GET, EXISTS, DELETE, LIST = 1, 2, 3, 4, 5, 6, 7
OP_NAMES = {AUTH: "AUTH", HEALTH: "HEALTH", PUT: "PUT", GET: "GET", EXISTS: "EXISTS", DELETE: "DELETE", LIST: "LIST"}
# statuses
OK, NOT_FOUND, ERROR, FATAL = 0, 1, 2, 3
STATUS_NAMES = {OK: "OK", NOT_FOUND: "NOT_FOUND", ERROR: "ERROR", FATAL: "FATAL"}
# flags
MORE = 1

MAX_KEY = 4096
MAX_TOKEN = 4096
#: LIST pages hold at most this many entries
LIST_PAGE = 1000
DEFAULT_MAX_VALUE = 1 << 30
DEFAULT_PORT = 7171
_ENTRY = struct.Struct("<HQ")


class ProtocolError(LMCacheError):
    """A frame broke the protocol; the connection that carried it is closed."""


@dataclass(frozen=True)
class Frame:
    op: int
    status: int
    flags: int
    seq: int
    key_len: int
    value_len: int


# ----------------------------------------------------------------- encoding
def pack_header(op: int, seq: int, key: bytes = b"", value_len: int = 0, *, status: int = 0, flags: int = 0) -> bytes:
    """The header of a frame whose key is ``key`` and whose value is ``value_len`` bytes."""
    return HEADER.pack(MAGIC, VERSION, op, status, flags, seq & 0xFFFFFFFF, len(key), value_len)


def encode(op: int, seq: int, key: bytes = b"", value: bytes | bytearray | memoryview = b"", *,
           status: int = 0, flags: int = 0) -> bytes:
    """One whole frame as bytes (small frames; large values go out as separate buffers)."""
    return pack_header(op, seq, key, len(value), status=status, flags=flags) + key + bytes(value)


def parse_header(data: bytes | bytearray | memoryview, max_value: int) -> Frame:
    """Check a 24-byte header; raise :class:`ProtocolError` saying what is wrong.

    Checks only what needs no knowledge of the direction: magic, version and lengths."""
    magic, version, op, status, flags, seq, klen, vlen = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}; not an lmcache server frame")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    if klen > MAX_KEY:
        raise ProtocolError(f"key of {klen} bytes exceeds the limit of {MAX_KEY}")
    if vlen > max_value:
        raise ProtocolError(f"value of {vlen} bytes exceeds the limit of {max_value}")
    return Frame(op, status, flags, seq, klen, vlen)


def check_request(f: Frame) -> None:
    """The per-op rules of a request (checked before its value is read)."""
    if f.op not in OP_NAMES:
        raise ProtocolError(f"unknown op {f.op}")
    if f.status or f.flags:
        raise ProtocolError("a request has status and flags 0")
    if f.op in (HEALTH, GET, EXISTS, DELETE, LIST) and f.value_len:
        raise ProtocolError(f"{OP_NAMES[f.op]} carries no value (got {f.value_len} bytes)")
    if f.op in (PUT, GET, EXISTS, DELETE) and not f.key_len:
        raise ProtocolError(f"{OP_NAMES[f.op]} needs a key")
    if f.op == AUTH and (f.key_len or f.value_len > MAX_TOKEN):
        raise ProtocolError("AUTH carries only a token of at most 4096 bytes")


def encode_list_page(entries: Sequence[tuple[bytes, int]]) -> bytes:
    """A LIST page: for each entry u16 key length, u64 stored size, key bytes."""
    out = bytearray()
    for k, size in entries:
        out += _ENTRY.pack(len(k), size)
        out += k
    return bytes(out)


def decode_list_page(data: bytes | bytearray | memoryview) -> list[tuple[str, int]]:
    mv = memoryview(data)
    out: list[tuple[str, int]] = []
    i = 0
    while i < len(mv):
        if i + _ENTRY.size > len(mv):
            raise ProtocolError("truncated LIST page")
        klen, size = _ENTRY.unpack_from(mv, i)
        i += _ENTRY.size
        if i + klen > len(mv):
            raise ProtocolError("truncated LIST page")
        try:
            out.append((bytes(mv[i : i + klen]).decode(), size))
        except UnicodeDecodeError:
            raise ProtocolError("LIST page holds a key that is not UTF-8") from None
        i += klen
    return out


#: values at least this large are received into memory that is not zero-filled first
LAZY_ALLOC = 64 << 10


def alloc(n: int) -> bytearray | memoryview:
    """A writable buffer of ``n`` bytes. Large ones are not zero-filled (numpy ``empty``):
    their pages are committed only as received bytes land in them, so a peer that
    declares a large value and then sends little of it costs little memory, and a large
    value is not written twice."""
    if n < LAZY_ALLOC:
        return bytearray(n)
    import numpy as np

    return memoryview(np.empty(n, dtype=np.uint8))


def recv_exact(sock: socket.socket, n: int) -> bytearray | memoryview:
    """Exactly ``n`` bytes, or :class:`ConnectionError` when the peer closes first."""
    buf = alloc(n)
    recv_into_exact(sock, memoryview(buf))
    return buf


#: how many times one read waits again after its timer fired late (see recv_into_exact)
LATE_WAKES = 2


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (its timeout applies to each wait). A wait whose timer
    fired long past its time (more than twice the timeout and a second) says that this
    process did not run meanwhile (the host paused the machine, or starved it), not that
    the peer was slow: the peer, paused with it, may answer a moment after both resume.
    Such a wait is made again, at most :data:`LATE_WAKES` times per call."""
    got, n = 0, len(view)
    late = 0
    while got < n:
        t0 = time.monotonic()
        try:
            r = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            t = sock.gettimeout()
            waited = time.monotonic() - t0
            if t is None or late >= LATE_WAKES or waited < 2 * t + 1.0:
                raise
            late += 1
            logging.getLogger(__name__).warning(
                "a %.3g s wait for a peer ended after %.1f s: this process did not run meanwhile; waiting again", t, waited)
            continue
        if r == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += r


def send_buffers(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """Send the concatenation of ``buffers`` without joining them (``sendmsg`` until all
    of it is out)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        sent = sock.sendmsg(views[:512])
        while sent:
            first = views[0]
            if sent >= len(first):
                sent -= len(first)
                views.pop(0)
            else:
                views[0] = first[sent:]
                sent = 0


def iter_frames(data: bytes, max_value: int = DEFAULT_MAX_VALUE) -> Iterator[tuple[Frame, bytes, bytes]]:
    """Parse complete frames out of ``data`` (tests and tools)."""
    i = 0
    while i + HEADER_SIZE <= len(data):
        f = parse_header(data[i : i + HEADER_SIZE], max_value)
        end = i + HEADER_SIZE + f.key_len + f.value_len
        if end > len(data):
            return
        k = data[i + HEADER_SIZE : i + HEADER_SIZE + f.key_len]
        yield f, k, data[i + HEADER_SIZE + f.key_len : end]
        i = end
