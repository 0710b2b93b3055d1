"""Inspecting and changing a cache instance's tiers: the one admin layer.

:class:`Admin` answers the questions of ``lmcache tiers``, ``ls``, ``evict``, ``pin``,
``unpin`` and ``stats``. The instance API (:mod:`lmcache.plugins.services.api`) serves a live engine's
``Admin`` over HTTP; the CLI uses :class:`lmcache.plugins.services.api_client.ApiClient` against it, or an
``Admin`` of its own over a config's persisted tiers (:meth:`Admin.open_config`), so both
paths run the same code. Every method returns plain JSON-able data.

Entries are listed per tier in tier order, keys sorted within a tier (so pages are
stable). An explicit eviction removes entries from the tier it names and nothing else
(in ``write-back`` mode nothing is demoted); it never removes a pinned entry, one leased
by ``lookup(pin=True)``, or one a reader still holds: those are reported as skipped.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, Sequence

from .config import Config
from .errors import AdminError, BackendError, LMCacheError, NotFoundError
from .keys import CacheKey
from .admin_evict import _check_selection, _plan_keys, _why_not

if TYPE_CHECKING:  # pragma: no cover
    from .tier import Tier


class LiveEngine(Protocol):
    """What an :class:`Admin` uses of the engine it serves (:class:`lmcache.CacheEngine`,
    which imports this module, not the other way round)."""

    config: Config
    hierarchy: Any
    p2p: Any

    def stats(self) -> dict[str, Any]: ...

#: most entries one ``keys`` call returns
MAX_PAGE = 10_000


def parse_key(text: Any) -> CacheKey:
    """A :class:`CacheKey` from its canonical string; :class:`AdminError` otherwise."""
    if not isinstance(text, str):
        raise AdminError(f"a key must be a string, got {text!r}")
    try:
        return CacheKey.parse(text)
    except ValueError as exc:
        raise AdminError(str(exc)) from None


def _key_parts(key: str) -> tuple[str | None, str | None]:
    try:
        k = CacheKey.parse(key)
    except ValueError:
        return None, None
    return k.namespace, k.model


def _matcher(namespace: str | None, model: str | None) -> Callable[[str], bool]:
    if namespace is None and model is None:
        return lambda key: True

    def match(key: str) -> bool:
        ns, m = _key_parts(key)
        return (namespace is None or ns == namespace) and (model is None or m == model)

    return match


class Admin:
    """The admin operations over a list of tiers (a live engine's, or a config's
    persisted tiers opened on their own)."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        engine: LiveEngine | None = None,
        config: Config | None = None,
        skipped_tiers: Sequence[tuple[str, str]] = (),
        wall_clock: Callable[[], float] = time.time,
        on_close: Callable[[], None] | None = None,
    ):
        self._tiers = list(tiers)
        self.engine = engine
        self.config = config if config is not None else (engine.config if engine is not None else None)
        #: ``(tier name, why)`` for the tiers of the config that are not open here
        self.skipped_tiers = list(skipped_tiers)
        self.wall_clock = wall_clock
        self._on_close = on_close
        self._pins: set[tuple[str, str]] = set()  # (tier, key) pinned through this admin
        self._lock = threading.Lock()

    @property
    def live(self) -> bool:
        return self.engine is not None

    # ------------------------------------------------------------ opening
    @classmethod
    def for_engine(cls, engine: LiveEngine) -> Admin:
        return cls(engine.hierarchy.tiers, engine=engine)

    @classmethod
    def open_config(
        cls,
        config: Config,
        *,
        read_only: bool = True,
        tier: str | None = None,
        registries: Any = None,
    ) -> Admin:
        """Open the tiers of ``config`` that persist outside a process (every tier
        whose backend does not hold memory objects: ``disk``, not ``cpu``) without
        starting an engine. ``read_only`` opens them for inspection only (nothing is
        created or repaired); either way nothing is evicted on opening (an engine trims a
        tier that holds more than its capacity; this does not). ``tier`` opens only that
        one."""
        from .hierarchy import build_tier, check_tier

        names = [t.name for t in config.tiers]
        if tier is not None and tier not in names:
            raise NotFoundError(f"unknown tier {tier!r}; the config's tiers: {', '.join(names)}")
        opened: list[Tier] = []
        skipped: list[tuple[str, str]] = []
        try:
            for i, tcfg in enumerate(config.tiers):
                if tier is not None and tcfg.name != tier:
                    continue
                parts = check_tier(i, tcfg, source=config.source, registries=registries)
                if parts.backend_cls.holds_memory_objects:
                    skipped.append((tcfg.name, "it lives in a running instance's memory; use --url to see it"))
                    continue
                opened.append(
                    build_tier(i, tcfg, source=config.source, registries=registries, read_only=read_only,
                               trim=False, parts=parts)
                )
        except BaseException:
            for t in opened:
                t.backend.close()
            raise
        if tier is not None and not opened:
            raise AdminError(f"tier {tier!r} cannot be opened from its config: {skipped[0][1]}")

        def close() -> None:
            for t in opened:
                t.backend.close()

        return cls(opened, config=config, skipped_tiers=skipped, on_close=close)

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close()
            self._on_close = None

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ tiers
    def tier(self, name: str) -> Tier:
        for t in self._tiers:
            if t.name == name:
                return t
        known = ", ".join(t.name for t in self._tiers) or "none"
        extra = next((f" ({why})" for n, why in self.skipped_tiers if n == name), "")
        raise NotFoundError(f"unknown tier {name!r}{extra}; tiers: {known}")

    def _select(self, tier: str | None) -> list[Tier]:
        if tier is None:
            return list(self._tiers)
        if not isinstance(tier, str):
            raise AdminError(f"tier must be a tier name, got {tier!r}")
        return [self.tier(tier)]

    def tiers(self, *, namespace: str | None = None) -> list[dict[str, Any]]:
        """Per tier: backend, entries, bytes used and capacity, counters, hit rate (a
        shared store is listed first, so the numbers cover all of it). With
        ``namespace``: per tier its name, backend and that namespace's entries and bytes
        only (what a tenant may see)."""
        for t in self._tiers:
            t.refresh()
        if namespace is None:
            return [t.info() for t in self._tiers]
        match = _matcher(namespace, None)
        rows = []
        for t in self._tiers:
            sizes = [e.size for e, _ in t.entries() if match(e.key)]
            rows.append({"name": t.name, "backend": t.cfg.backend, "namespace": namespace,
                         "entries": len(sizes), "bytes": sum(sizes)})
        return rows

    def stats(self) -> dict[str, Any]:
        """``CacheEngine.stats()`` for a live engine; the same shape (tiers only) offline."""
        if self.engine is not None:
            return {"live": True, **self.engine.stats()}
        return {"live": False, "tiers": {t.name: t.info() for t in self._tiers}, "pool": None, "hierarchy": None}

    def config_report(self) -> dict[str, Any]:
        if self.config is None:
            raise AdminError("no config is known here")
        return self.config.report()

    # ------------------------------------------------------------ keys
    def _entry_rows(self, t: Tier, match: Callable[[str], bool], now: float) -> list[dict[str, Any]]:
        rows = []
        for e, pinned in t.entries():
            if not match(e.key):
                continue
            ns, model = _key_parts(e.key)
            rows.append(
                {
                    "tier": t.name,
                    "key": e.key,
                    "namespace": ns,
                    "model": model,
                    "size": e.size,
                    "codec": e.codec,
                    "stored_at": e.stored_at,
                    "age_s": None if e.stored_at is None else max(0.0, now - e.stored_at),
                    "pinned": pinned,
                }
            )
        rows.sort(key=lambda r: r["key"])
        return rows

    def keys(
        self,
        tier: str | None = None,
        *,
        namespace: str | None = None,
        model: str | None = None,
        offset: int = 0,
        limit: int | None = 1000,
    ) -> dict[str, Any]:
        """One page of entries: ``{"entries": [...], "total": n, "offset": o,
        "next_offset": o2 or None}``; each entry has tier, key, namespace, model, size,
        codec, stored_at, age_s and pinned."""
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise AdminError(f"offset must be an integer >= 0, got {offset!r}")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
            raise AdminError(f"limit must be an integer >= 0, got {limit!r}")
        limit = MAX_PAGE if limit is None else min(limit, MAX_PAGE)
        tiers = self._select(tier)
        match = _matcher(namespace, model)
        now = self.wall_clock()
        rows: list[dict[str, Any]] = []
        for t in tiers:
            rows.extend(self._entry_rows(t, match, now))
        page = rows[offset : offset + limit]
        end = offset + len(page)
        return {"entries": page, "total": len(rows), "offset": offset, "next_offset": end if end < len(rows) else None}

    # ------------------------------------------------------------ eviction
    def plan_evict(
        self,
        tier: str | None = None,
        *,
        keys: Sequence[str] | None = None,
        bytes: int | str | None = None,  # noqa: A002 - the API's field name
        older_than: float | str | None = None,
        all: bool = False,  # noqa: A002
        namespace: str | None = None,
        model: str | None = None,
    ) -> dict[str, Any]:
        """What an eviction would remove: ``{"evict": [{tier, key, size}], "skipped":
        [{tier, key, reason}], "bytes": total}``, victims in policy order per tier.

        Say what goes with exactly one of: ``keys``; ``bytes`` (free at least this much
        from one tier, in its eviction policy's order) and/or ``older_than`` (seconds, or
        a duration such as ``"1h"``); ``all``. ``namespace`` and ``model`` narrow any of
        them but ``keys``.
        """
        tiers = self._select(tier)
        nbytes, age = _check_selection(keys, bytes, older_than, all, namespace, model)
        if nbytes is not None and len(tiers) > 1:
            raise AdminError(
                "bytes needs a tier (eviction order is per tier); name one of: " + ", ".join(t.name for t in tiers)
            )
        victims: list[dict[str, Any]] = []
        skipped: list[dict[str, Any]] = []
        for t in tiers:
            t.refresh()  # a shared store: account for what peers wrote, so it can be evicted
        if keys is not None:
            for k in keys:
                parse_key(k)
            return _plan_keys(tiers, keys, tier)

        match = _matcher(namespace, model)
        now = self.wall_clock()
        for t in tiers:
            stored_at: dict[str, float | None] = {}
            if age is not None:
                stored_at = {e.key: e.stored_at for e, _ in t.entries()}
            freed = 0
            for k in t.eviction_order():
                if nbytes is not None and freed >= nbytes:
                    break
                if not match(k):
                    continue
                if age is not None:
                    ts = stored_at.get(k)
                    if ts is None or now - ts <= age:
                        continue
                size = t.size_of(k)
                if size is None:
                    continue
                victims.append({"tier": t.name, "key": k, "size": size})
                freed += size
            if nbytes is None:  # a full sweep: say which matching entries stay, and why
                chosen = {v["key"] for v in victims if v["tier"] == t.name}
                for e, _ in t.entries():
                    if e.key in chosen or not match(e.key):
                        continue
                    if age is not None and (e.stored_at is None or now - e.stored_at <= age):
                        continue
                    why = _why_not(t, e.key)
                    if why:
                        skipped.append({"tier": t.name, "key": e.key, "reason": why})
        return {"evict": victims, "skipped": skipped, "bytes": sum(v["size"] for v in victims)}

    def evict(self, tier: str | None = None, *, dry_run: bool = False, **selection: Any) -> dict[str, Any]:
        """Plan (see :meth:`plan_evict`) and, unless ``dry_run``, evict. Returns
        ``{"evicted": [{tier, key, size}], "skipped": [...], "bytes": freed, "dry_run": b}``."""
        plan = self.plan_evict(tier, **selection)
        if dry_run:
            return {"evicted": plan["evict"], "skipped": plan["skipped"], "bytes": plan["bytes"], "dry_run": True}
        done, skipped = self.evict_entries([(v["tier"], v["key"]) for v in plan["evict"]])
        return {"evicted": done, "skipped": plan["skipped"] + skipped,
                "bytes": sum(v["size"] for v in done), "dry_run": False}

    def evict_entries(
        self, entries: Iterable[tuple[str, str]]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Evict these ``(tier, key)`` entries; ``(evicted, skipped)`` as in :meth:`evict`."""
        by_tier: dict[str, list[str]] = {}
        for tname, key in entries:
            by_tier.setdefault(tname, []).append(key)
        done: list[dict[str, Any]] = []
        skipped: list[dict[str, Any]] = []
        for tname, keys in by_tier.items():
            t = self.tier(tname)
            ok, no = t.evict_keys(keys)
            done += [{"tier": tname, "key": k, "size": s} for k, s in ok]
            skipped += [{"tier": tname, "key": k, "reason": why} for k, why in no]
        return done, skipped

    def clear(
        self, tier: str | None = None, *, namespace: str | None = None, all: bool = False  # noqa: A002
    ) -> dict[str, Any]:
        """Empty ``tier`` (every tier with ``all=True``; of one namespace's entries only,
        with ``namespace``): drop the pins made through this admin, then evict every
        entry (entries that a lookup leased or a reader holds stay, reported as skipped).
        Nothing selected (no tier, no namespace, ``all`` false) is an :class:`AdminError`:
        an empty request never means "everything"."""
        if not isinstance(all, bool):
            raise AdminError(f"all must be true or false, got {all!r}")
        if tier is None and namespace is None and not all:
            raise AdminError("say what to clear: tier, namespace or all: true (an empty selection clears nothing)")
        tiers = self._select(tier)
        names = {t.name for t in tiers}
        match = _matcher(namespace, None)
        with self._lock:
            for tname, key in [p for p in self._pins if p[0] in names and match(p[1])]:
                self.tier(tname).unpin(key)
                self._pins.discard((tname, key))
        # (KV-event subscribers hear one BlockRemoved per evicted block, never
        # AllBlocksCleared: llm-d applies that to the whole pod, the engine's GPU blocks too)
        return self.evict(tier, all=True, namespace=namespace)

    # ------------------------------------------------------------ re-encoding
    def recode(
        self,
        tier: str,
        codec: str,
        *,
        keys: Sequence[str] | None = None,
        namespace: str | None = None,
        model: str | None = None,
        codec_options: Mapping[str, Any] | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Re-encode the entries of ``tier`` (all; or those of a namespace / model; or
        ``keys``, of which an empty list selects none) with ``codec`` (a name or an ``a+b`` chain; ``raw`` decompresses), each
        replaced atomically. Returns ``{"tier", "codec", "recoded": [{key, before,
        after}], "skipped": [{key, reason}], "bytes_before", "bytes_after", "dry_run"}``."""
        from .codecs import load_codec
        from .plugin_manager import get_registries

        t = self.tier(tier)
        if t.backend.holds_memory_objects:
            raise AdminError(f"tier {tier!r} holds chunks in memory, uncompressed; only byte tiers (disk, ...) can be re-encoded")
        try:
            chosen = load_codec(get_registries().codecs.load, codec, codec_options)
        except LMCacheError as exc:
            raise AdminError(f"codec {codec!r}: {exc}") from None
        except (ValueError, TypeError) as exc:
            raise AdminError(f"codec {codec!r}: {exc}") from None
        match = _matcher(namespace, model)
        t.refresh()
        if keys is not None:
            # an explicit list selects exactly its keys (none for an empty one: never
            # "everything"), still narrowed by namespace/model, so a caller scoped to one
            # namespace cannot reach another's entries through it
            if isinstance(keys, str) or not isinstance(keys, (list, tuple)):
                raise AdminError(f"keys must be a list of keys, got {keys!r}")
            for k in keys:
                parse_key(k)
            selected = [k for k in keys if match(k)]
        else:
            selected = [e.key for e, _ in t.entries() if match(e.key)]
        if dry_run:
            rows = [{"key": k, "before": t.size_of(k) or 0, "after": None} for k in selected]
            total = sum(r["before"] for r in rows)
            return {"tier": tier, "codec": getattr(chosen, "name", codec), "recoded": rows, "skipped": [],
                    "bytes_before": total, "bytes_after": None, "dry_run": True}
        done, skipped = _recode(t, selected, chosen)
        return {
            "tier": tier,
            "codec": getattr(chosen, "name", codec),
            "recoded": [{"key": k, "before": a, "after": b} for k, a, b in done],
            "skipped": [{"key": k, "reason": why} for k, why in skipped],
            "bytes_before": sum(a for _, a, _ in done),
            "bytes_after": sum(b for _, _, b in done),
            "dry_run": False,
        }

    # ------------------------------------------------------------ push (p2p)
    def push(self, target: str, *, tokens: Sequence[int] | None = None, keys: Sequence[str] | None = None,
             tier: str | None = None, target_tier: str | None = None, remove_source: bool | None = False,
             namespace: str | None = None) -> dict[str, Any]:
        """Send entries to another instance's peer endpoint (``target``: ``lm://host:port``
        or an instance id): the cached prefix of ``tokens``, or ``keys``, from ``tier``
        (default: whichever tier has them) into the target's ``target_tier``; with
        ``remove_source`` they are then evicted here. Answered when the target stored
        them (see :meth:`lmcache.engine.CacheEngine.push`). With ``namespace`` (a
        tenant's request) the target must be an instance id the controller registered in
        that namespace: an address is 403, another namespace's instance 404."""
        self._need_live("push")
        engine = self.engine
        if engine.p2p is None:
            raise AdminError("push needs the peer-to-peer part: this instance runs with p2p.enabled false")
        if (tokens is None) == (keys is None):
            raise AdminError("give the field 'tokens' or 'keys' (one of them)")
        if tokens is not None:
            for i, t in enumerate(tokens):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 1 << 63:
                    raise AdminError(f"field 'tokens'[{i}] must be a non-negative integer token id, got {t!r}")
        if keys is not None:
            for k in keys:
                parse_key(k)
        if tier is not None:
            self.tier(tier)
        try:
            return engine.p2p.push_prompt(tokens, target, keys=keys, tier=tier, target_tier=target_tier,
                                          remove_source=bool(remove_source), namespace=namespace)
        except ValueError as exc:  # an unresolvable target
            raise AdminError(str(exc)) from None
        except BackendError as exc:  # the target refused or did not answer
            err = AdminError(str(exc))
            err.status = 502  # type: ignore[attr-defined]
            raise err from None

    # ------------------------------------------------------------ pins
    def _need_live(self, what: str) -> None:
        if not self.live:
            raise AdminError(f"{what} needs a running instance (pins live in its memory); use --url")

    def pin(self, key: str, tier: str | None = None) -> dict[str, Any]:
        """Keep ``key`` from eviction in every tier that holds it (or in ``tier``) until
        :meth:`unpin`. Pinning twice is the same as once."""
        self._need_live("pin")
        parse_key(key)
        tiers = self._select(tier)
        pinned = []
        with self._lock:
            for t in tiers:
                if t.size_of(key) is None:
                    continue
                if (t.name, key) not in self._pins:
                    t.pin(key)
                    self._pins.add((t.name, key))
                pinned.append(t.name)
        if not pinned:
            where = f"tier {tier!r}" if tier is not None else "any tier"
            raise NotFoundError(f"key {key} is not in {where}")
        return {"key": key, "pinned": pinned}

    def unpin(self, key: str, tier: str | None = None) -> dict[str, Any]:
        """Undo :meth:`pin` (in ``tier`` only, if given). Unpinning a key that is not
        pinned changes nothing (``unpinned`` is empty)."""
        self._need_live("unpin")
        parse_key(key)
        tiers = self._select(tier)
        unpinned = []
        with self._lock:
            for t in tiers:
                if (t.name, key) in self._pins:
                    t.unpin(key)
                    self._pins.discard((t.name, key))
                    unpinned.append(t.name)
        return {"key": key, "unpinned": unpinned}

    def pins(self) -> list[dict[str, str]]:
        with self._lock:
            return [{"tier": t, "key": k} for t, k in sorted(self._pins)]



def _recode(t: Tier, keys: Sequence[str], codec: object) -> tuple[list[tuple[str, int, int]], list[tuple[str, str]]]:
    """Re-encode entries of tier ``t`` in place with ``codec``. Each entry is read (its
    checks pass or it is a miss), encoded anew and written over the old one atomically
    (:meth:`Tier.rewrite`), pinned while it is worked on; a larger encoding makes room by
    evicting others, or the entry is skipped. ``([(key, bytes before, bytes after)],
    [(key, why not)])``."""
    from . import payload

    if not t.backend.supports_bytes:
        raise AdminError(f"tier {t.name!r} ({t.cfg.backend}) does not store encoded bytes; only such tiers can be re-encoded")
    done: list[tuple[str, int, int]] = []
    skipped: list[tuple[str, str]] = []
    for key in keys:
        if t.size_of(key) is None:
            skipped.append((key, "not in this tier"))
            continue
        t.pin(key)
        try:
            obj = t.backend.get_one(key)
            if obj is None:
                skipped.append((key, "unreadable (removed as corrupt)"))
                continue
            try:
                bufs = payload.encode(key, obj, codec)  # type: ignore[arg-type]
            finally:
                obj.unref()
            result = t.rewrite(key, bufs)
            if isinstance(result, str):
                skipped.append((key, result))
            else:
                done.append((key, *result))
        except Exception as exc:
            skipped.append((key, f"{type(exc).__name__}: {exc}"))
        finally:
            t.unpin(key)
    return done, skipped
