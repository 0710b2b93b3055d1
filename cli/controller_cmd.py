"""``lmcache controller``: run the controller service and talk to it.

``serve`` runs the service in the foreground (its URL on stdout, logs on stderr); the
other commands call a running controller (``--url``, default ``$LMCACHE_CONTROLLER_URL``
or ``http://127.0.0.1:9000``; several replicas as ``--url http://a:9000,http://b:9000``) with ``--token`` (default ``$LMCACHE_CONTROLLER_TOKEN``).
Tokens are given as ``--tokens 1,2,3`` or ``--tokens-file FILE`` (a JSON list, or ids
separated by commas or spaces; ``-`` reads stdin).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from ._util import LMCacheGroup, note, out, print_json

app = typer.Typer(
    name="controller", add_completion=False, no_args_is_help=True,
    help="The controller: a global index of cached chunks for KV-aware routing, and admin commands to instances.",
)

DEFAULT_URL = "http://127.0.0.1:9000"

CtlUrlOpt = Annotated[
    str, typer.Option("--url", envvar="LMCACHE_CONTROLLER_URL", metavar="URL", show_envvar=False,
                      help="The controller, or several replicas comma-separated (tried in turn when one does not "
                           "answer or answers 502/503) (default: $LMCACHE_CONTROLLER_URL or http://127.0.0.1:9000).")
]
CtlTokenOpt = Annotated[
    str | None, typer.Option("--token", envvar="LMCACHE_CONTROLLER_TOKEN", metavar="TOKEN", show_default=False,
                             show_envvar=False, help="The controller's bearer token (default: $LMCACHE_CONTROLLER_TOKEN).")
]
TimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.05, metavar="SECONDS", help="Seconds to wait for the answer.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
TokensOpt = Annotated[
    str | None, typer.Option("--tokens", metavar="IDS", show_default=False, help="Token ids, comma-separated.")
]
TokensFileOpt = Annotated[
    Path | None, typer.Option("--tokens-file", metavar="FILE", show_default=False,
                              help="Token ids from a file (JSON list, or separated by commas/spaces; '-' is stdin).")
]
KeysOpt = Annotated[
    list[str] | None, typer.Option("--key", metavar="KEY", show_default=False, help="A chunk key (repeatable).")
]
InstanceArg = Annotated[str, typer.Argument(metavar="INSTANCE", help="An instance id, as 'instances' lists it.")]
TierOpt = Annotated[str | None, typer.Option("--tier", "-t", metavar="NAME", show_default=False, help="Only this tier.")]


def _client(url: str, token: str | None, timeout: float):
    from lmcache.plugins.services.controller_client import ControllerClient

    return ControllerClient(url, token, timeout)


def _parse_tokens(tokens: str | None, tokens_file: Path | None) -> list[int] | None:
    if tokens is not None and tokens_file is not None:
        raise typer.BadParameter("give --tokens or --tokens-file, not both", param_hint="'--tokens'")
    if tokens is None and tokens_file is None:
        return None
    if tokens_file is not None:
        text = sys.stdin.read() if str(tokens_file) == "-" else tokens_file.read_text()
        hint = "'--tokens-file'"
    else:
        text, hint = tokens or "", "'--tokens'"
    text = text.strip()
    try:
        if text.startswith("["):
            ids = json.loads(text)
            if not isinstance(ids, list):
                raise ValueError("not a list")
        else:
            ids = [int(t) for t in text.replace(",", " ").split()]
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError("token ids must be non-negative integers")
    except ValueError as exc:
        raise typer.BadParameter(f"not a list of token ids: {exc}", param_hint=hint) from None
    if not ids:
        raise typer.BadParameter("no token ids given", param_hint=hint)
    return ids


def _read_tenants(path: Path | None) -> dict[str, tuple[str, ...]]:
    """``--tenants-file``: a YAML (or JSON) mapping of namespace to token(s), checked."""
    if path is None:
        return {}
    import yaml

    from lmcache.auth import parse_tenants
    from lmcache.errors import ConfigError

    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc.strerror or exc}", param_hint="'--tenants-file'") from None
    except yaml.YAMLError as exc:
        raise typer.BadParameter(f"{path} is not YAML/JSON: {exc}", param_hint="'--tenants-file'") from None
    try:
        return parse_tenants("tenants", raw, str(path))
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--tenants-file'") from None


TenantsFileOpt = Annotated[
    Path | None, typer.Option("--tenants-file", metavar="FILE", show_default=False,
                              help="Tenant tokens, YAML or JSON {namespace: token | [tokens]}: each token sees and "
                                   "acts on its namespace's instances only (default: $LMCACHE_CONTROLLER_TENANTS_FILE).",
                              envvar="LMCACHE_CONTROLLER_TENANTS_FILE", show_envvar=False)
]
IndexOpt = Annotated[
    str, typer.Option("--index", envvar="LMCACHE_CONTROLLER_INDEX", metavar="URL", show_envvar=False,
                      help="Where the index lives: memory (this process), valkey://HOST:PORT\\[/DB], "
                           "valkey+sentinel://HOST:PORT\\[,...]/MASTER or valkey+cluster://HOST:PORT\\[,...] "
                           "(redis:// alike; password from $LMCACHE_CONTROLLER_INDEX_PASSWORD); with Valkey any "
                           "number of controllers serve the same instances (default: $LMCACHE_CONTROLLER_INDEX).")
]
AllowedHostsOpt = Annotated[
    list[str] | None, typer.Option("--allowed-host", metavar="NAME", show_default=False,
                                   help="A Host name the controller answers to besides IP addresses and localhost "
                                        "(repeatable; .domain for its subdomains, * for any). Checked when no "
                                        "token is set, and always once given (a guard against DNS rebinding).")
]
InstanceNetworksOpt = Annotated[
    list[str] | None, typer.Option("--instance-network", metavar="CIDR|NAME", show_default=False,
                                   help="Where registered instance APIs may be, besides the address each "
                                        "registration comes from (repeatable: a network such as 10.0.0.0/8, an "
                                        "address or a host name).")
]


def _check_serve_args(index: str, allowed_hosts: list[str] | None, instance_networks: list[str] | None) -> None:
    """``serve``'s --index, --allowed-host and --instance-network, each a BadParameter naming it."""
    if index != "memory":
        from lmcache.server.index_valkey import parse_url
        from lmcache.errors import ConfigError

        try:
            parse_url(index)
        except ConfigError as exc:
            raise typer.BadParameter(str(exc), param_hint="'--index'") from None
    from lmcache.server.reach import InstancePolicy
    from lmcache.server.http import check_allowed_hosts

    for check, values, hint in ((check_allowed_hosts, allowed_hosts, "'--allowed-host'"),
                                (InstancePolicy, instance_networks, "'--instance-network'")):
        try:
            check(values or ())
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint=hint) from None


