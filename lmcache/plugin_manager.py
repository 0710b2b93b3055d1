"""Plugin manager and typed registries.

Built-in plugins are the modules in :data:`DEFAULT_PLUGINS`; third-party plugins are
entry points in the group ``lmcache``. Both register through the hooks in
:mod:`lmcache.hookspecs`. Environment controls:

- ``LMCACHE_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points (built-ins still load);
- ``LMCACHE_PLUGINS=a,b``: load only these entry points;
- ``LMCACHE_DISABLED_PLUGINS=a,b``: never load these plugins (built-ins included); an
  item ``kind:name`` (``backend:s3``, ``codec:fp8``) drops that one registered name and
  keeps the rest of its plugin.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import inspect
import logging
import os
import shlex
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable

import pluggy

from . import hookspecs
from .errors import MissingDependencyError, PluginError, UnknownPluginError

ENTRY_POINT_GROUP = "lmcache"
log = logging.getLogger(__name__)

#: Built-in plugins, registered exactly as third-party ones are (and also declared as
#: entry points in lmcache's own metadata; they are loaded once).
DEFAULT_PLUGINS: tuple[str, ...] = (
    "lmcache.backends.builtin",
    "lmcache.plugins.codecs.builtin",
    "lmcache.plugins.connectors.builtin",
    "lmcache.plugins.policies",
    "lmcache.kernels.builtin",
    "lmcache.plugins.services.builtin",
)

KINDS = {
    "backend": "lmcache_register_backends",
    "codec": "lmcache_register_codecs",
    "connector": "lmcache_register_connectors",
    "policy": "lmcache_register_policies",
    "layout": "lmcache_register_layouts",
    "service": "lmcache_register_services",
    "channel": "lmcache_register_channels",
    "baseline": "lmcache_register_bench_baselines",
    "launcher": "lmcache_register_store_launchers",
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
    requires: str | None = None
    _loaded: Any = field(default=None, repr=False)


class Registry:
    """Name -> ``"module:Class"`` targets of one plugin kind; imports on first use."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._current_plugin = "<direct>"
        self._lock = threading.Lock()
        self._dropped: set[tuple[str, str]] = set()

    def add(
        self,
        name: str,
        target: str | type,
        *,
        extra: str | None = None,
        requires: str | None = None,
        description: str = "",
    ) -> None:
        """Register ``target`` (a ``"module:Class"`` string or a class) as ``name``.

        If importing ``target`` fails for a missing package, the error says how to install
        it: ``requires`` is a pip requirement (``"fancy-kv>=1.0"``), printed quoted as
        ``pip install 'fancy-kv>=1.0'``; ``extra`` is an extra of the package that provides
        the plugin (``pip install 'lmcache[s3]'`` for a built-in, ``'<your package>[extra]'``
        for a third-party plugin)."""
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {self._current_plugin!r} registered a {self.kind} with an empty name")
        if self.kind == "codec" and "+" in name:
            raise PluginError(
                f"plugin {self._current_plugin!r} registered codec {name!r}; codec names may not contain '+', "
                "which joins the names of a chain (int8+zstd)"
            )
        for label, value in (("extra", extra), ("requires", requires), ("description", description)):
            if value is not None and not isinstance(value, str):
                raise PluginError(
                    f"plugin {self._current_plugin!r} registered {self.kind} {name!r} with {label}={value!r}; "
                    "expected a string"
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
        if (self.kind, name) in self._dropped:
            return  # LMCACHE_DISABLED_PLUGINS names this one target
        self._entries[name] = Entry(self.kind, name, target, self._current_plugin, extra, description, requires)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]

    def in_order(self) -> list[Entry]:
        """The entries in registration order (plugin by plugin; services start in it)."""
        return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            plural = "policies" if self.kind == "policy" else f"{self.kind}s"
            hint = "" if (self.kind, name) not in self._dropped else " (disabled by LMCACHE_DISABLED_PLUGINS)"
            raise UnknownPluginError(f"unknown {self.kind} {name!r}{hint}; registered {plural}: {known}") from None

    def load(self, name: str) -> Any:
        """Return the class registered as ``name``, importing it if needed."""
        e = self.entry(name)
        with self._lock:
            if e._loaded is None:
                e._loaded = _import_target(e)
            return e._loaded

    def missing(self, name: str, exc: ModuleNotFoundError) -> MissingDependencyError:
        """The error for a module missing while ``name``'s class is built (a client
        library the plugin imports lazily, in ``__init__``): the same one-line
        :class:`MissingDependencyError`, with its ``requires``/``extra`` hint, as for one
        missing when the target is imported."""
        return _missing(self.entry(name), exc)


