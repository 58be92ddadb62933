#!/usr/bin/env bash
# Interleaved decode A/B: BUILDS="a b" THREADS="1 2" ROUNDS=n DTYPES=... ; binaries /tmp/mha_NAME
set -u
BUILDS=${BUILDS:-"z4 base"}; THREADS=${THREADS:-"1 2"}; ROUNDS=${ROUNDS:-3}
DTYPES=${DTYPES:-f32,bf16,int8,f32-transposed,bf16-transposed,int8-transposed}
out=${OUT:-/tmp/dec_ab.jsonl}; : > $out
for r in $(seq 1 $ROUNDS); do
  for t in $THREADS; do
    for b in $BUILDS; do
      j=$(/tmp/mha_$b bench-decode --contexts 8192 --dtype $DTYPES --threads $t --json 2>/dev/null)
      /usr/bin/python3 -c "import json,sys; d=json.loads(sys.argv[1]); d.update(build='$b',threads=$t,round=$r); print(json.dumps(d))" "$j" >> $out
    done
  done
done
/usr/bin/python3 - $out <<'PY'
import json,sys,statistics as st
rows={}
for l in open(sys.argv[1]):
    d=json.loads(l)
    for x in d['decode']:
        rows.setdefault((d['threads'],x['dtype'],d['build']),[]).append((x['ms_per_token_best'],x['fraction_of_read_bw'],d['read_bw_gbs']))
for k in sorted(rows):
    v=rows[k]
    print(f"t={k[0]} {k[1]:16s} {k[2]:6s} ms {st.median(a for a,_,_ in v):6.3f} [{' '.join(f'{a:.3f}' for a,_,_ in v)}] frac_read {st.median(b for _,b,_ in v):.3f} bw {st.median(c for _,_,c in v):.1f}")
PY
/usr/bin/python3 - $out <<'PY'
import json,sys,statistics as st
rat={}
for l in open(sys.argv[1]):
    d=json.loads(l); f={x['dtype']:x['ms_per_token_best'] for x in d['decode']}
    for k,v in f.items():
        if k!='f32': rat.setdefault((d['threads'],k,d['build']),[]).append(f['f32']/v)
for k in sorted(rat): print(f"ratio t={k[0]} {k[1]:16s} {k[2]:6s} median {st.median(rat[k]):.2f} [{' '.join(f'{x:.2f}' for x in rat[k])}]")
PY
