#!/bin/bash
# Every row of issue 15's and 17's tables on this machine at the current build, one after another
# (each step interleaves mha with its anchor itself). Run from the repository root with a quiet
# machine; outputs land in OUT_DIR.
#   usage: bash bench/run_all.sh OUT_DIR [STEP...]
#   steps: anchors core backward short bf16 decode weights (default: all). MHA=path picks the binary.
# On a CPU without bf16 dot products (AVX2) bf16 runs at float32's speed: leave out bf16 there
# (core_suite's bf16 rows say the same in a few minutes).
set -euo pipefail
out=${1:?usage: bash bench/run_all.sh OUT_DIR [STEP...]}
shift
steps=${*:-anchors core backward short bf16 decode weights}
mkdir -p "$out"
mha=${MHA:-build/mha}
stamp() { date -u +%H:%M; }
want() { [[ " $steps " == *" $1 "* ]]; }
if want anchors; then
  echo "anchors $(stamp)" >&2
  /usr/bin/python3 bench/compare.py anchors --rounds 3 --repeat 4 --versions 2 --mha "$mha" > "$out/anchors.txt"
  cp bench/results/anchors.json "$out/anchors.json"
  git checkout -- bench/results/anchors.json  # compare.py writes there; the committed file is an older run
fi
if want core; then
  echo "core suite $(stamp)" >&2
  /usr/bin/python3 bench/core_suite.py --rows T=4096 --no-torch-rows bf16 --rounds 3 --mha "$mha" \
    --out "$out/core_suite.json" > "$out/core_suite.txt"
fi
if want backward; then
  echo "backward core $(stamp)" >&2
  for th in 1 2; do
    "$mha" bench --core --backward --seq 4096 --embed-dim 512 --heads 8 --threads $th --repeat 3 --json 2>/dev/null
  done > "$out/backward_core.jsonl"
fi
if want short; then
  echo "short sequences $(stamp)" >&2
  bash bench/short_seqs.sh "$mha" "$mha" 2 > "$out/short.jsonl"
  /usr/bin/python3 bench/summarize_runs.py "$out/short.jsonl" > "$out/short.txt"
fi
if want bf16; then
  echo "bf16 ratio $(stamp)" >&2
  for d in 64 128; do
    for th in 1 2; do
      bash bench/results/zen4_2026-12-06g/bf16_ratio.sh 5 $th $d "$out/bf16_d${d}_t${th}.raw" "$mha" > "$out/bf16_d${d}_t${th}.txt"
    done
  done
fi
if want decode; then
  echo "decode $(stamp)" >&2
  for r in 1 2; do
    for th in 1 2; do
      "$mha" bench-decode --contexts 8192 --dtype f32,bf16,int8,f32-transposed,bf16-transposed,int8-transposed \
        --threads $th --json 2>/dev/null
    done
  done > "$out/decode.jsonl"
fi
if want weights; then
  echo "weights vs weights-free module $(stamp)" >&2
  for r in 1 2 3; do
    for th in 1 2; do
      for w in none averaged; do
        printf 't%s %s: ' $th $w
        "$mha" bench --batch 1 --seq 2048 --embed-dim 512 --heads 8 --threads $th --need-weights $w --repeat 4 --json \
          2>/dev/null | python3 -c "import json,sys,statistics as s; d=json.load(sys.stdin); print(round(s.median(d['times_ms']),1), round(d['fraction_of_peak'],3))"
      done
    done
  done > "$out/weights_vs_free.txt"
fi
echo "done $(stamp)" >&2
