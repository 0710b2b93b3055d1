"""A Mooncake master on loopback, from the ``mooncake-transfer-engine`` wheel itself.

Why the wheel's own binary: ``mooncake_master`` ships inside the Python package (the
console script of the same name only ``exec``s it), so the master and the client always
come from the same release. The master runs with its built-in HTTP metadata server
(no etcd) and its HTTP admin server, all three on free loopback ports; it keeps
everything in memory, so a killed and restarted master comes back empty, and the clients
mount their segments again by themselves.

The client library links against ``libibverbs`` even for protocol ``tcp``;
:func:`ensure_client` installs Debian's ``libibverbs1`` when it is missing and we are
root (CI), and otherwise says how to get it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator

from . import INSTALL_SCRIPT, LocalServer, ServerUnavailable, Store, free_port, port_open

__all__ = ["mooncake_store", "ensure_client", "master_binary", "APT_PACKAGES"]

#: Debian packages the Mooncake client needs at run time
APT_PACKAGES = ("libibverbs1",)


def ensure_client() -> Any:
    """Import ``mooncake.store``, or raise :class:`ServerUnavailable` saying what is
    missing (the client loads ``libibverbs`` even for protocol tcp: :data:`APT_PACKAGES`,
    installed by ``requirements/install-test-servers.sh``)."""
    try:
        return importlib.import_module("mooncake.store")
    except ModuleNotFoundError as exc:
        raise ServerUnavailable(
            f"the Mooncake client is not installed ({exc}): pip install 'lmcache[mooncake]'"
        ) from None
    except ImportError as exc:
        if "libibverbs" not in str(exc):
            raise ServerUnavailable(f"the Mooncake client cannot be loaded: {exc}") from None
        raise ServerUnavailable(
            f"the Mooncake client needs libibverbs ({exc}): install it with "
            f"`apt-get install -y {' '.join(APT_PACKAGES)}` or `bash {INSTALL_SCRIPT}`, as root"
        ) from None


def master_binary() -> str:
    """The ``mooncake_master`` executable inside the installed wheel."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise ServerUnavailable("the Mooncake client is not installed: pip install 'lmcache[mooncake]'")
    for d in spec.submodule_search_locations:
        path = Path(d) / "mooncake_master"
        if path.is_file():
            if not os.access(path, os.X_OK):  # wheels do not always keep the mode bits
                path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            return str(path)
    raise ServerUnavailable("mooncake_master is not in the installed mooncake package")


@contextlib.contextmanager
def mooncake_store(
    *,
    global_segment_size: str | int = "1GiB",
    local_buffer_size: str | int = "256MiB",
    timeout: float | None = None,
    workdir: str | Path | None = None,
    start_timeout: float = 30.0,
    master_args: tuple[str, ...] = (),
) -> Iterator[Store]:
    """Start ``mooncake_master`` on free loopback ports and yield its :class:`Store`.

    ``store.options`` are exactly the ``mooncake`` backend options that reach it
    (``url``, ``metadata_server``, ``admin_url``, ``local_hostname``, the two segment
    sizes, and ``timeout`` when given); ``store.servers[0]`` is the master's
    :class:`LocalServer` (kill/restart it for fault tests: a restart listens on the same
    ports and starts empty). ``master_args`` are extra ``mooncake_master`` flags.
    Raises :class:`ServerUnavailable` when the client or the master is missing or does
    not start. The default sizes fit ``lmcache bench``'s workloads; the client maps
    them lazily, so they cost memory only as they fill.
    """
    ensure_client()  # the master comes from the same wheel; a client that cannot load is no use
    binary = master_binary()
    own = workdir is None
    root = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="lmcache-mooncake-"))
    rpc, meta, admin = free_port(), free_port(), free_port()
    while len({rpc, meta, admin}) < 3:
        meta, admin = free_port(), free_port()
    argv = [
        binary, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
        "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={meta}",
        "--metrics_host=127.0.0.1", f"--metrics_port={admin}",
        "--enable_metric_reporting=false", *master_args,
    ]
    server = LocalServer(
        "mooncake-master", argv, rpc, workdir=root, start_timeout=start_timeout,
        # the admin server comes up last (about a second after the RPC port)
        ready=lambda: port_open(rpc) and port_open(meta) and port_open(admin),
    )
    options: dict[str, Any] = {
        "url": f"mooncake://127.0.0.1:{rpc}",
        "metadata_server": f"http://127.0.0.1:{meta}/metadata",
        "admin_url": f"http://127.0.0.1:{admin}",
        "local_hostname": "127.0.0.1",
        "global_segment_size": global_segment_size,
        "local_buffer_size": local_buffer_size,
    }
    if timeout is not None:
        options["timeout"] = timeout
    try:
        server.start()
        yield Store("mooncake", options, [server], {"admin_port": admin, "metadata_port": meta})
    finally:
        server.close()
        if own:
            shutil.rmtree(root, ignore_errors=True)
