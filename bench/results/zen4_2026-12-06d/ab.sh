#!/bin/bash
# The A/B of ab.txt §3-4: for ROUNDS rounds, each binary in turn runs `bench --core` (h = 8, E = 512,
# -r 6) and keeps its best time; prints the median of those per binary and its ratio to the first.
# Usage: ab.sh ROUNDS T DTYPE THREADS BINARY...
R=$1; T=$2; DT=$3; TH=$4; shift 4
out=$(mktemp); : > $out
for r in $(seq $R); do for b in "$@"; do
  $b bench --core -T $T -E 512 -H 8 --dtype $DT --threads $TH -r 6 --sgemm-size 64 --bw-mib 8 --json 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); print('$b', min(d['times_ms']), d['peak_gflops'])" >> $out
done; done
python3 - $out <<'P'
import sys,statistics,collections
d=collections.defaultdict(list)
for line in open(sys.argv[1]):
    b,t,p=line.split(); d[b].append(float(t))
base=None
for b,v in d.items():
    m=statistics.median(v)
    if base is None: base=m
    print(f"{b:28s} median-of-min {m:8.2f} ms  min {min(v):8.2f}  ratio {m/base:.3f}  all {' '.join(f'{x:.1f}' for x in v)}")
P
