#!/usr/bin/env bash
# int8 decode A/B from memory: ROUNDS rounds, builds /tmp/mha_NAME interleaved; median of each build's per-run best.
set -u
out=${OUT:-/tmp/ab_int8.jsonl}; : > $out
for r in $(seq 1 ${ROUNDS:-10}); do for b in $BUILDS; do
  j=$(/tmp/mha_$b bench-decode --contexts 8192 --dtype ${DTYPES:-int8,int8-transposed} --threads ${THREADS:-1} --repeat 40 --json 2>/dev/null)
  /usr/bin/python3 -c "import json,sys; d=json.loads(sys.argv[1]); d.update(build='$b',round=$r); print(json.dumps(d))" "$j" >> $out
done; done
/usr/bin/python3 - $out <<'PY'
import json,sys,statistics as st
rows={}
for l in open(sys.argv[1]):
    d=json.loads(l)
    for x in d['decode']: rows.setdefault((x['dtype'],d['build']),[]).append(x['ms_per_token_best'])
for k in sorted(rows): v=rows[k]; print(f"{k[0]:16s} {k[1]:6s} median {st.median(v):.3f} min {min(v):.3f} [{' '.join(f'{a:.3f}' for a in v)}]")
PY
