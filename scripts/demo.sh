#!/usr/bin/env bash
# The main job: build mha and walk through multi-head attention step by step.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build -DCMAKE_BUILD_TYPE=Release -DMHA_BUILD_TESTS=OFF -DMHA_BUILD_BENCH=OFF >&2
exec build/mha demo "$@"
