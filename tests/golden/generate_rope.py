#!/usr/bin/python3
"""Generate the rotary-embedding (RoPE) golden cases (deterministic; run with Debian's python3-torch).

    /usr/bin/python3 tests/golden/generate_rope.py

Writes tests/golden/rope/*.safetensors, read by tests/test_decode.cpp:
  rope_*.safetensors    x (B, h, T, d), start (B) → expected: x rotated at positions start[b] + t
  module_*.safetensors  a Llama-style attention layer (GQA, no biases, RoPE on Q and K, causal)
                        written out in torch: query (B, T, E), in_proj_weight, out_proj_weight → output

The half-split layout is Hugging Face Llama's formulation, written out:
    inv_freq = 1 / theta ** (arange(0, dims, 2) / dims);  freqs = pos ⊗ inv_freq
    emb = cat(freqs, freqs);  rotate_half(x) = cat(−x[dims/2:], x[:dims/2])
    x' = x · cos(emb) + rotate_half(x) · sin(emb)      (features past `dims` pass through)
The interleaved layout is GPT-J's: pairs (2i, 2i+1) rotated by freqs[i].
Everything is computed in float64 and rounded to float32 once. Seeds: crc32 of the case name.
"""
import os
import sys
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate import write_small_case  # noqa: E402  (same writer as the other goldens)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rope")


def gen(name):
    return torch.Generator().manual_seed(zlib.crc32(name.encode("utf-8")))


def angles(pos, dims, theta):
    inv_freq = 1.0 / (theta ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims))
    return torch.outer(pos.to(torch.float64), inv_freq)  # (T, dims/2)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_half_split(x, pos, dims, theta):
    """x (..., T, d) float64; Hugging Face's apply_rotary_pos_emb on the first `dims` features."""
    freqs = angles(pos, dims, theta)
    emb = torch.cat((freqs, freqs), dim=-1)
    rot, rest = x[..., :dims], x[..., dims:]
    return torch.cat((rot * emb.cos() + rotate_half(rot) * emb.sin(), rest), dim=-1)


def rope_interleaved(x, pos, dims, theta):
    freqs = angles(pos, dims, theta)
    c, s = freqs.cos(), freqs.sin()
    out = x.clone()
    a, b = x[..., 0:dims:2], x[..., 1:dims:2]
    out[..., 0:dims:2] = a * c - b * s
    out[..., 1:dims:2] = b * c + a * s
    return out


def rope(x, pos, dims, theta, layout):
    return (rope_half_split if layout == "half_split" else rope_interleaved)(x, pos, dims, theta)


def kernel_case(name, B, h, T, d, dims, theta, layout, starts):
    g = gen(name)
    x = (torch.rand(B, h, T, d, generator=g, dtype=torch.float64) * 2 - 1).float()
    out = torch.empty_like(x)
    for b in range(B):
        pos = torch.arange(T, dtype=torch.int64) + starts[b]
        out[b] = rope(x[b].double(), pos, dims, theta, layout).float()
    write(name, {"x": x, "start": torch.tensor(starts, dtype=torch.float32), "expected": out},
          {"format": "mha-rope/1", "dims": dims, "theta": theta, "layout": layout})


def module_case(name, B, T, E, h, kv, dims, theta, layout):
    """q/k/v projections (no bias), RoPE at 0..T-1, causal GQA attention, output projection."""
    g = gen(name)
    d = E // h
    w_in = (torch.rand((h + 2 * kv) * d, E, generator=g, dtype=torch.float64) * 2 - 1).float() / E ** 0.5
    w_out = (torch.rand(E, h * d, generator=g, dtype=torch.float64) * 2 - 1).float() / (h * d) ** 0.5
    x = (torch.rand(B, T, E, generator=g, dtype=torch.float64) * 2 - 1).float()
    X, Wi, Wo = x.double(), w_in.double(), w_out.double()
    q = (X @ Wi[: h * d].T).view(B, T, h, d).transpose(1, 2)
    k = (X @ Wi[h * d:(h + kv) * d].T).view(B, T, kv, d).transpose(1, 2)
    v = (X @ Wi[(h + kv) * d:].T).view(B, T, kv, d).transpose(1, 2)
    pos = torch.arange(T)
    q, k = rope(q, pos, dims, theta, layout), rope(k, pos, dims, theta, layout)
    k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)  # Llama's repeat_kv
    scores = q @ k.transpose(-1, -2) / d ** 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    heads = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, h * d)
    out = (heads @ Wo.T).float()
    write(name, {"query": x, "in_proj_weight": w_in, "out_proj_weight": w_out, "expected": out},
          {"format": "mha-rope-module/1", "embed_dim": E, "num_heads": h, "num_kv_heads": kv, "dims": dims,
           "theta": theta, "layout": layout})


def write(name, tensors, meta):
    write_small_case(OUT, name, tensors, meta)


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.set_num_threads(1)
    kernel_case("rope_half_split_full", 2, 3, 5, 8, 8, 10000.0, "half_split", [0, 7])
    kernel_case("rope_half_split_partial", 2, 2, 4, 12, 8, 500000.0, "half_split", [1000, 4093])
    kernel_case("rope_interleaved_partial", 1, 3, 4, 8, 6, 10000.0, "interleaved", [100000])
    kernel_case("rope_interleaved_full", 2, 1, 3, 16, 16, 10000.0, "interleaved", [0, 31])
    module_case("module_llama_gqa", 2, 7, 32, 4, 2, 8, 10000.0, "half_split")
    module_case("module_gptj_partial", 1, 6, 24, 2, 2, 8, 10000.0, "interleaved")


if __name__ == "__main__":
    main()
