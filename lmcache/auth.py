"""Tokens: bearer tokens for lmcache's HTTP services (one admin token and tenant
tokens), and the mutual token handshake of the binary protocol (:mod:`lmcache.wire`).

The instance API (``api.token`` / ``api.tenants``) and the controller (``--token`` /
``--tenants-file``) accept two kinds of token:

* the admin token sees and changes everything;
* a tenant token is scoped to one namespace (the ``namespace`` of the engines that
  serve that tenant): every listing is narrowed to it, and naming an entry, a namespace
  or an instance of another namespace is refused with 403 (an instance of another
  namespace is answered like an unknown one, 404).

Tenants are given as ``{namespace: token}`` or ``{namespace: [token, ...]}`` (several
tokens per namespace allow rotation). When any token is configured, a request without
one of them is refused with 401. Every configured token is compared with
:func:`hmac.compare_digest`, all of them on every request, so the time a refusal takes
says nothing about which token came close.

The binary protocol's handshake (``lmcache server``, the ``lm`` backend, peer
endpoints) never sends the shared token: each side proves it knows it.

1. client -> server: AUTH, value ``HELLO + nc`` (``nc``: 32 random bytes);
2. server -> client: AUTH OK, value ``ns + server_proof + identity`` (``ns``: 32 random
   bytes; ``identity``: the server's name, a peer endpoint's instance id, up to
   :data:`MAX_IDENTITY` bytes; ``server_proof = HMAC-SHA256(token, "lmcache server" |
   nc | ns | identity)``);
3. the client checks the proof (and, when it knows whom it dialled, the identity) and
   only then sends AUTH, value ``HELLO + client_proof`` (the same HMAC with "lmcache
   client"); the server checks it and answers AUTH OK.

Why: a listener that does not know the token (an address a request named, a stolen
registration) cannot produce ``server_proof``, so the client stops before sending a
proof or any request; what it saw (``nc``) is useless. The two labels differ, so a
server cannot be used as an oracle for client proofs. A relay that forwards the
handshake to a real peer is caught by the identity: the client expects the instance id
it resolved, the real peer announces its own, and both proofs cover it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Any, Mapping

from .errors import ConfigError, LMCacheError

_NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")

#: what :meth:`Credentials.check` returns for an admin token
ADMIN = None


class Unauthorized(LMCacheError):
    """No token, or not one of the configured ones."""


def parse_tenants(key: str, raw: Any, src: str | None = None, admin_token: str | None = None) -> dict[str, tuple[str, ...]]:
    """Validate a tenants mapping ``{namespace: token | [tokens]}``; ``ConfigError``
    naming ``key`` (and the namespace) otherwise. A token may serve one tenant only and
    may not be the admin token."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(key, f"expected a mapping of namespace to token(s), such as {{team-a: <token>}}, got {type(raw).__name__}", src)
    out: dict[str, tuple[str, ...]] = {}
    seen: dict[str, str] = {}
    for ns, toks in raw.items():
        if not isinstance(ns, str) or not _NAME_RE.match(ns):
            raise ConfigError(key, f"namespace {ns!r} may only contain letters, digits, '.', '_' and '-'", src)
        if isinstance(toks, str):
            toks = [toks]
        if not isinstance(toks, (list, tuple)) or not toks:
            raise ConfigError(f"{key}.{ns}", "expected a token or a non-empty list of tokens", src)
        for tok in toks:
            if not isinstance(tok, str) or not tok or tok != tok.strip() or len(tok) > 4096:
                raise ConfigError(f"{key}.{ns}", "a token must be a non-empty string without surrounding spaces", src)
            if admin_token is not None and hmac.compare_digest(tok.encode(), admin_token.encode()):
                raise ConfigError(f"{key}.{ns}", "a tenant token cannot be the admin token", src)
            if tok in seen:
                raise ConfigError(f"{key}.{ns}", f"this token is also namespace {seen[tok]!r}'s; each token serves one tenant", src)
            seen[tok] = ns
        out[ns] = tuple(toks)
    return out


class Credentials:
    """Who a request's ``Authorization`` header speaks for."""

    def __init__(self, token: str | None, tenants: Mapping[str, tuple[str, ...]] | None = None):
        self._tokens: list[tuple[bytes, str | None]] = []
        if token:
            self._tokens.append((token.encode(), ADMIN))
        for ns, toks in (tenants or {}).items():
            self._tokens.extend((t.encode(), ns) for t in toks)
        self.tenants = tuple(sorted((tenants or {}).keys()))

    @property
    def open(self) -> bool:
        """No token configured: every request is admin."""
        return not self._tokens

    def check(self, header: str | None) -> str | None:
        """The namespace a tenant token is scoped to, or ``ADMIN`` (``None``) for the
        admin token (and for every request when no token is configured); raises
        :class:`Unauthorized` otherwise."""
        if not self._tokens:
            return ADMIN
        if not header:
            raise Unauthorized
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer":
            raise Unauthorized
        given = value.strip().encode()
        found = False
        scope: str | None = ADMIN
        for tok, ns in self._tokens:  # every token compared: no early exit
            if hmac.compare_digest(given, tok):
                found, scope = True, ns
        if not found:
            raise Unauthorized
        return scope


#: first bytes of a handshake's AUTH value (then a 32-byte nonce or proof)
HELLO = b"LMA1"
NONCE = 32
#: the longest server identity a client accepts
MAX_IDENTITY = 256


def nonce() -> bytes:
    """32 random bytes."""
    return secrets.token_bytes(NONCE)


def proof(token: bytes, side: str, nc: bytes, ns: bytes, identity: bytes) -> bytes:
    """``HMAC-SHA256(token, "lmcache <side>" | nc | ns | identity)``; ``side`` is
    ``"server"`` or ``"client"`` (the nonces have fixed sizes, so the concatenation is
    unambiguous)."""
    assert side in ("server", "client")
    return hmac.new(token, b"lmcache " + side.encode() + b"|" + nc + ns + identity, hashlib.sha256).digest()


def foreign(tenant: str | None, namespace: str | None) -> bool:
    """Whether ``namespace`` is out of reach for a caller scoped to ``tenant``."""
    return tenant is not ADMIN and namespace != tenant


__all__ = ["ADMIN", "HELLO", "MAX_IDENTITY", "NONCE", "Credentials", "Unauthorized", "foreign", "nonce", "parse_tenants",
           "proof"]
