"""One client connection of lmcache's framed protocol (:mod:`lmcache.wire`): a socket,
the mutual token handshake (:mod:`lmcache.auth`) and pipelined requests.

It imports no tensor library, so a short-lived process (the cache server's health probe,
``lmcache.cli.health_probe``) talks to a server in milliseconds; the ``lm`` backend
(:mod:`lmcache.backends.lm`) keeps a pool of them.
"""

from __future__ import annotations

import hmac
import socket
from typing import Any, Iterator, Sequence

from lmcache import auth
from lmcache import wire as proto
from lmcache.errors import BackendError


class Connection:
    """One socket to the server and the number of its next request."""

    def __init__(self, host: str, port: int, timeout: float, token: str | None, max_value: int,
                 peer_id: str | None = None):
        self.max_value = max_value
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.seq = 0
        #: response headers read on it so far
        self.answered = 0
        self._scratch: memoryview | None = None
        if token:
            try:
                self._handshake(token.encode(), peer_id)
            except BaseException:
                self.close()
                raise

    def _auth_frame(self, value: bytes) -> bytes:
        """Send one AUTH frame and return the value of its OK answer (at most 4 KiB is
        read, whatever the other side declares); :class:`BackendError` otherwise."""
        seq, self.seq = self.seq, self.seq + 1
        self.sock.sendall(proto.encode(proto.AUTH, seq, b"", value))
        try:
            f = proto.parse_header(proto.recv_exact(self.sock, proto.HEADER_SIZE), proto.MAX_TOKEN)
        except proto.ProtocolError as exc:
            raise BackendError(f"bad answer to the token handshake: {exc}") from None
        body = bytes(proto.recv_exact(self.sock, f.key_len + f.value_len))[f.key_len:]
        if f.status == proto.FATAL:
            raise BackendError(f"server refused the request: {body.decode(errors='replace')}")
        if f.status != proto.OK or f.op != proto.AUTH or f.seq != seq:
            raise BackendError(f"unexpected answer to the token handshake (op {f.op}, status {f.status}, seq {f.seq})")
        return body

    def _handshake(self, token: bytes, peer_id: str | None) -> None:
        """The mutual token handshake (:mod:`lmcache.auth`): the server proves it knows
        the token first; only then is this side's proof sent. The token never is."""
        nc = auth.nonce()
        try:
            got = self._auth_frame(auth.HELLO + nc)
        except BackendError as exc:
            if str(exc).endswith("wrong token"):  # what a server older than the handshake says to a hello
                raise BackendError(f"{exc} (or the server predates the mutual token handshake: upgrade it)") from None
            raise
        if len(got) < 2 * auth.NONCE or len(got) > 2 * auth.NONCE + auth.MAX_IDENTITY:
            raise BackendError("the server did not prove it knows the token (no token set there, or not an "
                               "lmcache server): refusing to authenticate to it; nothing was sent")
        ns, sp, ident = got[: auth.NONCE], got[auth.NONCE : 2 * auth.NONCE], got[2 * auth.NONCE :]
        if not hmac.compare_digest(sp, auth.proof(token, "server", nc, ns, ident)):
            raise BackendError("wrong token, or not a server of this cluster: the server did not prove it knows "
                               "this token; refusing to authenticate to it, nothing was sent")
        if peer_id is not None and not hmac.compare_digest(ident, peer_id.encode()):
            raise BackendError(f"the server is {ident.decode(errors='replace')!r}, not the expected {peer_id!r} "
                               "(a relay or a stale address): refusing to authenticate to it")
        self._auth_frame(auth.HELLO + auth.proof(token, "client", nc, ns, ident))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:  # pragma: no cover
            pass

    def request(self, reqs: Sequence[tuple[int, bytes, Sequence[Any]]], scratch: bool = False) -> list[tuple[proto.Frame, Any]]:
        """Send ``(op, key, value buffers)`` requests pipelined, then read one response
        each (several pages for LIST, joined); a FATAL response or a response out of
        order raises :class:`BackendError`; ERROR is returned for the caller to judge.

        With ``scratch``, the responses are yielded as they arrive, each value in a
        reused per-connection buffer that is only valid until the next one is read (the
        caller decodes it into pool memory at once): no allocation, and warm pages."""
        return list(self.stream(reqs, scratch)) if not scratch else self.stream(reqs, scratch)  # type: ignore[return-value]

    def stream(self, reqs: Sequence[tuple[int, bytes, Sequence[Any]]], scratch: bool) -> Iterator[tuple[proto.Frame, Any]]:
        bufs: list[Any] = []
        first = self.seq
        for op, key, value in reqs:
            n = sum(len(b) for b in value)
            bufs.append(proto.pack_header(op, self.seq, key, n) + key)
            bufs.extend(value)
            self.seq = (self.seq + 1) & 0xFFFFFFFF
        proto.send_buffers(self.sock, bufs)
        for i, (op, _, _) in enumerate(reqs):
            f, val = self._read(scratch)
            want = (first + i) & 0xFFFFFFFF
            if f.status == proto.FATAL:
                raise BackendError(f"server refused the request: {bytes(val).decode(errors='replace')}")
            if f.seq != want or f.op != op:
                raise BackendError(f"out-of-order response (seq {f.seq}, op {f.op}; expected {want}, {op})")
            if op == proto.LIST:
                pages = [val]
                while f.flags & proto.MORE:
                    f, val = self._read()
                    if f.status != proto.OK or f.seq != want:
                        raise BackendError("LIST stream broke off")
                    pages.append(val)
                val = bytearray(b"".join(pages)) if len(pages) > 1 else pages[0]
            yield f, val

    def _read(self, scratch: bool = False) -> tuple[proto.Frame, Any]:
        hdr = proto.recv_exact(self.sock, proto.HEADER_SIZE)
        self.answered += 1
        try:
            f = proto.parse_header(hdr, self.max_value)
        except proto.ProtocolError as exc:
            raise BackendError(f"bad response from the server: {exc}") from None
        if f.key_len:
            proto.recv_exact(self.sock, f.key_len)
        if not f.value_len:
            return f, bytearray()
        if not scratch:
            return f, proto.recv_exact(self.sock, f.value_len)
        if self._scratch is None or len(self._scratch) < f.value_len:
            self._scratch = memoryview(proto.alloc(max(f.value_len, proto.LAZY_ALLOC))).cast("B")
        view = self._scratch[: f.value_len]
        proto.recv_into_exact(self.sock, view)
        return f, view
