"""Which instance addresses the controller calls, and what of their answers it passes on.

A worker registers its instance API's ``api_url``; the controller later calls it with
the token the worker registered and answers the caller with the result. Without a
policy a tenant could register any address (a loopback-only service next to the
controller, a cloud metadata endpoint) and read its text back through the controller,
or tell open ports from closed ones by the error. So:

- **Where** (:class:`InstancePolicy`, checked at registration): by default the
  ``api_url``'s host must be the address the registration came from (an instance
  registers itself, from where it runs); a wildcard host (``0.0.0.0``, ``::``: the API
  bound to every interface) stands for that address and is replaced by it. Addresses
  in ``--instance-network`` (CIDR networks or addresses, or exact host names) are
  accepted from anywhere, for deployments where the registration passes a proxy or NAT.
- **What** (:class:`InstanceClient`): an answer is passed on only when it is the
  instance API's own JSON for that call (checked field by field, other fields dropped);
  an error's message only when it is the API's ``{"error", "status"}``. Anything else
  (no answer, a refusal, a timeout, another server's text or JSON) is the same one
  line to the caller, ``instance '<id>' unreachable``, with the reason in the
  controller's log only.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Iterable
from urllib.parse import urlsplit, urlunsplit

from ..errors import AdminError, UnreachableError
from .http import HTTPError
from ..plugins.services.api_client import ApiClient

#: an --instance-network list holds at most this many entries
MAX_ENTRIES = 256
#: the largest answer read from an instance (bytes): a page of entries or a long text's tokens fit
MAX_ANSWER = 16 << 20
_NAME = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*\.?")
_Net = ipaddress.IPv4Network | ipaddress.IPv6Network


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(text.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    return getattr(ip, "ipv4_mapped", None) or ip


class InstancePolicy:
    """Which ``api_url`` hosts a registration may name (see the module's doc)."""

    def __init__(self, allowed: Iterable[str] = ()):
        self.networks: list[_Net] = []
        self.names: set[str] = set()
        items = list(allowed)
        if len(items) > MAX_ENTRIES:
            raise ValueError(f"{len(items)} instance networks given; at most {MAX_ENTRIES}")
        for item in items:
            text = item.strip() if isinstance(item, str) else ""
            try:
                self.networks.append(ipaddress.ip_network(text, strict=False))
                continue
            except ValueError:
                pass
            if not _NAME.fullmatch(text) or len(text) > 253 or text.replace(".", "").isdigit():
                raise ValueError(f"not a network, an address or a host name: {str(item)[:80]!r}")
            self.names.add(text.lower().rstrip("."))

    def admit(self, api_url: Any, source: str) -> Any:
        """``api_url`` as the controller will call it (a wildcard host replaced by
        ``source``, the registration's peer address), or :class:`HTTPError` 403 when the
        controller may not call it. A malformed URL is returned as it is (the index's own
        checks answer it 400)."""
        if not isinstance(api_url, str):
            return api_url
        try:
            parts = urlsplit(api_url)
            host, port = parts.hostname, parts.port
        except ValueError:
            return api_url
        if not host:
            return api_url
        src = _ip(source)
        ip = _ip(host)
        if ip is not None and ip.is_unspecified and src is not None:
            ip = src
            shown = f"[{src}]" if src.version == 6 else str(src)
            api_url = urlunsplit((parts.scheme, f"{shown}:{port}" if port is not None else shown, parts.path,
                                  parts.query, parts.fragment))
        if ip is not None:
            if ip == src or any(ip.version == n.version and ip in n for n in self.networks):
                return api_url
        elif host.lower().rstrip(".") in self.names:
            return api_url
        raise HTTPError(403, f"field 'api_url': the controller calls an instance only at the address its registration "
                             f"came from ({source}) or in its allowed instance networks, not {host[:100]!r} "
                             "(lmcache controller serve --instance-network)")


# ---------------------------------------------------------------- the answers passed on
_STR, _INT, _LIST, _BOOL, _NONE = (str,), (int,), (list,), (bool,), (type(None),)
_EVICT = {"evicted": _LIST, "skipped": _LIST, "bytes": _INT, "dry_run": _BOOL}
#: path of the instance API -> {field: types}: every field required, others dropped
SHAPES: dict[str, dict[str, tuple[type, ...]]] = {
    "/v1/keys": {"entries": _LIST, "total": _INT, "offset": _INT, "next_offset": _INT + _NONE},
    "/v1/evict": _EVICT,
    "/v1/clear": _EVICT,
    "/v1/pin": {"key": _STR, "pinned": _LIST},
    "/v1/unpin": {"key": _STR, "unpinned": _LIST},
    "/v1/recode": {"tier": _STR, "codec": _STR, "recoded": _LIST, "skipped": _LIST, "bytes_before": _INT,
                   "bytes_after": _INT + _NONE, "dry_run": _BOOL},
    "/v1/push": {"target": _STR, "pushed": _LIST, "missing": _LIST, "bytes": _INT, "removed": _LIST,
                 "skipped": _LIST},
    "/v1/tokenize": {"tokens": _LIST, "model": _STR + _NONE},
}
_OPTIONAL = {"/v1/push": {"target_tier": _STR + _NONE, "seconds": (int, float)}}


def _fits(v: Any, types: tuple[type, ...]) -> bool:
    return any(isinstance(v, t) and not (isinstance(v, bool) and t is int) for t in types)


def checked(path: str, answer: Any) -> dict[str, Any]:
    """``answer`` of the instance API's ``path`` with only its documented fields;
    :class:`UnreachableError` when it is not that answer's shape."""
    shape = SHAPES.get(path)
    if shape is None:
        raise UnreachableError(f"no answer shape known for {path}")
    if not isinstance(answer, dict):
        raise UnreachableError(f"{path} answered {type(answer).__name__}, not the instance API's JSON object")
    out: dict[str, Any] = {}
    for name, types in shape.items():
        if name not in answer or not _fits(answer[name], types):
            raise UnreachableError(f"{path} answered without the instance API's field {name!r}")
        out[name] = answer[name]
    for name, types in _OPTIONAL.get(path, {}).items():
        if name in answer and _fits(answer[name], types):
            out[name] = answer[name]
    for name, v in out.items():  # lists hold entries (objects), keys (strings) or token ids
        if isinstance(v, list) and not all(isinstance(x, (dict, str, int)) and not isinstance(x, bool) for x in v):
            raise UnreachableError(f"{path} answered a field {name!r} that is not the instance API's")
    if path == "/v1/tokenize" and not all(isinstance(t, int) and not isinstance(t, bool) for t in out["tokens"]):
        raise UnreachableError("/v1/tokenize answered tokens that are not token ids")
    return out


class InstanceClient(ApiClient):
    """The controller's client of an instance API: answers read up to :data:`MAX_ANSWER`
    bytes and passed on only in the API's own shape (:func:`checked`)."""

    max_answer = MAX_ANSWER

    def request(self, method: str, path: str, *, query: dict[str, Any] | None = None, body: Any = None) -> Any:
        try:
            answer = super().request(method, path, query=query, body=body)
        except UnreachableError:
            raise
        except AdminError as exc:  # an error answer: passed on only when it is the API's own
            if getattr(exc, "api_message", None) is None:
                raise UnreachableError(f"{exc} (HTTP {getattr(exc, 'status', '?')}, not the instance API's "
                                       "error answer)") from None
            raise
        return checked(path, answer)


__all__ = ["InstanceClient", "InstancePolicy", "MAX_ANSWER", "SHAPES", "checked"]
