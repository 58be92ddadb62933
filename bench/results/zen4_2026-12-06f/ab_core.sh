#!/bin/bash
# Interleaved A/B of `mha bench --core ARGS`: ab_any.sh with --core put before ARGS. Per binary the
# median over rounds of each run's best time, its ratio to the first binary, and the median
# fraction of the same run's FMA peak.
# Usage: ab_core.sh ROUNDS "ARGS" BINARY...
exec bash "$(dirname "$0")/ab_any.sh" "$1" "--core $2" "${@:3}"
