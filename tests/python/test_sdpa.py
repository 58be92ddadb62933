"""mha.sdpa / mha.sdpa_backward on numpy arrays: every argument, error path, memory and GIL promise."""
import threading
import time

import numpy as np
import pytest

import mha


def ref_sdpa(q, k, v, scale=None, allowed=None, bias=None, causal_offset=None, kpm=None):
    """float64 reference: softmax(scale q kᵀ + bias, masked) v, fully masked rows → 0."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    B, h, Tq, d = q.shape
    kv = k.shape[1]
    k = np.repeat(k, h // kv, axis=1)
    v = np.repeat(v, h // kv, axis=1)
    s = (scale if scale is not None else 1 / np.sqrt(d)) * q @ k.transpose(0, 1, 3, 2)
    Tk = k.shape[2]
    ok = np.ones(s.shape, bool)
    if bias is not None:
        s = s + bias
    if allowed is not None:
        ok &= np.broadcast_to(allowed, s.shape)
    if causal_offset is not None:
        ok &= (np.arange(Tk)[None, :] <= np.arange(Tq)[:, None] + causal_offset)
    if kpm is not None:
        ok &= ~kpm[:, None, None, :]
    s = np.where(ok, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    z = e.sum(-1, keepdims=True)
    w = np.where(z > 0, e / np.where(z > 0, z, 1), 0)
    return w @ v, w


def qkv(rng, B=2, h=4, kv=4, Tq=5, Tk=7, d=8, dv=None):
    dv = dv or d
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return f(B, h, Tq, d), f(B, kv, Tk, d), f(B, kv, Tk, dv)


def test_version_and_help():
    assert isinstance(mha.__version__, str) and mha.__version__
    assert "Scaled dot-product attention" in mha.sdpa.__doc__
    assert mha.MultiheadAttention.forward.__doc__
    assert "return_lse" in str(mha.sdpa.__annotations__) or mha.sdpa.__annotations__


def test_plain_matches_reference(rng):
    q, k, v = qkv(rng)
    out, w, lse = mha.sdpa(q, k, v, return_weights=True, return_lse=True)
    ro, rw = ref_sdpa(q, k, v)
    np.testing.assert_allclose(out, ro, atol=1e-5)
    np.testing.assert_allclose(w, rw, atol=1e-6)
    assert out.dtype == np.float32 and out.shape == (2, 4, 5, 8) and lse.shape == (2, 4, 5)
    assert isinstance(mha.sdpa(q, k, v), np.ndarray)


def test_gqa_scale_dv(rng):
    q, k, v = qkv(rng, h=6, kv=2, dv=3)
    out = mha.sdpa(q, k, v, scale=0.3)
    np.testing.assert_allclose(out, ref_sdpa(q, k, v, scale=0.3)[0], atol=1e-5)


@pytest.mark.parametrize("causal,off", [(mha.Causal.top_left(), 0), (mha.Causal.bottom_right(), 2),
                                        (mha.Causal.offset(-1), -1), (mha.Causal.offset(3), 3)])
def test_causal(rng, causal, off):
    q, k, v = qkv(rng, Tq=5, Tk=7)
    np.testing.assert_allclose(mha.sdpa(q, k, v, causal=causal), ref_sdpa(q, k, v, causal_offset=off)[0], atol=1e-5)


def test_masks_by_meaning(rng):
    q, k, v = qkv(rng)
    allowed = rng.random((1, 4, 5, 7)) > 0.3
    bias = rng.standard_normal((2, 1, 5, 7)).astype(np.float32)
    kpm = np.zeros((2, 7), bool)
    kpm[1, 4:] = True
    ref = ref_sdpa(q, k, v, allowed=allowed, bias=bias, kpm=kpm)[0]
    np.testing.assert_allclose(mha.sdpa(q, k, v, allowed=allowed, bias=bias, key_padding_mask=kpm), ref, atol=1e-5)
    np.testing.assert_allclose(mha.sdpa(q, k, v, attn_mask=mha.Allowed(allowed), bias=bias, key_padding_mask=kpm),
                               ref, atol=1e-5)
    np.testing.assert_allclose(mha.sdpa(q, k, v, attn_mask=mha.Additive(bias), allowed=allowed,
                                        key_padding_mask=kpm), ref, atol=1e-5)
    # a float key_padding_mask is added; a 2-D mask broadcasts with leading 1s
    kb = np.where(kpm, -np.inf, 0).astype(np.float32)
    np.testing.assert_allclose(mha.sdpa(q, k, v, attn_mask=allowed[0, 0].astype(np.float32) * 0.5,
                                        key_padding_mask=kb),
                               ref_sdpa(q, k, v, bias=allowed[0, 0] * 0.5, kpm=kpm)[0], atol=1e-5)


def test_window(rng):
    q, k, v = qkv(rng, Tq=6, Tk=6)
    out = mha.sdpa(q, k, v, causal=mha.Causal.top_left(), window=2)
    band = (np.arange(6)[None, :] <= np.arange(6)[:, None]) & (np.arange(6)[None, :] > np.arange(6)[:, None] - 2)
    np.testing.assert_allclose(out, ref_sdpa(q, k, v, allowed=band)[0], atol=1e-5)


def test_fully_masked_row_is_zero(rng):
    q, k, v = qkv(rng)
    allowed = np.ones((5, 7), bool)
    allowed[2] = False
    out, lse = mha.sdpa(q, k, v, allowed=allowed, return_lse=True)
    assert np.all(out[:, :, 2] == 0) and np.all(np.isneginf(lse[:, :, 2]))


def test_dropout_deterministic(rng):
    q, k, v = qkv(rng)
    a = mha.sdpa(q, k, v, dropout_p=0.5, seed=7)
    b = mha.sdpa(q, k, v, dropout_p=0.5, seed=7, threads=1)
    c = mha.sdpa(q, k, v, dropout_p=0.5, seed=8)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_bf16_option(rng):
    q, k, v = qkv(rng)
    out = mha.sdpa(q, k, v, dtype="bf16")
    ref = mha.sdpa(q, k, v)
    assert out.dtype == np.float32
    assert np.abs(out - ref).max() < 5e-2 and not np.array_equal(out, ref)


def test_other_float_dtypes_converted(rng):
    q, k, v = qkv(rng)
    np.testing.assert_allclose(mha.sdpa(q.astype(np.float64), k.astype(np.float16), v), mha.sdpa(q, k.astype(
        np.float16).astype(np.float32), v), atol=1e-6)


# ---- memory: zero copy and strided views ---------------------------------------------------------

def test_strided_inputs_read_in_place(rng):
    base = rng.standard_normal((2, 5, 4, 8)).astype(np.float32)  # (B, T, h, d): heads interleaved
    q = base.transpose(0, 2, 1, 3)  # (B, h, T, d), not C-contiguous
    k = rng.standard_normal((2, 4, 9, 8)).astype(np.float32)[:, :, ::2]  # every other key
    v = np.broadcast_to(rng.standard_normal((1, 4, 5, 8)).astype(np.float32), (2, 4, 5, 8))
    out = mha.sdpa(q, k, v)
    np.testing.assert_allclose(out, mha.sdpa(*(np.ascontiguousarray(x) for x in (q, k, v))), atol=1e-6)
    # negative strides are copied, still correct
    np.testing.assert_allclose(mha.sdpa(q[:, :, ::-1], k, v), mha.sdpa(np.ascontiguousarray(q[:, :, ::-1]), k, v),
                               atol=1e-6)


def test_zero_copy(rng, monkeypatch):
    q, k, v = qkv(rng)
    seen = []
    real = mha._core.sdpa

    def spy(qa, ka, va, *rest):
        seen.extend([qa, ka, va])
        return real(qa, ka, va, *rest)

    monkeypatch.setattr(mha._core, "sdpa", spy)
    out, w = mha.sdpa(q, k, v, return_weights=True)
    # the very buffers the caller passed reach the kernels
    for given, passed in zip((q, k, v), seen):
        assert passed.__array_interface__["data"][0] == given.__array_interface__["data"][0]
    # the results are fresh: they share no memory with the inputs or with each other
    for x in (q, k, v):
        assert not np.shares_memory(out, x) and not np.shares_memory(w, x)
    assert not np.shares_memory(out, w)
    assert out.flags.c_contiguous and out.flags.writeable and out.base is None or out.flags.owndata
    # a transposed view also reaches the kernel uncopied
    seen.clear()
    t = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    mha.sdpa(t, k, v)
    assert seen[0].__array_interface__["data"][0] == t.__array_interface__["data"][0]


def _ticks_during(call):
    """Runs call() on a worker thread while this thread keeps taking time stamps; returns the call's
    (start, end) and the stamps. Holding the GIL in C++ would leave no stamps inside the call."""
    span = {}

    def work():
        span["t0"] = time.perf_counter()
        call()
        span["t1"] = time.perf_counter()

    t = threading.Thread(target=work)
    ticks = []
    t.start()
    while t.is_alive():
        ticks.append(time.perf_counter())
    t.join()
    return span["t0"], span["t1"], ticks


def test_gil_released(rng):
    q, k, v = qkv(rng, B=1, h=8, kv=8, Tq=1024, Tk=1024, d=64)
    out, lse = mha.sdpa(q, k, v, return_lse=True)
    m = mha.MultiheadAttention(512, 8).eval()
    x = rng.standard_normal((1024, 1, 512)).astype(np.float32)
    calls = {
        "sdpa": lambda: mha.sdpa(q, k, v, threads=1),
        "sdpa_backward": lambda: mha.sdpa_backward(q, k, v, out, out, lse, threads=1),
        "module forward": lambda: m(x, x, x, need_weights=False, threads=1),
    }
    for name, call in calls.items():
        t0, t1, ticks = _ticks_during(call)
        lo, hi = t0 + 0.2 * (t1 - t0), t1 - 0.2 * (t1 - t0)
        inside = sum(lo < s < hi for s in ticks)
        # this thread ran Python code while the call was computing: the GIL was released
        assert inside > 10, (name, t1 - t0, inside)
    # two threads computing at once: their start/end stamps overlap (speed-up is measured, not asserted)
    stamps = {}

    def work(i):
        t0 = time.perf_counter()
        mha.sdpa(q, k, v, threads=1)
        stamps[i] = (t0, time.perf_counter())

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (a0, a1), (b0, b1) = stamps[0], stamps[1]
    assert a0 < b1 and b0 < a1


# ---- errors ---------------------------------------------------------------------------------------

def test_type_errors(rng):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match="q must be a float32"):
        mha.sdpa(q.astype(np.int32), k, v)
    with pytest.raises(TypeError, match="None"):
        mha.sdpa(None, k, v)
    with pytest.raises(TypeError, match="ambiguous"):
        mha.sdpa(q, k, v, attn_mask=np.ones((5, 7), bool))
    with pytest.raises(TypeError, match="allowed must be a boolean"):
        mha.sdpa(q, k, v, allowed=np.ones((5, 7), np.float32))
    with pytest.raises(TypeError, match="mha.Causal"):
        mha.sdpa(q, k, v, causal=True)
    with pytest.raises(TypeError, match="scale"):
        mha.sdpa(q, k, v, scale="x")
    with pytest.raises(TypeError, match="window"):
        mha.sdpa(q, k, v, window=1.5)
    with pytest.raises(TypeError, match="seed must be an int"):
        mha.sdpa(q, k, v, seed="1")
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\), got -1"):
        mha.sdpa(q, k, v, seed=-1)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\), got 18446744073709551616"):
        mha.sdpa(q, k, v, seed=2**64)
    with pytest.raises(TypeError, match="threads"):
        mha.sdpa(q, k, v, threads="4")
    with pytest.raises(ValueError, match=r"sdpa: threads must be >= 0 \(0 = the library default\), got -1"):
        mha.sdpa(q, k, v, threads=-1)
    with pytest.raises(TypeError, match="dropout_p"):
        mha.sdpa(q, k, v, dropout_p=None)
    with pytest.raises(TypeError):
        mha.sdpa(q, k, v, 0.5)  # keywords only
    with pytest.raises(TypeError, match="int"):
        mha.Causal.offset(1.5)


def test_value_errors_carry_library_message(rng):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match="4-D"):
        mha.sdpa(q[0], k, v)
    with pytest.raises(ValueError) as e:
        mha.sdpa(q, k[:, :, :, :5], v)
    assert "(2, 4, 7, 5)" in str(e.value) or "k" in str(e.value)
    with pytest.raises(ValueError, match="kv|head|multiple|divide"):
        mha.sdpa(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError):
        mha.sdpa(q, k, v[:, :, :6])
    with pytest.raises(ValueError):
        mha.sdpa(q, k, v, allowed=np.ones((3, 7), bool))
    with pytest.raises(ValueError):
        mha.sdpa(q, k, v, bias=np.zeros((2, 4, 5, 6), np.float32))
    with pytest.raises(ValueError, match="key_padding_mask"):
        mha.sdpa(q, k, v, key_padding_mask=np.zeros(7, bool))
    with pytest.raises(ValueError):
        mha.sdpa(q, k, v, key_padding_mask=np.zeros((3, 7), bool))
    with pytest.raises(ValueError, match="dropout_p"):
        mha.sdpa(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match="window"):
        mha.sdpa(q, k, v, window=-1)
    with pytest.raises(ValueError, match="causal"):
        mha.sdpa(q, k, v, window=2)
    with pytest.raises(ValueError, match="dtype"):
        mha.sdpa(q, k, v, dtype="f16")
    with pytest.raises(ValueError, match="once"):
        mha.sdpa(q, k, v, attn_mask=mha.Allowed(np.ones((5, 7), bool)), allowed=np.ones((5, 7), bool))
    with pytest.raises(ValueError, match="at most 4"):
        mha.sdpa(q, k, v, allowed=np.ones((1, 1, 1, 5, 7), bool))


# ---- backward -------------------------------------------------------------------------------------

def numeric_grad(f, x, eps=1e-3):
    g = np.zeros_like(x, dtype=np.float64)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        hi = f()
        x[i] = old - eps
        lo = f()
        x[i] = old
        g[i] = (hi - lo) / (2 * eps)
    return g


def test_backward_finite_differences(rng):
    q, k, v = qkv(rng, B=1, h=2, kv=1, Tq=3, Tk=4, d=3)
    q, k, v = (x.astype(np.float64).astype(np.float32) for x in (q, k, v))
    d_out = rng.standard_normal((1, 2, 3, 3)).astype(np.float32)
    kw = dict(causal=mha.Causal.bottom_right(), bias=rng.standard_normal((3, 4)).astype(np.float32))
    out, lse = mha.sdpa(q, k, v, return_lse=True, **kw)
    dq, dk, dv = mha.sdpa_backward(q, k, v, out, d_out, lse, **kw)
    loss = lambda: float((ref_sdpa(q, k, v, bias=kw["bias"], causal_offset=1)[0] * d_out).sum())  # noqa: E731
    for x, g in ((q, dq), (k, dk), (v, dv)):
        np.testing.assert_allclose(g, numeric_grad(loss, x), atol=2e-3)


def test_backward_errors(rng):
    q, k, v = qkv(rng)
    out, lse = mha.sdpa(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="lse"):
        mha.sdpa_backward(q, k, v, out, out, lse[..., None])
    with pytest.raises(ValueError):
        mha.sdpa_backward(q, k, v, out[:, :, :3], out, lse)
    with pytest.raises(TypeError):
        mha.sdpa_backward(q, k, v, out, out.astype(np.int64), lse)


def test_edge_shapes_and_values_never_crash(rng):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    assert mha.sdpa(f(0, 2, 3, 4), f(0, 2, 3, 4), f(0, 2, 3, 4)).shape == (0, 2, 3, 4)
    assert mha.sdpa(f(1, 2, 0, 4), f(1, 2, 3, 4), f(1, 2, 3, 4)).shape == (1, 2, 0, 4)
    # no keys at all: every row is fully masked, so zeros
    assert np.all(mha.sdpa(f(1, 2, 3, 4), f(1, 2, 0, 4), f(1, 2, 0, 4)) == 0)
    with pytest.raises(ValueError, match="head dim"):
        mha.sdpa(f(1, 2, 3, 0), f(1, 2, 3, 0), f(1, 2, 3, 4))
    with pytest.raises(ValueError, match="finite"):
        mha.sdpa(f(1, 2, 3, 4), f(1, 2, 3, 4), f(1, 2, 3, 4), scale=np.inf)
    with pytest.raises(ValueError, match="seed"):
        mha.sdpa(f(1, 2, 3, 4), f(1, 2, 3, 4), f(1, 2, 3, 4), seed=2**70)
    out = mha.sdpa(f(1, 2, 3, 4), f(1, 2, 3, 4), f(1, 2, 3, 4), causal=mha.Causal.offset(-10**12))
    assert np.all(out == 0)
    with pytest.raises(ValueError, match="cannot open"):
        mha.load_safetensors("/nonexistent/x.safetensors")


def test_arguments_past_64_bits_or_of_the_wrong_type_are_named(rng):
    """Causal offsets and varlen bounds went through int() or straight to pybind11: 2**70 printed
    pybind11's dump of every argument (the arrays included), 5.9 became 5, Causal('offset', 2.5) and
    an unknown alignment were taken; an integer attn_mask's error named `bias`."""
    q = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    with pytest.raises(ValueError, match="Causal.offset: n must fit in 64 bits"):
        mha.Causal.offset(2**70)
    with pytest.raises(TypeError, match="Causal: value must be an int, got float"):
        mha.Causal("offset", 2.5)
    with pytest.raises(ValueError, match="Causal: align must be"):
        mha.Causal("sideways", 0)
    assert mha.Causal("offset", np.int64(2)) == mha.Causal.offset(2)
    packed = q[0].transpose(1, 0, 2)
    for value, error, message in ((2**64, ValueError, "max_seqlen_q must fit in 64 bits"),
                                  (5.9, TypeError, "max_seqlen_q must be an int, got float"),
                                  ("3", TypeError, "max_seqlen_q must be an int, got str")):
        with pytest.raises(error, match=f"sdpa_varlen: {message}"):
            mha.sdpa_varlen(packed, packed, packed, [0, 3], [0, 3], max_seqlen_q=value)
    with pytest.raises(TypeError, match="sdpa: attn_mask must be a float32 array"):
        mha.sdpa(q, q, q, attn_mask=np.zeros((3, 3), np.int32))


def test_key_padding_mask_of_integers_names_both_kinds():
    q = np.zeros((1, 1, 3, 4), np.float32)
    with pytest.raises(TypeError, match=r"key_padding_mask must be bool \(True = padding\) or float"):
        mha.sdpa(q, q, q, key_padding_mask=np.zeros((1, 3), np.uint8))