@app.command("serve")
def serve(
    host: Annotated[str, typer.Option("--host", help="Address to listen on (loopback unless you say otherwise).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port (0 picks a free one).")] = 9000,
    token: CtlTokenOpt = None,
    instance_timeout: Annotated[
        float, typer.Option("--instance-timeout", min=0.1, metavar="SECONDS",
                            help="An instance without a heartbeat for this long drops out of lookups.")
    ] = 10.0,
    expire_after: Annotated[
        float | None, typer.Option("--expire-after", min=1.0, metavar="SECONDS", show_default=False,
                                   help="Forget a silent instance's keys after this long (default: max(300, 6 x timeout)).")
    ] = None,
    dispatch_timeout: Annotated[
        float, typer.Option("--dispatch-timeout", min=0.1, metavar="SECONDS",
                            help="Seconds to wait for an instance to answer a command.")
    ] = 30.0,
    request_timeout: Annotated[
        float, typer.Option("--request-timeout", min=0.1, metavar="SECONDS",
                            help="A client must send its whole request within this long, or is disconnected.")
    ] = 10.0,
    max_connections: Annotated[
        int, typer.Option("--max-connections", min=1, help="Connections served at once; one more is answered 503.")
    ] = 64,
    max_keys_per_instance: Annotated[
        int, typer.Option("--max-keys-per-instance", min=1,
                          help="Keys the index holds per instance; events beyond are answered 429.")
    ] = 100_000,
    max_instances_per_tenant: Annotated[
        int, typer.Option("--max-instances-per-tenant", min=1,
                          help="Instances a tenant token may register in its namespace; one more is answered 429.")
    ] = 16,
    tenants_file: TenantsFileOpt = None,
    index: IndexOpt = "memory",
    allowed_hosts: AllowedHostsOpt = None,
    instance_networks: InstanceNetworksOpt = None,
    write_openapi: Annotated[
        Path | None, typer.Option("--write-openapi", metavar="FILE", show_default=False,
                                  help="Write the OpenAPI document to FILE and exit.")
    ] = None,
) -> None:
    """Run the controller service until SIGTERM or Ctrl-C; its URL is printed on stdout."""
    from lmcache.server.controller import ControllerServer, openapi

    if write_openapi is not None:
        write_openapi.write_text(json.dumps(openapi(), indent=2) + "\n")
        note(f"wrote {write_openapi}")
        return
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tenants = _read_tenants(tenants_file)
    _check_serve_args(index, allowed_hosts, instance_networks)
    if host not in ("127.0.0.1", "localhost", "::1") and not token and not tenants:
        note(f"warning: listening on {host} without --token: anyone who can reach it can dispatch commands")
    server = ControllerServer(host, port, token=token, tenants=tenants, instance_timeout=instance_timeout,
                              expire_after=expire_after, dispatch_timeout=dispatch_timeout,
                              request_timeout=request_timeout, max_connections=max_connections,
                              max_keys_per_instance=max_keys_per_instance,
                              max_instances_per_tenant=max_instances_per_tenant, index=index,
                              allowed_hosts=tuple(allowed_hosts or ()), instance_networks=tuple(instance_networks or ()))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sys.stdout.write(server.url + "\n")
    sys.stdout.flush()
    try:
        stop.wait()
    finally:
        server.close()


