"""The HTTP layer under lmcache's two HTTP services, the instance API
(:mod:`lmcache.plugins.services.api`) and the controller (:mod:`lmcache.server.controller`):
a bounded ``ThreadingHTTPServer``, a JSON request handler that bounds each whole request in
time and checks bodies and query strings field by field, and :class:`HTTPError`, the one
place where an error becomes an HTTP status.

A service subclasses :class:`JSONHandler` and writes ``_dispatch(method)``; everything else
(JSON answers, http.server's own refusals as JSON, draining a small unread body before an
error, the whole-request deadline) is shared.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable
from urllib.parse import parse_qs, urlsplit

from ..errors import LMCacheError

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
        self.message = str(self)  # credentials masked (LMCacheError)
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


# ---------------------------------------------------------------- Host and Origin
#: a Host header's value: a name or an IPv4 address, or an IPv6 address in brackets; a port
_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::([0-9]{1,5}))?")
_NAME = re.compile(r"\*|\.?[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*\.?")
_WILDCARD = ("", "0.0.0.0", "::")
#: an allow-list of Host names holds at most this many
MAX_ALLOWED_HOSTS = 64
_SAFE = ("GET", "HEAD", "OPTIONS")


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped or ip


def split_host(value: str) -> tuple[str, int | None] | None:
    """``(name, port)`` of a ``Host`` header's value (the name lower case, without a
    trailing dot or IPv6 brackets), or ``None`` when it is not ``name[:port]``."""
    m = _HOST.fullmatch(value.strip())
    if m is None:
        return None
    port = int(m.group(2)) if m.group(2) else None
    if port is not None and port > 65535:
        return None
    return m.group(1).strip("[]").lower().rstrip("."), port


def check_allowed_hosts(items: Iterable[Any]) -> tuple[str, ...]:
    """The Host names of an allow-list (``name``, ``.domain`` for it and its subdomains,
    or ``*`` for any), lower case; :class:`ValueError` naming a bad entry."""
    out: list[str] = []
    for item in items:
        if not isinstance(item, str) or not _NAME.fullmatch(item.strip()) or len(item) > 253:
            raise ValueError(f"not a host name: {str(item)[:80]!r} (a name, .domain for it and its subdomains, or *)")
        name = item.strip().lower().rstrip(".")
        if name not in out:
            out.append(name)
    if len(out) > MAX_ALLOWED_HOSTS:
        raise ValueError(f"{len(out)} host names given; at most {MAX_ALLOWED_HOSTS}")
    return tuple(out)


class RequestGuard:
    """What a browser can be made to send from another site, refused before routing.

    **Host** (DNS rebinding: a page on a name the attacker re-points at this address
    sends ``Host: attacker.example``): accepted when it is an IP address (a rebound page
    always names its own domain), ``localhost`` or a ``*.localhost`` name (browsers
    resolve those to loopback themselves), the name the server was bound to, this
    machine's host name when bound beyond loopback, or a name in ``allowed_hosts``
    (``name``, ``.domain``, ``*``); anything else is 403. The check is made when the
    server takes no token (a rebound page needs no credential then), and always when
    ``allowed_hosts`` is given; with a token every data endpoint needs it, and a page of
    another origin never has it, so Service and Ingress names work as they are.

    **Origin** (cross-origin writes): a request other than GET/HEAD/OPTIONS whose
    ``Origin`` is present and not this server's (the ``Host`` it was sent to, or a name in
    ``allowed_hosts``), or is ``null``, or whose ``Sec-Fetch-Site`` says another site,
    is 403 whatever its token. Clients that are not browsers send neither header."""

    def __init__(self, bound: str, allowed_hosts: Iterable[str] = (), *, token_required: bool = False):
        self.allowed = check_allowed_hosts(allowed_hosts)
        self.check_host = bool(self.allowed) or not token_required
        names = {"localhost"}
        bound_ip = _ip(bound) if bound not in _WILDCARD else None
        if bound not in _WILDCARD and bound_ip is None:
            names.add(bound.lower().rstrip("."))
        if bound in _WILDCARD or (bound_ip is not None and not bound_ip.is_loopback):
            names.add(socket.gethostname().lower().rstrip("."))
        self.names = frozenset(names)

    def host_ok(self, name: str) -> bool:
        """Whether ``name`` (as :func:`split_host` gives it) is one this server answers to."""
        if _ip(name) is not None or name in self.names or name.endswith(".localhost"):
            return True
        return self._listed(name)

    def _listed(self, name: str) -> bool:
        for a in self.allowed:
            if a == "*" or a == name or (a.startswith(".") and (name == a[1:] or name.endswith(a))):
                return True
        return False

    def check(self, method: str, headers: Any) -> None:
        """:class:`HTTPError` 400/403 for a request this server must not act on."""
        hosts = headers.get_all("Host") or []
        if len(hosts) > 1:
            raise HTTPError(400, f"{len(hosts)} Host headers; send one")
        host = split_host(hosts[0]) if hosts else None
        if hosts and host is None:
            raise HTTPError(400, f"malformed Host header {hosts[0][:80]!r}")
        if self.check_host and host is not None and not self.host_ok(host[0]):
            log.info("refused a request for Host %r (not one this server answers to)", hosts[0][:80])
            raise HTTPError(403, f"Host {hosts[0][:80]!r} is not a name this server answers to (a guard against DNS "
                                 "rebinding): use its address, localhost, or add the name to the allowed hosts")
        if method in _SAFE:
            return
        site = (headers.get("Sec-Fetch-Site") or "").strip().lower()
        if site and site not in ("same-origin", "none"):
            raise HTTPError(403, f"cross-site {method} refused (Sec-Fetch-Site: {site[:40]!r})")
        origin = headers.get("Origin")
        # "null": an opaque origin, unless the browser itself says same-origin (a no-referrer fetch)
        if origin is not None and not self._same_origin(origin, host) \
                and not (origin.strip() == "null" and site == "same-origin"):
            raise HTTPError(403, f"cross-origin {method} refused: Origin {origin[:100]!r} is not this server's")

    def _same_origin(self, origin: str, host: tuple[str, int | None] | None) -> bool:
        try:
            o = urlsplit(origin.strip())
            o_port = o.port or {"http": 80, "https": 443}.get(o.scheme)
        except ValueError:
            return False
        if o.scheme not in ("http", "https") or not o.hostname or o.path not in ("", "/") or o.query:
            return False
        name = o.hostname.lower().rstrip(".")
        if any(a != "*" and (a == name or (a.startswith(".") and name.endswith(a))) for a in self.allowed):
            return True  # a name the operator configured (e.g. an Ingress that rewrites Host)
        if host is None or name != host[0]:
            return False
        return o_port == host[1] or (host[1] is None and o_port == {"http": 80, "https": 443}[o.scheme])


class JSONHandler(BaseHTTPRequestHandler):
    """A request handler that answers JSON; subclasses route in ``_dispatch(method)``."""

    server_version = "lmcache"
    protocol_version = "HTTP/1.0"
    #: Host and Origin checks made before any routing (``None``: none); set per server
    guard: RequestGuard | None = None

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

    def _route(self, method: str) -> None:
        """The :attr:`guard`'s checks, then ``_dispatch``: a refused request is answered
        here and reaches no endpoint (not even the page)."""
        if self.guard is not None:
            try:
                self.guard.check(method, self.headers)
            except HTTPError as exc:
                self._error(exc.status, exc.message, exc.headers)
                return
        self._dispatch(method)

    def do_GET(self) -> None:  # noqa: N802 - http.server's names
        self._arrived()
        self._route("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._route("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._route("DELETE")

    def do_PATCH(self) -> None:  # noqa: N802
        self._route("PATCH")


__all__ = ["BoundedHTTPServer", "DEFAULT_MAX_CONNECTIONS", "HTTPError", "JSONHandler", "JSON_TYPE", "MAX_BODY",
           "RequestGuard", "check_allowed_hosts", "check_field", "split_host"]
