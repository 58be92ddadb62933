#!/usr/bin/python3
"""Generate mha's PyTorch golden cases (deterministic; run with Debian's python3-torch).

    /usr/bin/python3 tests/golden/generate.py

Writes
  tests/golden/forward/*.safetensors  module-level cases in the shared conformance format
                                      (../shared/conformance/README.md, format `mha-case/1`)
  tests/golden/sdpa/*.safetensors     SDPA-level cases (format `mha-sdpa/1`, see README.md here)

Every value comes from a torch.Generator seeded with crc32(case name), so adding, removing or
reordering cases never changes the others, and a rerun reproduces the files byte for byte.

Module cases: expected answers come from torch.nn.MultiheadAttention itself (eval mode, autograd
on, parameters requiring grad, so the inference fast path is never taken), run in float64 on the
float32-rounded weights and inputs and then rounded to float32. Every such case is cross-checked
against an independent explicit implementation (`ref_forward`) and against the same module run
in float32. Grouped-query (num_kv_heads < num_heads) cases have no nn.MultiheadAttention
counterpart; their answers come from `ref_forward` (explicit PyTorch code repeating K/V heads),
which is itself validated on every plain case.

SDPA cases: plain float64 torch math (scale, + bias, masking, softmax, lse), cast to float32.
"""
import json
import math
import os
import struct
import sys
import zlib

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(1)

HERE = os.path.dirname(os.path.abspath(__file__))
FWD_DIR = os.path.join(HERE, "forward")
SDPA_DIR = os.path.join(HERE, "sdpa")
MAX_FILE_BYTES = 20 * 1024
ATOL, RTOL = 2e-5, 2e-4  # the shared checker's tolerance

# --------------------------------------------------------------------------------------------
# safetensors: a small self-contained writer/reader (same layout as shared/conformance/stio.py:
# tensors sorted by name, header padded with spaces to a multiple of 8).

_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.bool_): "BOOL"}
_NP = {"F32": np.dtype("<f4"), "BOOL": np.dtype(np.bool_)}


def write_small_case(out_dir, name, tensors, meta, limit=20 * 1024):
    """Writes torch tensors to out_dir/name.safetensors, reads them back and checks the file stays small."""
    path = os.path.join(out_dir, name + ".safetensors")
    write_safetensors(path, {k: v.contiguous().numpy() for k, v in tensors.items()}, meta)
    _, back = read_safetensors(path)
    for k, v in tensors.items():
        assert (back[k] == v.numpy()).all(), (name, k)
    assert os.path.getsize(path) < limit, path


