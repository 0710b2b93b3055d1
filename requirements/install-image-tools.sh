#!/usr/bin/env bash
# Installs what `make image` needs to build and run the OCI image without a registry, on
# Debian (12, bookworm) as root: podman, buildah, runc (podman's default crun cannot run
# here: setrlimit RLIMIT_NOFILE is refused), catatonit (`podman run --init`), mmdebstrap (the base image, from the host's apt
# sources). Elsewhere it only says what is missing; `make test-image` then skips (fails under
# CI=true) naming it. apt-get waits up to $LMCACHE_APT_LOCK_TIMEOUT s (default 600) for the
# dpkg lock. Exits 1, naming the packages, when they cannot be installed.
set -euo pipefail

need=()
for tool in podman buildah runc mmdebstrap; do
    command -v "$tool" >/dev/null || need+=("$tool")
done
# `podman run --init` (without it `podman stop` waits, then SIGKILLs) runs catatonit
[ -x /usr/libexec/podman/catatonit ] || command -v catatonit >/dev/null || need+=(catatonit)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install-image-tools: missing ${need[*]}; as root on Debian run: bash $0" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt=(apt-get -q -o "DPkg::Lock::Timeout=${LMCACHE_APT_LOCK_TIMEOUT:-600}")
log=$(mktemp)
trap 'rm -f "$log"' EXIT
echo "install-image-tools: installing ${need[*]}" >&2
"${apt[@]}" update >"$log" 2>&1 || { echo "install-image-tools: apt-get update failed; trying the lists already here" >&2; tail -n 3 "$log" >&2; }
if ! "${apt[@]}" install -y --no-install-recommends "${need[@]}" >"$log" 2>&1; then
    echo "install-image-tools: FAILED to install ${need[*]}:" >&2
    tail -n 5 "$log" >&2
    exit 1
fi
