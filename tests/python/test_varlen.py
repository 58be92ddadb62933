"""mha.sdpa_varlen: packed variable-length sequences, against the PyTorch goldens (a loop over
sequences in plain PyTorch) and against mha.sdpa run on each sequence alone."""
import os

import numpy as np
import pytest

import mha
from conftest import GOLDEN


def test_varlen_goldens():
    for name in ("gqa_bottom_right", "self_top_left_window", "cross_none"):
        tensors, meta = mha.load_safetensors(os.path.join(GOLDEN, "varlen", name + ".safetensors"))
        causal = {"none": None, "top_left": mha.Causal.top_left(),
                  "bottom_right": mha.Causal.bottom_right()}[meta["causal"]]
        cu_q = tensors["cu_q"].astype(np.int32)  # int32 offsets, as FlashAttention takes them
        cu_k = tensors["cu_k"].astype(np.int64)
        out, lse = mha.sdpa_varlen(tensors["q"], tensors["k"], tensors["v"], cu_q, cu_k, causal=causal,
                                   window=int(meta["window"]), return_lse=True)
        np.testing.assert_allclose(out, tensors["out"], atol=2e-6, rtol=2e-6)
        np.testing.assert_allclose(lse, tensors["lse"], atol=2e-6, rtol=2e-6)


def test_varlen_equals_sdpa_per_sequence():
    rng = np.random.default_rng(0)
    lens = [3, 0, 1, 130, 7]
    cu = np.concatenate([[0], np.cumsum(lens)])
    q = rng.standard_normal((cu[-1], 4, 16)).astype(np.float32)
    k = rng.standard_normal((cu[-1], 2, 16)).astype(np.float32)
    v = rng.standard_normal((cu[-1], 2, 8)).astype(np.float32)
    out = mha.sdpa_varlen(q, k, v, cu, cu, causal=mha.Causal.bottom_right(), threads=2)
    assert out.shape == (cu[-1], 4, 8)
    for s, n in enumerate(lens):
        if n == 0:
            continue
        sl = slice(cu[s], cu[s + 1])
        one = mha.sdpa(q[None, sl].transpose(0, 2, 1, 3), k[None, sl].transpose(0, 2, 1, 3),
                       v[None, sl].transpose(0, 2, 1, 3), causal=mha.Causal.bottom_right(), threads=2)
        np.testing.assert_array_equal(out[sl], one[0].transpose(1, 0, 2))  # the same kernel: bitwise


def test_varlen_bf16_and_errors():
    q = np.ones((5, 2, 4), np.float32)
    out = mha.sdpa_varlen(q, q, q, [0, 2, 5], [0, 2, 5], dtype="bf16")
    np.testing.assert_allclose(out, 1.0)
    with pytest.raises(ValueError, match="must not decrease"):
        mha.sdpa_varlen(q, q, q, [0, 3, 2, 5], [0, 3, 2, 5])
    with pytest.raises(ValueError, match="must equal the total rows"):
        mha.sdpa_varlen(q, q, q, [0, 2, 4], [0, 2, 4])
    with pytest.raises(ValueError, match="more than the given maximum"):
        mha.sdpa_varlen(q, q, q, [0, 2, 5], [0, 2, 5], max_seqlen_q=2)
    with pytest.raises(ValueError, match="3-D"):
        mha.sdpa_varlen(q[None], q, q, [0, 5], [0, 5])
    with pytest.raises(TypeError, match="integer"):
        mha.sdpa_varlen(q, q, q, [0.0, 5.0], [0, 5])


def test_sink_cache_decodes_like_the_explicit_mask():
    """StreamingLLM: a ring cache keeping 2 sink positions plus a window of 4, token by token, equals
    the full forward under the mask 'p <= q and (p < 2 or p > q - 4)'."""
    rng = np.random.default_rng(3)
    attn = mha.MultiheadAttention(16, 2, batch_first=True)
    T, sinks, window = 12, 2, 4
    x = rng.standard_normal((1, T, 16)).astype(np.float32)
    cache = attn.new_cache(1, sinks + window, ring=True, sinks=sinks)
    got = np.concatenate([attn.forward_incremental(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], cache, window=window)
                          for t in range(T)], axis=1)
    q, p = np.arange(T)[:, None], np.arange(T)[None, :]
    masked_out = ~((p <= q) & ((p < sinks) | (p > q - window)))  # PyTorch's polarity: True = may NOT attend
    want, _ = attn(x, x, x, attn_mask=masked_out, need_weights=False)
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=3e-5)
