#!/bin/bash
# The run behind the README's Zen 4 tables (2026-12-06, 20:50 UTC): every step of bench/run_all.sh,
# outputs next to this script. usage: bash bench/results/zen4_2026-12-06h/run_all.sh
exec bash bench/run_all.sh "$(dirname "$0")" "$@"
