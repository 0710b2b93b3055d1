"""The HTTP layer under lmcache's two HTTP services, the instance API
(:mod:`lmcache.plugins.services.api`) and the controller (:mod:`lmcache.controller.service`):
a bounded ``ThreadingHTTPServer``, a JSON request handler that bounds each whole request in
time and checks bodies and query strings field by field, and :class:`HTTPError`, the one
place where an error becomes an HTTP status.

A service subclasses :class:`JSONHandler` and writes ``_dispatch(method)``; everything else
(JSON answers, http.server's own refusals as JSON, draining a small unread body before an
error, the whole-request deadline) is shared.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

from .errors import LMCacheError

log = logging.getLogger(__name__)

MAX_BODY = 1 << 20
_LINE = 1024  # a chunk-size or trailer line of a chunked body
_MAX_TRAILERS = 32
_HEX = b"0123456789abcdefABCDEF"
#: connections an HTTP service (instance API, controller) serves at once; one more gets 503
DEFAULT_MAX_CONNECTIONS = 64


class BoundedHTTPServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` that serves at most ``max_connections`` connections at
    once (one more is answered 503 from the accepting thread and closed), so slow or idle
    clients cannot take every thread. Each handler bounds its whole request in time (see
    ``JSONHandler.setup``)."""

    daemon_threads = True

    def __init__(self, address: Any, handler: Any, max_connections: int = DEFAULT_MAX_CONNECTIONS):
        self.max_connections = max_connections
        self._active = 0
        self._active_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._active_lock:
            full = self._active >= self.max_connections
            if not full:
                self._active += 1
        if full:
            body = json.dumps({"error": f"too many connections (limit {self.max_connections})", "status": 503}).encode()
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done()
            raise

    def _done(self) -> None:
        with self._active_lock:
            self._active -= 1

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done()
JSON_TYPE = "application/json"


