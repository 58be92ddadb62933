#!/usr/bin/python3
"""Generate mha's PyTorch gradient goldens (deterministic; run with Debian's python3-torch).

    /usr/bin/python3 tests/golden/generate_grad.py

Writes tests/golden/grad/*.safetensors:
  module_<case>   format `mha-grad/1`: a module case of generate.py (same weights under the same
                  names, same inputs and masks, same metadata) plus a fixed `d_output` and the
                  gradients of L = sum(output * d_output) under `grad.<name>`: grad.query,
                  grad.key, grad.value (per argument, even for self-attention where the three
                  inputs are equal) and grad.<parameter> under PyTorch's names (in_proj_weight or
                  q/k/v_proj_weight, in_proj_bias, bias_k, bias_v, out_proj.weight, out_proj.bias;
                  Hugging Face files get theirs converted to these names).
  sdpa_<case>     format `mha-sdpa-grad/1`: an SDPA case of generate.py plus `d_out` and grad.q,
                  grad.k, grad.v of L = sum(out * d_out).

Gradients come from autograd in float64 on the float32-rounded inputs, then are rounded to float32.
Module gradients are computed through generate.py's explicit `ref_forward` and, for every plain
(non-GQA, PyTorch-named) case, cross-checked against torch.nn.MultiheadAttention's own autograd.
SDPA gradients come through generate.py's `sdpa_ref`, cross-checked by float64 finite differences
on a few entries. No dropout here: PyTorch's dropout masks are not mha's counter-based ones
(finite differences in tests/test_backward.cpp cover dropout).
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate as G  # noqa: E402  (the forward goldens: cases, inputs, writer)

GRAD_DIR = os.path.join(G.HERE, "grad")

MODULE_CASES = [
    "self_basic_bf", "self_seq_first_per_head", "cross_bf", "cross_seq_first_per_head", "kdim_vdim_bf",
    "kdim_vdim_nobias_seq_first", "kdim_only", "vdim_only_seq_first", "no_bias", "bias_kv", "zero_attn_cross",
    "bias_kv_zero_attn_seq_first", "bias_kv_zero_attn_kdim_vdim", "unbatched_self",
    "unbatched_cross_kdim_vdim_per_head", "unbatched_bool_mask_bool_kpm", "unbatched_float_mask_3d_per_head",
    "bool_mask_2d", "bool_mask_3d_seq_first", "float_mask_2d_neg_inf", "kpm_bool", "kpm_float",
    "bool_mask_plus_bool_kpm", "masks_bias_kv_zero_attn_seq_first", "zero_attn_rescues_masked_row",
    "bias_kv_rescues_padded_batch", "causal_bf", "causal_kpm", "causal_bias_kv_zero_attn", "heads4_d1",
    "single_key_Tk1", "gqa_h4_kv2", "gqa_h8_kv2_causal_per_head", "mqa_kdim_vdim", "gqa_bool_mask_3d_kpm_seq_first",
    "hf_mha_self",
]
SDPA_CASES = [c["name"] for c in G.SDPA_CASES]


def torch_names(c, grads):
    """Parameter gradients under PyTorch's names (Hugging Face files converted)."""
    if not c["hf"]:
        return grads
    E = c["E"]
    out = {}
    if c["kdim"] == E and c["vdim"] == E:
        out["in_proj_weight"] = torch.cat([grads["q_proj.weight"], grads["k_proj.weight"], grads["v_proj.weight"]])
    else:
        out["q_proj_weight"], out["k_proj_weight"], out["v_proj_weight"] = (
            grads["q_proj.weight"], grads["k_proj.weight"], grads["v_proj.weight"])
    if c["bias"]:
        out["in_proj_bias"] = torch.cat([grads["q_proj.bias"], grads["k_proj.bias"], grads["v_proj.bias"]])
        out["out_proj.bias"] = grads["o_proj.bias"]
    out["out_proj.weight"] = grads["o_proj.weight"]
    return out


def module_grads(c, P, X, dY):
    """(output, {grad name: tensor}) through ref_forward in float64, inputs as separate leaves."""
    P64 = {k: v.double().requires_grad_(True) for k, v in P.items()}
    X64 = {k: (v.double() if v.is_floating_point() else v) for k, v in X.items()}
    for n in ("query", "key", "value"):
        X64[n] = X64[n].clone().requires_grad_(True)
    out, _ = G.ref_forward(c, P64, X64)
    (out * dY.double()).sum().backward()
    grads = {n: X64[n].grad for n in ("query", "key", "value")}
    grads.update(torch_names(c, {k: v.grad for k, v in P64.items()}))
    return out.detach(), grads


def torch_module_grads(c, P, X, causal, dY):
    """The same gradients from torch.nn.MultiheadAttention's autograd (plain cases only)."""
    E, h = c["E"], c["h"]
    m = torch.nn.MultiheadAttention(E, h, dropout=0.0, bias=c["bias"], add_bias_kv=c["bias_kv"],
                                    add_zero_attn=c["zero_attn"], kdim=c["kdim"], vdim=c["vdim"],
                                    batch_first=c["batch_first"]).double()
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(P[n].double())
    m.train()  # dropout is 0: train mode only keeps the fast path away
    q, k, v = (X[n].double().clone().requires_grad_(True) for n in ("query", "key", "value"))
    am = X.get("attn_mask")
    kpm = X.get("key_padding_mask")
    am = am.double() if am is not None and am.is_floating_point() else am
    kpm = kpm.double() if kpm is not None and kpm.is_floating_point() else kpm
    if causal is not None:
        am = causal if am is None else (am | causal if am.dtype == torch.bool else am.masked_fill(causal, float("-inf")))
    out, _ = m(q, k, v, key_padding_mask=kpm, attn_mask=am, need_weights=False)
    (out * dY.double()).sum().backward()
    grads = {"query": q.grad, "key": k.grad, "value": v.grad}
    grads.update({n: p.grad for n, p in m.named_parameters()})
    return out.detach(), grads


