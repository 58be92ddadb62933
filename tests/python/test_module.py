"""mha.MultiheadAttention on numpy arrays: PyTorch's conventions, state_dict, files, cache, analysis."""
import numpy as np
import pytest

import mha


def x(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_constructor_positional_like_torch():
    m = mha.MultiheadAttention(16, 4, 0.0, True, False, False, None, None, True)
    assert (m.embed_dim, m.num_heads, m.head_dim, m.batch_first, m.kdim, m.vdim) == (16, 4, 4, True, 16, 16)
    assert m.training and m.eval() is m and not m.training


def test_parameter_count_4d2():
    for d in (8, 64, 512):
        m = mha.MultiheadAttention(d, 8 if d >= 8 else 1, bias=False)
        assert m.parameter_count() == 4 * d * d
    assert mha.MultiheadAttention(16, 4).parameter_count() == 4 * 16 * 16 + 4 * 16


def test_state_dict_names_and_roundtrip(rng):
    m = mha.MultiheadAttention(16, 4, add_bias_kv=True)
    sd = m.state_dict()
    assert list(sd) == ["in_proj_weight", "in_proj_bias", "bias_k", "bias_v", "out_proj.weight", "out_proj.bias"]
    assert sd["in_proj_weight"].shape == (48, 16) and sd["bias_k"].shape == (1, 1, 16)
    sep = mha.MultiheadAttention(16, 4, kdim=10, vdim=6, bias=False)
    assert list(sep.state_dict()) == ["q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"]
    sd2 = {k: x(rng, *v.shape) for k, v in sd.items()}
    m.load_state_dict(sd2)
    for k in sd2:
        np.testing.assert_array_equal(m.state_dict()[k], sd2[k])
    with pytest.raises(ValueError, match="missing"):
        m.load_state_dict({"in_proj_weight": sd2["in_proj_weight"]})
    with pytest.raises(ValueError, match="shape"):
        m.load_state_dict({**sd2, "in_proj_bias": np.zeros(3, np.float32)})
    with pytest.raises(TypeError):
        m.load_state_dict({**sd2, "in_proj_bias": np.zeros(48, np.int32)})


def test_forward_conventions(rng):
    m = mha.MultiheadAttention(16, 4, batch_first=True).eval()
    q, kv = x(rng, 2, 5, 16), x(rng, 2, 7, 16)
    out, w = m(q, kv, kv)
    assert out.shape == (2, 5, 16) and w.shape == (2, 5, 7)
    np.testing.assert_allclose(w.sum(-1), 1, atol=1e-5)
    out2, wh = m(q, kv, kv, average_attn_weights=False)
    assert wh.shape == (2, 4, 5, 7)
    np.testing.assert_allclose(wh.mean(1), w, atol=1e-6)
    np.testing.assert_array_equal(out, out2)
    out3, none = m(q, kv, kv, need_weights=False)
    assert none is None
    np.testing.assert_allclose(out3, out, atol=1e-6)
    # PyTorch polarity: True = may NOT attend
    masked = np.zeros((5, 7), bool)
    masked[:, 3] = True
    _, wm = m(q, kv, kv, attn_mask=masked)
    assert np.all(wm[..., 3] == 0)
    fm = np.where(masked, -np.inf, 0).astype(np.float32)
    np.testing.assert_allclose(m(q, kv, kv, attn_mask=fm)[0], m(q, kv, kv, attn_mask=masked)[0], atol=1e-6)
    kpm = np.zeros((2, 7), bool)
    kpm[0, 5:] = True
    _, wk = m(q, kv, kv, key_padding_mask=kpm)
    assert np.all(wk[0, :, 5:] == 0) and np.all(wk[1] > 0)
    # is_causal: top-left
    _, wc = m(q, q, q, is_causal=True)
    assert np.all(np.triu(wc[0], 1) == 0)
    # seq-first default and unbatched input
    s = mha.MultiheadAttention(16, 4).eval()
    s.load_state_dict(m.state_dict())
    np.testing.assert_allclose(s(q.transpose(1, 0, 2), kv.transpose(1, 0, 2), kv.transpose(1, 0, 2))[0],
                               out.transpose(1, 0, 2), atol=1e-6)
    np.testing.assert_allclose(s(q[0], kv[0], kv[0])[0], out[0], atol=1e-5)


def test_forward_errors(rng):
    m = mha.MultiheadAttention(16, 4, batch_first=True)
    q = x(rng, 2, 5, 16)
    with pytest.raises(ValueError):
        m(q, x(rng, 2, 5, 15), q)
    with pytest.raises(ValueError):
        m(q, q, q, attn_mask=np.zeros((3, 3), bool))
    with pytest.raises(ValueError):
        m(q, q, q, key_padding_mask=np.zeros((2, 4), bool))
    with pytest.raises(TypeError):
        m(q.astype(np.int32), q, q)
    with pytest.raises(TypeError):
        m(q, q, q, attn_mask=np.zeros((5, 5), np.int64))
    with pytest.raises(TypeError):
        m(q, q, q, is_causal="yes")
    with pytest.raises(ValueError):
        mha.MultiheadAttention(16, 3)
    with pytest.raises(ValueError):
        mha.MultiheadAttention(16, 4, num_kv_heads=3)
    with pytest.raises(TypeError):
        mha.MultiheadAttention(16.0, 4)
    with pytest.raises(ValueError, match="pairing"):
        mha.MultiheadAttention(16, 4, rope=mha.Rope(pairing="x"))


def test_seeds_and_widths_are_checked_not_truncated(rng):
    """Seeds and widths were passed through int(): 1.5 became 1 and a negative seed reached the
    binding, whose TypeError listed every constructor argument. Each now names itself."""
    with pytest.raises(TypeError, match="MultiheadAttention: seed must be an int, got float"):
        mha.MultiheadAttention(16, 4, seed=1.5)
    with pytest.raises(ValueError, match=r"MultiheadAttention: seed must be in \[0, 2\*\*64\), got -1"):
        mha.MultiheadAttention(16, 4, seed=-1)
    for name in ("kdim", "vdim", "num_kv_heads"):
        with pytest.raises(TypeError, match=f"MultiheadAttention: {name} must be an int, got float"):
            mha.MultiheadAttention(16, 4, **{name: 2.0})
    m = mha.MultiheadAttention(16, 4, dropout=0.5, batch_first=True, seed=2**64 - 1)
    q = x(rng, 1, 3, 16)
    m.dropout_seed = -1
    with pytest.raises(ValueError, match=r"forward: dropout_seed must be in \[0, 2\*\*64\), got -1"):
        m(q, q, q)
    m.dropout_seed = 2**64 - 1  # the per-call step wraps around instead of leaving the range
    m(q, q, q)
    assert m.dropout_seed == 0


def test_save_load(rng, tmp_path):
    m = mha.MultiheadAttention(16, 4, num_kv_heads=2, batch_first=True, seed=3).eval()
    q = x(rng, 2, 5, 16)
    ref = m(q, q, q)[0]
    for names in ("pytorch", "huggingface"):
        p = tmp_path / f"{names}.safetensors"
        m.save(p, names=names)
        back = mha.MultiheadAttention.load(p).eval()
        assert back.config == m.config
        np.testing.assert_array_equal(back(q, q, q)[0], ref)
        t, meta = mha.load_safetensors(p)
        assert ("o_proj.weight" in t) == (names == "huggingface")
    with pytest.raises(ValueError, match="names"):
        m.save(tmp_path / "x.safetensors", names="jax")
    with pytest.raises(ValueError):
        mha.MultiheadAttention.load(tmp_path / "missing.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(ValueError):
        mha.load_safetensors(tmp_path / "bad.safetensors")


def test_load_safetensors_keeps_integer_tensors_integers(tmp_path):
    """Integer tensors came back as float32: 2**24 + 1 read as 2**24, and a file's cu_seqlens could
    not go back into forward(cu_seqlens_q=…), which takes integers."""
    import json
    import struct
    tensors = {"ids": np.array([16777217, 2**53 + 1, -5], np.int64), "flags": np.array([[0, 1, 255]], np.uint8),
               "i32": np.zeros((0, 3), np.int32), "u16": np.array([65535], np.uint16),
               "x": np.array([1.5, -2.0], np.float32)}
    names = {np.dtype(np.int64): "I64", np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32",
             np.dtype(np.uint16): "U16", np.dtype(np.float32): "F32"}
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        b = a.tobytes()
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path = tmp_path / "ints.safetensors"
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    got, _ = mha.load_safetensors(path)
    for name, a in tensors.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        np.testing.assert_array_equal(got[name], a)


def test_load_safetensors_names_the_tensor_numpy_cannot_hold(tmp_path):
    """A shape the format allows but numpy does not (more dimensions than numpy's NPY_MAXDIMS;
    extents whose product overflows before a zero one empties the tensor) raised numpy's ValueError,
    which named neither the file nor the tensor. The limit is numpy's own, asked of the numpy that is
    loaded: a copy of numpy 1's 32 refused what numpy 2 (64 dimensions) holds, saying numpy could not."""
    import json
    import struct

    def write(dtype, shape, data):
        h = json.dumps({"t": {"dtype": dtype, "shape": shape, "data_offsets": [0, len(data)]}}).encode()
        path = tmp_path / "odd.safetensors"
        path.write_bytes(struct.pack("<Q", len(h)) + h + data)
        return path

    max_dims = 1
    while max_dims < 128:  # numpy's NPY_MAXDIMS, as numpy itself answers
        try:
            np.empty((1,) * (max_dims + 1))
        except ValueError:
            break
        max_dims += 1
    for dtype, shape, data in [("F32", [1] * (max_dims + 1), b"\0" * 4), ("I64", [1] * (max_dims + 1), b"\0" * 8),
                               ("BOOL", [1] * (max_dims + 8), b"\1"), ("F32", [2**62, 0], b""),
                               ("I32", [2**61, 0], b""), ("F32", [0, 2**62], b"")]:
        with pytest.raises(ValueError, match=r"odd\.safetensors: tensor 't' " + dtype + r" shape .* is not one numpy "
                                             r"can hold: "):
            mha.load_safetensors(write(dtype, shape, data))
    # as many dimensions as numpy takes load
    for dtype, data in (("F32", b"\0" * 4), ("I64", b"\0" * 8), ("BOOL", b"\1")):
        assert mha.load_safetensors(write(dtype, [1] * max_dims, data))[0]["t"].shape == (1,) * max_dims


def test_kv_cache_decoding_equals_causal_forward(rng):
    m = mha.MultiheadAttention(32, 8, num_kv_heads=2, batch_first=True, rope=mha.Rope(), seed=1).eval()
    xs = x(rng, 2, 9, 32)
    full = m(xs, xs, xs, is_causal=True, need_weights=False)[0]
    cache = m.new_cache(batch=2, capacity=16)
    rows = [m.forward_incremental(xs[:, :4], xs[:, :4], xs[:, :4], cache)]
    for t in range(4, 9):
        rows.append(m.forward_incremental(xs[:, t:t + 1], xs[:, t:t + 1], xs[:, t:t + 1], cache))
    np.testing.assert_allclose(np.concatenate(rows, axis=1), full, atol=1e-5)
    assert cache.lengths() == [9, 9]
    small = m.new_cache(batch=2, capacity=16, dtype="bf16")
    assert small.nbytes * 2 == cache.nbytes
    gqa_saving = mha.MultiheadAttention(32, 8).new_cache(2, 16).nbytes / cache.nbytes
    assert gqa_saving == 4
    with pytest.raises(ValueError):
        m.forward_incremental(xs, xs, xs, m.new_cache(batch=2, capacity=4))
    with pytest.raises(TypeError):
        m.forward_incremental(xs, xs, xs, None)
    with pytest.raises(ValueError, match="dtype"):
        m.new_cache(2, 4, dtype="f16")
    cache.reset()
    assert cache.lengths() == [0, 0]


def test_gradients_finite_differences(rng):
    m = mha.MultiheadAttention(8, 2, batch_first=True, seed=2).eval()
    q = x(rng, 1, 3, 8)
    d = x(rng, 1, 3, 8)
    _, g = m.gradients(q, q, q, d, is_causal=True)
    eps = 1e-3
    base = q.copy()
    num = np.zeros_like(q)
    for i in np.ndindex(q.shape):
        a = base.copy(); a[i] += eps  # noqa: E702
        b = base.copy(); b[i] -= eps  # noqa: E702
        num[i] = ((m(a, a, a, is_causal=True)[0] - m(b, b, b, is_causal=True)[0]) * d).sum() / (2 * eps)
    np.testing.assert_allclose(g["query"] + g["key"] + g["value"], num, atol=5e-3)


def test_analyze_key_positions_leave_appended_columns_out():
    # Top-left causal, 4 queries over 2 real keys and an appended bias_k column that takes most of
    # the weight: no query's own or previous token is the bias_k column.
    w = np.full((1, 1, 4, 3), 0.25, np.float32)
    w[..., 2] = 0.5
    r = mha.analyze(w, query_offset=0, key_positions=2)[0]
    assert r["self"] == pytest.approx(0.25) and r["prev_token"] == pytest.approx(0.25)
    assert r["class"] != "prev_token" and r["rows"] == 4
    assert mha.analyze(w, query_offset=0)[0]["self"] == pytest.approx(1 / 3)  # as a position
    with pytest.raises(ValueError, match="key_positions 4 is out of range"):
        mha.analyze(w, key_positions=4)


def test_analyze_leaves_out_rows_that_see_only_the_appended_keys():
    # A module with add_zero_attn under a bottom-right causal mask, T_q = 4 > T_k = 2: queries 0
    # and 1 see no real key, so all their weight is on the zero key. Counted, they read as focus 1
    # and entropy 0; they are left out like fully masked rows.
    m = mha.MultiheadAttention(8, 2, batch_first=True, add_zero_attn=True, seed=3).eval()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 8)).astype(np.float32)
    kv = rng.standard_normal((1, 2, 8)).astype(np.float32)
    causal = np.triu(np.ones((4, 2), bool), k=-1)  # True = may not attend: key j > query i - 2
    _, w = m(q, kv, kv, attn_mask=causal, need_weights=True, average_attn_weights=False)
    assert w.shape == (1, 2, 4, 3)
    np.testing.assert_allclose(w[0, :, :2, 2], 1.0, rtol=1e-6)
    assert (w[0, :, :2, :2] == 0).all()
    for r in mha.analyze(w, key_positions=2):
        assert r["rows"] == 2
    assert all(r["rows"] == 4 for r in mha.analyze(w))  # the zero key as a position: every row


