#!/usr/bin/env bash
# Build the vLLM engine venv: VENV_DIR chains MAIN_VENV_DIR (torch, lmcache, ... come from
# there) and holds vLLM's own pins from requirements/vllm.txt. Idempotent.
# usage: requirements/setup-vllm.sh VENV_DIR MAIN_VENV_DIR
set -euo pipefail
venv=${1:?usage: setup-vllm.sh VENV_DIR MAIN_VENV_DIR}
main=${2:?usage: setup-vllm.sh VENV_DIR MAIN_VENV_DIR}
here=$(cd "$(dirname "$0")" && pwd)
main=$(cd "$main" && pwd)
base=$("$main/bin/python" -c 'import sys; print(sys._base_executable)')
main_site=$("$main/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ -x "$venv/bin/python" ] || "$base" -m venv "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$main_site')" > "$site/_lmcache_main.pth"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$here/vllm.txt"
"$venv/bin/python" -c 'import vllm.config, vllm.distributed.kv_transfer.kv_connector.v1.base, lmcache, torch'
