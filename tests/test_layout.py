"""The package's shape: test tooling stays out of the core, no import circles, and imports
that run one way: ``lmcache.demos`` -> ``lmcache.benchmarks`` -> ``lmcache.cli.console`` ->
the core. The command (``lmcache.cli``) imports neither the benchmarks nor the demos: they
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


def _imports(name: str, path: Path, mods: dict[str, Path], type_only: bool = False) -> set[str]:
    """Project modules ``name`` imports, at any depth (function-level imports count:
    they run), except under ``if TYPE_CHECKING:`` unless ``type_only`` (a type-only
    import ties two rooms together as much as one that runs)."""
    found: set[str] = set()
    is_pkg = path.name == "__init__.py"

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not type_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                subs = {f"{mod}.{a.name}" for a in child.names}
                found.update(subs)
                if not subs <= set(mods):  # `from pkg import submodule` imports the submodule
                    found.add(mod)
            visit(child)

    visit(ast.parse(path.read_text()))
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


def _room(name: str) -> str:
    return next((r for r in ("lmcache.cli", "lmcache.benchmarks", "lmcache.demos") if name.startswith(r)), "core")


#: who may import whom across rooms (a room always imports itself)
MAY_IMPORT = {
    "core": set(),
    "lmcache.cli": {"core"},
    "lmcache.benchmarks": {"core", "lmcache.cli.console"},
    "lmcache.demos": {"core", "lmcache.cli.console", "lmcache.benchmarks"},
}


def test_imports_run_one_way_demos_then_benchmarks_then_the_commands_console_then_core():
    """The core imports none of the front; the command imports neither the benchmarks nor
    the demos; the benchmarks import no demo, and of the command only its console."""
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
