#!/bin/bash
# The attention core, forward and backward, T=4096, E=512, h=8, 1 and 2 threads: a previous mha build
# (/tmp/mha_base; copy one there) and build/mha against PyTorch 2.x SDPA (../shared/tools/torch2), 3
# interleaved rounds, one JSON line per run. usage: bench/core_vs_torch2.sh [OUT.jsonl]
cd "$(dirname "$0")/.."
T2=../shared/tools/torch2
out=${1:-bench/results/core_vs_torch2.jsonl}
for round in 1 2 3; do
  for th in 1 2; do
    for bin in /tmp/mha_base build/mha; do
      $bin bench --core --seq 4096 --embed-dim 512 --heads 8 --threads $th -r 3 --json 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); d['bin']='$bin'; d['what']='core_fwd'; d['round']=$round; print(json.dumps(d))" >> $out
      $bin bench --core --backward --seq 4096 --embed-dim 512 --heads 8 --threads $th -r 2 --json 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); d['bin']='$bin'; d['what']='core_bwd'; d['round']=$round; print(json.dumps(d))" >> $out
    done
    $T2 bench/pytorch_mha.py --core --core-impl sdpa --seq 4096 --embed-dim 512 --heads 8 --threads $th --repeat 3 --json 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); d['bin']='torch2'; d['what']='core_fwd'; d['round']=$round; d['threads']=$th; print(json.dumps(d))" >> $out
    $T2 bench/pytorch_mha.py --core --core-impl sdpa --backward --seq 4096 --embed-dim 512 --heads 8 --threads $th --repeat 2 --json 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); d['bin']='torch2'; d['what']='core_bwd'; d['round']=$round; d['threads']=$th; print(json.dumps(d))" >> $out
  done
done
echo $out
