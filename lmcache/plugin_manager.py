"""Plugin manager and typed registries.

Built-in plugins are the modules in :data:`DEFAULT_PLUGINS`; third-party plugins are
entry points in the group ``lmcache``. Both register through the hooks in
:mod:`lmcache.hookspecs`. Environment controls:

- ``LMCACHE_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points (built-ins still load);
- ``LMCACHE_PLUGINS=a,b``: load only these entry points;
- ``LMCACHE_DISABLED_PLUGINS=a,b``: never load these plugins (built-ins included).
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable

import pluggy

from . import hookspecs
from .errors import MissingDependencyError, PluginError, UnknownPluginError

ENTRY_POINT_GROUP = "lmcache"

#: Built-in plugins, registered exactly as third-party ones are (and also declared as
#: entry points in lmcache's own metadata; they are loaded once).
DEFAULT_PLUGINS: tuple[str, ...] = (
    "lmcache.backends.builtin",
    "lmcache.plugins.codecs.builtin",
    "lmcache.plugins.connectors.builtin",
    "lmcache.policies",
)

KINDS = {
    "backend": "lmcache_register_backends",
    "codec": "lmcache_register_codecs",
    "connector": "lmcache_register_connectors",
    "policy": "lmcache_register_policies",
}


@dataclass
class Entry:
    """One registered plugin target."""

    kind: str
    name: str
    target: str | type
    plugin: str
    extra: str | None = None
    description: str = ""
    _loaded: Any = field(default=None, repr=False)


class Registry:
    """Name -> ``"module:Class"`` targets of one plugin kind; imports on first use."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._current_plugin = "<direct>"
        self._lock = threading.Lock()

    def add(
        self,
        name: str,
        target: str | type,
        *,
        extra: str | None = None,
        description: str = "",
    ) -> None:
        """Register ``target`` (a ``"module:Class"`` string or a class) as ``name``."""
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {self._current_plugin!r} registered a {self.kind} with an empty name")
        if self.kind == "codec" and "+" in name:
            raise PluginError(
                f"plugin {self._current_plugin!r} registered codec {name!r}; codec names may not contain '+', "
                "which joins the names of a chain (int8+zstd)"
            )
        if isinstance(target, str) and ":" not in target:
            raise PluginError(
                f"plugin {self._current_plugin!r} registered {self.kind} {name!r} as {target!r}; "
                "expected 'package.module:Class'"
            )
        old = self._entries.get(name)
        if old is not None:
            raise PluginError(
                f"{self.kind} name {name!r} is registered twice: by plugin {old.plugin!r} "
                f"({_describe(old.target)}) and by plugin {self._current_plugin!r} "
                f"({_describe(target)}); disable one with LMCACHE_DISABLED_PLUGINS"
            )
        self._entries[name] = Entry(self.kind, name, target, self._current_plugin, extra, description)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            raise UnknownPluginError(f"unknown {self.kind} {name!r}; registered {self.kind}s: {known}") from None

    def load(self, name: str) -> Any:
        """Return the class registered as ``name``, importing it if needed."""
        e = self.entry(name)
        with self._lock:
            if e._loaded is None:
                e._loaded = _import_target(e)
            return e._loaded


def _describe(target: str | type) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def _import_target(e: Entry) -> Any:
    if not isinstance(e.target, str):
        return e.target
    mod_name, _, attr = e.target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or "?"
        # the target module itself missing inside a package that exists: a wrong path in
        # the plugin, not a missing optional dependency
        own = missing == mod_name and "." in mod_name
        if e.extra and not own:
            hint = f"pip install 'lmcache[{e.extra}]'" if "." not in e.extra and "/" not in e.extra else f"pip install {e.extra}"
            raise MissingDependencyError(
                f"{e.kind} {e.name!r} needs the Python package {missing!r}, which is not installed; "
                f"install it with: {hint}"
            ) from exc
        raise MissingDependencyError(
            f"{e.kind} {e.name!r} (from plugin {e.plugin!r}) cannot be imported: no module named {missing!r}"
        ) from exc
    try:
        obj: Any = mod
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise PluginError(f"{e.kind} {e.name!r}: module {mod_name!r} has no attribute {attr!r}") from None
    return obj


