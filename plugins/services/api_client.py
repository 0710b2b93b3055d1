"""A small client of the instance API (:mod:`lmcache.plugins.services.api`), used by ``lmcache --url``.

Its methods mirror :class:`lmcache.admin.Admin` and return the same data, so a command
works the same against a live instance and against a config's tiers opened offline.
Stdlib only (no torch); every call has a timeout, connects directly (proxy settings in
the environment are not used, so the token never passes through a proxy) and follows no
redirects.

Errors: an answer of 4xx/5xx raises the matching :class:`~lmcache.errors.AdminError`
(``AuthError`` for 401, ``NotFoundError`` for 404) with the server's message; no
answer (refused, timed out, not HTTP) raises :class:`~lmcache.errors.UnreachableError`.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from typing import Any, Iterable
from urllib.parse import urlencode, urlsplit

from lmcache.errors import AdminError, AuthError, NotFoundError, UnreachableError

DEFAULT_TIMEOUT = 5.0


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """The API never redirects; following one could carry the token elsewhere."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D102
        return None


# direct connections only: no proxies from the environment, no redirects
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect)


def check_url(url: str) -> str:
    """``url`` without a trailing slash; :class:`AdminError` unless it is http(s)://host[:port]."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise AdminError(f"not an instance API URL: {url!r} (expected http://HOST:PORT)")
    try:
        parts.port
    except ValueError:
        raise AdminError(f"not an instance API URL: {url!r} (bad port)") from None
    return url.rstrip("/")


class ApiClient:
    """Calls one instance's API. ``token`` is sent as a bearer token when given."""

    live = True
    #: the largest answer read (bytes; ``None``: any); over it the call raises UnreachableError
    max_answer: int | None = None

    def __init__(self, url: str, token: str | None = None, timeout: float = DEFAULT_TIMEOUT):
        self.url = check_url(url)
        self.token = token
        self.timeout = timeout
        self.skipped_tiers: list[tuple[str, str]] = []

    # ------------------------------------------------------------ transport
    def request(self, method: str, path: str, *, query: dict[str, Any] | None = None, body: Any = None) -> Any:
        """One call: the decoded JSON answer (or text for non-JSON answers)."""
        q = {k: v for k, v in (query or {}).items() if v is not None}
        url = self.url + path + (("?" + urlencode(q)) if q else "")
        data = None
        headers = {"Accept": "application/json"}
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with _OPENER.open(req, timeout=self.timeout) as resp:
                raw = resp.read() if self.max_answer is None else resp.read(self.max_answer + 1)
                ctype = resp.headers.get("Content-Type", "")
            if self.max_answer is not None and len(raw) > self.max_answer:
                raise UnreachableError(f"{self.url} answered more than {self.max_answer} bytes")
        except urllib.error.HTTPError as exc:
            raise _from_http_error(exc, self.url) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, (socket.timeout, TimeoutError)):
                raise UnreachableError(f"no answer from {self.url} within {self.timeout:g}s") from None
            why = getattr(reason, "strerror", None) or str(reason)
            raise UnreachableError(f"cannot reach {self.url}: {why}") from None
        except TimeoutError:
            raise UnreachableError(f"no answer from {self.url} within {self.timeout:g}s") from None
        except (ConnectionError, OSError) as exc:
            raise UnreachableError(f"cannot reach {self.url}: {exc.strerror or exc}") from None
        except ValueError as exc:  # http.client's garbage (not an HTTP server)
            raise UnreachableError(f"{self.url} did not answer as an HTTP server: {exc}") from None
        except http.client.HTTPException as exc:  # an answer cut off (IncompleteRead: the server died mid-answer)
            raise UnreachableError(f"{self.url} stopped in the middle of its answer: {exc!r}") from None
        if "json" not in ctype:
            return raw.decode("utf-8", "replace")
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise UnreachableError(f"{self.url} answered with invalid JSON; is it an lmcache instance?") from None

    def close(self) -> None:
        pass

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the Admin methods
    def health(self) -> dict[str, Any]:
        return self.request("GET", "/v1/health")

    def tiers(self) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/tiers")

    def stats(self) -> dict[str, Any]:
        return self.request("GET", "/v1/stats")

    def config_report(self) -> dict[str, Any]:
        return self.request("GET", "/v1/config")

    def pins(self) -> list[dict[str, str]]:
        return self.request("GET", "/v1/pins")

    def metrics(self) -> str:
        return self.request("GET", "/metrics")

    def keys(
        self,
        tier: str | None = None,
        *,
        namespace: str | None = None,
        model: str | None = None,
        offset: int = 0,
        limit: int | None = 1000,
    ) -> dict[str, Any]:
        return self.request(
            "GET", "/v1/keys",
            query={"tier": tier, "namespace": namespace, "model": model, "offset": offset, "limit": limit},
        )

    def plan_evict(self, tier: str | None = None, **selection: Any) -> dict[str, Any]:
        r = self.evict(tier, dry_run=True, **selection)
        return {"evict": r["evicted"], "skipped": r["skipped"], "bytes": r["bytes"]}

    def evict(self, tier: str | None = None, *, dry_run: bool = False, **selection: Any) -> dict[str, Any]:
        body = {"tier": tier, "dry_run": dry_run, **selection}
        return self.request("POST", "/v1/evict", body={k: v for k, v in body.items() if v is not None})

    def recode(self, tier: str, codec: str, **selection: Any) -> dict[str, Any]:
        body = {"tier": tier, "codec": codec, **selection}
        return self.request("POST", "/v1/recode", body={k: v for k, v in body.items() if v is not None})

    def evict_entries(self, entries: Iterable[tuple[str, str]]) -> tuple[list[dict], list[dict]]:
        by_tier: dict[str, list[str]] = {}
        for tname, key in entries:
            by_tier.setdefault(tname, []).append(key)
        done: list[dict] = []
        skipped: list[dict] = []
        for tname, keys in by_tier.items():
            r = self.evict(tname, keys=keys)
            done += r["evicted"]
            skipped += r["skipped"]
        return done, skipped

    def clear(self, tier: str | None = None, *, namespace: str | None = None, all: bool = False) -> dict[str, Any]:  # noqa: A002
        """``POST /v1/clear``: ``all=True`` is sent as ``all: true`` (the API clears
        nothing on an empty selection)."""
        body = {"tier": tier, "namespace": namespace, "all": True if all else None}
        return self.request("POST", "/v1/clear", body={k: v for k, v in body.items() if v is not None})

    def pin(self, key: str, tier: str | None = None) -> dict[str, Any]:
        return self.request("POST", "/v1/pin", body={"key": key, **({"tier": tier} if tier else {})})

    def unpin(self, key: str, tier: str | None = None) -> dict[str, Any]:
        return self.request("POST", "/v1/unpin", body={"key": key, **({"tier": tier} if tier else {})})


def _from_http_error(exc: urllib.error.HTTPError, url: str) -> AdminError:
    try:
        raw = exc.read()
    except Exception:  # pragma: no cover - a broken connection
        raw = b""
    message = ""
    own = None  # the message when the answer is an lmcache API's own error: {"error": text, "status": code}
    try:
        parsed = json.loads(raw)
        message = parsed.get("error", "")
        if set(parsed) == {"error", "status"} and isinstance(message, str) and parsed["status"] == exc.code:
            own = message
    except (ValueError, AttributeError):
        pass
    if not isinstance(message, str):
        message = ""
    message = message or f"HTTP {exc.code} {exc.reason}"
    cls = {401: AuthError, 404: NotFoundError}.get(exc.code, AdminError)
    err = cls(f"{url}: {message}")
    err.status = exc.code
    err.api_message = own
    return err


__all__ = ["ApiClient", "DEFAULT_TIMEOUT", "check_url"]
