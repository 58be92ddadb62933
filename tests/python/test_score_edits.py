"""ALiBi, logit softcapping and learned attention sinks through mha.sdpa / sdpa_backward and the module."""
import numpy as np
import pytest

import mha


def ref(q, k, v, slopes=None, softcap=0.0, sinks=None, causal_offset=None):
    """float64 reference with the score edits written out: cap, ALiBi, mask, softmax with sinks."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    B, h, Tq, d = q.shape
    kv = k.shape[1]
    k = np.repeat(k, h // kv, axis=1)
    v = np.repeat(v, h // kv, axis=1)
    Tk = k.shape[2]
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    off = causal_offset if causal_offset is not None else Tk - Tq
    dist = (np.arange(Tq)[:, None] + off) - np.arange(Tk)[None, :]
    if slopes is not None:
        s = s - np.asarray(slopes, np.float64)[None, :, None, None] * dist
    if causal_offset is not None:
        s = np.where(dist >= 0, s, -np.inf)
    z = np.full((1, h, 1, 1), -np.inf) if sinks is None else np.asarray(sinks, np.float64)[None, :, None, None]
    m = np.maximum(s.max(-1, keepdims=True), z)
    e = np.exp(s - m)
    denom = e.sum(-1, keepdims=True) + np.exp(z - m)
    return (e / denom) @ v, (m + np.log(denom))[..., 0]


@pytest.fixture
def qkv():
    rng = np.random.default_rng(3)
    return (rng.standard_normal((2, 6, 9, 8), dtype=np.float32), rng.standard_normal((2, 3, 11, 8), dtype=np.float32),
            rng.standard_normal((2, 3, 11, 5), dtype=np.float32))


def test_alibi_slopes_schedule():
    np.testing.assert_allclose(mha.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    s12 = mha.alibi_slopes(12)
    np.testing.assert_allclose(s12[8:], 2.0 ** (-(2 * np.arange(4) + 1) / 2), rtol=1e-6)


@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("edits", [dict(alibi=True), dict(softcap=1.5), dict(sinks=True),
                                   dict(alibi=True, softcap=2.0, sinks=True)])
def test_sdpa_matches_explicit_score_edits(qkv, causal, edits):
    q, k, v = qkv
    slopes = mha.alibi_slopes(6) if edits.get("alibi") else None
    sinks = np.linspace(-1, 1, 6).astype(np.float32) if edits.get("sinks") else None
    softcap = edits.get("softcap", 0.0)
    c = mha.Causal.bottom_right() if causal else None
    want_out, want_lse = ref(q, k, v, slopes, softcap, sinks, causal_offset=2 if causal else None)
    for backend_threads in (1, 3):
        out, lse = mha.sdpa(q, k, v, causal=c, alibi_slopes=slopes, softcap=softcap, sinks=sinks, return_lse=True,
                            threads=backend_threads)
        np.testing.assert_allclose(out, want_out, atol=2e-5)
        np.testing.assert_allclose(lse, want_lse, atol=2e-5)


def test_sink_gradient_matches_finite_differences(qkv):
    q, k, v = qkv
    sinks = np.array([0.5, -0.3, 1.0, 0.0, 0.2, -1.0], np.float32)
    kw = dict(alibi_slopes=mha.alibi_slopes(6), softcap=3.0, causal=mha.Causal.bottom_right())
    out, lse = mha.sdpa(q, k, v, sinks=sinks, return_lse=True, **kw)
    d_out = np.random.default_rng(5).standard_normal(out.shape).astype(np.float32)
    dq, dk, dv, dsinks = mha.sdpa_backward(q, k, v, out, d_out, lse, sinks=sinks, **kw)
    assert dsinks.shape == (6,)
    step = 1e-2
    for h in range(6):
        up, down = sinks.copy(), sinks.copy()
        up[h] += step
        down[h] -= step
        fd = ((ref(q, k, v, kw["alibi_slopes"], 3.0, up, 2)[0] - ref(q, k, v, kw["alibi_slopes"], 3.0, down, 2)[0])
              * d_out).sum() / (2 * step)
        assert abs(dsinks[h] - fd) < 2e-3


def test_fully_masked_row_with_sink_gives_zeros(qkv):
    q, k, v = qkv
    sinks = np.arange(6, dtype=np.float32)
    out, lse = mha.sdpa(q, k, v, key_padding_mask=np.ones((2, 11), bool), sinks=sinks, return_lse=True)
    assert not out.any()
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks[None, :, None], lse.shape))


def test_bad_arguments_are_clear_errors(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"alibi slopes has 3 entries, expected one per query head \(6\)"):
        mha.sdpa(q, k, v, alibi_slopes=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="softcap must be a finite c > 0"):
        mha.sdpa(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="softcap must be a finite c > 0"):
        mha.sdpa(q, k, v, softcap=float("nan"))
    with pytest.raises(ValueError, match=r"sinks has 2 entries, expected one per query head \(6\)"):
        mha.sdpa(q, k, v, sinks=[0.0, 1.0])
    with pytest.raises(TypeError, match="softcap must be a number"):
        mha.sdpa(q, k, v, softcap="big")


def test_module_sinks_parameter_and_config():
    m = mha.MultiheadAttention(16, 4, batch_first=True, scale=0.2, alibi_slopes=mha.alibi_slopes(4), softcap=5.0,
                               attention_sinks=True)
    assert m.deterministic
    cfg = m.config
    assert cfg["scale"] == pytest.approx(0.2) and cfg["softcap"] == 5.0 and cfg["attention_sinks"]
    sd = m.state_dict()
    assert sd["sinks"].shape == (4,) and not sd["sinks"].any()
    x = np.random.default_rng(1).standard_normal((2, 5, 16)).astype(np.float32)
    y0 = m(x, x, x)[0]
    sd["sinks"] = np.full(4, 2.0, np.float32)
    m.load_state_dict(sd)
    assert not np.allclose(m(x, x, x)[0], y0)


@pytest.mark.parametrize("kw, match", [
    (dict(alibi_slopes=[0.5, np.nan, 0.1, 0.1]), r"alibi_slopes must be finite, got alibi_slopes\[1\] = nan$"),
    (dict(alibi_slopes=np.array([0.5, 0.1, 0.1, -np.inf])),
     r"alibi_slopes must be finite, got alibi_slopes\[3\] = -inf$"),
    (dict(alibi_slopes=[0.5, 0.25]), r"alibi_slopes has 2 entries, expected one per head \(4\)$"),
    # finite in float64, ±inf in the float32 the library holds
    (dict(alibi_slopes=[1e39, 0.1, 0.1, 0.1]), r"alibi_slopes\[0\] = 1e\+39 is finite but beyond float32's range$"),
    (dict(softcap=np.inf), "softcap must be a finite c > 0"),
    (dict(scale=np.nan), "scale must be finite"),
])
def test_module_score_edit_values_are_named_as_the_constructor_took_them(kw, match):
    """The library's messages named its C++ configuration and field ("MhaConfig: alibi slope nan is
    not finite"): the constructor's ValueError now names it and the argument."""
    with pytest.raises(ValueError, match=r"^MultiheadAttention: " + match):
        mha.MultiheadAttention(16, 4, **kw)


