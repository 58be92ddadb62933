#!/usr/bin/env bash
# The distributed-attention benchmark of the README: ring attention on 2 ranks × 1 thread against
# the single process on 2 threads (the same fused kernel), T = 16384 (3 interleaved repeats) and
# 65536 (REPEATS_LONG, default 1), causal and not; then an MPI ping-pong. One JSON object per line.
# Each rank's OpenMP runtime is held to one thread (OMP_NUM_THREADS=1) besides --threads 1.
# usage: bench/dist_bench.sh BUILD_DIR [REPEATS] [REPEATS_LONG] > results.jsonl
set -uo pipefail
build=${1:-build}
reps=${2:-3}
reps_long=${3:-1}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=passive
mpirun=(mpirun --oversubscribe --bind-to none --mca btl self,vader)
shape=(--embed-dim 512 --heads 8)
run() {  # seq causal_flag
  "$build/mha" bench --core --seq "$1" "${shape[@]}" $2 --threads 2 --repeat "$3" --json 2>/dev/null
  OMP_NUM_THREADS=1 "${mpirun[@]}" -np 2 "$build/mha" bench --parallel ring --seq "$1" "${shape[@]}" $2 --threads 1 --repeat "$3" --json 2>/dev/null
}
for ((i = 0; i < reps; ++i)); do
  run 16384 "" 3
  run 16384 --causal 3
done
for ((i = 0; i < reps_long; ++i)); do
  run 65536 "" 1
  run 65536 --causal 1
done
"${mpirun[@]}" -np 2 "$build/mha" bench --parallel pingpong --repeat 5 --json 2>/dev/null
