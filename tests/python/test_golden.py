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