def test_module_non_finite_sinks_are_refused_where_they_are_loaded(tmp_path):
    """Non-finite sink logits loaded into the module failed every later call with "sdpa: sink logit 1
    is not finite", naming a function the caller never called; each way in now names the parameter,
    leaving the module as it was."""
    m = mha.MultiheadAttention(16, 4, batch_first=True, attention_sinks=True)
    x = np.random.default_rng(2).standard_normal((2, 5, 16)).astype(np.float32)
    before = m(x, x, x)[0]
    for bad in (np.inf, -np.inf, np.nan):
        sd = m.state_dict()
        sd["sinks"] = np.array([0.0, 0.5, bad, 0.0], np.float32)
        with pytest.raises(ValueError, match=rf"^load_state_dict: sinks must be finite, got sinks\[2\] = {bad}$"):
            m.load_state_dict(sd)
        assert np.array_equal(m(x, x, x)[0], before)
    poisoned = mha.MultiheadAttention(16, 4, batch_first=True, attention_sinks=True)
    poisoned._m.set("sinks", np.array([np.nan, 0, 0, 0], np.float32))  # only a file can bring them in now
    poisoned.save(tmp_path / "poisoned.safetensors")
    with pytest.raises(ValueError, match=r"^load_weights: sinks must be finite, got sinks\[0\] = nan$"):
        m.load_weights(tmp_path / "poisoned.safetensors")
    assert np.array_equal(m(x, x, x)[0], before)
    with pytest.raises(ValueError, match=r"^MultiheadAttention.load: sinks must be finite, got sinks\[0\] = nan$"):
        mha.MultiheadAttention.load(tmp_path / "poisoned.safetensors")
