#!/bin/sh
# Throughput of the CPU and disk tiers next to memcpy and raw file I/O, as JSON on stdout:
# first a CPU tier above a disk tier (write-through), then each tier alone per chunk shape and
# number of concurrent requests (--matrix); one JSON document per line.
# Extra arguments go to the first run, e.g.: benchmarks/tiers.sh --layers 8 --dir /mnt/nvme/lmcache-bench
set -e
lmcache bench tiers --json --restart "$@" | python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin)))'
lmcache bench tiers --matrix --json | python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin)))'
