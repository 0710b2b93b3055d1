"""``lmcache plugin new NAME --kind KIND``: start a plugin package that passes its tests as
written.

It writes ``DIR/lmcache-NAME/``: a ``pyproject.toml`` with the ``lmcache`` entry point, the
package ``lmcache_NAME`` (the hook module and a minimal but real implementation of the
kind), tests that run lmcache's conformance suite through lmcache's pytest plugin, and a
README saying how to install, test and publish it. The templates are in
:mod:`lmcache.cli.plugin_templates` and :mod:`lmcache.cli.plugin_kinds`.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path
from string import Template
from typing import Annotated

import typer

from . import plugin_kinds, plugin_templates
from ._util import note

app = typer.Typer(help="Start a plugin package (lmcache plugins lists the installed ones).", no_args_is_help=True,
                  add_completion=False)

KIND_NAMES = tuple(plugin_kinds.KINDS)
#: a registered name: lower case, words joined by one '-' or '_' (also a distribution and module suffix)
NAME_RE = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")
MAX_NAME = 40


def registered_name(name: str) -> str:
    """The registered name for what the user typed: PyPI's plugins are named
    ``lmcache-NAME``, so ``lmcache-foo`` (or ``lmcache_foo``) means the plugin ``foo`` in the
    package ``lmcache-foo``, never ``lmcache-lmcache-foo``."""
    for prefix in ("lmcache-", "lmcache_"):
        if name.startswith(prefix) and len(name) > len(prefix):
            return name[len(prefix):]
    return name


def check_name(name: str, kind: str) -> None:
    """Refuse (``typer.BadParameter``, exit 2) a name that cannot be a package and a
    registered name of ``kind``, or one that a plugin of this environment registers already."""
    if not NAME_RE.match(name) or len(name) > MAX_NAME:
        raise typer.BadParameter(
            f"{name!r} is not a plugin name: use lower-case letters and digits, words joined by '-' or '_', "
            f"starting with a letter, at most {MAX_NAME} characters (e.g. 'my-store')",
            param_hint="'NAME'",
        )
    from lmcache.plugin_manager import get_registries

    registry = getattr(get_registries(), plugin_kinds.KINDS[kind].registry)
    if name in registry:
        raise typer.BadParameter(
            f"a {kind} named {name!r} is registered already (by plugin {registry.entry(name).plugin!r}); pick another name",
            param_hint="'NAME'",
        )


def render(name: str, kind: str) -> dict[str, str]:
    """The files of the package for ``name`` of ``kind``, by path relative to the package
    directory."""
    k = plugin_kinds.KINDS[kind]
    from lmcache import __version__

    module = "lmcache_" + name.replace("-", "_")
    cls = "".join(part.capitalize() for part in re.split(r"[-_]", name))
    values = {
        "name": name,
        "module": module,
        "dist": f"lmcache-{name}",
        "cls": cls,
        "kind": kind,
        "lmcache_version": __version__,
        "hook": k.hook,
        "registry": k.registry,
        "impl_module": k.impl_module,
        "impl_class": cls + k.impl_suffix,
        "impl_pad": " " * max(1, 13 - len(k.impl_module)),
        "suite": k.suite,
        "summary": k.summary,
        "description": k.description,
    }
    values["usage"] = Template(k.usage).substitute(values)

    def fill(text: str) -> str:
        return Template(text).substitute(values)

    return {
        "pyproject.toml": fill(plugin_templates.PYPROJECT),
        "README.md": fill(plugin_templates.README),
        ".gitignore": plugin_templates.GITIGNORE,
        f"{module}/__init__.py": fill(plugin_templates.INIT),
        f"{module}/plugin.py": fill(plugin_templates.PLUGIN),
        f"{module}/{k.impl_module}.py": fill(k.module),
        "tests/conftest.py": plugin_templates.CONFTEST,
        f"tests/test_{module}.py": fill(k.tests) + fill(plugin_templates.DISCOVERY_TEST),
    }


def write_package(name: str, kind: str, directory: Path) -> Path:
    """Write the package into ``directory/lmcache-NAME`` and return that path. Nothing is
    written unless all of it is: the files go to a temporary folder beside it, renamed into
    place at the end; an existing package directory is refused (exit 2). A name that
    starts with ``lmcache-`` is the package's name (see :func:`registered_name`)."""
    name = registered_name(name)
    check_name(name, kind)
    target = directory / f"lmcache-{name}"
    if target.exists() or target.is_symlink():
        raise typer.BadParameter(f"{target} exists already; remove it or choose another --dir", param_hint="'NAME'")
    if not directory.is_dir():
        raise typer.BadParameter(f"{directory} is not a directory", param_hint="'--dir'")
    files = render(name, kind)
    tmp = directory / f".lmcache-{name}.{uuid.uuid4().hex}.tmp"
    tmp.mkdir()
    try:
        for rel, text in files.items():
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        os.rename(tmp, target)  # fails if the target appeared meanwhile: nothing is replaced
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


@app.command("new")
def new(
    name: Annotated[str, typer.Argument(help="The plugin's registered name, e.g. 'my-store' (package lmcache-my-store); "
                                             "'lmcache-my-store' means the same.")],
    kind: Annotated[str, typer.Option("--kind", help=f"What it adds: {', '.join(KIND_NAMES)}.")],
    directory: Annotated[Path, typer.Option("--dir", help="Where to create lmcache-NAME/.")] = Path("."),
) -> None:
    """Write a ready plugin package DIR/lmcache-NAME: pyproject with the entry point, a working module, tests, README.

    The package passes its own tests as written: pip install -e DIR/lmcache-NAME, then pytest there.
    """
    if kind not in plugin_kinds.KINDS:
        raise typer.BadParameter(f"must be one of {', '.join(KIND_NAMES)}; got {kind!r}", param_hint="'--kind'")
    target = write_package(name, kind, directory)
    typer.echo(str(target))
    note(f"wrote a {kind} plugin package registering {registered_name(name)!r}; "
         f"next: pip install -e {target} && (cd {target} && pytest)")
