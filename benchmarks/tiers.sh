#!/bin/sh
# Throughput of the CPU and disk tiers next to memcpy and raw file I/O, as JSON on stdout.
# Extra arguments are passed on, e.g.: benchmarks/tiers.sh --layers 8 --dir /mnt/nvme/lmcache-bench
exec lmcache bench tiers --json --restart "$@"
