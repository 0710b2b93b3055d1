"""``lmcache dashboard``: the address of the operator page (the controller's ``/``), checked.

The page is public (it holds no data) and asks for the token itself, keeping it in the
browser tab's memory; so the printed URL never carries a token, and a URL given with
credentials in it is refused rather than printed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer

from ._target import ConfigOpt, config_path
from ._util import CLIError, note, print_json

app = typer.Typer(add_completion=False)

DEFAULT_URL = "http://127.0.0.1:9000"


def page_urls(controller: str | None, config: Path | None) -> list[str]:
    """The page's URLs, one per controller replica: ``--controller``, else
    ``$LMCACHE_CONTROLLER_URL``, else the config's ``controller.url``, else the default
    controller address (each a URL or a comma-separated list); each as
    ``scheme://host:port/`` (a path, query or fragment is dropped; credentials refused)."""
    url = controller or os.environ.get("LMCACHE_CONTROLLER_URL") or None
    if url is None:
        path = config_path(config)
        if path is not None:
            from lmcache.config import load_config

            url = load_config(path).controller.url or None
    return [_page(u.strip()) for u in (url or DEFAULT_URL).split(",")]


def page_url(controller: str | None, config: Path | None) -> str:
    """The first of :func:`page_urls`."""
    return page_urls(controller, config)[0]


def _page(url: str) -> str:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise CLIError(f"not a controller URL: {url!r} (bad port)") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CLIError(f"not a controller URL: {url!r} (expected http://HOST:PORT)")
    if parts.username or parts.password:
        raise CLIError("the controller URL holds credentials: give it without them (the page asks for the token)")
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    return f"{parts.scheme}://{host}{'' if port is None else f':{port}'}/"


@app.command("dashboard")
def dashboard(
    controller: Annotated[
        str | None, typer.Option("--controller", metavar="URL", show_default=False,
                                 help="The controller (default: $LMCACHE_CONTROLLER_URL, the config's controller.url, "
                                      f"or {DEFAULT_URL}).")
    ] = None,
    config: ConfigOpt = None,
    token: Annotated[
        str | None, typer.Option("--token", envvar="LMCACHE_CONTROLLER_TOKEN", metavar="TOKEN", show_default=False,
                                 show_envvar=False, help="Only to report the instance counts; never put in the URL "
                                                         "(default: $LMCACHE_CONTROLLER_TOKEN).")
    ] = None,
    check: Annotated[bool, typer.Option("--check/--no-check", help="Check that the controller serves the page.")] = True,
    timeout: Annotated[float, typer.Option("--timeout", min=0.05, metavar="SECONDS", help="Seconds to wait.")] = 5.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Print the URL of the operator page (the controller's web page) to open in a browser."""
    urls = page_urls(controller, config)
    url = urls[0]
    info: dict[str, object] = {"url": url, "checked": False}
    if check:
        from lmcache.plugins.services.controller_client import ControllerClient
        from lmcache.errors import AdminError, AuthError, UnreachableError

        for i, url in enumerate(urls):  # replicas: the first that serves the page
            base = url.rstrip("/")
            try:
                with ControllerClient(base, None, timeout) as anon:
                    page = anon.request("GET", "/")
                break
            except (UnreachableError, AdminError) as exc:
                if i == len(urls) - 1:
                    more = f" (nor {len(urls) - 1} other URLs)" if len(urls) > 1 else ""
                    raise CLIError(f"the controller at {base} does not answer: {exc}{more} "
                                   "(start it with: lmcache controller serve)") from None
        info["url"] = url
        if not isinstance(page, str) or "/static/app.js" not in page:
            raise CLIError(f"{base} answered, but not with the lmcache operator page (an lmcache controller of this version?)")
        info["checked"] = True
        try:
            with ControllerClient(base, token, timeout) as client:
                h = client.health()
            info.update(version=h.get("version"), instances=h.get("instances"), healthy_instances=h.get("healthy_instances"))
            note(f"controller {h.get('version')}: {h.get('healthy_instances')} of {h.get('instances')} instances healthy")
        except AuthError:
            note("the controller wants a token: type it into the page (it stays in that browser tab)")
        except (UnreachableError, AdminError) as exc:
            note(f"the page is served, but /v1/health failed: {exc}")
    if as_json:
        print_json(info)
    else:
        typer.echo(url)