@app.command("instances")
def instances(url: CtlUrlOpt = DEFAULT_URL, token: CtlTokenOpt = None, timeout: TimeoutOpt = 5.0,
              as_json: JsonOpt = False) -> None:
    """List registered instances: healthy or not, last heartbeat, tiers, keys indexed."""
    with _client(url, token, timeout) as c:
        rows = c.instances()
    if as_json:
        print_json(rows)
        return
    if not rows:
        note("no instances registered")
        return
    from rich.table import Table

    t = Table()
    for col in ("instance", "healthy", "last heartbeat", "api", "model", "tiers", "keys"):
        t.add_column(col, no_wrap=True)
    for r in rows:
        t.add_row(r["instance_id"], "yes" if r["healthy"] else "NO", f"{r['last_heartbeat_age_s']:.1f}s ago",
                  r["api_url"] or "-", r["model"], ", ".join(r["tiers"]), str(r["keys"]))
    out().print(t)


@app.command("lookup")
def lookup(
    tokens: TokensOpt = None,
    tokens_file: TokensFileOpt = None,
    hashes: Annotated[str | None, typer.Option("--hashes", metavar="HEX,...", show_default=False,
                                               help="Chunk hashes instead of tokens, comma-separated.")] = None,
    namespace: Annotated[str | None, typer.Option("--namespace", show_default=False, help="Only instances of this namespace.")] = None,
    model: Annotated[str | None, typer.Option("--model", show_default=False, help="Only instances of this model.")] = None,
    url: CtlUrlOpt = DEFAULT_URL,
    token: CtlTokenOpt = None,
    timeout: TimeoutOpt = 5.0,
    as_json: JsonOpt = False,
) -> None:
    """Which instances hold the longest cached prefix of these tokens (best first)."""
    ids = _parse_tokens(tokens, tokens_file)
    if (ids is None) == (hashes is None):
        raise typer.BadParameter("give --tokens, --tokens-file or --hashes", param_hint="'--tokens'")
    with _client(url, token, timeout) as c:
        r = c.lookup(ids, chunk_hashes=hashes.split(",") if hashes else None, namespace=namespace, model=model)
    if as_json:
        print_json(r)
        return
    if not r["results"]:
        note(f"no instance holds a prefix ({r['instances_considered']} healthy instances considered)")
        return
    for row in r["results"]:
        tiers = ", ".join(f"{k} {v}" for k, v in row["tiers"].items())
        out().print(f"{row['instance_id']}\t{row['hit_tokens']} tokens\t(tiers: {tiers})")


