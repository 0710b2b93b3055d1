#!/bin/sh
# Codecs and chains on real KV of SmolLM2-135M-Instruct (CPU): compression ratio, encode and
# decode GB/s, K/V error, and first-token / greedy agreement with the exact KV; JSON on stdout.
# Extra arguments are passed on, e.g.: benchmarks/codecs.sh --codec int4+zstd --group-size 32
exec lmcache bench codecs --json "$@"