def write_safetensors(path, tensors, metadata):
    header = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    chunks, offset = [], 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        dtype = _DTYPES[arr.dtype]
        raw = arr.astype(_NP[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for c in chunks:
            f.write(c)


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    data = blob[8 + n:]
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        dt = _NP[info["dtype"]]
        arr = np.frombuffer(data[b:e], dtype=dt).reshape(info["shape"])
        out[name] = arr.copy()
    return meta, out


# --------------------------------------------------------------------------------------------
# Random values

class Rng:
    def __init__(self, name):
        self.g = torch.Generator().manual_seed(zlib.crc32(name.encode("utf-8")))

    def normal(self, *shape, std=1.0):
        return (torch.randn(*shape, generator=self.g, dtype=torch.float64) * std).float()

    def uniform(self, *shape, a=1.0):
        return ((torch.rand(*shape, generator=self.g, dtype=torch.float64) * 2 - 1) * a).float()

    def bern(self, *shape, p=0.5):
        return torch.rand(*shape, generator=self.g, dtype=torch.float64) < p

    def randint(self, lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=self.g).item())


def weight(rng, rows, cols):
    return rng.uniform(rows, cols, a=math.sqrt(3.0 / cols))  # unit-variance outputs


# --------------------------------------------------------------------------------------------
# Module cases

FWD_CASES = []


def case(name, E, h, *, kv=None, kdim=None, vdim=None, bias=True, bias_kv=False, zero_attn=False,
         batch_first=True, need_weights=True, avg=True, causal=False, B=2, Tq=5, Tk=None, self_attn=None,
         hf=False, kv_meta=False, attn_mask=None, kpm=None, rescue=None, note=""):
    """attn_mask: None | (kind, ndim) with kind 'bool'|'float'; kpm: None|'bool'|'float';
    B=None: unbatched 2-D inputs; rescue: 'row' masks every real key of some rows (only legal with
    add_bias_kv/add_zero_attn, whose extra column keeps the row finite), 'batch' pads every key of
    one batch element."""
    Tk = Tq if Tk is None else Tk
    if self_attn is None:
        self_attn = Tk == Tq and kdim is None and vdim is None
    FWD_CASES.append(dict(name=name, E=E, h=h, kv=kv, kdim=kdim or E, vdim=vdim or E, bias=bias, bias_kv=bias_kv,
                          zero_attn=zero_attn, batch_first=batch_first, need_weights=need_weights, avg=avg,
                          causal=causal, B=B, Tq=Tq, Tk=Tk, self_attn=self_attn, hf=hf or kv is not None,
                          kv_meta=kv_meta, attn_mask=attn_mask, kpm=kpm, rescue=rescue, note=note))


# ---- projections, layouts, options
case("self_basic_bf", 8, 2, note="self-attention, batch_first, averaged weights")
case("self_seq_first_per_head", 12, 3, B=3, Tq=4, batch_first=False, avg=False,
     note="(T, B, E) layout, per-head weights")
case("cross_bf", 16, 4, Tq=3, Tk=7, note="cross-attention T_q=3, T_k=7")
case("cross_seq_first_per_head", 8, 2, Tq=6, Tk=2, batch_first=False, avg=False, note="cross, seq-first, T_q > T_k")
case("kdim_vdim_bf", 16, 4, kdim=10, vdim=6, Tq=3, Tk=7, note="kdim=10, vdim=6: q/k/v_proj_weight")
case("kdim_vdim_nobias_seq_first", 12, 2, kdim=5, vdim=9, bias=False, batch_first=False, Tq=4, Tk=3,
     note="separate projections without bias, seq-first")
case("kdim_only", 8, 2, kdim=7, Tq=4, Tk=6, avg=False, note="kdim=7, vdim=E: still separate projections")
case("vdim_only_seq_first", 8, 4, vdim=3, Tq=3, Tk=5, batch_first=False, note="vdim=3, kdim=E")
case("no_bias", 16, 4, bias=False, note="bias=false: no in_proj_bias / out_proj.bias")
case("need_weights_false", 16, 4, need_weights=False, Tq=6, note="need_weights=false: output only")
case("need_weights_false_cross_seq_first", 12, 3, need_weights=False, Tq=5, Tk=3, batch_first=False,
     note="need_weights=false, cross, seq-first")
case("bias_kv", 8, 2, bias_kv=True, avg=False, Tq=4, note="add_bias_kv only, per-head weights")
case("zero_attn_cross", 8, 2, zero_attn=True, Tq=3, Tk=5, note="add_zero_attn only, cross")
case("bias_kv_zero_attn_seq_first", 12, 3, bias_kv=True, zero_attn=True, batch_first=False, avg=False, Tq=4, Tk=6,
     note="both extra columns, seq-first, per-head weights")
case("bias_kv_no_bias", 8, 2, bias_kv=True, bias=False, Tq=4, note="bias_k/bias_v with bias=false")
case("bias_kv_zero_attn_kdim_vdim", 8, 2, bias_kv=True, zero_attn=True, kdim=5, vdim=3, Tq=3, Tk=4,
     note="extra columns with separate projections")
case("bias_kv_zero_attn_need_weights_false", 8, 2, bias_kv=True, zero_attn=True, need_weights=False, Tq=4,
     note="extra columns, output only")

# ---- unbatched (2-D) inputs
case("unbatched_self", 8, 2, B=None, Tq=4, note="2-D input (T, E)")
case("unbatched_cross_kdim_vdim_per_head", 12, 3, B=None, kdim=5, vdim=7, Tq=3, Tk=6, avg=False, batch_first=False,
     note="2-D cross with kdim/vdim, per-head weights (h, T_q, T_k)")
case("unbatched_bool_mask_bool_kpm", 8, 2, B=None, Tq=5, Tk=6, attn_mask=("bool", 2), kpm="bool",
     note="2-D bool attn_mask + key_padding_mask of shape (T_k)")
case("unbatched_float_mask_3d_per_head", 8, 2, B=None, Tq=4, Tk=5, attn_mask=("float", 3), avg=False,
     note="unbatched 3-D float attn_mask (h, T_q, T_k)")
case("unbatched_float_kpm", 8, 4, B=None, Tq=3, Tk=5, kpm="float", note="unbatched float key_padding_mask (T_k)")
case("unbatched_bias_kv_zero_attn_kpm", 8, 2, B=None, Tq=3, Tk=4, bias_kv=True, zero_attn=True, kpm="bool",
     avg=False, note="unbatched, both extra columns, bool key padding")
case("unbatched_need_weights_false", 6, 3, B=None, Tq=5, need_weights=False, attn_mask=("bool", 2),
     note="unbatched, bool mask, output only")
case("unbatched_causal", 8, 2, B=None, Tq=6, causal=True, note="unbatched, is_causal")

# ---- attention masks and key padding
case("bool_mask_2d", 16, 2, Tq=6, attn_mask=("bool", 2), note="2-D bool attn_mask (true = masked out)")
case("bool_mask_2d_cross_seq_first", 8, 2, Tq=4, Tk=7, batch_first=False, attn_mask=("bool", 2),
     note="2-D bool mask, cross, seq-first")
case("bool_mask_3d_per_head", 8, 2, Tq=4, Tk=5, attn_mask=("bool", 3), avg=False,
     note="3-D bool mask (B*h, T_q, T_k), batch_first")
case("bool_mask_3d_seq_first", 12, 3, B=2, Tq=3, Tk=4, attn_mask=("bool", 3), batch_first=False, avg=False,
     note="3-D bool mask, seq-first: row b*h + head")
case("float_mask_2d_neg_inf", 8, 2, Tq=5, Tk=6, attn_mask=("float", 2), note="2-D float mask with -inf entries")
case("float_mask_3d_neg_inf_per_head", 8, 4, Tq=4, Tk=5, attn_mask=("float", 3), avg=False,
     note="3-D float mask with -inf entries")
case("float_mask_2d_finite", 8, 2, Tq=4, Tk=4, attn_mask=("float_finite", 2), note="2-D float mask, finite values only")
case("kpm_bool", 16, 4, B=3, Tq=5, Tk=8, kpm="bool", note="bool key_padding_mask, B=3")
case("kpm_bool_seq_first_cross", 8, 2, B=3, Tq=3, Tk=6, kpm="bool", batch_first=False, avg=False,
     note="bool key padding, seq-first, per-head")
case("kpm_float", 8, 2, B=2, Tq=4, Tk=6, kpm="float", note="float key_padding_mask (added), with -inf")
case("bool_mask_plus_bool_kpm", 8, 2, Tq=5, Tk=6, attn_mask=("bool", 2), kpm="bool", avg=False,
     note="bool attn_mask OR bool key padding")
case("float_mask_3d_plus_bool_kpm", 8, 2, Tq=4, Tk=5, attn_mask=("float", 3), kpm="bool",
     note="float 3-D mask, bool key padding -> -inf")
case("float_mask_plus_float_kpm", 8, 2, Tq=4, Tk=5, attn_mask=("float", 2), kpm="float",
     note="float mask + float key padding, summed (PyTorch >= 2.0 semantics; see README)")
case("bool_mask_bias_kv", 8, 2, Tq=4, Tk=5, attn_mask=("bool", 2), bias_kv=True, avg=False,
     note="bool mask padded with an unmasked bias_k column")
case("float_mask_3d_zero_attn_kpm", 8, 2, Tq=3, Tk=5, attn_mask=("float", 3), zero_attn=True, kpm="bool",
     note="3-D float mask + key padding + zero_attn column")
case("masks_bias_kv_zero_attn_seq_first", 12, 3, Tq=4, Tk=5, attn_mask=("bool", 3), kpm="bool", bias_kv=True,
     zero_attn=True, batch_first=False, avg=False, note="everything at once, seq-first, per-head")
case("zero_attn_rescues_masked_row", 8, 2, Tq=4, Tk=5, attn_mask=("bool", 2), zero_attn=True, avg=False,
     rescue="row", note="rows with every real key masked stay finite thanks to the zero column")
case("bias_kv_rescues_padded_batch", 8, 2, B=2, Tq=3, Tk=4, kpm="bool", bias_kv=True, rescue="batch",
     note="batch 1 fully padded; only bias_k is visible")

# ---- causal
case("causal_bf", 16, 2, B=1, Tq=9, causal=True, note="is_causal, top-left")
case("causal_seq_first_per_head", 12, 3, B=2, Tq=5, causal=True, batch_first=False, avg=False,
     note="is_causal, seq-first, per-head")
case("causal_kpm", 8, 2, B=3, Tq=6, causal=True, kpm="bool", note="causal + bool key padding")
case("causal_T1_B1", 8, 2, B=1, Tq=1, causal=True, note="causal, T=1, B=1")
case("causal_float_mask", 8, 2, Tq=5, causal=True, attn_mask=("float", 2), note="causal + float attn_mask")
case("causal_bias_kv_zero_attn", 8, 2, Tq=4, causal=True, bias_kv=True, zero_attn=True, avg=False,
     note="causal over the real keys only; bias_k and zero columns stay visible")
case("causal_need_weights_false", 8, 4, Tq=7, causal=True, need_weights=False, batch_first=False,
     note="causal, output only")

# ---- head counts, head dims, sequence lengths
case("heads1_d16", 16, 1, Tq=5, note="h=1, d=16")
case("heads8_d2", 16, 8, Tq=5, avg=False, note="h=8, d=2, per-head")
case("heads3_d5_odd_T", 15, 3, Tq=7, Tk=5, note="h=3, d=5, odd T")
case("heads4_d1", 4, 4, Tq=3, Tk=5, avg=False, note="h=4, d=1")
case("heads2_d7_T11", 14, 2, B=1, Tq=11, note="h=2, d=7, T=11")
case("heads2_d3_T1", 6, 2, B=1, Tq=1, note="T_q=T_k=1, B=1")
case("decode_Tq1", 8, 2, B=2, Tq=1, Tk=9, kpm="bool", note="T_q=1 against 9 keys with padding")
case("single_key_Tk1", 8, 2, B=2, Tq=5, Tk=1, avg=False, note="T_k=1: every weight is 1")
case("B1_seq_first", 12, 4, B=1, Tq=5, batch_first=False, note="B=1, seq-first")

# ---- Hugging Face names, plain MHA
case("hf_mha_self", 16, 4, hf=True, Tq=5, note="q/k/v/o_proj names, num_kv_heads absent")
case("hf_mha_cross_no_bias", 8, 2, hf=True, bias=False, Tq=3, Tk=6, avg=False, note="HF names, no biases, cross")
case("hf_mha_kv_meta_equal", 12, 3, hf=True, kv_meta=True, Tq=4, batch_first=False,
     note="HF names with num_kv_heads = num_heads written out")
case("hf_mha_kdim_vdim_mask", 8, 2, hf=True, kdim=6, vdim=5, Tq=3, Tk=4, attn_mask=("bool", 2),
     note="HF names, kdim/vdim, bool mask")

# ---- grouped-query and multi-query attention (explicit PyTorch code)
case("gqa_h4_kv2", 16, 4, kv=2, Tq=5, note="GQA h=4, kv=2")
case("gqa_h8_kv2_causal_per_head", 16, 8, kv=2, B=2, Tq=6, causal=True, avg=False, note="GQA causal, per-head")
case("gqa_h6_kv2_cross", 12, 6, kv=2, Tq=3, Tk=5, note="groups of 3 query heads")
case("mqa_h4_kv1_cross", 16, 4, kv=1, Tq=4, Tk=7, avg=False, note="MQA cross, per-head")
case("mqa_h8_kv1_causal_kpm", 16, 8, kv=1, B=2, Tq=5, causal=True, kpm="bool", note="MQA causal + key padding")
case("gqa_bool_mask_3d_kpm_seq_first", 16, 4, kv=2, Tq=4, Tk=5, attn_mask=("bool", 3), kpm="bool",
     batch_first=False, avg=False, note="GQA 3-D bool mask + key padding, seq-first")
case("gqa_float_mask_bool_kpm", 12, 4, kv=2, Tq=4, Tk=6, attn_mask=("float", 2), kpm="bool",
     note="GQA float mask with -inf + bool key padding")
case("gqa_float_kpm", 8, 4, kv=2, Tq=3, Tk=5, kpm="float", avg=False, note="GQA float key padding")
case("gqa_unbatched_kpm", 12, 4, kv=2, B=None, Tq=4, Tk=5, kpm="bool", avg=False, note="GQA unbatched, (T_k) padding")
case("gqa_no_bias_need_weights_false", 16, 4, kv=2, bias=False, need_weights=False, Tq=5, note="GQA without biases")
case("mqa_kdim_vdim", 8, 2, kv=1, kdim=10, vdim=6, Tq=3, Tk=4, note="MQA with kdim=10, vdim=6")
case("gqa_causal_kpm_per_head_seq_first", 16, 4, kv=2, B=2, Tq=5, causal=True, kpm="bool", batch_first=False,
     avg=False, note="GQA causal + key padding, seq-first, per-head")
case("gqa_T1", 8, 4, kv=2, B=1, Tq=1, causal=True, note="GQA T=1")


def make_params(c, rng):
    """Parameters under the names the file uses (float32 tensors)."""
    E, h, kdim, vdim = c["E"], c["h"], c["kdim"], c["vdim"]
    d = E // h
    kv = c["kv"] or h
    P = {}
    if c["hf"]:
        P["q_proj.weight"] = weight(rng, h * d, E)
        P["k_proj.weight"] = weight(rng, kv * d, kdim)
        P["v_proj.weight"] = weight(rng, kv * d, vdim)
        P["o_proj.weight"] = weight(rng, E, h * d)
        if c["bias"]:
            P["q_proj.bias"] = rng.uniform(h * d, a=0.5)
            P["k_proj.bias"] = rng.uniform(kv * d, a=0.5)
            P["v_proj.bias"] = rng.uniform(kv * d, a=0.5)
            P["o_proj.bias"] = rng.uniform(E, a=0.5)
    else:
        if kdim == E and vdim == E:
            P["in_proj_weight"] = weight(rng, 3 * E, E)
        else:
            P["q_proj_weight"] = weight(rng, E, E)
            P["k_proj_weight"] = weight(rng, E, kdim)
            P["v_proj_weight"] = weight(rng, E, vdim)
        if c["bias"]:
            P["in_proj_bias"] = rng.uniform(3 * E, a=0.5)
        if c["bias_kv"]:
            P["bias_k"] = rng.normal(1, 1, E)
            P["bias_v"] = rng.normal(1, 1, E)
        P["out_proj.weight"] = weight(rng, E, E)
        if c["bias"]:
            P["out_proj.bias"] = rng.uniform(E, a=0.5)
    return P


def make_inputs(c, rng):
    """query/key/value in the file's layout, plus the masks (and the causal mask, not stored)."""
    E, h, B, Tq, Tk = c["E"], c["h"], c["B"], c["Tq"], c["Tk"]
    unbatched = B is None
    Bn = 1 if unbatched else B

    def layout(x):  # x is (B, T, F)
        if unbatched:
            return x[0]
        return x if c["batch_first"] else x.transpose(0, 1).contiguous()

    qb = rng.normal(Bn, Tq, E)
    if c["self_attn"]:
        kb = vb = qb
    else:
        kb = rng.normal(Bn, Tk, c["kdim"])
        vb = rng.normal(Bn, Tk, c["vdim"])
    X = {"query": layout(qb), "key": layout(kb), "value": layout(vb)}

    causal = torch.triu(torch.ones(Tq, Tk, dtype=torch.bool), diagonal=1) if c["causal"] else None
    if c["causal"]:
        assert Tq == Tk

    # key padding: (B, Tk) with True = padding
    kpm_pad = None
    kpm_val = None
    if c["kpm"]:
        kpm_pad = torch.zeros(Bn, Tk, dtype=torch.bool)
        for b in range(Bn):
            kind = b % 3 if Bn > 1 else 1
            if kind == 0 and Bn > 1:
                pass  # no padding in this batch element
            elif kind == 1:  # trailing padding
                keep = rng.randint(max(1, Tk // 2), max(1, Tk - 1))
                kpm_pad[b, keep:] = True
            else:  # scattered padding, key 0 kept
                kpm_pad[b, 1:] = rng.bern(Tk - 1, p=0.4)
        if c["rescue"] == "batch":
            kpm_pad[Bn - 1, :] = True
        if c["kpm"] == "float":
            kpm_val = rng.normal(Bn, Tk, std=1.0)
            kpm_val[kpm_pad] = float("-inf")
    if c["causal"] and kpm_pad is not None:
        assert not kpm_pad[:, 0].any()

    am = None
    nh = h
    if c["attn_mask"]:
        kind, nd = c["attn_mask"]
        shape = (Tq, Tk) if nd == 2 else (Bn * nh, Tq, Tk)
        if kind == "bool":
            am = rng.bern(*shape, p=0.35)
        else:
            am = rng.normal(*shape, std=1.5)
            if kind == "float":
                am[rng.bern(*shape, p=0.25)] = float("-inf")
        if c["rescue"] == "row":
            assert nd == 2
            am[1, :] = True
            am[Tq - 1, :] = True
        else:
            # make sure no row is fully masked over the real keys (PyTorch would give NaN)
            am3 = am.expand(Bn * nh, Tq, Tk) if nd == 2 else am
            for bh in range(Bn * nh):
                b = bh // nh
                for i in range(Tq):
                    vis = ~(am3[bh, i] if am.dtype == torch.bool else torch.isinf(am3[bh, i]))
                    if kpm_pad is not None:
                        vis &= ~kpm_pad[b]
                    if causal is not None:
                        vis &= ~causal[i]
                    if not vis.any():
                        ok = torch.ones(Tk, dtype=torch.bool)
                        if kpm_pad is not None:
                            ok &= ~kpm_pad[b]
                        if causal is not None:
                            ok &= ~causal[i]
                        j = int(torch.nonzero(ok)[0])
                        idx = (i, j) if nd == 2 else (bh, i, j)
                        am[idx] = False if am.dtype == torch.bool else 0.25
    if am is not None:
        X["attn_mask"] = am
    if c["kpm"]:
        k = kpm_pad if c["kpm"] == "bool" else kpm_val
        X["key_padding_mask"] = k[0] if unbatched else k
    return X, causal


def to64(d):
    return {k: (v.double() if v.is_floating_point() else v) for k, v in d.items()}


def ref_forward(c, P, X):
    """Independent explicit computation (also the GQA oracle). P, X: float64 tensors."""
    E, h = c["E"], c["h"]
    kv = c["kv"] or h
    d = E // h
    unbatched = X["query"].dim() == 2

    def to_bte(x):
        if unbatched:
            return x.unsqueeze(0)
        return x if c["batch_first"] else x.transpose(0, 1)

    q_in, k_in, v_in = to_bte(X["query"]), to_bte(X["key"]), to_bte(X["value"])
    B, Tq, Tk = q_in.shape[0], q_in.shape[1], k_in.shape[1]
    if c["hf"]:
        Wq, Wk, Wv, Wo = P["q_proj.weight"], P["k_proj.weight"], P["v_proj.weight"], P["o_proj.weight"]
        bq, bk, bv, bo = (P.get(n + ".bias") for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    else:
        if "in_proj_weight" in P:
            Wq, Wk, Wv = P["in_proj_weight"].chunk(3)
        else:
            Wq, Wk, Wv = P["q_proj_weight"], P["k_proj_weight"], P["v_proj_weight"]
        bq = bk = bv = None
        if "in_proj_bias" in P:
            bq, bk, bv = P["in_proj_bias"].chunk(3)
        Wo, bo = P["out_proj.weight"], P.get("out_proj.bias")

    def lin(x, W, b):
        y = x @ W.T
        return y + b if b is not None else y

    Q = lin(q_in, Wq, bq)  # (B, Tq, h*d)
    K = lin(k_in, Wk, bk)  # (B, Tk, kv*d)
    V = lin(v_in, Wv, bv)
    if c["bias_kv"]:
        K = torch.cat([K, P["bias_k"].reshape(1, 1, -1).expand(B, 1, -1)], dim=1)
        V = torch.cat([V, P["bias_v"].reshape(1, 1, -1).expand(B, 1, -1)], dim=1)
    Q = Q.reshape(B, Tq, h, d).transpose(1, 2)
    K = K.reshape(B, K.shape[1], kv, d).transpose(1, 2)
    V = V.reshape(B, V.shape[1], kv, d).transpose(1, 2)
    if c["zero_attn"]:
        K = torch.cat([K, torch.zeros(B, kv, 1, d, dtype=K.dtype)], dim=2)
        V = torch.cat([V, torch.zeros(B, kv, 1, d, dtype=V.dtype)], dim=2)
    S = K.shape[2]
    K = K.repeat_interleave(h // kv, dim=1)  # query head i uses kv head i // (h // kv)
    V = V.repeat_interleave(h // kv, dim=1)
    scores = (Q / math.sqrt(d)) @ K.transpose(-1, -2)  # (B, h, Tq, S)
    add = torch.zeros(B, h, Tq, S, dtype=scores.dtype)
    allowed = torch.ones(B, h, Tq, S, dtype=torch.bool)
    if "attn_mask" in X:
        m = X["attn_mask"]
        m = m.reshape(1, 1, Tq, Tk) if m.dim() == 2 else m.reshape(B, h, Tq, Tk)
        if m.dtype == torch.bool:
            allowed[..., :Tk] &= ~m
        else:
            add[..., :Tk] += m
    if "key_padding_mask" in X:
        m = X["key_padding_mask"].reshape(B, 1, 1, Tk)
        if m.dtype == torch.bool:
            allowed[..., :Tk] &= ~m
        else:
            add[..., :Tk] += m
    if c["causal"]:
        allowed[..., :Tk] &= torch.tril(torch.ones(Tq, Tk, dtype=torch.bool))
    scores = (scores + add).masked_fill(~allowed, float("-inf"))
    Pw = torch.softmax(scores, dim=-1)
    O = (Pw @ V).transpose(1, 2).reshape(B, Tq, h * d)
    out = lin(O, Wo, bo)
    if unbatched:
        out = out[0]
    elif not c["batch_first"]:
        out = out.transpose(0, 1)
    w = None
    if c["need_weights"]:
        w = Pw.mean(dim=1) if c["avg"] else Pw
        if unbatched:
            w = w[0]
    return out, w


def torch_forward(c, P, X, causal, dtype):
    """torch.nn.MultiheadAttention on the case (not for GQA)."""
    E, h = c["E"], c["h"]
    assert (c["kv"] or h) == h
    m = torch.nn.MultiheadAttention(E, h, dropout=0.0, bias=c["bias"], add_bias_kv=c["bias_kv"],
                                    add_zero_attn=c["zero_attn"], kdim=c["kdim"], vdim=c["vdim"],
                                    batch_first=c["batch_first"])
    m = m.to(dtype)
    if c["hf"]:
        mp = {}
        if c["kdim"] == E and c["vdim"] == E:
            mp["in_proj_weight"] = torch.cat([P["q_proj.weight"], P["k_proj.weight"], P["v_proj.weight"]])
        else:
            mp["q_proj_weight"], mp["k_proj_weight"], mp["v_proj_weight"] = (
                P["q_proj.weight"], P["k_proj.weight"], P["v_proj.weight"])
        if c["bias"]:
            mp["in_proj_bias"] = torch.cat([P["q_proj.bias"], P["k_proj.bias"], P["v_proj.bias"]])
            mp["out_proj.bias"] = P["o_proj.bias"]
        mp["out_proj.weight"] = P["o_proj.weight"]
    else:
        mp = P
    names = dict(m.named_parameters())
    assert set(names) == set(mp), (sorted(names), sorted(mp))
    with torch.no_grad():
        for n, p in names.items():
            p.copy_(mp[n].to(dtype))
    for p in m.parameters():
        assert p.requires_grad
    m.eval()

    q = X["query"].to(dtype)
    if c["self_attn"]:
        k = v = q  # same tensor object, as real self-attention would pass
    else:
        k, v = X["key"].to(dtype), X["value"].to(dtype)
    am = X.get("attn_mask")
    kpm = X.get("key_padding_mask")
    am = am.to(dtype) if am is not None and am.is_floating_point() else am
    kpm = kpm.to(dtype) if kpm is not None and kpm.is_floating_point() else kpm
    if causal is not None:  # 1.13 has no is_causal: pass the top-left causal mask explicitly
        if am is None:
            am = causal
        elif am.dtype == torch.bool:
            am = am | causal
        else:
            am = am.masked_fill(causal, float("-inf"))
    if kpm is not None and kpm.is_floating_point() and am is not None:
        # PyTorch 1.13 cannot combine a float key_padding_mask with an attn_mask (masked_fill with
        # a float mask raises; with a bool attn_mask it would logical_or the float values). Give it
        # the sum, as PyTorch >= 2.0 does, as one 3-D float mask.
        unb = q.dim() == 2
        Bn = 1 if unb else kpm.shape[0]
        Tq, Tk = am.shape[-2], am.shape[-1]
        if am.dtype == torch.bool:
            am = torch.zeros(am.shape, dtype=dtype).masked_fill(am, float("-inf"))
        am3 = am.expand(Bn * h, Tq, Tk) if am.dim() == 2 else am
        am = (am3.reshape(Bn, h, Tq, Tk) + kpm.reshape(Bn, 1, 1, Tk)).reshape(Bn * h, Tq, Tk)
        kpm = None
    with torch.enable_grad():
        out, w = m(q, k, v, key_padding_mask=kpm, need_weights=c["need_weights"], attn_mask=am,
                   average_attn_weights=c["avg"])
    return out.detach(), (w.detach() if w is not None else None)


def ratio(got, want):
    """Worst |got - want| / (ATOL + RTOL |want|)."""
    got, want = got.double(), want.double()
    return float(((got - want).abs() / (ATOL + RTOL * want.abs())).max())


def metadata(c):
    md = {
        "format": "mha-case/1",
        "embed_dim": c["E"], "num_heads": c["h"], "kdim": c["kdim"], "vdim": c["vdim"],
        "bias": c["bias"], "add_bias_kv": c["bias_kv"], "add_zero_attn": c["zero_attn"],
        "batch_first": c["batch_first"], "need_weights": c["need_weights"],
        "average_attn_weights": c["avg"], "is_causal": c["causal"],
    }
    if c["kv"] is not None or c["kv_meta"]:
        md["num_kv_heads"] = c["kv"] or c["h"]
    return {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in md.items()}


def np32(t):
    return t.detach().numpy().astype(np.bool_ if t.dtype == torch.bool else np.float32)


def gen_forward():
    os.makedirs(FWD_DIR, exist_ok=True)
    names = [c["name"] for c in FWD_CASES]
    assert len(names) == len(set(names))
    report = []
    for c in FWD_CASES:
        rng = Rng(c["name"])
        P = make_params(c, rng)
        X, causal = make_inputs(c, rng)
        P64, X64 = to64(P), to64(X)
        ref_out, ref_w = ref_forward(c, P64, X64)
        is_gqa = (c["kv"] or c["h"]) != c["h"]
        if is_gqa:
            out, w = ref_out, ref_w
            f32_ratio = None
        else:
            out, w = torch_forward(c, P64, X64, causal, torch.float64)
            assert torch.allclose(out, ref_out, atol=1e-10, rtol=1e-9), c["name"]
            if w is not None:
                assert torch.allclose(w, ref_w, atol=1e-12), c["name"]
            o32, w32 = torch_forward(c, P, X, causal, torch.float32)
            f32_ratio = ratio(o32, out)
            if w is not None:
                f32_ratio = max(f32_ratio, ratio(w32, w))
            assert f32_ratio < 0.25, (c["name"], f32_ratio)
        assert torch.isfinite(out).all(), c["name"]
        assert (w is None) == (not c["need_weights"])
        tensors = {k: np32(v) for k, v in P.items()}
        tensors.update({k: np32(v) for k, v in X.items()})
        tensors["expected.output"] = np32(out)
        if w is not None:
            assert torch.isfinite(w).all()
            tensors["expected.attn_weights"] = np32(w)
        path = os.path.join(FWD_DIR, c["name"] + ".safetensors")
        md = metadata(c)
        write_safetensors(path, tensors, md)
        # read back and compare
        md2, t2 = read_safetensors(path)
        assert md2 == md, c["name"]
        assert sorted(t2) == sorted(tensors), c["name"]
        for k, v in tensors.items():
            assert t2[k].dtype == v.dtype and t2[k].shape == v.shape, (c["name"], k)
            assert np.array_equal(t2[k], v), (c["name"], k)  # -inf compares equal; no NaN stored
        size = os.path.getsize(path)
        assert size < MAX_FILE_BYTES, (c["name"], size)
        report.append((c["name"], size, f32_ratio, c["note"]))
    return report


# --------------------------------------------------------------------------------------------
# SDPA cases

SDPA_CASES = []


def sdpa_case(name, B, h, Tq, Tk, d, *, kv=None, dv=None, causal="none", scale=None, allowed=None, bias=None,
              full_row=False, note=""):
    """allowed / bias: None or a broadcast shape pattern string like 'B1' (B|1, h|1 for the first two dims)."""
    SDPA_CASES.append(dict(name=name, B=B, h=h, kv=kv or h, Tq=Tq, Tk=Tk, d=d, dv=dv or d, causal=causal,
                           scale=scale, allowed=allowed, bias=bias, full_row=full_row, note=note))


sdpa_case("basic", 2, 2, 5, 5, 4, note="no mask")
sdpa_case("dv_ne_d", 2, 2, 4, 6, 3, dv=7, note="d=3, d_v=7, T_q != T_k")
sdpa_case("gqa_h4_kv2", 2, 4, 5, 6, 4, kv=2, note="GQA: head i reads K/V head i // 2")
sdpa_case("mqa_h3_kv1_dv5", 1, 3, 4, 5, 4, kv=1, dv=5, note="MQA with d_v != d")
sdpa_case("causal_top_left_square", 2, 2, 6, 6, 4, causal="top_left", note="T_q = T_k")
sdpa_case("causal_top_left_tq_lt_tk", 1, 2, 3, 7, 4, causal="top_left", note="query i sees keys <= i")
sdpa_case("causal_bottom_right_tq_lt_tk", 1, 2, 3, 7, 4, causal="bottom_right", note="query i sees keys <= i + 4")
sdpa_case("causal_top_left_tq_gt_tk", 1, 2, 7, 4, 4, causal="top_left", note="T_q > T_k, top-left")
sdpa_case("causal_bottom_right_tq_gt_tk", 1, 2, 6, 3, 4, causal="bottom_right",
          note="T_q > T_k: queries 0..2 see no key -> zeros, lse -inf")
sdpa_case("T1", 1, 1, 1, 1, 1, note="T_q = T_k = 1, d = 1")
sdpa_case("decode_tq1_bottom_right", 2, 2, 1, 9, 8, causal="bottom_right", note="T_q = 1 sees all 9 keys")
sdpa_case("allowed_full", 2, 2, 4, 5, 4, allowed="Bh", note="allowed (B, h, T_q, T_k)")
sdpa_case("allowed_bcast_bias_batch", 2, 2, 4, 5, 4, allowed="11", bias="B1",
          note="allowed (1, 1, T_q, T_k), bias (B, 1, T_q, T_k)")
sdpa_case("allowed_key_padding_causal_br", 3, 2, 4, 6, 4, allowed="B1pad", causal="bottom_right",
          note="key padding as allowed (B, 1, T_q, T_k) + bottom-right causal")
sdpa_case("bias_neg_inf_per_head", 2, 3, 4, 5, 2, bias="1h", note="bias (1, h, T_q, T_k) with -inf entries")
sdpa_case("scale_custom_dv_ne_d", 2, 2, 3, 4, 6, dv=2, scale=0.125, note="scale=0.125, d=6, d_v=2")
sdpa_case("fully_masked_row", 1, 2, 4, 5, 4, allowed="1h", full_row=True,
          note="rows with no allowed key -> out 0, weights 0, lse -inf")
sdpa_case("gqa_everything", 2, 4, 3, 6, 4, kv=2, dv=5, causal="bottom_right", scale=0.3, allowed="B1", bias="Bh",
          note="GQA + allowed + bias + bottom-right causal + scale")
sdpa_case("head_dim16", 1, 1, 8, 8, 16, causal="top_left", note="d=16")


def bshape(pat, B, h, Tq, Tk):
    return (B if pat[0] == "B" else 1, h if pat[1] == "h" else 1, Tq, Tk)


def sdpa_ref(q, k, v, allowed, bias, causal, scale):
    """float64 SDPA: scale, + bias, masking, softmax; fully masked rows -> zeros, lse -inf."""
    B, h, Tq, d = q.shape
    kv, Tk = k.shape[1], k.shape[2]
    kr = k.repeat_interleave(h // kv, dim=1)
    vr = v.repeat_interleave(h // kv, dim=1)
    s = scale * (q @ kr.transpose(-1, -2))
    if bias is not None:
        s = s + bias
    ok = torch.ones(B, h, Tq, Tk, dtype=torch.bool)
    if allowed is not None:
        ok &= allowed
    if causal != "none":
        off = 0 if causal == "top_left" else Tk - Tq
        i = torch.arange(Tq).reshape(Tq, 1)
        j = torch.arange(Tk).reshape(1, Tk)
        ok &= j <= i + off
    s = s.masked_fill(~ok, float("-inf"))
    mx = s.max(dim=-1, keepdim=True).values
    dead = torch.isinf(mx) & (mx < 0)
    mx = torch.where(dead, torch.zeros_like(mx), mx)
    e = torch.exp(s - mx)
    z = e.sum(dim=-1, keepdim=True)
    w = torch.where(dead, torch.zeros_like(e), e / torch.where(dead, torch.ones_like(z), z))
    lse = torch.where(dead, torch.full_like(z, float("-inf")), mx + torch.log(z)).squeeze(-1)
    return w @ vr, w, lse


def sdpa_loops(q, k, v, allowed, bias, causal, scale):
    """The same by scalar loops in numpy (an independent check of sdpa_ref)."""
    q, k, v = q.numpy(), k.numpy(), v.numpy()
    B, h, Tq, d = q.shape
    kv, Tk, dv = k.shape[1], k.shape[2], v.shape[3]
    out = np.zeros((B, h, Tq, dv))
    lse = np.full((B, h, Tq), -np.inf)
    for b in range(B):
        for i in range(h):
            g = i // (h // kv)
            for t in range(Tq):
                sc = []
                for j in range(Tk):
                    a = allowed is None or bool(allowed[min(b, allowed.shape[0] - 1), min(i, allowed.shape[1] - 1), t, j])
                    if causal == "top_left":
                        a = a and j <= t
                    elif causal == "bottom_right":
                        a = a and j <= t + Tk - Tq
                    x = scale * float(np.dot(q[b, i, t], k[b, g, j]))
                    if bias is not None:
                        x += float(bias[min(b, bias.shape[0] - 1), min(i, bias.shape[1] - 1), t, j])
                    sc.append(x if a else -math.inf)
                m = max(sc)
                if m == -math.inf:
                    continue
                ex = [math.exp(x - m) for x in sc]
                z = sum(ex)
                lse[b, i, t] = m + math.log(z)
                out[b, i, t] = sum(ex[j] / z * v[b, g, j] for j in range(Tk))
    return out, lse


def sdpa_inputs(c, rng):
    """q, k, v and the case's mask / bias drawn from rng, as a dict of named tensors plus allowed and
    bias (None when the case has none). generate_grad.py draws the same stream for its gradients."""
    B, h, kv, Tq, Tk, d, dv = c["B"], c["h"], c["kv"], c["Tq"], c["Tk"], c["d"], c["dv"]
    q, k, v = rng.normal(B, h, Tq, d), rng.normal(B, kv, Tk, d), rng.normal(B, kv, Tk, dv)
    T = {"q": q, "k": k, "v": v}
    allowed = bias = None
    if c["allowed"]:
        pat = c["allowed"]
        shape = bshape(pat, B, h, Tq, Tk)
        if pat.endswith("pad"):  # per-batch key padding, same for every query
            allowed = torch.ones(shape, dtype=torch.bool)
            for b in range(B):
                n = max(1, Tk - b - 1 - rng.randint(0, 1)) if b > 0 else Tk
                allowed[b, :, :, n:] = False
                allowed[b, :, :, 0] = True
        else:
            allowed = ~rng.bern(*shape, p=0.3)
        if c["full_row"]:
            allowed[0, 0, 1, :] = False
            allowed[0, shape[1] - 1, 3, :] = False
        T["allowed"] = allowed
    if c["bias"]:
        shape = bshape(c["bias"], B, h, Tq, Tk)
        bias = rng.normal(*shape, std=1.0)
        bias[rng.bern(*shape, p=0.2)] = float("-inf")
        T["bias"] = bias
    return T, allowed, bias


def gen_sdpa():
    os.makedirs(SDPA_DIR, exist_ok=True)
    report = []
    for c in SDPA_CASES:
        rng = Rng("sdpa/" + c["name"])
        B, h, kv, Tq, Tk, d, dv = c["B"], c["h"], c["kv"], c["Tq"], c["Tk"], c["d"], c["dv"]
        T, allowed, bias = sdpa_inputs(c, rng)
        q, k, v = T["q"], T["k"], T["v"]
        scale = c["scale"] if c["scale"] is not None else 1.0 / math.sqrt(d)
        q64, k64, v64 = q.double(), k.double(), v.double()
        b64 = bias.double() if bias is not None else None
        out, w, lse = sdpa_ref(q64, k64, v64, allowed, b64, c["causal"], scale)
        lo, ll = sdpa_loops(q64, k64, v64, allowed, b64, c["causal"], scale)
        assert np.allclose(out.numpy(), lo, atol=1e-12), c["name"]
        assert np.array_equal(np.isinf(lse.numpy()), np.isinf(ll)), c["name"]
        fin = np.isfinite(ll)
        assert np.allclose(lse.numpy()[fin], ll[fin], atol=1e-12), c["name"]
        assert torch.isfinite(out).all() and torch.isfinite(w).all()
        dead_rows = int(torch.isinf(lse).sum())
        assert (dead_rows > 0) == (c["full_row"] or (c["causal"] == "bottom_right" and Tq > Tk)), c["name"]
        # without masking and bias, compare with the softmax of nn.functional on its own
        if allowed is None and bias is None and c["causal"] == "none":
            sm = F.softmax(scale * q64 @ k64.repeat_interleave(h // kv, 1).transpose(-1, -2), dim=-1)
            assert torch.allclose(sm, w, atol=1e-12)
        md = {"format": "mha-sdpa/1", "causal": c["causal"]}
        if c["scale"] is not None:
            md["scale"] = repr(float(c["scale"]))
        tensors = {n: np32(t) for n, t in T.items()}
        tensors["expected.out"] = np32(out)
        tensors["expected.weights"] = np32(w)
        tensors["expected.lse"] = np32(lse)
        path = os.path.join(SDPA_DIR, c["name"] + ".safetensors")
        write_safetensors(path, tensors, md)
        md2, t2 = read_safetensors(path)
        assert md2 == md and sorted(t2) == sorted(tensors)
        for n, a in tensors.items():
            assert t2[n].dtype == a.dtype and t2[n].shape == a.shape and np.array_equal(t2[n], a), (c["name"], n)
        size = os.path.getsize(path)
        assert size < MAX_FILE_BYTES, (c["name"], size)
        report.append((c["name"], size, dead_rows, c["note"]))
    return report


def main():
    fwd = gen_forward()
    sd = gen_sdpa()
    total = 0
    for name, size, r, note in fwd:
        total += size
        rs = "explicit GQA code" if r is None else f"f32 torch vs f64: {r:.3f}x tol"
        print(f"forward/{name:40s} {size:6d} B  {rs:28s} {note}")
    for name, size, dead, note in sd:
        total += size
        print(f"sdpa/{name:40s} {size:6d} B  fully-masked rows: {dead:<3d} {note}")
    print(f"{len(fwd)} forward cases, {len(sd)} sdpa cases, {total} bytes")
    assert total < 1024 * 1024
    return 0


if __name__ == "__main__":
    sys.exit(main())
