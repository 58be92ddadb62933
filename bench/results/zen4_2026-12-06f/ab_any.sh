#!/bin/bash
# Interleaved A/B of `mha bench ARGS` (--core in ARGS for the core; ab_core.sh adds it): per binary
# the median over rounds of each run's best time, its ratio to the first, the median fraction of peak.
# Usage: ab_any.sh ROUNDS "ARGS" BINARY...   (each round: each binary once, keeps min of its times)
R=$1; ARGS=$2; shift 2
out=$(mktemp); : > $out
for r in $(seq $R); do for b in "$@"; do
  $b bench $ARGS --sgemm-size 64 --bw-mib 8 --json 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); print('$b', min(d['times_ms']), d['peak_gflops'], d['flops'])" >> $out
done; done
python3 - $out <<'P'
import sys,statistics,collections
d=collections.defaultdict(list); pk=collections.defaultdict(list); fl={}
for line in open(sys.argv[1]):
    b,t,p,f=line.split(); d[b].append(float(t)); pk[b].append(float(p)); fl[b]=float(f)
base=None
for b,v in d.items():
    m=statistics.median(v)
    if base is None: base=m
    frac=statistics.median([fl[b]/(t*1e-3)/(p*1e9) for t,p in zip(v,pk[b])])
    print(f"{b:22s} med-of-min {m:8.3f} ms  min {min(v):8.3f}  ratio {m/base:.3f}  frac_peak {frac:.3f}")
P
