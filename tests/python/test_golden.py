"""The committed PyTorch goldens (tests/golden), through the Python API: outputs and gradients."""
import glob
import os

import numpy as np
import pytest

import mha
from conftest import GOLDEN

FORWARD = sorted(glob.glob(os.path.join(GOLDEN, "forward", "*.safetensors")))
SDPA = sorted(glob.glob(os.path.join(GOLDEN, "sdpa", "*.safetensors")))
MODULE_GRAD = sorted(glob.glob(os.path.join(GOLDEN, "grad", "module_*.safetensors")))
SDPA_GRAD = sorted(glob.glob(os.path.join(GOLDEN, "grad", "sdpa_*.safetensors")))

ATOL, RTOL = 5e-5, 1e-4


def name(path):
    return os.path.basename(path)[: -len(".safetensors")]


def test_goldens_present():
    assert len(FORWARD) >= 70 and len(SDPA) >= 19 and len(MODULE_GRAD) >= 30 and len(SDPA_GRAD) >= 19


def causal_of(meta):
    return {"none": None, "top_left": mha.Causal.top_left(), "bottom_right": mha.Causal.bottom_right()}[
        meta.get("causal", "none")]


def sdpa_kwargs(t, meta):
    kw = dict(causal=causal_of(meta), allowed=t.get("allowed"), bias=t.get("bias"))
    if "scale" in meta:
        kw["scale"] = float(meta["scale"])
    return kw