class HTTPError(LMCacheError):
    """An HTTP reply other than 200, raised inside a handler (the status is this layer's)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def _type_names(types: tuple[type, ...]) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string", list: "a list"}
    return " or ".join(names[t] for t in types)


def check_field(name: str, value: Any, types: tuple[type, ...]) -> None:
    if value is None:
        return
    ok = any(isinstance(value, t) and not (isinstance(value, bool) and t is not bool) for t in types)
    if not ok:
        try:
            shown = json.dumps(value)
        except (RecursionError, ValueError):
            shown = "a deeply nested value"
        if len(shown) > 200:
            shown = shown[:200] + "..."
        raise HTTPError(400, f"field {name!r} must be {_type_names(types)}, got {shown}")



class JSONHandler(BaseHTTPRequestHandler):
    """A request handler that answers JSON; subclasses route in ``_dispatch(method)``."""

    server_version = "lmcache"
    protocol_version = "HTTP/1.0"

    def _dispatch(self, method: str) -> None:  # pragma: no cover - every service routes
        raise NotImplementedError

    def _send(self, status: int, payload: Any, ctype: str = JSON_TYPE, headers: dict[str, str] | None = None) -> None:
        body = payload if isinstance(payload, bytes) else (json.dumps(payload) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line or header, a request line
        or header over its limits, a method with no handler) answered as JSON like every
        other error, not as an HTML page; a method with no handler is 405, not 501."""
        if code == 501:
            code, message = 405, f"method {self.command!r} is not allowed"
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "error"
        body = (json.dumps({"error": message or phrase, "status": code}) + "\n").encode()
        self.log_error("code %d, message %s", code, message)
        self.close_connection = True
        self.send_response(code, phrase)
        self.send_header("Content-Type", JSON_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self._drain()
        self._send(status, {"error": message, "status": status}, headers=headers)

    def _drain(self) -> None:
        """Read a small unread body before answering, so that closing the connection
        does not reset it under the client's feet (a body over MAX_BODY is not read)."""
        if getattr(self, "_body_read", False):
            return
        self._body_read = True
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return
        if 0 < n <= MAX_BODY:
            try:
                self.rfile.read(n)
            except OSError:  # a timeout or a reset: answer anyway
                pass

    def _query(self, raw: str, allowed: tuple[str, ...]) -> dict[str, str]:
        try:
            q = parse_qs(raw, keep_blank_values=True, strict_parsing=False, max_num_fields=50)
        except ValueError as exc:
            raise HTTPError(400, f"malformed query string: {exc}") from None
        out = {}
        for k, v in q.items():
            if k not in allowed:
                known = ", ".join(allowed) or "none"
                raise HTTPError(400, f"unknown query parameter {k!r}; known: {known}")
            if len(v) != 1:
                raise HTTPError(400, f"query parameter {k!r} given {len(v)} times")
            if v[0] == "":
                raise HTTPError(400, f"query parameter {k!r} is empty")
            out[k] = v[0]
        return out

    def _raw_body(self) -> bytes:
        """The request's body, at most MAX_BODY bytes: ``Content-Length`` bytes, or a
        ``Transfer-Encoding: chunked`` body decoded (what ``http.client`` sends for an
        iterable); none of either is an empty body. Both at once is 400, another
        transfer coding 501, a body over the bound 413 (the rest is not read)."""
        length = self.headers.get("Content-Length")
        coding = self.headers.get("Transfer-Encoding")
        if coding is not None:
            if length is not None:
                raise HTTPError(400, "request has both Content-Length and Transfer-Encoding; send one")
            if coding.strip().lower() != "chunked":
                raise HTTPError(501, f"Transfer-Encoding {coding!r} is not supported; send Content-Length or chunked")
            self._body_read = True  # read now, or never: the connection closes after the answer
            return self._read_chunked()
        if length is None:
            return b""
        try:
            n = int(length)
        except ValueError:
            raise HTTPError(400, f"bad Content-Length {length!r}") from None
        if n < 0:
            raise HTTPError(400, f"bad Content-Length {length!r}")
        if n > MAX_BODY:
            self._body_read = True  # not read: the connection closes after the answer
            raise HTTPError(413, f"body of {n} bytes is larger than {MAX_BODY} bytes")
        self._body_read = True
        raw = self.rfile.read(n)
        if len(raw) != n:
            raise HTTPError(400, f"body ended after {len(raw)} of {n} bytes")
        return raw

    def _read_chunked(self) -> bytes:
        """Decode a chunked body within MAX_BODY bytes (each size line and trailer line
        within _LINE bytes, at most _MAX_TRAILERS trailers); the whole-request deadline
        bounds the time."""
        parts: list[bytes] = []
        total = 0
        while True:
            line = self._line("chunk size line")
            size_text = line.split(b";", 1)[0].strip()
            if not size_text or size_text.strip(_HEX):
                raise HTTPError(400, f"bad chunk size {size_text[:40].decode('latin-1')!r}")
            size = int(size_text, 16)
            if size == 0:
                break
            total += size
            if total > MAX_BODY:
                raise HTTPError(413, f"chunked body is larger than {MAX_BODY} bytes")
            data = self.rfile.read(size)
            if len(data) != size:
                raise HTTPError(400, f"body ended inside a chunk ({len(data)} of {size} bytes)")
            parts.append(data)
            if self.rfile.read(2) != b"\r\n":
                raise HTTPError(400, "chunk not followed by CRLF")
        for _ in range(_MAX_TRAILERS + 1):
            if not self._line("trailer line").strip():
                return b"".join(parts)
        raise HTTPError(400, f"more than {_MAX_TRAILERS} trailer lines after a chunked body")

    def _line(self, what: str) -> bytes:
        line = self.rfile.readline(_LINE + 1)
        if not line.endswith(b"\n"):
            if len(line) > _LINE:
                raise HTTPError(400, f"{what} longer than {_LINE} bytes")
            raise HTTPError(400, f"body ended before the {what} ended")
        return line

    def _body(self, fields: dict[str, tuple[type, ...]], required: tuple[str, ...]) -> dict[str, Any]:
        """The request's JSON object, checked field by field. Only ``application/json``
        is accepted (415 otherwise, nothing parsed): an HTML form or a cross-site
        ``fetch`` without a CORS preflight can send only form or text types, so no other
        site can make a visitor's browser change anything here. A body that is framed
        wrongly or too large is refused as such first."""
        raw = self._raw_body()  # framing errors first (bounded: at most MAX_BODY bytes read)
        self._arrived()
        ctype = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if ctype != JSON_TYPE:
            raise HTTPError(415, f"send the body as Content-Type: application/json, not {ctype[:80] or 'no content type'}")
        if not raw.strip():
            body: Any = {}
        else:
            try:
                body = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise HTTPError(400, f"body is not valid JSON: {exc}") from None
            except RecursionError:  # 1 MiB of "[" nests deeper than the parser recurses
                raise HTTPError(400, "body nests too deeply (JSON arrays/objects inside each other)") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "body must be a JSON object")
        for k, v in body.items():
            if k not in fields:
                raise HTTPError(400, f"unknown field {k!r}; known fields: {', '.join(fields)}")
            check_field(k, v, fields[k])
        for k in required:
            if body.get(k) is None:
                raise HTTPError(400, f"field {k!r} is required")
        return body

    # ------------------------------------------------------------ whole-request deadline
    def setup(self) -> None:
        """``timeout`` bounds each read; this timer bounds the whole request: a client that
        has not sent its request line, headers and body within ``timeout`` seconds is
        disconnected, however slowly its bytes come."""
        super().setup()
        self._request_in = False
        self._deadline = threading.Timer(float(self.timeout or 10.0), self._expire)
        self._deadline.daemon = True
        self._deadline.start()

    def _expire(self) -> None:
        if not self._request_in:
            log.info("%s: a client did not send its request within %gs; disconnecting it", type(self).__name__, self.timeout)
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _arrived(self) -> None:
        """The whole request is in: no deadline from here on (the answer may take longer)."""
        self._request_in = True
        self._deadline.cancel()

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()

    def handle_one_request(self) -> None:
        self._request_in = False  # each request of a connection gets the deadline anew
        super().handle_one_request()

    def do_GET(self) -> None:  # noqa: N802 - http.server's names
        self._arrived()
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:  # noqa: N802
        self._dispatch("PATCH")


__all__ = ["BoundedHTTPServer", "DEFAULT_MAX_CONNECTIONS", "HTTPError", "JSONHandler", "JSON_TYPE", "MAX_BODY", "check_field"]
