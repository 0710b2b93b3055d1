#!/usr/bin/env bash
# Installs the system packages the test suite's real servers and clients need, on Debian
# (12, bookworm) as root; `make test` runs it. Elsewhere it only says what is missing:
# the tests then fail under CI=true and skip elsewhere, naming what to install.
#
#   redis-server, redis-tools            Redis and redis-cli (redis, cluster, sentinel tests)
#   valkey-server, valkey-tools          Valkey, from bookworm-backports
#   openssl                              self-signed certificates for the TLS tests
#   libibverbs1                          the Mooncake client loads it even for protocol tcp
#   libcuda1 (contrib non-free)          lets kvikio import for the gds tests (no GPU needed)
#   chromium, chromium-driver            headless Chromium and its WebDriver for the operator
#                                        page's browser tests (tests/web, driven with selenium)
#
#   bash requirements/install-test-servers.sh [PACKAGE...]
#
# With PACKAGEs, installs exactly those (from the suites above) the same way. apt-get waits
# up to $LMCACHE_APT_LOCK_TIMEOUT seconds (default 600) for another apt/dpkg to let go of
# the dpkg lock. A package that cannot be installed is named on stderr and the script
# exits 1 (after trying the other groups): the tests that need it would fail under CI=true.
set -euo pipefail

need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null || need+=(redis-tools)
command -v openssl >/dev/null || need+=(openssl)
libs=$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null || true)
[[ $libs == *"libibverbs.so.1 "* ]] || need+=(libibverbs1)
command -v chromium >/dev/null || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)
backports=()
command -v valkey-server >/dev/null || backports+=(valkey-server)
command -v valkey-cli >/dev/null || backports+=(valkey-tools)
nonfree=()
[[ $libs == *"libcuda.so.1 "* ]] || nonfree+=(libcuda1)
if [ $# -gt 0 ]; then  # exactly what the caller named
    need=("$@") backports=() nonfree=()
fi

if [ ${#need[@]} -eq 0 ] && [ ${#backports[@]} -eq 0 ] && [ ${#nonfree[@]} -eq 0 ]; then
    exit 0
fi
missing=$(echo "${need[*]}" "${backports[*]}" "${nonfree[*]}" | xargs)
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install-test-servers: missing system packages: ${missing}; as root on Debian run: bash $0" >&2
    exit 0
fi

codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
source_entry() {  # name suites components
    local f="/etc/apt/sources.list.d/lmcache-$1.sources"
    [ -e "$f" ] || printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: %s\nComponents: %s\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' "$2" "$3" > "$f"
}
[ ${#backports[@]} -eq 0 ] || source_entry "$codename-backports" "$codename-backports" main
[ ${#nonfree[@]} -eq 0 ] || source_entry "$codename-contrib-non-free" "$codename" "contrib non-free"

export DEBIAN_FRONTEND=noninteractive
lock_timeout=${LMCACHE_APT_LOCK_TIMEOUT:-600}
apt=(apt-get -q -o "DPkg::Lock::Timeout=$lock_timeout")
log=$(mktemp)
trap 'rm -f "$log"' EXIT
echo "install-test-servers: installing ${missing} (apt waits up to ${lock_timeout}s for the dpkg lock)" >&2
"${apt[@]}" update >"$log" 2>&1 \
    || { echo "install-test-servers: apt-get update failed; trying the package lists already here:" >&2; tail -n 3 "$log" >&2; }
failed=()
apt_install() {  # a label for messages, then apt-get install's arguments
    local what=$1
    shift
    if ! "${apt[@]}" install -y --no-install-recommends "$@" >"$log" 2>&1; then
        echo "install-test-servers: could not install ${what}:" >&2
        tail -n 5 "$log" >&2
        failed+=("$what")
    fi
}
# each group on its own: one that cannot be installed (a mirror without non-free) does not
# keep the others out; the script still exits 1 at the end, naming it
[ ${#need[@]} -eq 0 ] || apt_install "${need[*]}" "${need[@]}"
[ ${#backports[@]} -eq 0 ] || apt_install "${backports[*]} (from $codename-backports)" -t "$codename-backports" "${backports[@]}"
[ ${#nonfree[@]} -eq 0 ] || apt_install "${nonfree[*]} (contrib non-free)" "${nonfree[@]}"
if [ ${#failed[@]} -gt 0 ]; then
    printf -v names '%s; ' "${failed[@]}"
    echo "install-test-servers: FAILED to install: ${names%; } (the tests that need them fail under CI=true)" >&2
    exit 1
fi
