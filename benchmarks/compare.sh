#!/bin/sh
# lmcache and LMCache 0.5.6 side by side (tiers and lookup), as JSON on stdout. Needs the
# reference venv: make bench-compare. Extra arguments are passed on, e.g.: benchmarks/compare.sh --quick
exec lmcache bench compare --json "$@"
