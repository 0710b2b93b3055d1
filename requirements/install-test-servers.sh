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
set -euo pipefail

need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null || need+=(redis-tools)
command -v openssl >/dev/null || need+=(openssl)
libs=$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null || true)
[[ $libs == *"libibverbs.so.1 "* ]] || need+=(libibverbs1)
backports=()
command -v valkey-server >/dev/null || backports+=(valkey-server)
command -v valkey-cli >/dev/null || backports+=(valkey-tools)
nonfree=()
[[ $libs == *"libcuda.so.1 "* ]] || nonfree+=(libcuda1)

if [ ${#need[@]} -eq 0 ] && [ ${#backports[@]} -eq 0 ] && [ ${#nonfree[@]} -eq 0 ]; then
    exit 0
fi
missing="${need[*]} ${backports[*]} ${nonfree[*]}"
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install-test-servers: missing system packages:${missing}; as root on Debian run: bash $0" >&2
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
apt-get update -q >/dev/null
apt_install() { apt-get install -y -q --no-install-recommends "$@" >/dev/null; }
# each group on its own: one that cannot be installed (a mirror without non-free) must
# not keep the others out; the tests that need it then say what is missing
[ ${#need[@]} -eq 0 ] || apt_install "${need[@]}" || echo "install-test-servers: could not install ${need[*]}" >&2
[ ${#backports[@]} -eq 0 ] || apt_install -t "$codename-backports" "${backports[@]}" \
    || echo "install-test-servers: could not install ${backports[*]} from $codename-backports" >&2
[ ${#nonfree[@]} -eq 0 ] || apt_install "${nonfree[@]}" || echo "install-test-servers: could not install ${nonfree[*]}" >&2
