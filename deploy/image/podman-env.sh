# Sourced by deploy/image/*.sh: the cache folder and podman's settings for this machine.
# Sets $cache (outside the clone, so a fresh clone on the same machine reuses it) and
# exports CONTAINERS_CONF: runc instead of crun (crun's setrlimit(RLIMIT_NOFILE) is refused
# here), open-file limits no higher than the hard limit we have, cgroupfs, events to a file.
if [ -n "${LMCACHE_IMAGE_CACHE:-}" ]; then
    cache=$LMCACHE_IMAGE_CACHE
elif [ "$(id -u)" = 0 ]; then
    cache=/var/cache/lmcache-image
else
    cache=${XDG_CACHE_HOME:-$HOME/.cache}/lmcache-image
fi
mkdir -p "$cache"
_nofile=$(ulimit -Hn)
[ "$_nofile" = unlimited ] && _nofile=1048576
cat > "$cache/containers.conf.tmp" <<CONF
[containers]
default_ulimits = ["nofile=${_nofile}:${_nofile}", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
mv -f "$cache/containers.conf.tmp" "$cache/containers.conf"
export CONTAINERS_CONF="$cache/containers.conf"
