#!/usr/bin/env bash
# Build the reference LMCache venv of `lmcache bench compare`: PyPI's lmcache 0.5.6 with
# torch 2.13.0 (CPU) and only the packages its CPU storage path imports
# (requirements/lmcache-ref.txt, all with --no-deps). It is a venv of its own that never
# sees this repository's lmcache (same distribution name), nor does .venv see it. Idempotent.
# usage: requirements/setup-lmcache-ref.sh VENV_DIR
set -euo pipefail
venv=${1:?usage: setup-lmcache-ref.sh VENV_DIR}
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
venv=$(cd "$venv" && pwd)
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# the exact CPU build: a looser spec pulls a multi-GB CUDA build
"${pip[@]}" torch==2.13.0
"${pip[@]}" --no-deps -r "$here/lmcache-ref.txt"
# check in a neutral directory, isolated from the caller's paths
cd "$(mktemp -d)"
LMCACHE_LOG_LEVEL=ERROR "$venv/bin/python" -I -P -c '
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.v1.token_database import ChunkedTokenDatabase
import lmcache, torch
assert lmcache.__file__.startswith("'"$venv"'/"), lmcache.__file__
print("lmcache", __import__("importlib.metadata").metadata.version("lmcache"), "torch", torch.__version__)
'
