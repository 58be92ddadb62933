#!/usr/bin/env bash
# Fuzzes the safetensors reader and the weight loader (fuzz/fuzz_io.cpp) with libFuzzer under
# ASan + UBSan, for a bounded time.
# usage: scripts/fuzz.sh [SECONDS]     default 60; e.g. scripts/fuzz.sh 14400 for four hours
# Needs clang-14, libclang-rt-14-dev (the fuzzer runtime) and libomp-14-dev (scripts/setup.sh).
# Findings (crash-*, leak-*, oom-*, timeout-*) are written to build-fuzz/findings/; the corpus
# grows in build-fuzz/corpus/ and is kept between runs.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
build=build-fuzz

if [[ ! -f $build/CMakeCache.txt ]]; then
  CXX=clang++-14 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_FUZZ=ON \
    -DMHA_BUILD_TESTS=OFF -DMHA_BUILD_BENCH=OFF >/dev/null
fi
cmake --build "$build" --target mha_fuzz_io -j "$(nproc)"

# Seed corpus: the committed files under 64 KiB (golden cases and the shared conformance cases).
mkdir -p "$build/corpus" "$build/findings"
find tests/golden ../shared/conformance/cases -name '*.safetensors' -size -64k -exec cp -n {} "$build/corpus/" \; \
  2>/dev/null || true

echo "fuzz: running mha_fuzz_io for ${seconds} s on $(ls "$build/corpus" | wc -l) corpus files" >&2
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  "$build/fuzz/mha_fuzz_io" "$build/corpus" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
  -max_len=65536 -print_final_stats=1 -artifact_prefix="$build/findings/" 2>"$build/fuzz.log" || {
  tail -n 60 "$build/fuzz.log" >&2
  echo "fuzz: FAILED; the input is in $build/findings/" >&2
  exit 1
}
grep -E '^stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)' "$build/fuzz.log" >&2
