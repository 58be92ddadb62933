#!/bin/bash
# Many short sequences: `mha bench --core` at B=64, T=128/256/512 (causal and not, 1 and 2
# threads), the B=1 T=4096 core and the B=64 T=128 module, alternating two builds round by round
# so that a loaded machine hits both alike. One JSON line per run (the bench's own keys, with
# `bin`, `round`, `args`) on stdout; summarise fraction_of_peak and median_ms per args and bin.
# usage: bench/short_seqs.sh BEFORE_MHA AFTER_MHA [ROUNDS=2] > runs.jsonl
#        /usr/bin/python3 bench/summarize_runs.py runs.jsonl   (the table: medians, ratios)
set -euo pipefail
before=$1 after=$2 rounds=${3:-2}
configs=()
for t in 128 256 512; do
  for mask in "" "--causal"; do
    for th in 1 2; do configs+=("--core --batch 64 --seq $t --embed-dim 512 --heads 8 --threads $th $mask"); done
  done
done
for mask in "" "--causal"; do
  for th in 1 2; do configs+=("--core --batch 1 --seq 4096 --embed-dim 512 --heads 8 --threads $th $mask"); done
done
configs+=("--batch 64 --seq 128 --embed-dim 512 --heads 8 --threads 2")
for r in $(seq 1 "$rounds"); do
  for cfg in "${configs[@]}"; do
    for which in before after; do
      bin=$before
      [ "$which" = after ] && bin=$after
      # shellcheck disable=SC2086  # cfg is a list of arguments
      j=$("$bin" bench $cfg --repeat 3 --json --sgemm-size 256 --bw-mib 16 2>/dev/null)
      echo "{\"bin\":\"$which\",\"round\":$r,\"args\":\"$cfg\",${j#\{}"
    done
  done
done
