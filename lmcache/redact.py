"""Credentials masked wherever lmcache shows text.

Two functions, used by every place that prints, logs, answers or raises something built
from configuration: :func:`redact` for a structure (a config as plain data, a report)
and :func:`redact_text` for free text (an error message, a log line, a URL).

What is masked:

- the value of a key that names a credential (:func:`is_secret`): ``password``,
  ``secret``, ``token``, ``auth``, ``secret_access_key``, ``session_token``, any name
  ending in ``_password``, ``_secret``, ``_token``, ``_key`` or ``_passphrase``...: it
  reads ``***`` (each string of a list or mapping under it; ``null`` and booleans stay);
- an access key id (``access_key_id``, ``aws_access_key_id``, fsspec's ``key`` in a
  structure; in text a bare ``key`` is a chunk's): not a secret by AWS's account, but it
  names the account; it reads ``***`` and its last four characters, as ``aws configure
  list`` shows it;
- the password in a URL's user info: ``redis://default:pw@host`` reads
  ``redis://default:***@host``, ``rediss://:pw@host`` ``rediss://:***@host``; user info
  without a colon is, for Redis, a password alone (``redis://pw@host``): it reads ``***``;
- in free text, ``name=value`` (query strings, environment assignments), ``'name':
  'value'`` (a repr, JSON), ``name: value`` (YAML) and ``Bearer value``, when ``name``
  names a credential.

Both functions are idempotent (masking masked text changes nothing) and never raise.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

MASK = "***"

#: names that are credentials whole (compared in lower case, ``-`` read as ``_``)
_EXACT = frozenset({
    "password", "passwd", "pwd", "pass", "passphrase", "secret", "token", "auth", "authorization",
    "credential", "credentials", "apikey", "api_key", "private_key", "secret_access_key",
    "session_token", "security_token", "sas_token", "connection_string", "sig", "signature",
    "x_amz_signature", "x_amz_security_token", "x_amz_credential",
})
_SUFFIXES = ("_password", "_passwd", "_secret", "_token", "_key", "_passphrase", "_credentials")
#: identifiers of an account: partly shown
_IDS = frozenset({"access_key_id", "aws_access_key_id", "key", "x_amz_access_key_id"})


def _norm(name: object) -> str:
    return str(name).rsplit(".", 1)[-1].strip().lower().replace("-", "_")


def is_secret(name: object) -> bool:
    """Whether a key called ``name`` (the last part of a dotted path) holds a credential."""
    n = _norm(name)
    return n in _EXACT or (n.endswith(_SUFFIXES) and n not in _IDS)


def _is_id(name: object) -> bool:
    return _norm(name) in _IDS


def _partial(v: str) -> str:
    if v.startswith(MASK):
        return v
    return MASK + v[-4:] if len(v) >= 12 else MASK


def _masked(v: Any, budget: list[int], depth: int) -> Any:
    """Every string or number under a credential's key, masked."""
    if budget[0] == 0 or depth > 32:
        return MASK
    budget[0] -= 1
    if isinstance(v, Mapping):
        return {k: _masked(x, budget, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_masked(x, budget, depth + 1) for x in v]
    if v is None or isinstance(v, bool):
        return v
    return MASK


def redact(obj: Any, name: object = None, *, limit: int | None = None) -> Any:
    """A copy of ``obj`` (mappings, lists, strings, numbers) with credentials masked: the
    value of every credential-named key, and URL passwords in every string. ``name`` is
    the key ``obj`` is held under, if any. ``limit`` bounds the values visited (a YAML
    alias bomb, a structure that holds itself): past it, and below 32 levels, ``...``."""
    return _walk(obj, name, [-1 if limit is None else limit], 0)


def _walk(obj: Any, name: object, budget: list[int], depth: int) -> Any:
    if budget[0] == 0 or depth > 32:
        return "..."
    budget[0] -= 1
    if name is not None and is_secret(name):
        return _masked(obj, budget, depth)
    if name is not None and _is_id(name) and isinstance(obj, str):
        return _partial(obj)
    if isinstance(obj, Mapping):
        return {k: _walk(v, k, budget, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_walk(x, None, budget, depth + 1) for x in obj]
    if isinstance(obj, str):
        return redact_text(obj)
    return obj


# user info of a URL: everything between '://' and the last '@' before the host ends
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<info>[^\s/?#'\"<>\\]*)@")
# name=value: a query string, an environment assignment
_ASSIGN = re.compile(r"(?<![\w.])(?P<name>[A-Za-z_][\w.\-]{0,80})(?P<sep>=)"
                     r"(?P<value>\"[^\"]*\"?|'[^']*'?|[^\s&;,'\"#)\]}]*)")
# 'name': 'value' or "name": "value" (a repr, JSON); the value may be cut off (a bounded repr)
_QUOTED = re.compile(r"(?P<q>[\"'])(?P<name>[A-Za-z_][\w.\-]{0,80})(?P=q)(?P<sep>\s*:\s*)"
                     r"(?P<value>\"(?:[^\"\\]|\\.)*\"?|'(?:[^'\\]|\\.)*'?|[0-9][\w.\-]*)")
# name: value (YAML), only for compound names: plain "token: " is prose more often than not
_YAML = re.compile(r"(?<![\w.\-'\"])(?P<name>[A-Za-z_][\w\-]{0,80})(?P<sep>:[ \t]+)"
                   r"(?P<value>\"[^\"]*\"?|'[^']*'?|[^\s,}\]'\"]+)")
_BEARER = re.compile(r"\b(?P<kind>Bearer|Basic)(?P<sep>\s+)(?P<value>[A-Za-z0-9._~+/\-]+=*)")


def _userinfo(m: re.Match[str]) -> str:
    info = m["info"]
    user, colon, _ = info.partition(":")
    return f"{m['scheme']}{user}:{MASK}@" if colon else f"{m['scheme']}{MASK}@"


def _value(m: re.Match[str], *, strict: bool = False) -> str:
    name, value = m["name"], m["value"]
    if strict and ("_" not in _norm(name) and _norm(name) not in ("password", "passwd", "passphrase")):
        return m[0]
    secret, ident = is_secret(name), _is_id(name) and _norm(name) != "key"  # a bare "key" in text: a chunk's
    if not (secret or ident) or not value:
        return m[0]
    q = value[0] if value[0] in "'\"" else ""
    inner = value[len(q):-1] if q and len(value) > 1 and value.endswith(q) else value[len(q):]
    shown = MASK if secret else _partial(inner)
    return m[0][: m.start("value") - m.start()] + f"{q}{shown}{q}"


def redact_text(text: str) -> str:
    """``text`` with URL passwords and the values of credential-named keys masked."""
    if not isinstance(text, str) or not text:
        return text
    if "@" in text:
        text = _USERINFO.sub(_userinfo, text)
    if "=" in text:
        text = _ASSIGN.sub(_value, text)
    if ":" in text:
        text = _QUOTED.sub(_value, text)
        text = _YAML.sub(lambda m: _value(m, strict=True), text)
    if "Bearer" in text or "Basic" in text:
        text = _BEARER.sub(lambda m: f"{m['kind']}{m['sep']}{MASK}" if m["value"] != MASK else m[0], text)
    return text


__all__ = ["MASK", "is_secret", "redact", "redact_text"]
