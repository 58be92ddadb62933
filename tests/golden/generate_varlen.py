#!/usr/bin/python3
"""Generate the packed variable-length (varlen) golden cases (deterministic; Debian's python3-torch).

    /usr/bin/python3 tests/golden/generate_varlen.py

Writes tests/golden/varlen/*.safetensors, read by tests/test_varlen.cpp. Each holds packed
q (total_q, h, d), k (total_k, kv, d), v (total_k, kv, d_v), d_out (total_q, h, d_v), the offsets
cu_q / cu_k (B + 1, as float32) and, computed in float64 by plain PyTorch as a loop over the
sequences (each one an ordinary attention with its own causal mask, GQA by repeat_interleave):
out (total_q, h, d_v), lse (total_q, h) and the autograd gradients dq, dk, dv. Metadata: causal
("none", "top_left", "bottom_right") and window. Seeds: crc32 of the case name.
"""
import os
import sys
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate import read_safetensors, write_safetensors  # noqa: E402  (same writer as the other goldens)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "varlen")


def visible(tq, tk, causal, window):
    """(tq, tk) bool: query i sees key j (mha/masks.h, Causal)."""
    if causal == "none":
        return torch.ones(tq, tk, dtype=torch.bool)
    off = 0 if causal == "top_left" else tk - tq
    i = torch.arange(tq).unsqueeze(1)
    j = torch.arange(tk).unsqueeze(0)
    ok = j <= i + off
    if window > 0:
        ok = ok & (j > i + off - window)
    return ok


def case(name, h, kv, d, dv, lens_q, lens_k, causal, window):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode("utf-8")))
    nq, nk = sum(lens_q), sum(lens_k)

    def rnd(*shape):
        return (torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1).float()

    q, k, v, dout = rnd(nq, h, d), rnd(nk, kv, d), rnd(nk, kv, dv), rnd(nq, h, dv)
    cu_q = [0]
    cu_k = [0]
    for a, b in zip(lens_q, lens_k):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    Q, K, V = (t.double().requires_grad_(True) for t in (q, k, v))
    outs, lses = [], []
    for s in range(len(lens_q)):
        qs = Q[cu_q[s]:cu_q[s + 1]].transpose(0, 1)  # (h, Tq, d)
        ks = K[cu_k[s]:cu_k[s + 1]].transpose(0, 1).repeat_interleave(h // kv, dim=0)
        vs = V[cu_k[s]:cu_k[s + 1]].transpose(0, 1).repeat_interleave(h // kv, dim=0)
        scores = qs @ ks.transpose(-1, -2) / d ** 0.5
        scores = scores.masked_fill(~visible(lens_q[s], lens_k[s], causal, window), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # (h, Tq); −inf for a row that sees nothing
        p = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
        outs.append((p @ vs).transpose(0, 1))  # (Tq, h, dv); zeros for a row that sees nothing
        lses.append(lse.transpose(0, 1))
    out = torch.cat(outs, 0)
    lse = torch.cat(lses, 0).detach()
    out.backward(dout.double())
    tensors = {"q": q, "k": k, "v": v, "d_out": dout,
               "cu_q": torch.tensor(cu_q, dtype=torch.float32), "cu_k": torch.tensor(cu_k, dtype=torch.float32),
               "out": out.detach().float(), "lse": lse.float(),
               "dq": Q.grad.float(), "dk": K.grad.float(), "dv": V.grad.float()}
    path = os.path.join(OUT, name + ".safetensors")
    write_safetensors(path, {n: t.numpy() for n, t in tensors.items()},
                      {"format": "mha-varlen/1", "causal": causal, "window": window})
    _, back = read_safetensors(path)
    for n, t in tensors.items():
        assert (back[n] == t.numpy()).all(), (name, n)
    assert os.path.getsize(path) < 20 * 1024, path


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.set_num_threads(1)
    case("gqa_bottom_right", 4, 2, 8, 6, [3, 0, 1, 5], [4, 2, 1, 5], "bottom_right", 0)
    case("self_top_left_window", 2, 2, 4, 4, [1, 6, 3], [1, 6, 3], "top_left", 2)
    case("cross_none", 3, 1, 5, 3, [2, 4], [7, 1], "none", 0)


if __name__ == "__main__":
    main()