def test_analyze_padding_moves_the_sink_and_leaves_padded_queries_out():
    w = np.zeros((2, 1, 3, 3), np.float32)
    w[0, ..., 0] = 1
    w[1, ..., 1] = 1  # batch 1's key 0 is padding: its rows put their weight on key 1
    pad = np.array([[False] * 3, [True, False, False]])
    assert mha.analyze(w)[0]["sink"] == pytest.approx(0.5)
    r = mha.analyze(w, key_padding_mask=pad, query_padding_mask=pad)[0]
    assert r["sink"] == pytest.approx(1.0) and r["rows"] == 5
    with pytest.raises(TypeError, match="key_padding_mask must be a boolean array"):
        mha.analyze(w, key_padding_mask=pad.astype(np.float32))
    with pytest.raises(ValueError, match="query_padding"):
        mha.analyze(w, query_padding_mask=pad[:, :2])


def test_float64_beyond_float32_range_is_refused_naming_the_argument():
    # Converted silently, 1e39 became inf and the output inf or NaN (numpy only warned).
    q = np.zeros((1, 1, 2, 4))
    big = q.copy()
    big[0, 0, 1, 2] = 1e39
    with pytest.raises(ValueError, match=r"sdpa: k\[0, 0, 1, 2\] = 1e\+39 is finite but beyond float32's range"):
        mha.sdpa(q, big, q)
    m = mha.MultiheadAttention(4, 1, batch_first=True)
    with pytest.raises(ValueError, match=r"query\[0, 1, 2\] = 1e\+39"):
        m(big[0], q[0], q[0])
    edge = q.copy()
    edge[0, 0, 0, 0] = float(np.finfo(np.float32).max)  # the largest float32 itself is fine
    assert np.isfinite(mha.sdpa(edge, q, q)).all()
    with np.errstate(over="ignore"):
        inf = q.copy()
        inf[0, 0, 0, 0] = np.inf  # an infinity is an infinity: the documented rules apply, no error
    mha.sdpa(q, inf, q)


