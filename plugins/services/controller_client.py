"""The controller's HTTP client, used by ``lmcache controller ...``, the worker and P2P.

It shares the instance API client's transport (:class:`lmcache.plugins.services.api_client.ApiClient`:
stdlib only, a timeout on every call, no proxies, no redirects, the bearer token when
given), so errors are the same: an answer of 4xx/5xx raises the matching
:class:`~lmcache.errors.AdminError` (``AuthError`` for 401, ``NotFoundError`` for 404),
no answer raises :class:`~lmcache.errors.UnreachableError`.

Several controller URLs (replicas of one controller, e.g. over the ``valkey`` index):
the client sticks to the URL that last answered; when it does not answer (refused,
timed out, reset) or answers 502/503, the same call is tried on the next URL, each try
bounded by ``timeout`` (so a call takes at most ``len(urls) * timeout``); an answer cut
off in the middle (the replica died while answering) counts as no answer. Any other
answer, 4xx included, is final: a refused token or a bad request is not retried
elsewhere. The URLs all come from the caller's configuration, so the token goes only
to addresses it chose.
"""

from __future__ import annotations

from typing import Any, Sequence

from lmcache.errors import AdminError
from lmcache.redact import redact_text
from lmcache.plugins.services.api_client import DEFAULT_TIMEOUT, ApiClient, check_url

#: at most this many controller URLs in one list
MAX_URLS = 16
#: answers that mean "this replica cannot serve now, another may" (besides no answer)
FAILOVER_STATUS = (502, 503)


def split_urls(url_or_urls: str | Sequence[str]) -> list[str]:
    """The controller URLs of ``url_or_urls``: one URL, a comma-separated string or a
    sequence of URLs; duplicates dropped, order kept. :class:`AdminError` (one line naming
    the bad entry) for an entry that is not ``http(s)://HOST[:PORT]``, an empty list or
    more than :data:`MAX_URLS`."""
    items = url_or_urls.split(",") if isinstance(url_or_urls, str) else list(url_or_urls)
    urls: list[str] = []
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise AdminError(f"not a controller URL: {item!r} in {url_or_urls!r} (expected http://HOST:PORT[,http://HOST:PORT...])")
        try:
            u = check_url(item.strip())
        except AdminError:
            raise AdminError(f"not a controller URL: {item.strip()!r} (expected http://HOST:PORT)") from None
        if u not in urls:
            urls.append(u)
    if not urls:
        raise AdminError("no controller URL given")
    if len(urls) > MAX_URLS:
        raise AdminError(f"{len(urls)} controller URLs given; at most {MAX_URLS}")
    return urls


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


class ControllerClient:
    """Calls a controller, given one URL or several (replicas; see the module's doc).
    Methods return the decoded JSON answer. Thread-safe: calls share only the index of
    the URL that last answered."""

    live = True

    def __init__(self, url_or_urls: str | Sequence[str], token: str | None = None, timeout: float = DEFAULT_TIMEOUT):
        self.urls = split_urls(url_or_urls)
        self.token = token
        self.timeout = timeout
        self._clients = [ApiClient(u, token, timeout) for u in self.urls]
        self._current = 0

    @property
    def url(self) -> str:
        """The URL that answered last (the first one until a call was made), for messages,
        logs and stats: a password in it reads ``***`` (:func:`lmcache.redact.redact_text`)."""
        return redact_text(self.urls[self._current])

    def request(self, method: str, path: str, *, query: dict[str, Any] | None = None, body: Any = None) -> Any:
        """One call, on the URL that answered last, then on the next ones while a URL
        does not answer or answers 502/503. When none answers, the last URL's error is
        raised with every URL's reason in its message."""
        n = len(self._clients)
        start = self._current
        errors: list[AdminError] = []
        for i in range(n):
            idx = (start + i) % n
            try:  # no answer, an answer cut off mid-way included, is UnreachableError (status 503)
                answer = self._clients[idx].request(method, path, query=query, body=body)
            except AdminError as exc:
                if getattr(exc, "status", None) not in FAILOVER_STATUS:
                    self._current = idx  # it answered: a 4xx is the answer
                    raise
                errors.append(exc)
                continue
            self._current = idx
            return answer
        last = errors[-1]
        if n == 1:
            raise last
        err = type(last)(f"no controller answered ({'; '.join(str(e) for e in errors)})")
        err.status = getattr(last, "status", 503)
        raise err from None

    def close(self) -> None:
        for c in self._clients:
            c.close()

    def __enter__(self) -> ControllerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ routers and operators
    def health(self) -> dict[str, Any]:
        return self.request("GET", "/v1/health")

    def instances(self) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/instances")

    def openapi(self) -> dict[str, Any]:
        return self.request("GET", "/openapi.json")

    def lookup(
        self,
        tokens: Sequence[int] | None = None,
        *,
        chunk_hashes: Sequence[str] | None = None,
        keys: Sequence[str] | None = None,
        num_tokens: int | None = None,
        namespace: str | None = None,
        model: str | None = None,
    ) -> dict[str, Any]:
        body = _drop_none({
            "tokens": None if tokens is None else [int(t) for t in tokens],
            "chunk_hashes": None if chunk_hashes is None else list(chunk_hashes),
            "keys": None if keys is None else list(keys),
            "num_tokens": num_tokens, "namespace": namespace, "model": model,
        })
        return self.request("POST", "/v1/lookup", body=body)

    def command(self, name: str, **fields: Any) -> dict[str, Any]:
        """``move``, ``clear``, ``pin``, ``unpin``, ``compress`` or ``decompress``:
        dispatched to the instance and answered when the instance answered."""
        if "tokens" in fields and fields["tokens"] is not None:
            fields["tokens"] = [int(t) for t in fields["tokens"]]
        return self.request("POST", f"/v1/{name}", body=_drop_none(fields))

    # ------------------------------------------------------------ the worker's calls
    def register(self, info: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", "/v1/register", body=info)

    def heartbeat(self, instance_id: str, session: str, **extra: Any) -> dict[str, Any]:
        return self.request("POST", "/v1/heartbeat", body={"instance_id": instance_id, "session": session, **extra})

    def events(self, instance_id: str, session: str, events: list[list[str]]) -> dict[str, Any]:
        return self.request(
            "POST", "/v1/events", body={"instance_id": instance_id, "session": session, "events": events}
        )

    def deregister(self, instance_id: str, session: str) -> dict[str, Any]:
        return self.request("POST", "/v1/deregister", body={"instance_id": instance_id, "session": session})


__all__ = ["ControllerClient", "FAILOVER_STATUS", "MAX_URLS", "split_urls"]
