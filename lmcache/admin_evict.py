"""What an eviction of the admin API (:meth:`lmcache.admin.Admin.plan_evict`) selects:
the selection checked, named keys planned, and why an entry stays."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from .errors import AdminError
from .units import parse_duration, parse_size

if TYPE_CHECKING:
    from .tier import Tier


def _plan_keys(tiers: Sequence[Any], keys: Sequence[str], tier: str | None) -> dict[str, Any]:
    """:meth:`lmcache.admin.Admin.plan_evict` of named (parsed) ``keys``: each where a chosen tier holds it, or
    skipped with the reason (held by a reader, pinned, leased; not held at all)."""
    victims: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    found: set[str] = set()
    for t in tiers:
        for k in keys:
            size = t.size_of(k)
            if size is None:
                continue
            found.add(k)
            why = _why_not(t, k)
            if why:
                skipped.append({"tier": t.name, "key": k, "reason": why})
            else:
                victims.append({"tier": t.name, "key": k, "size": size})
    for k in keys:
        if k not in found:
            where = f"tier {tier!r}" if tier is not None else "any tier"
            skipped.append({"tier": tier, "key": k, "reason": f"not in {where}"})
    return {"evict": victims, "skipped": skipped, "bytes": sum(v["size"] for v in victims)}

def _why_not(t: Tier, key: str) -> str | None:
    if t.is_pinned(key):
        return "pinned"
    if t.backend.in_use(key):
        return "in use by a reader"
    return None


def _check_selection(
    keys: Any, nbytes: Any, older_than: Any, all_: Any, namespace: Any, model: Any
) -> tuple[int | None, float | None]:
    """Validate what an eviction selects; return ``(bytes, older_than seconds)``."""
    if not isinstance(all_, bool):
        raise AdminError(f"all must be true or false, got {all_!r}")
    for name, v in (("namespace", namespace), ("model", model)):
        if v is not None and (not isinstance(v, str) or not v):
            raise AdminError(f"{name} must be a non-empty string, got {v!r}")
    if keys is not None:
        if isinstance(keys, str) or not isinstance(keys, (list, tuple)) or not keys:
            raise AdminError(f"keys must be a non-empty list of keys, got {keys!r}")
        if nbytes is not None or older_than is not None or all_ or namespace is not None or model is not None:
            raise AdminError("keys cannot be combined with bytes, older_than, all, namespace or model")
        return None, None
    if all_ and (nbytes is not None or older_than is not None):
        raise AdminError("all cannot be combined with bytes or older_than")
    if not all_ and nbytes is None and older_than is None:
        raise AdminError("say what to evict: keys, bytes, older_than or all")
    n = age = None
    if nbytes is not None:
        try:
            n = parse_size(nbytes)
        except ValueError as exc:
            raise AdminError(f"bytes: {exc}") from None
        if n <= 0:
            raise AdminError("bytes must be larger than 0")
    if older_than is not None:
        try:
            age = parse_duration(older_than)
        except ValueError as exc:
            raise AdminError(f"older_than: {exc}") from None
    return n, age
