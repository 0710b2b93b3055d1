#!/usr/bin/env bash
# Build the vLLM engine venv: VENV_DIR chains MAIN_VENV_DIR (torch, lmcache, ... come from
# there) and holds vLLM's own pins from requirements/vllm.txt. Idempotent.
# usage: requirements/setup-vllm.sh VENV_DIR MAIN_VENV_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/chain-venv.sh" "$@"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$here/vllm.txt"
"$venv/bin/python" -c 'import vllm.config, vllm.distributed.kv_transfer.kv_connector.v1.base, lmcache, torch'