def test_float64_masks_beyond_float32_range_are_refused_naming_the_mask():
    """The module's float masks went to the binding as they came, whose cast turned a float64 entry
    past float32's range into ±inf without a word: 1e300 gave NaN rows, -1e300 fully masked ones,
    where a query, key or value entry like it is refused (above)."""
    m = mha.MultiheadAttention(4, 1, batch_first=True).eval()
    x = np.random.default_rng(0).standard_normal((1, 3, 4)).astype(np.float32)
    am = np.zeros((3, 3))
    am[1, 2] = 1e300
    kpm = np.zeros((1, 3))
    kpm[0, 1] = -1e39
    with pytest.raises(ValueError, match=r"attn_mask\[1, 2\] = 1e\+300 is finite but beyond float32's range"):
        m(x, x, x, attn_mask=am)
    with pytest.raises(ValueError, match=r"key_padding_mask\[0, 1\] = -1e\+39 is finite but beyond float32's range"):
        m(x, x, x, key_padding_mask=kpm)
    with pytest.raises(ValueError, match=r"attn_mask\[1, 2\] = 1e\+300"):
        m.gradients(x, x, x, np.ones_like(x), attn_mask=am)
    with pytest.raises(ValueError, match=r"key_padding_mask\[0, 1\] = -1e\+39"):
        mha.head_importance(m, x, x, x, key_padding_mask=kpm)
    # sdpa names the index of the (B, T_k) array it was given, not of its 4-D view
    q = x[None]
    with pytest.raises(ValueError, match=r"sdpa: key_padding_mask\[0, 1\] = -1e\+39 is finite"):
        mha.sdpa(q, q, q, key_padding_mask=kpm)
    # values in range are converted as before: float64 and float16 masks give the float32 mask's bits
    am[1, 2], kpm[0, 1] = -3.0, 0.5
    want = m(x, x, x, attn_mask=am.astype(np.float32), key_padding_mask=kpm.astype(np.float32))
    for dtype in (np.float64, np.float16):
        got = m(x, x, x, attn_mask=am.astype(dtype), key_padding_mask=kpm.astype(dtype))
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_dropout_that_rounds_to_one_in_float32_is_named():
    q = np.zeros((1, 1, 2, 4), np.float32)
    for p in (0.99999999, 1 - 2**-26):
        with pytest.raises(ValueError, match="rounds to 1 in float32"):
            mha.sdpa(q, q, q, dropout_p=p)
        with pytest.raises(ValueError, match="rounds to 1 in float32"):
            mha.MultiheadAttention(8, 2, dropout=p)
    mha.sdpa(q, q, q, dropout_p=0.9999999)  # the largest ones below stay accepted


