#!/bin/sh
# Controller lookup latency next to a trivial HTTP round trip, then peer-to-peer fetch GB/s
# next to raw loopback TCP between the same two processes; one JSON document per line.
# Extra arguments go to the controller lookup bench, e.g.: benchmarks/distributed.sh --instances 8 --count 5000
set -e
lmcache bench controller --json "$@" | python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin)))'
lmcache bench p2p --json | python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin)))'