def check_and_write(path, tensors, md):
    for n, t in tensors.items():
        if t.dtype == np.float32 and n.startswith(("grad.", "d_")):
            assert np.isfinite(t).all(), (path, n)
    G.write_safetensors(path, tensors, md)
    md2, t2 = G.read_safetensors(path)
    assert md2 == md and sorted(t2) == sorted(tensors), path
    for n, a in tensors.items():
        assert t2[n].dtype == a.dtype and t2[n].shape == a.shape and np.array_equal(t2[n], a), (path, n)
    size = os.path.getsize(path)
    assert size < G.MAX_FILE_BYTES, (path, size)
    return size


def gen_module():
    by_name = {c["name"]: c for c in G.FWD_CASES}
    report = []
    for name in MODULE_CASES:
        c = by_name[name]
        rng = G.Rng(c["name"])  # the forward golden's stream: same weights and inputs
        P = G.make_params(c, rng)
        X, causal = G.make_inputs(c, rng)
        dY = G.Rng("grad/" + name).normal(*X["query"].shape)
        out, grads = module_grads(c, P, X, dY)
        worst = None
        if not c["hf"] and (c["kv"] or c["h"]) == c["h"]:
            out2, grads2 = torch_module_grads(c, P, X, causal, dY)
            assert torch.allclose(out, out2, atol=1e-10), name
            assert sorted(grads) == sorted(grads2), (name, sorted(grads), sorted(grads2))
            worst = max(float((grads[n] - grads2[n]).abs().max()) for n in grads)
            assert worst < 1e-9, (name, worst)
        tensors = {k: G.np32(v) for k, v in P.items()}
        tensors.update({k: G.np32(v) for k, v in X.items()})
        tensors["d_output"] = G.np32(dY)
        tensors["expected.output"] = G.np32(out)
        tensors.update({"grad." + n: G.np32(g) for n, g in grads.items()})
        md = G.metadata(c)
        md["format"] = "mha-grad/1"
        size = check_and_write(os.path.join(GRAD_DIR, "module_" + name + ".safetensors"), tensors, md)
        report.append(("module_" + name, size, worst))
    return report


def gen_sdpa():
    by_name = {c["name"]: c for c in G.SDPA_CASES}
    report = []
    for name in SDPA_CASES:
        c = by_name[name]
        rng = G.Rng("sdpa/" + c["name"])  # same stream as generate.py: same q, k, v, masks
        B, h, kv, Tq, Tk, d, dv = c["B"], c["h"], c["kv"], c["Tq"], c["Tk"], c["d"], c["dv"]
        T, allowed, bias = G.sdpa_inputs(c, rng)
        q, k, v = T["q"], T["k"], T["v"]
        scale = c["scale"] if c["scale"] is not None else 1.0 / (d ** 0.5)
        dO = G.Rng("grad/sdpa/" + name).normal(B, h, Tq, dv)
        leaves = [t.double().clone().requires_grad_(True) for t in (q, k, v)]
        b64 = bias.double() if bias is not None else None

        def loss(qq, kk, vv):
            out, _, _ = G.sdpa_ref(qq, kk, vv, allowed, b64, c["causal"], scale)
            return (out * dO.double()).sum()

        loss(*leaves).backward()
        grads = [t.grad for t in leaves]
        # finite-difference spot checks in float64
        with torch.no_grad():
            for which in range(3):
                x = leaves[which].detach().clone()
                for idx in [0, x.numel() // 2, x.numel() - 1]:
                    args = [t.detach() for t in leaves]
                    xp, xm = x.clone(), x.clone()
                    xp.view(-1)[idx] += 1e-6
                    xm.view(-1)[idx] -= 1e-6
                    args[which] = xp
                    up = loss(*args)
                    args[which] = xm
                    fd = (up - loss(*args)) / 2e-6
                    assert abs(float(fd) - float(grads[which].view(-1)[idx])) < 1e-7, (name, which, idx)
        out, _, lse = G.sdpa_ref(q.double(), k.double(), v.double(), allowed, b64, c["causal"], scale)
        md = {"format": "mha-sdpa-grad/1", "causal": c["causal"]}
        if c["scale"] is not None:
            md["scale"] = repr(float(c["scale"]))
        tensors = {n: G.np32(t) for n, t in T.items()}
        tensors["d_out"] = G.np32(dO)
        tensors["expected.out"] = G.np32(out)
        tensors["expected.lse"] = G.np32(lse)
        for n, g in zip(("q", "k", "v"), grads):
            tensors["grad." + n] = G.np32(g)
        size = check_and_write(os.path.join(GRAD_DIR, "sdpa_" + name + ".safetensors"), tensors, md)
        report.append(("sdpa_" + name, size, None))
    return report


def main():
    torch.set_num_threads(1)
    os.makedirs(GRAD_DIR, exist_ok=True)
    rows = gen_module() + gen_sdpa()
    total = 0
    for name, size, worst in rows:
        total += size
        check = "" if worst is None else f"  nn.MultiheadAttention autograd agrees to {worst:.1e}"
        print(f"grad/{name:50s} {size:6d} B{check}")
    print(f"{len(rows)} gradient cases, {total} bytes")
    assert total < 1024 * 1024
    return 0


if __name__ == "__main__":
    sys.exit(main())