def _env_list(environ: dict[str, str] | os._Environ, name: str) -> set[str] | None:
    raw = environ.get(name)
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def create_plugin_manager(
    autoload: bool | None = None,
    blocked: Iterable[str] = (),
    *,
    environ: dict[str, str] | None = None,
) -> pluggy.PluginManager:
    """Build a plugin manager with the built-ins and (unless disabled) entry points.

    ``autoload=None`` follows ``LMCACHE_DISABLE_PLUGIN_AUTOLOAD``. ``blocked`` adds to
    ``LMCACHE_DISABLED_PLUGINS``. Nothing is loaded at import time of lmcache.
    """
    env = os.environ if environ is None else environ
    if autoload is None:
        autoload = env.get("LMCACHE_DISABLE_PLUGIN_AUTOLOAD", "").lower() not in ("1", "true", "yes")
    disabled = set(blocked) | (_env_list(env, "LMCACHE_DISABLED_PLUGINS") or set())
    allow = _env_list(env, "LMCACHE_PLUGINS")

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    eps = list(md.entry_points(group=ENTRY_POINT_GROUP))
    # a built-in may be named by its module or by its entry-point name
    aliases = {ep.name: ep.value.split(":")[0] for ep in eps if ep.value.split(":")[0] in DEFAULT_PLUGINS}
    for name in disabled:
        pm.set_blocked(aliases.get(name, name))
    for mod_name in DEFAULT_PLUGINS:
        if pm.is_blocked(mod_name):
            continue
        pm.register(importlib.import_module(mod_name), name=mod_name)
    if autoload:
        for ep in eps:
            if pm.is_blocked(ep.name) or pm.get_plugin(ep.name) is not None:
                continue
            if ep.value.split(":")[0] in DEFAULT_PLUGINS:
                continue  # a built-in, already registered under its module name
            if allow is not None and ep.name not in allow:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                dist = ep.dist.name if ep.dist else "?"
                raise PluginError(
                    f"plugin {ep.name!r} (entry point {ep.value!r} of package {dist!r}) failed to load: {exc}"
                ) from exc
            if pm.is_registered(plugin):
                continue
            pm.register(plugin, name=ep.name)
            dist = getattr(ep, "dist", None)
            if dist is not None:
                _DISTS[ep.name] = (dist.name, dist.version)
    pm.check_pending()
    return pm


_DISTS: dict[str, tuple[str, str]] = {}


def plugin_source(plugin_name: str) -> tuple[str, str]:
    """(distribution, version) that provides a plugin."""
    if plugin_name in _DISTS:
        return _DISTS[plugin_name]
    if plugin_name in DEFAULT_PLUGINS or plugin_name.startswith("lmcache."):
        try:
            return ("lmcache", md.version("lmcache"))
        except md.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
            return ("lmcache", "unknown")
    return ("<unknown>", "")


class Registries:
    """The four registries, filled by calling each plugin's hooks one plugin at a time
    (so that a duplicate name can name both plugins)."""

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm
        self.backends = Registry("backend")
        self.codecs = Registry("codec")
        self.connectors = Registry("connector")
        self.policies = Registry("policy")
        by_kind = {
            "backend": self.backends,
            "codec": self.codecs,
            "connector": self.connectors,
            "policy": self.policies,
        }
        for kind, hook_name in KINDS.items():
            reg = by_kind[kind]
            hook = getattr(pm.hook, hook_name)
            for impl in reversed(hook.get_hookimpls()):  # registration order
                reg._current_plugin = impl.plugin_name
                impl.function(registry=reg)
            reg._current_plugin = "<direct>"

    def hooks_of(self, plugin_name: str) -> list[str]:
        plugin = self.pm.get_plugin(plugin_name)
        return sorted(h.name for h in self.pm.get_hookcallers(plugin) or [])


_default: Registries | None = None
_default_lock = threading.Lock()


def get_registries(refresh: bool = False) -> Registries:
    """The process-wide registries, built on first call from :func:`create_plugin_manager`."""
    global _default
    with _default_lock:
        if _default is None or refresh:
            _default = Registries(create_plugin_manager())
        return _default


__all__ = [
    "DEFAULT_PLUGINS",
    "ENTRY_POINT_GROUP",
    "Entry",
    "Registry",
    "Registries",
    "create_plugin_manager",
    "get_registries",
    "plugin_source",
]