def test_analyze_and_prune(rng, tmp_path):
    m = mha.MultiheadAttention(16, 4, batch_first=True, seed=5).eval()
    q = x(rng, 1, 6, 16)
    out, w = m(q, q, q, average_attn_weights=False)
    png = tmp_path / "heads.png"
    res = mha.analyze(w, png=png)
    assert [r["head"] for r in res] == [0, 1, 2, 3]
    assert set(res[0]) == {"head", "rows", "entropy", "sink", "prev_token", "self", "focus", "class"}
    assert all(isinstance(r["class"], str) for r in res)
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError):
        mha.analyze(-w)
    with pytest.raises(ValueError, match="nothing to draw"):  # no sequence to draw (was an IndexError)
        mha.analyze(w[:0], png=tmp_path / "none.png")
    p = mha.prune_heads(m, [1, 3])
    assert p.num_heads == 2 and p.parameter_count() < m.parameter_count()
    sd = m.state_dict()
    sd["out_proj.weight"] = sd["out_proj.weight"].copy()
    sd["out_proj.weight"][:, 4:8] = 0
    sd["out_proj.weight"][:, 12:16] = 0
    ablated = mha.MultiheadAttention(16, 4, batch_first=True).eval()
    ablated.load_state_dict(sd)
    np.testing.assert_allclose(p(q, q, q)[0], ablated(q, q, q)[0], atol=1e-5)
    imp = mha.head_importance(m, q, q, q)
    assert imp.shape == (4,) and np.all(imp >= 0)
    with pytest.raises(ValueError):
        mha.prune_heads(m, [0, 1, 2, 3])
    with pytest.raises(ValueError):
        mha.prune_heads(m, [7])
    with pytest.raises(TypeError):
        mha.prune_heads("m", [0])


