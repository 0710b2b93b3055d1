#!/bin/sh
# Chunk hashing and prefix lookup in the engine (1k-128k-token prompts; the index holding
# just the prompt, then 1M other chunks), next to the raw hash of the same bytes and a dict
# lookup of as many keys measured in the same run; one JSON document.
# Extra arguments go to the bench, e.g.: benchmarks/lookup.sh --input numpy --plot lookup.png
exec lmcache bench lookup --json "$@"
