#!/usr/bin/python3
"""Generate the score-edit golden cases: ALiBi, logit softcapping, learned attention sinks
(deterministic; run with Debian's python3-torch).

    /usr/bin/python3 tests/golden/generate_score_edits.py

Writes tests/golden/edits/*.safetensors, read by tests/test_score_edits.cpp. Each case holds
q (B, h, T_q, d), k, v (B, kv, T_k, ·), d_out, and per head `slopes` / `sinks` when used, and
the expected out, lse (B, h, T_q) and gradients dq, dk, dv (and dsinks) from torch.autograd.

The edits are written out as explicit score edits, in float64, the way the models do them:
    s = q kᵀ · scale                               (scale = 1/√d)
    s = c · tanh(s / c)                            Gemma 2's attn_logit_softcapping, before masks
    s = s − m_h · (q_pos − k_pos)                  ALiBi (BLOOM / Press et al.); q_pos = i + T_k − T_q
    s = masked_fill(causal, −inf)                  bottom-right causal when the case is causal
    p = softmax(cat(s, sink_h)) without its last column   gpt-oss's learned sinks
    out = p v,   lse = logsumexp(cat(s, sink_h))
Metadata: softcap (0 = off), causal (true/false). Seeds: crc32 of the case name.
"""
import math
import os
import sys
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate import write_small_case  # noqa: E402  (same writer as the other goldens)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "edits")


def gen(name):
    return torch.Generator().manual_seed(zlib.crc32(name.encode("utf-8")))


def bloom_slopes(n):
    """BLOOM's build_alibi_tensor slopes, for any head count."""
    closest = 2 ** math.floor(math.log2(n))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != n:
        extra = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** (i + 1) for i in range(0, 2 * (n - closest), 2)]
    return torch.tensor(slopes, dtype=torch.float64)


def case(name, B, h, kv, Tq, Tk, d, alibi, softcap, sinks, causal):
    g = gen(name)

    def rand(*shape, scale=1.0):
        return ((torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1) * scale).float()

    q, k, v = rand(B, h, Tq, d, scale=2.0), rand(B, kv, Tk, d, scale=2.0), rand(B, kv, Tk, d)
    d_out = rand(B, h, Tq, d)
    sink = rand(h, scale=1.5) if sinks else None
    slopes = bloom_slopes(h).float() if alibi else None

    Q, K, V = (x.double().requires_grad_() for x in (q, k, v))
    Z = sink.double().requires_grad_() if sinks else None
    Kr, Vr = K.repeat_interleave(h // kv, dim=1), V.repeat_interleave(h // kv, dim=1)
    s = Q @ Kr.transpose(-1, -2) / math.sqrt(d)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    q_pos = torch.arange(Tq).view(Tq, 1) + (Tk - Tq)
    dist = (q_pos - torch.arange(Tk).view(1, Tk)).double()
    if alibi:
        s = s - slopes.double().view(1, h, 1, 1) * dist
    if causal:
        s = s.masked_fill(dist < 0, float("-inf"))
    if sinks:
        s = torch.cat((s, Z.view(1, h, 1, 1).expand(B, h, Tq, 1)), dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks:
        p = p[..., :Tk]
    out = p @ Vr
    (out * d_out.double()).sum().backward()

    t = {"q": q, "k": k, "v": v, "d_out": d_out, "out": out.detach().float(), "lse": lse.detach().float(),
         "dq": Q.grad.float(), "dk": K.grad.float(), "dv": V.grad.float()}
    if alibi:
        t["slopes"] = slopes
    if sinks:
        t["sinks"] = sink
        t["dsinks"] = Z.grad.float()
    write(name, t, {"format": "mha-score-edits/1", "softcap": softcap, "causal": "true" if causal else "false"})


def write(name, tensors, meta):
    write_small_case(OUT, name, tensors, meta)


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.set_num_threads(1)
    case("alibi_causal_gqa", 1, 6, 3, 5, 7, 8, True, 0.0, False, True)
    case("softcap_noncausal", 2, 2, 2, 4, 6, 8, False, 2.0, False, False)
    case("sinks_causal", 1, 4, 2, 6, 6, 8, False, 0.0, True, True)
    case("all_edits_decode_shape", 2, 4, 1, 3, 9, 8, True, 1.5, True, True)


if __name__ == "__main__":
    main()
