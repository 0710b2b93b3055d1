#!/bin/sh
# Each remote backend's batch put/get next to its raw client doing the same transfers, in
# the same run, against a store started on loopback for the run; one JSON object per
# backend on stdout. Extra arguments are passed on, e.g.: benchmarks/backends.sh --values 8
set -e
for spec in "redis" "redis --store redis-cluster" "valkey" "valkey --store valkey-cluster" "s3" "fs" "mooncake" "lm"; do
  # $spec is left unquoted on purpose: it holds the backend and its --store option
  lmcache bench tiers --backend $spec --json "$@" | python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin)))'
done
