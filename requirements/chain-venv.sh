#!/usr/bin/env bash
# Create (if absent) VENV_DIR as a venv that chains MAIN_VENV_DIR: the same base interpreter,
# and a .pth that adds the main venv's site-packages after VENV_DIR's own, so torch and
# lmcache come from the main venv while packages installed into VENV_DIR shadow its versions.
# Sourced by the engine setup scripts; sets $venv and $site.
# usage: source requirements/chain-venv.sh VENV_DIR MAIN_VENV_DIR
venv=${1:?usage: chain-venv.sh VENV_DIR MAIN_VENV_DIR}
main=${2:?usage: chain-venv.sh VENV_DIR MAIN_VENV_DIR}
main=$(cd "$main" && pwd)
base=$("$main/bin/python" -c 'import sys; print(sys._base_executable)')
main_site=$("$main/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ -x "$venv/bin/python" ] || "$base" -m venv "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$main_site')" > "$site/_lmcache_main.pth"
