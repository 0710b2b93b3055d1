"""Config sections declared once, as dataclass fields that carry their own check.

A section is a dataclass whose fields are made with :func:`option`: the check a raw value
must pass, whether it is a secret, the variable that may set it. Everything a section
needs then comes from those declarations: :func:`parse` validates a raw mapping into it
(merging into a base, so a file may set one key and the environment another),
:func:`copy` copies it, :func:`mask` hides its secrets in reports and
:func:`env_values` reads its ``LMCACHE_*`` variables. A field whose default factory is a
dataclass (``api: ApiConfig = field(default_factory=ApiConfig)``) holds a nested
section; a section may define ``validate(self, source)`` for rules across its fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import re
import reprlib
import threading
from typing import Any, Callable, Iterable, Mapping

import yaml

from .errors import ConfigError
from .redact import redact
from .units import parse_size

log = logging.getLogger("lmcache.config")

#: ``check(key, value, source) -> value``: the validated value, or a ConfigError naming ``key``
Check = Callable[[str, Any, "str | None"], Any]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, 80, 80


def show(v: Any) -> str:
    """A bounded repr for error messages: a YAML alias bomb or a huge nested value costs a
    few dozen characters, not its whole expansion; credentials in it read ``***``."""
    s = _REPR.repr(redact(v, limit=256) if isinstance(v, (str, Mapping, list, tuple)) else v)
    return s if len(s) <= 200 else s[:200] + "..."


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What PyYAML found wrong and where, without its quote of the line (a secret, maybe)."""
    mark = getattr(exc, "problem_mark", None)
    what = " ".join(filter(None, (getattr(exc, "context", None), getattr(exc, "problem", None))))
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{what or type(exc).__name__}{where}"


def option(default: Any = dataclasses.MISSING, check: Check | None = None, *, secret: bool = False,
           env: bool | str | None = None, shorthand: type | None = None, rest: bool = False) -> Any:
    """A config field. ``check`` validates a raw value; ``secret`` reads ``***`` in reports;
    ``env`` lets a variable set it verbatim (never parsed as YAML, so a token stays a
    string): ``True`` for ``LMCACHE_<SECTION>_<FIELD>``, or the variable's name;
    ``shorthand``: a bare value of that type stands for the whole section
    (``api: true`` is ``{enabled: true}``); ``rest``: this dict takes the keys no field
    names (a backend's own keys, checked by the backend). A list, dict or dataclass
    default is copied for each instance."""
    md = {"check": check, "secret": secret, "env": env, "shorthand": shorthand, "rest": rest}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: copy(default), metadata=md, repr=not secret)
    return dataclasses.field(default=default, metadata=md, repr=not secret)


@functools.cache
def keys(cls: type) -> dict[str, dataclasses.Field]:
    """The config keys of ``cls``: its fields with a check, and its nested sections."""
    return {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("check") or section_type(f)}


def section_type(f: dataclasses.Field) -> type | None:
    factory = f.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def _expand(cls: type, raw: Any) -> Any:
    """``None`` is ``{}``; a bare value of the shorthand's type is ``{shorthand: value}``."""
    if raw is None:
        return {}
    for k, f in keys(cls).items():
        kind = f.metadata.get("shorthand")
        if kind is not None and isinstance(raw, kind):
            return {k: raw}
    return raw


def touched(cls: type, raw: Any) -> list[str]:
    """The fields of ``cls`` that ``raw`` sets (all of them for a whole section object)."""
    raw = raw if raw is None else _expand(cls, raw)
    return [k for k in raw if k in keys(cls)] if isinstance(raw, Mapping) else list(keys(cls))