@pytest.mark.parametrize("path", SDPA, ids=name)
def test_sdpa_golden(path):
    t, meta = mha.load_safetensors(path)
    out, w, lse = mha.sdpa(t["q"], t["k"], t["v"], return_weights=True, return_lse=True, **sdpa_kwargs(t, meta))
    np.testing.assert_allclose(out, t["expected.out"], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(w, t["expected.weights"], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(lse, t["expected.lse"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("path", SDPA_GRAD, ids=name)
def test_sdpa_grad_golden(path):
    t, meta = mha.load_safetensors(path)
    kw = sdpa_kwargs(t, meta)
    out, lse = mha.sdpa(t["q"], t["k"], t["v"], return_lse=True, **kw)
    dq, dk, dv = mha.sdpa_backward(t["q"], t["k"], t["v"], out, t["d_out"], lse, **kw)
    for got, key in ((dq, "grad.q"), (dk, "grad.k"), (dv, "grad.v")):
        np.testing.assert_allclose(got, t[key], atol=1e-4, rtol=1e-4, err_msg=key)


def module_call(path):
    t, meta = mha.load_safetensors(path)
    m = mha.MultiheadAttention.load(path).eval()
    kw = dict(key_padding_mask=t.get("key_padding_mask"), attn_mask=t.get("attn_mask"),
              is_causal=meta.get("is_causal") == "true")
    return t, meta, m, kw


@pytest.mark.parametrize("path", FORWARD, ids=name)
def test_module_golden(path):
    t, meta, m, kw = module_call(path)
    need = meta.get("need_weights", "true") == "true"
    out, w = m(t["query"], t["key"], t["value"], need_weights=need,
               average_attn_weights=meta.get("average_attn_weights", "true") == "true", **kw)
    np.testing.assert_allclose(out, t["expected.output"], atol=ATOL, rtol=RTOL)
    if need:
        np.testing.assert_allclose(w, t["expected.attn_weights"], atol=ATOL, rtol=RTOL)
    else:
        assert w is None and "expected.attn_weights" not in t


@pytest.mark.parametrize("path", MODULE_GRAD, ids=name)
def test_module_grad_golden(path):
    t, meta, m, kw = module_call(path)
    out, g = m.gradients(t["query"], t["key"], t["value"], t["d_output"], **kw)
    np.testing.assert_allclose(out, t["expected.output"], atol=ATOL, rtol=RTOL)
    expected = {k[len("grad."):]: x for k, x in t.items() if k.startswith("grad.")}
    assert set(expected) == set(g), (sorted(expected), sorted(g))
    for k, x in expected.items():
        np.testing.assert_allclose(g[k], x, atol=2e-4, rtol=2e-4, err_msg=k)


# ---- the score edits', int8 caches' and RoPE modules' goldens (also checked by the C++ suite) ----
EDITS = sorted(glob.glob(os.path.join(GOLDEN, "edits", "*.safetensors")))
INT8 = sorted(glob.glob(os.path.join(GOLDEN, "int8_cache", "*.safetensors")))
ROPE_MODULES = sorted(glob.glob(os.path.join(GOLDEN, "rope", "module_*.safetensors")))


def test_extra_goldens_present():
    assert len(EDITS) >= 4 and len(INT8) >= 2 and len(ROPE_MODULES) >= 2


@pytest.mark.parametrize("path", EDITS, ids=name)
def test_score_edits_golden_forward_and_backward(path):
    """ALiBi, softcap and sinks through mha.sdpa / sdpa_backward against PyTorch autograd in float64."""
    t, meta = mha.load_safetensors(path)
    kw = dict(softcap=float(meta["softcap"]), alibi_slopes=t.get("slopes"), sinks=t.get("sinks"),
              causal=mha.Causal.bottom_right() if meta["causal"] == "true" else None)
    if "slopes" in t:
        np.testing.assert_array_equal(t["slopes"], mha.alibi_slopes(t["q"].shape[1]))  # BLOOM's schedule
    out, lse = mha.sdpa(t["q"], t["k"], t["v"], return_lse=True, **kw)
    np.testing.assert_allclose(out, t["out"], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, t["lse"], atol=2e-5, rtol=2e-5)
    grads = mha.sdpa_backward(t["q"], t["k"], t["v"], out, t["d_out"], lse, **kw)
    names = ("dq", "dk", "dv", "dsinks") if "sinks" in t else ("dq", "dk", "dv")
    assert len(grads) == len(names)
    for got, key in zip(grads, names):
        np.testing.assert_allclose(got, t[key], atol=1e-4, rtol=1e-4, err_msg=key)


@pytest.mark.parametrize("path", INT8, ids=name)
def test_int8_cache_golden_stores_torchs_values_and_decodes(path):
    """The int8 cache holds PyTorch's dequantised K/V bit for bit (per token, or per channel of each
    key_group positions, appended in two parts that split a group) and decodes q after it."""
    t, meta = mha.load_safetensors(path)
    k, v, q = t["k"], t["v"], t["q"]
    B, kv, T, d = k.shape
    channel = "key_group" in meta
    cache = mha.KvCache(B, kv, d, T, dtype="int8", int8_keys="per-channel" if channel else "per-token",
                        key_group=int(meta.get("key_group", 32)))
    cut = 11 if channel else T
    cache.append(k[:, :, :cut], v[:, :, :cut])
    if cut < T:
        cache.append(k[:, :, cut:], v[:, :, cut:])
    stored_k = np.array([[[[cache.k_at(b, g, p, x) for x in range(d)] for p in range(T)] for g in range(kv)]
                         for b in range(B)], np.float32)
    stored_v = np.array([[[[cache.v_at(b, g, p, x) for x in range(d)] for p in range(T)] for g in range(kv)]
                         for b in range(B)], np.float32)
    np.testing.assert_array_equal(stored_k, t["k_dequant"])
    np.testing.assert_array_equal(stored_v, t["v_dequant"])
    for threads in (1, 2):
        out, _ = mha.attend_cache(q, cache, q_start=[T] * B, threads=threads)
        np.testing.assert_allclose(out, t["out"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", ROPE_MODULES, ids=name)
def test_rope_module_golden_full_and_incremental(path):
    """A causal module with RoPE (Llama's half-split with GQA, GPT-J's interleaved partial) against
    PyTorch: the full forward, and prefill plus decoding two tokens at a time."""
    t, meta = mha.load_safetensors(path)
    rope = mha.Rope(float(meta["theta"]), int(meta["dims"]), meta["layout"])
    m = mha.MultiheadAttention(int(meta["embed_dim"]), int(meta["num_heads"]), num_kv_heads=int(meta["num_kv_heads"]),
                               bias=False, batch_first=True, rope=rope).eval()
    m.load_state_dict({"in_proj_weight": t["in_proj_weight"], "out_proj.weight": t["out_proj_weight"]})
    x, want = t["query"], t["expected"]
    out, _ = m(x, x, x, is_causal=True, need_weights=False)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-4)
    cache = m.new_cache(x.shape[0], x.shape[1])
    steps = [m.forward_incremental(x[:, s:s + 2], x[:, s:s + 2], x[:, s:s + 2], cache)
             for s in range(0, x.shape[1], 2)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), want, atol=2e-5, rtol=2e-4)
