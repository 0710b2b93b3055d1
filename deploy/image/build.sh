#!/usr/bin/env bash
# `make image`: build the vLLM + lmcache CPU image without a registry, then print its size.
#   1. the base: a minbase Debian bookworm (python3, venv, CA certificates, libnuma) made by
#      mmdebstrap from the host's apt sources, kept as a tar in the cache and imported into
#      podman as localhost/lmcache-base:<hash of its inputs> (skipped when that tag exists);
#   2. the wheelhouse: every wheel of deploy/image/requirements-cpu.txt, built on the host
#      with the host's pip configuration, in the cache under wheels-<hash of that file>;
#   3. the image: `podman build --network=none` of the repository's Dockerfile with the
#      wheelhouse bind-mounted read-only at /wheelhouse (layers cached by podman's store).
# The cache is /var/cache/lmcache-image as root, ~/.cache/lmcache-image otherwise,
# $LMCACHE_IMAGE_CACHE if set. $LMCACHE_IMAGE names the image (default localhost/lmcache-vllm:cpu).
# usage: deploy/image/build.sh PYTHON   (a Python whose pip builds the wheels)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
py=${1:?usage: build.sh PYTHON}
image=${LMCACHE_IMAGE:-localhost/lmcache-vllm:cpu}
source "$root/deploy/image/podman-env.sh"
for tool in podman mmdebstrap runc; do
    command -v "$tool" >/dev/null || { echo "image: $tool is missing (as root on Debian: bash requirements/install-image-tools.sh)" >&2; exit 1; }
done
t0=$(date +%s)

# 1. base
suite=bookworm
pkgs=python3,python3-venv,ca-certificates,libnuma1,libstdc++6,passwd
base_key=$(printf '%s\n' "$suite" "$pkgs" minbase v1 | sha256sum | cut -c1-12)
base=localhost/lmcache-base:$base_key
if ! podman image exists "$base"; then
    tar="$cache/base-$base_key.tar"
    if [ ! -s "$tar" ]; then
        echo "image: making the base ($suite minbase: $pkgs) with mmdebstrap ..." >&2
        mmdebstrap --quiet --variant=minbase --include="$pkgs" "$suite" "$tar.partial.tar"
        mv -f "$tar.partial.tar" "$tar"
    fi
    podman import --quiet "$tar" "$base" >/dev/null
fi

# 2. wheelhouse
reqs="$root/deploy/image/requirements-cpu.txt"
build_reqs=(setuptools==78.1.1 wheel==0.45.1)
wh_key=$( (grep -v '^#' "$reqs"; printf '%s\n' "${build_reqs[@]}") | sha256sum | cut -c1-12)  # pins only
wh="$cache/wheels-$wh_key"
if [ ! -f "$wh/.complete" ]; then
    echo "image: building the wheelhouse $wh with the host's pip ..." >&2
    rm -rf "$wh.tmp"
    if ! "$py" -m pip wheel --quiet --no-deps --wheel-dir "$wh.tmp" -r "$reqs" "${build_reqs[@]}" \
            > "$cache/pip-wheel.log" 2>&1; then
        echo "image: pip wheel failed (log: $cache/pip-wheel.log):" >&2
        grep -v "^WARNING: Location" "$cache/pip-wheel.log" | tail -n 15 >&2
        exit 1
    fi
    touch "$wh.tmp/.complete"
    rm -rf "$wh"
    mv "$wh.tmp" "$wh"
fi
t1=$(date +%s)

# 3. the image, offline
podman build --network=none --layers --volume "$wh:/wheelhouse:ro" \
    --build-arg "BASE=$base" --target cpu --tag "$image" --file "$root/Dockerfile" "$root"
t2=$(date +%s)
size=$(podman image inspect --format '{{.Size}}' "$image")
echo "image: $image, $((size / 1048576)) MiB; base and wheels $((t1 - t0)) s, podman build $((t2 - t1)) s"