def near_miss(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the choice closest to a misspelt ``word``, or ``""``
    when none is close: the hint every "unknown key" message gives."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def parse(cls: type, raw: Any, key: str = "", source: str | None = None, base: Any = None) -> Any:
    """``raw`` validated into a ``cls`` named ``key`` (``""`` for the top level); the keys
    it does not set keep their value in ``base`` (a nested section is merged the same way),
    or take their default; ``base`` is not changed."""
    if isinstance(raw, cls):
        return copy(raw)
    raw = _expand(cls, raw)
    if not isinstance(raw, Mapping):
        raise ConfigError(key, f"expected a mapping of {', '.join(keys(cls))}, got {show(raw)}", source)
    known = keys(cls)
    rest = next((f.name for f in dataclasses.fields(cls) if f.metadata.get("rest")), None)
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for k, v in raw.items():
        f, name = known.get(k), f"{key}.{k}" if key else str(k)
        if f is None and rest:
            if not isinstance(k, str):
                raise ConfigError(f"{key}.{k!r}", "keys must be strings", source)
            extra[k] = v
        elif f is None:
            hint = near_miss(str(k), known)
            raise ConfigError(name, "unknown key" + (hint or f"; known keys: {', '.join(known)}"), source)
        elif section_type(f):
            values[k] = parse(section_type(f), v, name, source, getattr(base, k, None))
        else:
            values[k] = f.metadata["check"](name, v, source)
    if extra:
        values[rest] = {**getattr(base, rest, {}), **extra}
    missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in values
               and f.default is f.default_factory is dataclasses.MISSING]
    if base is None and missing:
        raise ConfigError(f"{key}.{missing[0]}", "is required", source)
    try:
        out = cls(**values) if base is None else dataclasses.replace(copy(base), **values)
    except ConfigError as exc:  # a check of the whole object (``__post_init__``) names no source
        raise ConfigError(exc.key, exc.problem, exc.source or source) from None
    if hasattr(out, "validate"):
        out.validate(source)
    return out


def verify(obj: Any, key: str) -> None:
    """Run each field's check on ``obj`` as built in code (``KVSpec(...)``), not parsed."""
    for k, f in keys(type(obj)).items():
        if not section_type(f):
            f.metadata["check"](f"{key}.{k}", getattr(obj, k), None)


