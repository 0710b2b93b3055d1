"""The operator page: static files served at ``/`` by the controller and the instance API.

The page (``index.html``, ``app.js``, ``app.css``, shipped in this package) holds no data:
it is a thin client of the documented JSON endpoints of the server that serves it, so it
is public, while every JSON endpoint keeps its token check. Both servers call
:func:`serve` first in their dispatch; it answers ``GET /``, ``/static/app.js`` and
``/static/app.css`` and nothing else (any other name under ``/static/`` is 404: there is
no file-system lookup, so no path can leave the package).

Every answer carries a strict Content-Security-Policy (scripts and styles from this
origin only, no inline code, no framing, no form posts), ``X-Content-Type-Options:
nosniff``, ``Referrer-Policy: no-referrer`` and ``Cache-Control: no-store``.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

#: the policy of the page and its files (docs/distributed.md, "The operator page")
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
#: URL path -> (file in this package, content type); nothing else is served
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/app.css": ("app.css", "text/css; charset=utf-8"),
}


@cache
def read(name: str) -> bytes:
    """The bytes of one page file shipped in this package."""
    return resources.files(__name__).joinpath(name).read_bytes()


def serve(handler: Any, method: str, path: str) -> bool:
    """Answer a request for the page or its static files on ``handler`` (a
    :class:`~lmcache.server.http.JSONHandler`); ``False`` if ``path`` is not the page's (the
    caller routes it to its JSON API). ``path`` is the URL's path without the query.
    A path under ``/static/`` that is not one of the files is answered 404 here."""
    if path not in FILES:
        if path.startswith("/static/"):
            handler._error(404, f"no such file: {path[:200]}")
            return True
        return False
    if method != "GET":
        handler._error(405, f"{path} takes GET, not {method}", {"Allow": "GET"})
        return True
    name, ctype = FILES[path]
    handler._send(200, read(name), ctype, HEADERS)
    return True


__all__ = ["CSP", "FILES", "HEADERS", "read", "serve"]