def _command(name: str, url: str, token: str | None, timeout: float, as_json: bool, **fields: Any) -> None:
    with _client(url, token, timeout) as c:
        r = c.command(name, **fields)
    if as_json:
        print_json(r)
        return
    res = r["result"]
    if name == "clear":
        out().print(f"{r['instance']}: evicted {len(res['evicted'])} entries ({res['bytes']} bytes), skipped {len(res['skipped'])}")
    elif name in ("pin", "unpin"):
        out().print(f"{r['instance']}: {name}ned {len(res[name + 'ned'])} keys, skipped {len(res['skipped'])}")
    else:
        out().print(f"{r['instance']}: re-encoded {len(res['recoded'])} entries of {r['tier']} with {res['codec']} "
                    f"({res['bytes_before']} -> {res['bytes_after']} bytes), skipped {len(res['skipped'])}")


@app.command("clear")
def clear(instance: InstanceArg, tier: TierOpt = None, tokens: TokensOpt = None, tokens_file: TokensFileOpt = None,
          key: KeysOpt = None, url: CtlUrlOpt = DEFAULT_URL, token: CtlTokenOpt = None, timeout: TimeoutOpt = 30.0,
          all_: Annotated[bool, typer.Option("--all", "-a", help="Every entry of every tier.")] = False,
          yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
          as_json: JsonOpt = False) -> None:
    """Evict an instance's entries: those of --tier, only the chunks of --tokens / --key, or --all."""
    from ._util import confirm

    ids = _parse_tokens(tokens, tokens_file)
    if ids is None and not key and tier is None and not all_:
        raise typer.BadParameter("say what to clear: --tier, --tokens, --key or --all",
                                 param_hint="'--tier' / '--tokens' / '--key' / '--all'")
    if ids is None and not key:
        confirm(f"Evict every entry of {instance}{f' tier {tier}' if tier else ''}?", yes=yes,
                what=f"clear {instance}")
    _command("clear", url, token, timeout, as_json, instance=instance, tier=tier, tokens=ids, keys=key or None,
             all=True if all_ else None)


@app.command("pin")
def pin(instance: InstanceArg, tier: TierOpt = None, tokens: TokensOpt = None, tokens_file: TokensFileOpt = None,
        key: KeysOpt = None, url: CtlUrlOpt = DEFAULT_URL, token: CtlTokenOpt = None, timeout: TimeoutOpt = 30.0,
        as_json: JsonOpt = False) -> None:
    """Pin the chunks of --tokens (or --key) in an instance so they are never evicted."""
    _command("pin", url, token, timeout, as_json, instance=instance, tier=tier,
             tokens=_parse_tokens(tokens, tokens_file), keys=key or None)


@app.command("unpin")
def unpin(instance: InstanceArg, tier: TierOpt = None, tokens: TokensOpt = None, tokens_file: TokensFileOpt = None,
          key: KeysOpt = None, url: CtlUrlOpt = DEFAULT_URL, token: CtlTokenOpt = None, timeout: TimeoutOpt = 30.0,
          as_json: JsonOpt = False) -> None:
    """Unpin the chunks of --tokens (or --key) in an instance."""
    _command("unpin", url, token, timeout, as_json, instance=instance, tier=tier,
             tokens=_parse_tokens(tokens, tokens_file), keys=key or None)


