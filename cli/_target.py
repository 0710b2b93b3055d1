"""Which cache instance a command works on: a live one (``--url``) or a config's
persisted tiers opened directly (``--config``). Without either, ``$LMCACHE_API_URL``
names a live instance, else ``$LMCACHE_CONFIG_FILE`` a config.

Both give an object with the methods of :class:`lmcache.admin.Admin`
(:class:`lmcache.plugins.services.api_client.ApiClient` for ``--url``), so each command is written once.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Annotated, Any, Iterator

import typer

from ._util import CLIError, err, note

UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url", metavar="URL", show_default=False,
        help="A running instance's API, e.g. http://127.0.0.1:8000 (default: $LMCACHE_API_URL, unless --config is given).",
    ),
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token", envvar="LMCACHE_API_TOKEN", metavar="TOKEN", show_default=False,
        help="The instance API's bearer token (default: $LMCACHE_API_TOKEN).", show_envvar=False,
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", metavar="FILE", show_default=False,
        help="Work offline on the persisted tiers (e.g. disk) of this config (default: $LMCACHE_CONFIG_FILE).",
    ),
]
TimeoutOpt = Annotated[
    float,
    typer.Option("--timeout", min=0.05, metavar="SECONDS", help="Seconds to wait for each HTTP call to --url."),
]
TierOpt = Annotated[str | None, typer.Option("--tier", "-t", metavar="NAME", help="Only this tier.", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]

DEFAULT_TIMEOUT = 5.0


def config_path(config: Path | None) -> Path | None:
    if config is not None:
        return config
    env = os.environ.get("LMCACHE_CONFIG_FILE")
    return Path(env) if env else None


@contextlib.contextmanager
def open_target(
    url: str | None,
    token: str | None,
    config: Path | None,
    timeout: float = DEFAULT_TIMEOUT,
    *,
    write: bool = False,
    tier: str | None = None,
    live_only: str | None = None,
) -> Iterator[Any]:
    """The instance to work on. Offline, only the config's persisted tiers are opened
    (``tier``: only that one), read-only unless ``write``. ``live_only`` names a command
    that needs ``--url``."""
    if url is not None and config is not None:
        raise typer.BadParameter("give --url (a running instance) or --config (its files), not both",
                                 param_hint="'--url' / '--config'")
    if url is None and config is None:
        url = os.environ.get("LMCACHE_API_URL") or None
    if url is not None:
        from lmcache.plugins.services.api_client import ApiClient

        with ApiClient(url, token, timeout) as client:
            yield client
        return
    if live_only:
        raise CLIError(f"{live_only} needs a running instance: give --url http://HOST:PORT")
    path = config_path(config)
    if path is None:
        raise CLIError(
            "say which instance: --url http://HOST:PORT (a running engine's API) "
            "or --config FILE (the persisted tiers of its config)"
        )
    from lmcache.admin import Admin
    from lmcache.config import load_config

    cfg = load_config(path)
    console = err()
    status = console.status(f"opening the tiers of {path}", spinner="dots") if console.is_terminal else None
    with status or contextlib.nullcontext():
        admin = Admin.open_config(cfg, read_only=not write, tier=tier)
    try:
        for name, why in admin.skipped_tiers:
            note(f"tier {name!r} is not shown: {why}")
        yield admin
    finally:
        admin.close()
