#!/usr/bin/env bash
# Every test: a Release build (unit, property, golden, CLI, conformance, install) and the same
# suite again under AddressSanitizer + UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

echo "== Release build and tests ==" >&2
scripts/setup.sh build-test -DCMAKE_BUILD_TYPE=Release -DMHA_BUILD_BENCH=OFF
ctest --test-dir build-test --output-on-failure -j "$jobs"

echo "== AddressSanitizer + UndefinedBehaviorSanitizer build and tests ==" >&2
scripts/setup.sh build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_SANITIZE=ON -DMHA_BUILD_BENCH=OFF
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs"
