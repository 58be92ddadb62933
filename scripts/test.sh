#!/usr/bin/env bash
# Every test: a Release build (unit, property, golden, PyTorch, CLI, conformance, CLI mutation, soak,
# install) and the same suite again under AddressSanitizer + UndefinedBehaviorSanitizer; then the
# concurrency test under ThreadSanitizer and the safetensors/weights fuzzer for a bounded time.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
fuzz_seconds=${MHA_FUZZ_SECONDS:-60}
# PyTorch is installed and its tests must run (not skip): the mha.torch drop-in against
# torch.nn.MultiheadAttention, and the goldens recomputed from their files (tests/golden/verify.py).
export MHA_REQUIRE_TORCH=1

echo "== Release build and tests ==" >&2
scripts/setup.sh build-test -DCMAKE_BUILD_TYPE=Release -DMHA_BUILD_BENCH=OFF
ctest --test-dir build-test --output-on-failure -j "$jobs"

echo "== AddressSanitizer + UndefinedBehaviorSanitizer build and tests ==" >&2
scripts/setup.sh build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_SANITIZE=ON -DMHA_BUILD_BENCH=OFF
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs"

echo "== ThreadSanitizer: one module shared by several threads ==" >&2
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_TSAN=ON -DMHA_BUILD_BENCH=OFF >/dev/null
cmake --build build-tsan --target test_concurrency -j "$jobs"
TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp:halt_on_error=1:second_deadlock_stack=1" \
  OMP_NUM_THREADS=1 build-tsan/tests/test_concurrency

echo "== libFuzzer: safetensors reader and weight loader, ${fuzz_seconds} s ==" >&2
scripts/fuzz.sh "$fuzz_seconds"
