#!/bin/bash
# bf16 core ÷ float32 core at T = 4096, h = 8, head dim D (issue 17's "bf16 ≥ 1.9× mha's f32"),
# interleaved round by round: each round runs BASE's float32 core, then the bf16 core of each
# binary. Per binary: the median over rounds of its best time and of the ratio to the same
# round's float32 time. The JSON-free raw lines (name round best_ms fraction_of_peak) go to RAW.
# usage: bf16_ratio.sh ROUNDS THREADS D RAW BASE_MHA [OTHER_MHA...]
set -euo pipefail
rounds=$1 threads=$2 d=$3 raw=$4
shift 4
bins=("$@")
: > "$raw"
run() {  # label dtype binary round
  "$3" bench --core --batch 1 --seq 4096 --embed-dim $((d * 8)) --heads 8 --threads "$threads" --dtype "$2" \
    --repeat 3 --sgemm-size 64 --bw-mib 8 --json 2>/dev/null |
    python3 -c "import json,sys; d=json.load(sys.stdin); print('$1', $4, min(d['times_ms']), d['fraction_of_peak'])" >> "$raw"
}
for r in $(seq "$rounds"); do
  run f32 f32 "${bins[0]}" "$r"
  for i in "${!bins[@]}"; do run "bf16:$i" bf16 "${bins[$i]}" "$r"; done
done
python3 - "$raw" "${bins[@]}" <<'P'
import collections, statistics, sys
t = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    name, r, ms, _ = line.split()
    t[name][int(r)] = float(ms)
f32 = t.pop("f32")
print(f"float32 core ({sys.argv[2]}): median {statistics.median(f32.values()):.2f} ms")
for name, v in t.items():
    i = int(name.split(":")[1])
    ratios = [f32[r] / v[r] for r in v]
    print(f"bf16 {sys.argv[2 + i]}: median {statistics.median(v.values()):.2f} ms, "
          f"× f32 median {statistics.median(ratios):.3f} (rounds: {' '.join(f'{x:.2f}' for x in ratios)})")
P
