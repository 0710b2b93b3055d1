#!/bin/sh
# Time to first token of SmolLM2-135M-Instruct on the CPU: full prefill vs cpu-tier hit vs
# disk-tier hit, with memcpy and raw file reads measured in the same run; JSON on stdout.
# Extra arguments are passed on, e.g.: benchmarks/e2e.sh --lengths 1024,2048 --plot ttft.png
exec lmcache bench e2e --json "$@"