def test_threads_setting():
    n = mha.num_threads()
    mha.set_num_threads(1)
    assert mha.num_threads() == 1
    mha.set_num_threads(0)
    assert mha.num_threads() >= 1 and n >= 1


def test_default_threads_follow_omp_num_threads_and_the_affinity_mask():
    """The default was the machine's CPU count whatever the environment said: a process pinned to
    one CPU, or told OMP_NUM_THREADS=1 by a launcher, started a thread per CPU (oversubscribed)."""
    import os
    import subprocess
    import sys

    def default_in_child(env_threads, pin):
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        if env_threads is not None:
            env["OMP_NUM_THREADS"] = env_threads
        # Pinned before mha (and OpenMP) load, as taskset pins a process.
        code = ("import os\n"
                f"if {pin}: os.sched_setaffinity(0, {{sorted(os.sched_getaffinity(0))[0]}})\n"
                "import mha\n"
                "print(mha.num_threads())")
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        return int(r.stdout)

    assert default_in_child("3", False) == 3
    assert default_in_child("5,2", False) == 5  # nested levels: the outer one
    assert default_in_child("1", False) == 1
    assert default_in_child(None, True) == 1  # pinned to one CPU
    assert default_in_child(None, False) == len(os.sched_getaffinity(0))
    assert default_in_child("abc", True) == 1  # not a number: ignored, as OpenMP ignores it
    assert default_in_child("0", False) == len(os.sched_getaffinity(0))
    # OMP_PROC_BIND pins the initial thread to one CPU as OpenMP loads: the process still has all.
    env = dict(os.environ, OMP_PROC_BIND="true")
    env.pop("OMP_NUM_THREADS", None)
    r = subprocess.run([sys.executable, "-c", "import mha; print(mha.num_threads())"], env=env, capture_output=True,
                       text=True, check=True)
    assert int(r.stdout) == len(os.sched_getaffinity(0))


