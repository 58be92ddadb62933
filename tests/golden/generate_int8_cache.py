#!/usr/bin/python3
"""Generate the int8 KV-cache golden case (deterministic; run with Debian's python3-torch).

    /usr/bin/python3 tests/golden/generate_int8_cache.py

Writes tests/golden/int8_cache/decode_gqa.safetensors, read by tests/test_kv_int8.cpp: q (B, h,
T_q, d), k, v (B, kv, T, d) as appended, their int8 round trips k_dequant / v_dequant, and out
(B, h, T_q, d), the attention of q over the dequantised cache with every key visible (the
queries come after the cache). The quantisation is mha's CacheDtype::I8, per row (one token of
one K/V head), in float32:
    scale = max|x| / 127,   q = round_half_even(x / scale) clamped to ±127,   x' = q · scale
(a row of zeros: scale 0, x' = 0). Attention in float64; query head i reads K/V head i // (h/kv).
Row 3 of K head 0 is zeros. Seed: crc32 of the case name.

Also decode_gqa_channel.safetensors: the same with keys quantised per channel (KvCacheConfig's
Int8KeyScales::PerChannel, KIVI): one scale per channel of each group of key_group positions,
    scale[g][x] = max over the group's positions of |k[p][x]| / 127,
the last group possibly partial; key channel 1 of K head 1 is 30x the others (an outlier
channel), and channel 2 of the first group of K head 0 is zeros. Values stay per row.
"""
import os
import sys
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate import write_small_case  # noqa: E402  (same writer as the other goldens)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "int8_cache")


def quantise(x):
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale > 0, torch.round(x / safe).clamp(-127, 127), torch.zeros_like(x))
    return q * scale


def quantise_channels(x, group):
    """Per channel of each group of `group` positions (dim -2), as mha's per-channel key scales."""
    out = torch.empty_like(x)
    for g0 in range(0, x.shape[-2], group):
        part = x[..., g0:g0 + group, :]
        scale = part.abs().amax(dim=-2, keepdim=True) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.where(scale > 0, torch.round(part / safe).clamp(-127, 127), torch.zeros_like(part))
        out[..., g0:g0 + group, :] = q * scale
    return out


def case(name, B, h, kv, Tq, T, d, key_group=0):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode("utf-8")))

    def rand(*shape, scale=1.0):
        return ((torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1) * scale).float()

    q, k, v = rand(B, h, Tq, d, scale=2.0), rand(B, kv, T, d, scale=2.0), rand(B, kv, T, d)
    k[0, 0, 3, :] = 0.0
    meta = {"format": "mha-int8-cache/1"}
    if key_group:
        k[:, 1, :, 1] *= 30.0
        k[:, 0, :key_group, 2] = 0.0
        kd, vd = quantise_channels(k, key_group), quantise(v)
        meta["key_group"] = key_group
    else:
        kd, vd = quantise(k), quantise(v)
    K = kd.double().repeat_interleave(h // kv, dim=1)
    V = vd.double().repeat_interleave(h // kv, dim=1)
    s = q.double() @ K.transpose(-1, -2) / d ** 0.5
    out = torch.softmax(s, dim=-1) @ V
    write_small_case(OUT, name, {"q": q, "k": k, "v": v, "k_dequant": kd, "v_dequant": vd, "out": out.float()},
                     meta)


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.set_num_threads(1)
    case("decode_gqa", 2, 4, 2, 2, 24, 8)
    case("decode_gqa_channel", 2, 4, 2, 2, 27, 8, key_group=8)


if __name__ == "__main__":
    main()
