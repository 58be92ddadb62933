#!/usr/bin/python3
"""Recompute golden files from their own contents and compare with the stored answers.

    /usr/bin/python3 tests/golden/verify.py [CASE_DIR_OR_FILE ...]

Default: tests/golden/forward, tests/golden/sdpa and, when present, ../shared/conformance/cases.
Module cases are rebuilt from the file alone (metadata + tensors): torch.nn.MultiheadAttention in
float32 for plain cases, the explicit GQA code of generate.py for num_kv_heads < num_heads.
SDPA cases are recomputed with generate.sdpa_ref. Uses the shared checker's tolerance. Exits 77
(ctest's "skipped") without PyTorch, unless MHA_REQUIRE_TORCH=1.
"""
import glob
import math
import os
import sys

import numpy as np

try:
    import torch
except ImportError:
    # ctest counts exit code 77 as skipped; scripts/test.sh installs torch and sets MHA_REQUIRE_TORCH=1.
    print("verify.py: PyTorch is not installed (apt-get install python3-torch)", file=sys.stderr)
    sys.exit(1 if os.environ.get("MHA_REQUIRE_TORCH") == "1" else 77)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True  # keep tests/golden free of __pycache__
sys.path.insert(0, HERE)
import generate as G  # noqa: E402

torch.set_num_threads(1)


def config_from_file(meta, T):
    E, h = int(meta["embed_dim"]), int(meta["num_heads"])
    kv = int(meta["num_kv_heads"]) if "num_kv_heads" in meta else None
    b = lambda k: meta[k] == "true"  # noqa: E731
    c = dict(E=E, h=h, kv=kv if kv is not None and kv != h else None, kdim=int(meta["kdim"]), vdim=int(meta["vdim"]),
             bias=b("bias"), bias_kv=b("add_bias_kv"), zero_attn=b("add_zero_attn"), batch_first=b("batch_first"),
             need_weights=b("need_weights"), avg=b("average_attn_weights"), causal=b("is_causal"),
             hf="q_proj.weight" in T, self_attn=False)
    return c


def check_forward(path):
    meta, arrs = G.read_safetensors(path)
    assert meta["format"] == "mha-case/1"
    T = {k: torch.from_numpy(v) for k, v in arrs.items()}
    c = config_from_file(meta, T)
    P = {k: v for k, v in T.items() if k not in ("query", "key", "value", "attn_mask", "key_padding_mask")
         and not k.startswith("expected.")}
    X = {k: T[k] for k in ("query", "key", "value", "attn_mask", "key_padding_mask") if k in T}
    causal = None
    if c["causal"]:
        tdim = 1 if X["query"].dim() == 3 and c["batch_first"] else 0
        Tq, Tk = X["query"].shape[tdim], X["key"].shape[tdim]
        causal = torch.triu(torch.ones(Tq, Tk, dtype=torch.bool), diagonal=1)
    if c["kv"] is None:
        out, w = G.torch_forward(c, P, X, causal, torch.float32)
        how = "nn.MultiheadAttention f32"
    else:
        out, w = G.ref_forward(c, G.to64(P), G.to64(X))
        how = "explicit GQA f64"
    r = G.ratio(out, T["expected.output"])
    if c["need_weights"]:
        r = max(r, G.ratio(w, T["expected.attn_weights"]))
    else:
        assert "expected.attn_weights" not in T
    return r, how


def check_sdpa(path):
    meta, arrs = G.read_safetensors(path)
    assert meta["format"] == "mha-sdpa/1"
    T = {k: torch.from_numpy(v) for k, v in arrs.items()}
    q, k, v = T["q"].double(), T["k"].double(), T["v"].double()
    scale = float(meta["scale"]) if "scale" in meta else 1.0 / math.sqrt(q.shape[-1])
    bias = T["bias"].double() if "bias" in T else None
    out, w, lse = G.sdpa_ref(q, k, v, T.get("allowed"), bias, meta["causal"], scale)
    r = max(G.ratio(out, T["expected.out"]), G.ratio(w, T["expected.weights"]))
    want = T["expected.lse"].double()
    assert torch.equal(torch.isinf(want), torch.isinf(lse))
    fin = torch.isfinite(want)
    if fin.any():
        r = max(r, G.ratio(lse[fin], want[fin]))
    return r, "sdpa f64"


def main():
    targets = sys.argv[1:] or [os.path.join(HERE, "forward"), os.path.join(HERE, "sdpa"),
                               os.path.join(HERE, "..", "..", "..", "shared", "conformance", "cases")]
    files = []
    for t in targets:
        files += sorted(glob.glob(os.path.join(t, "*.safetensors"))) if os.path.isdir(t) else [t]
    worst, bad = 0.0, 0
    for f in files:
        meta, _ = G.read_safetensors(f)
        r, how = (check_sdpa if meta.get("format") == "mha-sdpa/1" else check_forward)(f)
        worst = max(worst, r)
        ok = r <= 1.0
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {os.path.relpath(f):70s} {r:.4f}x tol ({how})")
    print(f"{len(files)} files, {bad} mismatches, worst {worst:.4f}x the tolerance")
    return 1 if bad or not files else 0


if __name__ == "__main__":
    sys.exit(main())
