#!/bin/bash
# Every row of issue 15's and 17's tables on this machine at the current build, one after another
# (each step interleaves mha with its anchor itself). Run from the repository root with a quiet
# machine; outputs land next to this script. usage: bash bench/results/zen4_2026-12-06h/run_all.sh
set -euo pipefail
out=$(dirname "$0")
mha=${MHA:-build/mha}
stamp() { date -u +%H:%M; }
echo "anchors $(stamp)" >&2
/usr/bin/python3 bench/compare.py anchors --rounds 3 --repeat 4 --versions 2 --mha "$mha" > "$out/anchors.txt"
cp bench/results/anchors.json "$out/anchors.json"
git checkout -- bench/results/anchors.json  # compare.py writes there; the committed file is an older run
echo "core suite $(stamp)" >&2
/usr/bin/python3 bench/core_suite.py --rows T=4096 --no-torch-rows bf16 --rounds 3 --mha "$mha" \
  --out "$out/core_suite.json" > "$out/core_suite.txt"
echo "backward core $(stamp)" >&2
for th in 1 2; do
  "$mha" bench --core --backward --seq 4096 --embed-dim 512 --heads 8 --threads $th --repeat 3 --json 2>/dev/null
done > "$out/backward_core.jsonl"
echo "short sequences $(stamp)" >&2
bash bench/short_seqs.sh "$mha" "$mha" 2 > "$out/short.jsonl"
/usr/bin/python3 bench/summarize_runs.py "$out/short.jsonl" > "$out/short.txt"
echo "bf16 ratio $(stamp)" >&2
for d in 64 128; do
  for th in 1 2; do
    bash bench/results/zen4_2026-12-06g/bf16_ratio.sh 5 $th $d "$out/bf16_d${d}_t${th}.raw" "$mha" > "$out/bf16_d${d}_t${th}.txt"
  done
done
echo "decode $(stamp)" >&2
for r in 1 2; do
  for th in 1 2; do
    "$mha" bench-decode --contexts 8192 --dtype f32,bf16,int8,f32-transposed,bf16-transposed,int8-transposed \
      --threads $th --json 2>/dev/null
  done
done > "$out/decode.jsonl"
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
echo "done $(stamp)" >&2
