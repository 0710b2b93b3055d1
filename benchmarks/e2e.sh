#!/bin/sh
# Time to first token of SmolLM2-135M-Instruct on the CPU: full prefill vs cpu-tier hit vs
# disk-tier hit, with memcpy and raw file reads measured in the same run; then the
# multi-round QA workload (4 users x 4 rounds, shared system prompt, growing history) with
# and without lmcache, next to the ideal TTFT; one JSON document per line.
# Extra arguments go to the TTFT run, e.g.: benchmarks/e2e.sh --lengths 1024,2048 --plot ttft.png
set -e
lmcache bench e2e --json "$@" | python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin)))'
lmcache bench e2e --workload qa --json | python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin)))'
