"""Decode step time with and without logit softcap, through the module's KV cache.

    PYTHONPATH=build/python /usr/bin/python3 bench/decode_softcap.py [context]

Two modules (the same weights; one with softcap=30) each prefill `context` positions for a
batch of 4, then take one-token steps, interleaved (off, cap / cap, off, …) on 1 thread.
Prints each median step in ms and cap / off, the softcap's cost against the same-run baseline.
"""
import json
import sys
import time

import numpy as np

import mha

E, H, KV, B, STEPS = 1024, 16, 4, 4, 21
CTX = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
rng = np.random.default_rng(0)
x = rng.standard_normal((B, CTX, E)).astype(np.float32) * 0.5
mods = {"off": mha.MultiheadAttention(E, H, num_kv_heads=KV, batch_first=True, seed=1).eval(),
        "cap": mha.MultiheadAttention(E, H, num_kv_heads=KV, batch_first=True, seed=1, softcap=30.0).eval()}
caches = {}
for name, m in mods.items():
    caches[name] = m.new_cache(B, CTX + STEPS + 1)
    m.forward_incremental(x, x, x, caches[name], threads=1)
tok = rng.standard_normal((B, 1, E)).astype(np.float32)
times = {name: [] for name in mods}
for i in range(STEPS):
    for name in ("off", "cap") if i % 2 == 0 else ("cap", "off"):
        t0 = time.perf_counter()
        mods[name].forward_incremental(tok, tok, tok, caches[name], threads=1)
        times[name].append((time.perf_counter() - t0) * 1e3)
med = {name: float(np.median(v)) for name, v in times.items()}
print(json.dumps({"context": CTX, "off_ms": round(med["off"], 3), "cap_ms": round(med["cap"], 3),
                  "cap_over_off": round(med["cap"] / med["off"], 3)}))