def test_tensor_cache_keeps_and_releases_large_blocks():
    before = mha.tensor_cache_limit()
    try:
        mha.release_cached_tensors()
        mha.set_tensor_cache_limit(64 << 20)
        assert mha.tensor_cache_limit() == 64 << 20
        m = mha.MultiheadAttention(8, 2, batch_first=True).eval()
        x = np.random.default_rng(0).standard_normal((1, 1024, 8), dtype=np.float32)
        y0, w = m(x, x, x, need_weights=True, average_attn_weights=False)  # 8 MiB of weights
        w0 = w.copy()
        del w  # the array owned the library's block: freed into the cache
        assert mha.cached_tensor_bytes() >= 8 << 20
        y1, w1 = m(x, x, x, need_weights=True, average_attn_weights=False)  # written over that block
        np.testing.assert_array_equal(w1, w0)
        np.testing.assert_array_equal(y1, y0)
        del w1
        assert mha.release_cached_tensors() >= 8 << 20
        assert mha.cached_tensor_bytes() == 0
    finally:
        mha.release_cached_tensors()
        mha.set_tensor_cache_limit(before)


def test_error_quoting_bytes_that_are_not_utf8_keeps_its_message(tmp_path):
    # A hostile header's JSON error quotes its bytes: they arrive escaped, never as an empty message.
    header = b'{"\xff\xfe":1}'
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ValueError, match=r"not valid JSON.*\\xff"):
        mha.load_safetensors(path)


def test_no_queries_leave_nan_key_inputs_out_of_the_weight_gradients():
    """With T_q = 0 no key is read: dK and dV are 0, and a NaN in the key/value inputs no longer
    reaches dW_K / dW_V through 0 · NaN (as for padded keys)."""
    m = mha.MultiheadAttention(8, 2, kdim=6, vdim=6, batch_first=True).eval()
    kx = np.random.default_rng(3).standard_normal((2, 5, 6)).astype(np.float32)
    kx[:, 3] = np.nan
    out, g = m.gradients(np.zeros((2, 0, 8), np.float32), kx, kx, np.ones((2, 0, 8), np.float32))
    assert out.shape == (2, 0, 8)
    for name in ("k_proj_weight", "v_proj_weight", "q_proj_weight", "in_proj_bias"):
        np.testing.assert_array_equal(g[name], 0.0)
    np.testing.assert_array_equal(g["key"], 0.0)


