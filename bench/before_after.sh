#!/usr/bin/env bash
# The rows a change to the kernels moves, two builds interleaved in the same run: the causal and
# short-sequence backward, the T=4096 backward, the module with attention weights and without,
# and decode. Medians of 3 rounds are left to the reader of OUT/rows.txt (one line a run:
# round threads who | args | median_ms fraction_of_peak peak_ratio_after_before busy_balance).
#   bench/before_after.sh OLD_MHA NEW_MHA OUT_DIR
# bench/core_suite.py --base OLD_MHA and bench/compare.py anchors cover the attention core and
# the PyTorch anchors.
set -u
old=${1:?usage: bench/before_after.sh OLD_MHA NEW_MHA OUT_DIR} new=${2:?new mha} out=${3:?out dir}
mkdir -p "$out"
summary() {
  python3 -c "
import json,sys
t=sys.stdin.read().strip().splitlines()
try: j=json.loads(t[-1])
except Exception: print('ERR'); sys.exit()
print(round(j['median_ms'],2), round(j.get('fraction_of_peak',0),3), round(j.get('peak_ratio_after_before',0),2), j.get('busy_balance',''))"
}
rows=("--core --backward --causal --batch 64 --seq 128" "--core --backward --causal --batch 64 --seq 512"
      "--core --backward --batch 64 --seq 512" "--core --backward --causal --seq 4096" "--core --backward --seq 4096"
      "--need-weights averaged --seq 2048" "--need-weights per-head --seq 2048" "--seq 2048")
for rnd in 1 2 3; do
  for th in 1 2; do
    for args in "${rows[@]}"; do
      for who in old new; do
        bin=$old; [ "$who" = new ] && bin=$new
        # shellcheck disable=SC2086  # args is a list of options
        echo "$rnd $th $who | $args | $("$bin" bench $args -E 512 -H 8 --threads "$th" -r 3 --json 2>/dev/null | summary)"
      done
    done
  done
  echo "before_after: round $rnd/3 done" >&2
done > "$out/rows.txt"
for rnd in 1 2; do
  for th in 1 2; do
    for who in old new; do
      bin=$old; [ "$who" = new ] && bin=$new
      "$bin" bench-decode --contexts 8192 --threads "$th" --json > "$out/decode_${who}_${th}_${rnd}.json" 2>/dev/null
    done
  done
done
