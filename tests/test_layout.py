"""The package's shape: test tooling stays out of the core, no import circles, and imports
that run one way: ``lmcache.demos`` -> ``lmcache.benchmarks`` -> ``lmcache.cli.console`` ->
the core; the servers (``lmcache.server``) stand apart from the engine, joined to it at
three faces. The command (``lmcache.cli``) imports neither the benchmarks nor the demos: they
plug into it as entry points of the group ``lmcache.commands``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: folders of the core, as installed (pyproject's package-dir)
CORE = {"lmcache": ROOT / "lmcache", "lmcache.backends": ROOT / "backends", "lmcache.plugins": ROOT / "plugins",
        "lmcache.kernels": ROOT / "kernels"}
#: the front: the command and the benchmarks and demos plugged into it (their .py files;
#: benchmarks/ also holds plain scripts in subfolders, e.g. compare/lmcache_ref.py, that are
#: no modules)
FRONT = {"lmcache.cli": ROOT / "cli", "lmcache.benchmarks": ROOT / "benchmarks", "lmcache.demos": ROOT / "demos"}


def _modules(folders: dict[str, Path] | None = None) -> dict[str, Path]:
    out = {}
    for pkg, folder in (folders or CORE).items():
        for f in (folder.glob("*.py") if folders is FRONT else folder.rglob("*.py")):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = f
    return out


def _statements(name: str, path: Path, type_only: bool = False) -> list[tuple[str, list[str]]]:
    """Each import in module ``name`` as ``(module, names)``, relative ones resolved
    (``import m``: ``(m, [])``), at any depth (function-level imports count: they run),
    except under ``if TYPE_CHECKING:`` unless ``type_only``."""
    out: list[tuple[str, list[str]]] = []
    is_pkg = path.name == "__init__.py"

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not type_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, []) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                out.append((mod, [a.name for a in child.names]))
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def _imports(name: str, path: Path, mods: dict[str, Path], type_only: bool = False) -> set[str]:
    """Project modules ``name`` imports (see :func:`_statements`; a type-only import ties
    two rooms together as much as one that runs)."""
    found: set[str] = set()
    for mod, names in _statements(name, path, type_only):
        subs = {f"{mod}.{n}" for n in names}
        found.update(subs)
        if not names or not subs <= set(mods):  # `from pkg import submodule` imports the submodule
            found.add(mod)
    return {m for m in found if m in mods and m != name}


def test_the_core_never_imports_the_test_tooling():
    mods = _modules()
    offenders = sorted(
        f"{name} imports {dep}"
        for name, path in mods.items() if not name.startswith("lmcache.testing")
        for dep in _imports(name, path, mods) if dep.startswith("lmcache.testing")
    )
    assert not offenders, offenders


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strongconnect(v)
    return circles


def test_no_import_circles_in_the_core_type_only_imports_included():
    mods = _modules()
    circles = _circles({name: _imports(name, path, mods, type_only=True) for name, path in mods.items()})
    assert not circles, circles


def test_no_import_circles_in_the_cli_and_benchmarks():
    mods = _modules(FRONT)
    circles = _circles({name: _imports(name, path, mods, type_only=True) for name, path in mods.items()})
    assert not circles, circles


ROOMS = ("lmcache.server", "lmcache.cli", "lmcache.benchmarks", "lmcache.demos")


def _room(name: str) -> str:
    return next((r for r in ROOMS if name == r or name.startswith(r + ".")), "core")


#: the servers' faces: what the engine's side may use of ``lmcache.server`` (the instance
#: API's HTTP layer, the cache server the P2P endpoint embeds, the tier fields the
#: controller worker reports)
SERVER_FACES = {"lmcache.server.http", "lmcache.server.cache", "lmcache.server.limits"}
#: what ``lmcache.server`` may use of the core: the shared vocabulary, never the engine
SERVER_USES = {"lmcache", "lmcache.errors", "lmcache.auth", "lmcache.keys", "lmcache.wire", "lmcache.web",
               "lmcache.redact", "lmcache.plugin_manager", "lmcache.plugins.services.api_client"}

#: who may import whom across rooms (a room always imports itself): rooms, or single modules
MAY_IMPORT = {
    "core": SERVER_FACES,
    "lmcache.server": SERVER_USES,
    "lmcache.cli": {"core", "lmcache.server"},
    "lmcache.benchmarks": {"core", "lmcache.server", "lmcache.cli.console"},
    "lmcache.demos": {"core", "lmcache.server", "lmcache.cli.console", "lmcache.benchmarks"},
}


def test_imports_run_one_way_demos_then_benchmarks_then_the_commands_console_then_core():
    """The core imports none of the front and of the servers only their faces; the servers
    import of the core only its shared vocabulary; the command imports neither the
    benchmarks nor the demos; the benchmarks import no demo, and of the command only its
    console."""
    core, front = _modules(), _modules(FRONT)
    both = {**core, **front}
    offenders = []
    for name, path in both.items():
        room = _room(name)
        for dep in _imports(name, path, both, type_only=True):
            dep_room = _room(dep)
            if dep_room != room and dep_room not in MAY_IMPORT[room] and dep not in MAY_IMPORT[room]:
                offenders.append(f"{name} imports {dep}")
    assert not sorted(offenders), sorted(offenders)


def test_the_benchmarks_and_demos_plug_into_the_command_by_entry_point():
    """``lmcache bench`` and ``lmcache demo`` are the entry points the package declares in
    the group ``lmcache.commands``, the same way a third-party package adds a command."""
    from lmcache.cli.plugged import entry_points

    eps = entry_points()
    assert {n: eps[n].value for n in ("bench", "demo")} == {
        "bench": "lmcache.benchmarks.commands:app", "demo": "lmcache.demos.commands:app"}


def test_every_error_lmcache_defines_is_an_lmcache_error():
    """One tree: a caller catches ``LMCacheError`` and gets every error raised on purpose."""
    import importlib

    from lmcache.errors import LMCacheError

    stray = []
    for name in _modules():
        if name.startswith("lmcache.testing") or name.endswith(("connectors.vllm", "connectors.sglang")):
            continue
        try:
            mod = importlib.import_module(name)
        except ImportError:  # an optional dependency (kvikio, triton, ...) that is absent
            continue
        for attr, obj in vars(mod).items():
            if (isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == name
                    and not attr.startswith("_") and not issubclass(obj, LMCacheError)):
                stray.append(f"{name}.{attr}")
    assert not stray, stray


def test_the_servers_load_no_engine_and_no_torch():
    """``lmcache server`` and ``lmcache controller`` run without an engine: importing every
    module of ``lmcache.server`` loads neither torch nor any engine module."""
    import subprocess
    import sys

    mods = sorted(m for m in _modules() if _room(m) == "lmcache.server")
    code = ("import importlib, json, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lmcache'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    import json

    loaded = json.loads(out)
    assert "torch" not in loaded, loaded
    # besides the shared vocabulary: the packages it lives in, and what ``import lmcache`` runs
    allowed = SERVER_USES | {m.rsplit(".", i)[0] for m in SERVER_USES for i in range(1, m.count(".") + 1)}
    allowed |= {"lmcache.hookspecs"}
    engine = [m for m in loaded if m.startswith("lmcache") and _room(m) != "lmcache.server" and m not in allowed]
    assert not engine, engine


def test_every_import_of_the_project_names_a_module_it_has():
    """A module moved between rooms leaves no import behind (function-level ones
    included, which run only when called)."""
    mods = {**_modules(), **_modules(FRONT)}
    missing = sorted(f"{name}: {mod}" for name, path in mods.items()
                     for mod, _ in _statements(name, path, type_only=True)
                     if mod.split(".")[0] == "lmcache" and mod not in mods)
    assert not missing, missing