def test_deep_copies_and_pickles_keep_every_setting_and_are_independent(rng):
    import copy
    import pickle

    m = mha.MultiheadAttention(16, 4, num_kv_heads=2, batch_first=True, seed=5, rope=mha.Rope(dims=2), scale=0.3,
                               alibi_slopes=mha.alibi_slopes(4), softcap=5.0, attention_sinks=True).eval()
    sd = m.state_dict()
    sd["sinks"] = np.linspace(-1, 1, 4).astype(np.float32)
    m.load_state_dict(sd)
    pruned = mha.prune_heads(mha.MultiheadAttention(16, 4, kdim=6, vdim=10, add_bias_kv=True, seed=2), [1])
    q = x(rng, 2, 5, 16)
    for orig in (m, pruned):
        kv = (q, q) if orig is m else (x(rng, 5, 2, 6), x(rng, 5, 2, 10))
        qq = q if orig is m else x(rng, 5, 2, 16)
        ref = orig(qq, *kv)[0]
        for clone in (copy.deepcopy(orig), pickle.loads(pickle.dumps(orig))):
            assert clone._m.config() == orig._m.config()
            assert np.array_equal(clone(qq, *kv)[0], ref)
            w = clone.state_dict()
            w["out_proj.weight"] = np.zeros_like(w["out_proj.weight"])
            clone.load_state_dict(w)  # the clone's parameters are its own
            assert np.array_equal(orig(qq, *kv)[0], ref)
    with pytest.raises(ValueError, match="cannot unpickle"):
        mha._core.Module.__new__(mha._core.Module).__setstate__((2, (), {}))


def test_rope_fields_are_checked_not_truncated():
    with pytest.raises(TypeError, match="Rope: dims must be an int, got float"):
        mha.Rope(dims=2.7)
    with pytest.raises(ValueError, match="Rope: dims must fit in 64 bits"):
        mha.Rope(dims=2**70)
    with pytest.raises(TypeError, match="Rope: theta must be a number, got str"):
        mha.Rope(theta="1e4")
    with pytest.raises(TypeError, match="Rope: pairing must be a str"):
        mha.Rope(pairing=1)
    assert mha.Rope(theta=500, dims=4).dims == 4


def test_prune_heads_takes_whole_number_indices_only():
    m = mha.MultiheadAttention(16, 4, seed=1)
    for bad in (1.7, True, "2"):
        with pytest.raises(TypeError, match=r"prune_heads: heads\[\] must be an int"):
            mha.prune_heads(m, [bad])
    assert mha.prune_heads(m, [np.int64(1)])._m.config()["num_heads"] == 3


def test_load_state_dict_is_all_or_nothing(rng):
    m = mha.MultiheadAttention(16, 4, batch_first=True, seed=1).eval()
    q = x(rng, 1, 3, 16)
    before = m(q, q, q)[0]
    sd = m.state_dict()
    bad = {k: np.zeros_like(v) for k, v in sd.items()}
    bad["out_proj.bias"] = np.zeros(15, np.float32)  # the last one is wrong
    with pytest.raises(ValueError, match="out_proj.bias"):
        m.load_state_dict(bad)
    assert np.array_equal(m(q, q, q)[0], before)  # nothing of it was loaded


def test_torch_bfloat16_tensors_load_exactly():
    torch = pytest.importorskip("torch")
    m = mha.MultiheadAttention(8, 2, seed=1)
    sd = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in m.state_dict().items()}
    m.load_state_dict(sd)
    for k, v in m.state_dict().items():
        assert np.array_equal(v, sd[k].float().numpy()), k


def test_load_weights_while_another_thread_runs_forward(tmp_path):
    """load_weights wrote the new parameters into the module in place, freeing those a forward on
    another thread (without the GIL) was reading: segfaults, or wrong outputs once the freed blocks
    were reused. It now loads into a copy and swaps it in, as load_state_dict does."""
    import threading

    x = np.random.default_rng(0).standard_normal((2, 64, 256)).astype(np.float32)
    paths, wants = [], []
    for seed in (1, 2):  # two sets of weights, loaded in turn: every output must be one of the two
        other = mha.MultiheadAttention(256, 4, batch_first=True, seed=seed)
        other.eval()
        paths.append(tmp_path / f"w{seed}.safetensors")
        other.save(paths[-1])
        wants.append(other.forward(x, x, x, need_weights=False)[0])
    m = mha.MultiheadAttention(256, 4, batch_first=True)
    m.eval()
    m.load_weights(paths[0])
    stop = threading.Event()
    wrong = []

    def reload():
        i = 0
        while not stop.is_set():
            i += 1
            m.load_weights(paths[i % 2])

    t = threading.Thread(target=reload)
    t.start()
    try:
        for _ in range(40):
            out = m.forward(x, x, x, need_weights=False)[0]
            if not any(np.array_equal(out, w) for w in wants):
                wrong.append(min(float(np.abs(out - w).max()) for w in wants))
    finally:
        stop.set()
        t.join()
    assert not wrong