def _describe(target: str | type) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def _install_hint(e: Entry) -> str | None:
    """How to install what ``e`` needs, as a shell command (``None``: nothing declared)."""
    if e.requires:
        return f"pip install {shlex.quote(e.requires)}"
    if not e.extra:
        return None
    if e.plugin in DEFAULT_PLUGINS or e.plugin.startswith("lmcache.") or e.plugin == "<direct>":
        return f"pip install {shlex.quote(f'lmcache[{e.extra}]')}"
    dist = plugin_source(e.plugin)[0]
    if dist.startswith("<"):
        return f"pip install {shlex.quote(e.extra)}"  # no package known: the extra names what to install
    return f"pip install {shlex.quote(f'{dist}[{e.extra}]')}"


def _missing(e: Entry, exc: ModuleNotFoundError, *, hint: bool = True) -> MissingDependencyError:
    """The one-line error for ``e`` missing the module ``exc`` names, with the install
    hint of its ``requires``/``extra`` when there is one."""
    missing = exc.name or "?"
    how = _install_hint(e) if hint else None
    if how is not None:
        return MissingDependencyError(
            f"{e.kind} {e.name!r} (from plugin {e.plugin!r}) needs the Python package {missing!r}, "
            f"which is not installed; install it with: {how}"
        )
    return MissingDependencyError(
        f"{e.kind} {e.name!r} (from plugin {e.plugin!r}) cannot be imported: no module named {missing!r}"
    )


def _import_target(e: Entry) -> Any:
    if not isinstance(e.target, str):
        return e.target
    mod_name, _, attr = e.target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        # the target module itself missing inside a package that exists: a wrong path in
        # the plugin, not a missing optional dependency
        own = exc.name == mod_name and "." in mod_name
        raise _missing(e, exc, hint=not own) from exc
    try:
        obj: Any = mod
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise PluginError(
            f"{e.kind} {e.name!r} (from plugin {e.plugin!r}): module {mod_name!r} has no attribute {attr!r}"
        ) from None
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
    dropped = _dropped_targets(disabled)
    disabled -= {f"{k}:{n}" for k, n in dropped}
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
        _register(pm, importlib.import_module(mod_name), mod_name)
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
            dist = getattr(ep, "dist", None)
            if dist is not None:
                _DISTS[ep.name] = (dist.name, dist.version)
            _register(pm, plugin, ep.name)
    _check_pending(pm)
    pm._lmcache_dropped = dropped  # type: ignore[attr-defined]  # read by Registries
    return pm


def _dropped_targets(disabled: set[str]) -> set[tuple[str, str]]:
    """The ``kind:name`` items of ``LMCACHE_DISABLED_PLUGINS`` (one registered target each)."""
    out = set()
    for item in disabled:
        kind, sep, name = item.partition(":")
        if sep and kind in KINDS and name:
            out.add((kind, name))
    return out


