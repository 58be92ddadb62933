# Summary of ab4096_base_vs_exps_in_pv.jsonl (ab.txt §4b): /usr/bin/python3 sum4096.py FILE.jsonl
import json, sys, statistics, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
g = collections.defaultdict(list)
for d in rows:
    g[(d['threads'], d['head_dim'], d['build'], d['dtype'])].append(d)
for th in (1, 2):
    for hd in (64, 128):
        f = statistics.median(x['median_ms'] for x in g[(th, hd, 'base', 'f32')])
        b = statistics.median(x['median_ms'] for x in g[(th, hd, 'base', 'bf16')])
        n = statistics.median(x['median_ms'] for x in g[(th, hd, 'v4', 'bf16')])
        pk = statistics.median(x['peak_gflops'] for x in g[(th, hd, 'base', 'bf16')])
        fpb = statistics.median(x['fraction_of_peak'] for x in g[(th, hd, 'base', 'bf16')])
        fpn = statistics.median(x['fraction_of_peak'] for x in g[(th, hd, 'v4', 'bf16')])
        print(f"threads {th} d={hd}: f32 {f:.1f} ms | bf16 base {b:.1f} ({f/b:.3f}x, {fpb:.2f} of bf16 peak) -> new {n:.1f} ms ({f/n:.3f}x, {fpn:.2f}); new/base {n/b:.3f}  all new {[round(x['median_ms'],1) for x in g[(th,hd,'v4','bf16')]]} base {[round(x['median_ms'],1) for x in g[(th,hd,'base','bf16')]]}")