def _mask_layouts(masked, rng):
    """``masked`` (a C-contiguous bool array of rank ≥ 2) in layouts the binding reads in place."""
    last = masked.ndim - 1
    return {
        "transposed": np.ascontiguousarray(np.swapaxes(masked, last - 1, last)).swapaxes(last - 1, last),
        "every other column": np.repeat(masked, 2, axis=-1)[..., ::2],
        "reversed": masked[..., ::-1, ::-1].copy()[..., ::-1, ::-1],
        "uint8, any nonzero": (masked * rng.integers(1, 256, masked.shape)).astype(np.uint8),
        "broadcast": np.broadcast_to(masked[..., :1, :], masked.shape),
    }


@pytest.mark.parametrize("rank", [2, 3])
def test_bool_masks_are_read_in_place_in_any_layout(rng, rank):
    """A torch-polarity bool attn_mask was inverted by np.logical_not, and the result (F-ordered for
    a transposed mask) copied again into C-contiguous uint8 before the library's own copy: two to
    three mask-sized copies a call. The binding now reads the mask in place, whatever its strides,
    negating it in the one copy the library keeps; every layout gives the contiguous mask's numbers."""
    import tracemalloc

    B, h = 2, 4
    m = mha.MultiheadAttention(16, h, batch_first=True, seed=5).eval()

    def inputs(T, S):
        masked = rng.random((T, S) if rank == 2 else (B * h, T, S)) < 0.3
        masked[..., 0] = False  # every row sees a key, so the float mask's numbers compare too
        padding = rng.random((B, S)) < 0.3
        padding[:, 0] = False
        return x(rng, B, T, 16), x(rng, B, S, 16), masked, padding

    q, kv, masked, padding = inputs(7, 9)
    paddings = {"contiguous": padding, "reversed": padding[:, ::-1].copy()[:, ::-1],
                "broadcast": np.broadcast_to(padding[:1], padding.shape)}
    layouts = _mask_layouts(masked, rng)
    for name, mask in layouts.items():
        for pname, pad in paddings.items():
            contiguous_mask = np.ascontiguousarray(mask != 0)
            want = m(q, kv, kv, attn_mask=contiguous_mask, key_padding_mask=np.ascontiguousarray(pad),
                     average_attn_weights=False)
            got = m(q, kv, kv, attn_mask=mask, key_padding_mask=pad, average_attn_weights=False)
            for g, w in zip(got, want):
                assert np.array_equal(g, w), (name, pname)
            additive = np.where(contiguous_mask, -np.inf, 0).astype(np.float32)
            np.testing.assert_allclose(got[0], m(q, kv, kv, attn_mask=additive, key_padding_mask=pad)[0], atol=1e-6)
    g_in_place = m.gradients(q, kv, kv, q, attn_mask=layouts["transposed"], key_padding_mask=paddings["reversed"])
    g_contiguous = m.gradients(q, kv, kv, q, attn_mask=masked, key_padding_mask=padding)
    for n, g in g_contiguous[1].items():
        assert np.array_equal(g_in_place[1][n], g), n
    # No copy of a mask on the numpy side: tracemalloc sees numpy's allocations (not the library's).
    q, kv, masked, padding = inputs(128, 160)
    for name, mask in _mask_layouts(masked, rng).items():
        m(q, kv, kv, attn_mask=mask, key_padding_mask=padding[:, ::-1], need_weights=False)
        tracemalloc.start()
        try:
            m(q, kv, kv, attn_mask=mask, key_padding_mask=padding[:, ::-1], need_weights=False)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < masked.size // 8, (name, peak)