def _register(pm: pluggy.PluginManager, plugin: Any, name: str) -> None:
    """Register ``plugin``; a hook function with wrong arguments is a one-line
    :class:`PluginError` naming the plugin and the hook, and an ``lmcache_*`` function
    without ``@hookimpl`` (which pluggy ignores) is warned about."""
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        hook = _hook_named_in(plugin, str(exc))
        fn = getattr(plugin, hook, None) if hook else None
        try:
            params = ", ".join(inspect.signature(fn).parameters) if fn is not None else "?"
        except (TypeError, ValueError):  # pragma: no cover - not introspectable
            params = "?"
        raise PluginError(
            f"plugin {name!r}: hook {hook or '?'} must take exactly the argument 'registry' "
            f"(def {hook or 'lmcache_register_...'}(registry)), it takes ({params})"
        ) from None
    for attr in dir(plugin):
        if not attr.startswith("lmcache_") or not callable(getattr(plugin, attr, None)):
            continue
        if pm.parse_hookimpl_opts(plugin, attr) is None:
            log.warning(
                "plugin %r: %s is not decorated with @lmcache.hookimpl and is ignored; decorate it to register",
                name, attr,
            )


def _hook_named_in(plugin: Any, message: str) -> str | None:
    for attr in dir(plugin):
        if attr.startswith("lmcache_") and attr in message:
            return attr
    return None


def _check_pending(pm: pluggy.PluginManager) -> None:
    """A hook implementation no spec matches (a misspelled name): one line naming the
    plugin, the hook and the closest real hook."""
    for name in pm.hook.__dict__:
        if name.startswith("_"):
            continue
        caller = getattr(pm.hook, name)
        if caller.spec is not None:
            continue
        for impl in caller.get_hookimpls():
            if impl.optionalhook:
                continue
            close = difflib.get_close_matches(name, list(KINDS.values()), n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; lmcache's hooks: {', '.join(KINDS.values())}"
            raise PluginError(f"plugin {impl.plugin_name!r} implements unknown hook {name!r}{hint}")


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
    """The registries (one per plugin kind), filled by calling each plugin's hooks one plugin at a time
    (so that a duplicate name can name both plugins)."""

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm
        self.backends = Registry("backend")
        self.codecs = Registry("codec")
        self.connectors = Registry("connector")
        self.policies = Registry("policy")
        self.layouts = Registry("layout")
        self.services = Registry("service")
        #: transfer channels of PD (:mod:`lmcache.transfer`)
        self.channels = Registry("channel")
        #: raw-client baselines of ``lmcache bench tiers --backend`` (:mod:`lmcache.benchmarks.raw_baselines`)
        self.baselines = Registry("baseline")
        #: loopback store launchers of tests and ``lmcache bench tiers`` (:mod:`lmcache.testing.stores`)
        self.launchers = Registry("launcher")
        by_kind = {
            "backend": self.backends,
            "codec": self.codecs,
            "connector": self.connectors,
            "policy": self.policies,
            "layout": self.layouts,
            "service": self.services,
            "channel": self.channels,
            "baseline": self.baselines,
            "launcher": self.launchers,
        }
        _check_pending(pm)  # also for plugins registered on ``pm`` by hand
        dropped = getattr(pm, "_lmcache_dropped", set())
        for kind, hook_name in KINDS.items():
            reg = by_kind[kind]
            reg._dropped = {d for d in dropped if d[0] == kind}
            hook = getattr(pm.hook, hook_name)
            plugins = [(impl.plugin_name, impl.plugin) for impl in hook.get_hookimpls()]  # registration order
            for plugin_name, plugin in plugins:
                reg._current_plugin = plugin_name
                # through pluggy (wrappers and hook options apply), one plugin at a time so
                # that a duplicate name can name both plugins
                others = [p for n, p in plugins if n != plugin_name]
                try:
                    pm.subset_hook_caller(hook_name, remove_plugins=others)(registry=reg)
                except PluginError:
                    raise
                except Exception as exc:
                    raise PluginError(
                        f"plugin {plugin_name!r}: hook {hook_name} failed: {type(exc).__name__}: {exc}"
                    ) from exc
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
