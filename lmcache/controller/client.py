"""The controller's HTTP client, used by ``lmcache controller ...`` and by the worker.

It shares the instance API client's transport (:class:`lmcache.plugins.services.api_client.ApiClient`:
stdlib only, a timeout on every call, no proxies, no redirects, the bearer token when
given), so errors are the same: an answer of 4xx/5xx raises the matching
:class:`~lmcache.errors.AdminError` (``AuthError`` for 401, ``NotFoundError`` for 404),
no answer raises :class:`~lmcache.errors.UnreachableError`.
"""

from __future__ import annotations

from typing import Any, Sequence

from lmcache.plugins.services.api_client import DEFAULT_TIMEOUT, ApiClient


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


class ControllerClient(ApiClient):
    """Calls one controller. Methods return the decoded JSON answer."""

    def __init__(self, url: str, token: str | None = None, timeout: float = DEFAULT_TIMEOUT):
        super().__init__(url, token, timeout)

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


__all__ = ["ControllerClient"]