@app.command("compress")
def compress(instance: InstanceArg, tier: Annotated[str, typer.Option("--tier", "-t", metavar="NAME", help="A byte tier (disk, ...).")],
             codec: Annotated[str, typer.Option("--codec", metavar="NAME", help="Codec name or a+b chain.")] = "zstd",
             tokens: TokensOpt = None, tokens_file: TokensFileOpt = None, key: KeysOpt = None,
             url: CtlUrlOpt = DEFAULT_URL, token: CtlTokenOpt = None, timeout: TimeoutOpt = 120.0,
             as_json: JsonOpt = False) -> None:
    """Re-encode an instance's entries of a byte tier with a codec (all, or the chunks of --tokens)."""
    _command("compress", url, token, timeout, as_json, instance=instance, tier=tier, codec=codec,
             tokens=_parse_tokens(tokens, tokens_file), keys=key or None)


@app.command("decompress")
def decompress(instance: InstanceArg, tier: Annotated[str, typer.Option("--tier", "-t", metavar="NAME", help="A byte tier (disk, ...).")],
               tokens: TokensOpt = None, tokens_file: TokensFileOpt = None, key: KeysOpt = None,
               url: CtlUrlOpt = DEFAULT_URL, token: CtlTokenOpt = None, timeout: TimeoutOpt = 120.0,
               as_json: JsonOpt = False) -> None:
    """Re-encode an instance's entries of a byte tier without compression (codec raw)."""
    _command("decompress", url, token, timeout, as_json, instance=instance, tier=tier,
             tokens=_parse_tokens(tokens, tokens_file), keys=key or None)


@app.command("move")
def move(src_instance: Annotated[str, typer.Argument(metavar="SRC_INSTANCE")],
         src_tier: Annotated[str, typer.Argument(metavar="SRC_TIER")],
         dst_instance: Annotated[str, typer.Argument(metavar="DST_INSTANCE")],
         dst_tier: Annotated[str, typer.Argument(metavar="DST_TIER")],
         tokens: TokensOpt = None, tokens_file: TokensFileOpt = None, key: KeysOpt = None,
         remove_source: Annotated[bool, typer.Option("--remove-source", help="Evict the sent chunks from SRC_TIER afterwards.")] = False,
         url: CtlUrlOpt = DEFAULT_URL, token: CtlTokenOpt = None, timeout: TimeoutOpt = 120.0,
         as_json: JsonOpt = False) -> None:
    """Copy the chunks of --tokens (or --key) from an instance's tier into another instance's tier
    over the peer protocol (--remove-source: move them). Both need p2p enabled; the source its API."""
    ids = _parse_tokens(tokens, tokens_file)
    if ids is None and not key:
        raise typer.BadParameter("give --tokens, --tokens-file or --key", param_hint="'--tokens'")
    with _client(url, token, timeout) as c:
        r = c.command("move", src_instance=src_instance, src_tier=src_tier, dst_instance=dst_instance,
                      dst_tier=dst_tier, tokens=ids, keys=key or None, remove_source=remove_source or None)
    if as_json:
        print_json(r)
        return
    res = r["result"]
    out().print(f"{r['src_instance']}/{r['src_tier']} -> {r['dst_instance']}/{r['dst_tier']}: sent {len(res['pushed'])} "
                f"chunks ({res['bytes']} bytes), missing {len(res['missing'])}, removed from source {len(res['removed'])}")


def _standalone() -> None:
    """``python -m lmcache.cli.controller_cmd ...``: the sub-app on its own (same error
    handling as ``lmcache controller``)."""
    root = typer.Typer(cls=LMCacheGroup, add_completion=False, pretty_exceptions_enable=False)
    root.add_typer(app)
    root(prog_name="lmcache", args=["controller", *sys.argv[1:]])


if __name__ == "__main__":
    _standalone()