def copy(v: Any) -> Any:
    """A copy that shares no dataclass, list or dict with ``v``."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return dataclasses.replace(v, **{f.name: copy(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init})
    if isinstance(v, list):
        return [copy(x) for x in v]
    if isinstance(v, dict):
        return {k: copy(x) for k, x in v.items()}
    return v


def _stars(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _stars(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_stars(x) for x in v]
    return None if v is None else "***"


def mask(obj: Any, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (``asdict(obj)``) with every secret reading ``***`` (each token of a
    collection), in place."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.metadata.get("secret") and f.name in data:
            data[f.name] = _stars(data[f.name])
        elif dataclasses.is_dataclass(v) and isinstance(data.get(f.name), dict):
            mask(v, data[f.name])
    return data


def _field_vars(cls: type, prefix: str) -> dict[str, tuple[str, str]]:
    """``{variable: (section, field)}`` for the section fields that a variable sets."""
    out = {}
    for k, sub in ((k, section_type(f)) for k, f in keys(cls).items()):
        for n, g in keys(sub).items() if sub else ():
            env = g.metadata.get("env")
            if env:
                out[env if isinstance(env, str) else f"{prefix}{k}_{n}".upper()] = (k, n)
    return out


def env_values(cls: type, environ: Mapping[str, str], prefix: str = "LMCACHE_",
               not_keys: Iterable[str] = ()) -> list[tuple[str, dict[str, Any]]]:
    """``(variable, {key: value})`` for each variable that sets part of a ``cls``:
    ``<prefix><KEY>`` read as YAML, then each field's own variable, verbatim. Other
    ``<prefix>`` variables, unless in ``not_keys``, are warned about and ignored."""
    fields = _field_vars(cls, prefix)
    ignore = set(not_keys) | set(fields)
    out = []
    for var, raw in environ.items():
        if not var.startswith(prefix) or var in ignore:
            continue
        key = var[len(prefix):].lower()
        if key not in keys(cls):
            log.warning("ignoring environment variable %s: %s is not a config key", var, key)
            continue
        try:
            out.append((var, {key: yaml.safe_load(raw) if raw != "" else None}))
        except yaml.YAMLError as exc:
            raise ConfigError(key, f"cannot parse {show(raw)}: {yaml_problem(exc)}", f"${var}") from None
    out += [(var, {k: {n: environ[var]}}) for var, (k, n) in fields.items() if environ.get(var)]
    return out


# ---------------------------------------------------------------- checks, for ``option(check=...)``
def rule(test: Callable[[Any], Any], problem: str, after: Check | None = None) -> Check:
    """A check from a predicate and the problem to name when it fails (``{}`` shows the
    value); ``after``, a coarser check, runs first, so ``test`` sees a value of its type."""
    def check(key: str, v: Any, src: str | None) -> Any:
        v = v if after is None else after(key, v, src)
        if not test(v):
            raise ConfigError(key, problem.format(show(v)), src)
        return v
    return check


def integer(minimum: int = 1) -> Check:
    return rule(lambda v: v >= minimum, f"must be >= {minimum}, got {{}}", after=_INTEGER)


def seconds(minimum: float = 0.0) -> Check:
    """A positive number of seconds; ``minimum`` where a tiny one would be a busy loop."""
    at_least = rule(lambda v: v >= minimum, f"must be at least {minimum} s, got {{}}", after=_POSITIVE)
    return lambda key, v, src: float(at_least(key, v, src))


def choice(*choices: str) -> Check:
    return rule(lambda v: v in choices, f"must be one of {', '.join(choices)}; got {{}}")


def short_text(max_len: int) -> Check:
    """Any string, the empty one included, of at most ``max_len`` characters."""
    return rule(lambda v: isinstance(v, str) and len(v) <= max_len,
                f"expected a string of at most {max_len} characters, got {{}}")


def size(allow_zero: bool = False) -> Check:
    def check(key: str, v: Any, src: str | None) -> int:
        try:
            n = parse_size(v)
        except ValueError as exc:
            raise ConfigError(key, str(exc), src) from None
        if n == 0 and not allow_zero:
            raise ConfigError(key, "must be larger than 0", src)
        return n
    return check


def optional(check: Check) -> Check:
    """``check``, with ``null`` also accepted."""
    return lambda key, v, src: None if v is None else check(key, v, src)


def _zmq(v: Any) -> bool:
    return isinstance(v, str) and (
        (v.startswith("tcp://") and v.rpartition(":")[2].isdigit() and len(v.rpartition(":")[0]) > len("tcp://"))
        or (v.startswith(("ipc://", "inproc://")) and len(v.split("://", 1)[1]) > 0))


_INTEGER = rule(lambda v: isinstance(v, int) and not isinstance(v, bool), "expected an integer, got {}")
_POSITIVE = rule(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
                 "expected a positive number of seconds, got {}")
boolean = rule(lambda v: isinstance(v, bool), "expected true or false, got {}")
text = rule(lambda v: isinstance(v, str) and v, "expected a non-empty string, got {}")
#: a name that may be part of a key or a path
name = rule(_NAME_RE.match, "{} may only contain letters, digits, '.', '_' and '-'", after=text)
port = rule(lambda v: v <= 65535, "must be <= 65535, got {}", after=integer(0))
token = rule(lambda v: v is None or (isinstance(v, str) and v and v == v.strip() and len(v) <= 4096),
             "expected a non-empty string without surrounding spaces, or null")
zmq_endpoint = rule(_zmq, "expected a ZMQ endpoint such as tcp://127.0.0.1:5557, got {}")


#: the keys :func:`warn_once` has seen in this process (the upstream vocabulary's warnings)
_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str) -> None:
    """Log ``message`` (to ``lmcache.config``) the first time ``key`` is seen in this process."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    logging.getLogger("lmcache.config").warning("%s", message)
