"""mha.PagedKvCache through the module (equal to the contiguous KvCache token by token, fork with
copy-on-write, bad ids), and the module forward's lse and packed variable-length input."""
import numpy as np
import pytest

import mha


def x(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "int8"])
def test_paged_cache_equals_contiguous_cache_token_by_token(rng, dtype):
    m = mha.MultiheadAttention(32, 4, num_kv_heads=2, batch_first=True, rope=mha.Rope(), seed=1,
                               alibi_slopes=mha.alibi_slopes(4), softcap=4.0).eval()
    xs = x(rng, 2, 10, 32)
    flat = m.new_cache(batch=2, capacity=16, dtype=dtype)
    paged = m.new_paged_cache(num_blocks=8, block_size=3, dtype=dtype)
    seqs = [paged.add_sequence(), paged.add_sequence()]
    want = m.forward_incremental(xs[:, :4], xs[:, :4], xs[:, :4], flat, new_lengths=[4, 2], window=5)
    got = m.forward_incremental(xs[:, :4], xs[:, :4], xs[:, :4], paged, seqs=seqs, new_lengths=[4, 2], window=5)
    np.testing.assert_array_equal(got, want)
    for t in range(4, 10):
        step = xs[:, t:t + 1]
        np.testing.assert_array_equal(m.forward_incremental(step, step, step, paged, seqs=seqs, window=5),
                                      m.forward_incremental(step, step, step, flat, window=5))
    assert [paged.length(s) for s in seqs] == flat.lengths() == [10, 8]
    assert len(paged.block_table(seqs[0])) == 4 and paged.free_blocks() == 8 - 4 - 3


def test_paged_fork_shares_blocks_and_copies_on_write(rng):
    m = mha.MultiheadAttention(16, 2, batch_first=True, seed=2).eval()
    cache = mha.PagedKvCache(2, 8, block_size=4, num_blocks=6)
    parent = cache.add_sequence()
    prompt = x(rng, 1, 6, 16)
    m.forward_incremental(prompt, prompt, prompt, cache, seqs=[parent])
    free = cache.free_blocks()
    child = cache.fork(parent)
    assert cache.free_blocks() == free  # nothing copied
    assert cache.block_table(child) == cache.block_table(parent)
    assert all(cache.refcount(b) == 2 for b in cache.block_table(parent))
    # The child decodes like a copy of its parent.
    flat = m.new_cache(1, 8)
    m.forward_incremental(prompt, prompt, prompt, flat)
    tok = x(rng, 1, 1, 16)
    got = m.forward_incremental(tok, tok, tok, cache, seqs=[child])
    np.testing.assert_array_equal(got, m.forward_incremental(tok, tok, tok, flat))
    # Writing into the shared, partly filled last block copied it; the full first block stays shared.
    assert cache.block_table(child)[0] == cache.block_table(parent)[0]
    assert cache.block_table(child)[1] != cache.block_table(parent)[1]
    assert cache.free_blocks() == free - 1
    assert cache.length(parent) == 6 and cache.length(child) == 7
    cache.free(child)
    assert cache.free_blocks() == free and not cache.alive(child)


def test_paged_cache_bad_ids_and_arguments(rng):
    m = mha.MultiheadAttention(16, 2, batch_first=True, seed=2).eval()
    cache = m.new_paged_cache(num_blocks=2, block_size=4)
    a = cache.add_sequence()
    xs = x(rng, 2, 1, 16)
    with pytest.raises(ValueError, match="appears twice"):
        m.forward_incremental(xs, xs, xs, cache, seqs=[a, a])
    with pytest.raises(ValueError, match="seqs\\[1\\] = 5 is not a live sequence"):
        m.forward_incremental(xs, xs, xs, cache, seqs=[a, 5])
    with pytest.raises(ValueError, match="needs seqs"):
        m.forward_incremental(xs, xs, xs, cache)
    with pytest.raises(ValueError, match="seqs= is for a PagedKvCache"):
        m.forward_incremental(xs[:1], xs[:1], xs[:1], m.new_cache(1, 4), seqs=[0])
    with pytest.raises(ValueError, match="does not exist"):
        cache.fork(9)
    with pytest.raises(ValueError, match="more blocks"):
        big = x(rng, 1, 9, 16)
        m.forward_incremental(big, big, big, cache, seqs=[a])
    assert cache.length(a) == 0 and cache.free_blocks() == 2  # a refused call changes nothing
    with pytest.raises(ValueError, match="dtype"):
        mha.PagedKvCache(2, 8, num_blocks=4, dtype="f16")
    with pytest.raises(ValueError, match="must be ≥ 1"):
        mha.PagedKvCache(2, 8, num_blocks=0)


def test_module_forward_returns_lse(rng):
    m = mha.MultiheadAttention(16, 2, batch_first=True, seed=3, attention_sinks=False).eval()
    xs = x(rng, 2, 5, 16)
    out, w = m(xs, xs, xs, need_weights=False)
    out2, w2, lse = m(xs, xs, xs, need_weights=False, need_lse=True, is_causal=True)
    assert w is None and w2 is None and lse.shape == (2, 2, 5)
    # Row 0 sees only key 0 (causal): its lse is that one scaled score.
    q = xs @ m.state_dict()["in_proj_weight"][:16].T
    k = xs @ m.state_dict()["in_proj_weight"][16:32].T
    s00 = (q[:, 0, :8] * k[:, 0, :8]).sum(-1) / np.sqrt(8)
    np.testing.assert_allclose(lse[:, 0, 0], s00, atol=1e-5)
    # The torch-compatible return is unchanged without need_lse.
    assert len(m(xs, xs, xs)) == 2


def test_module_forward_packed_equals_each_sequence(rng):
    m = mha.MultiheadAttention(16, 4, num_kv_heads=2, seed=4, rope=mha.Rope(), alibi_slopes=mha.alibi_slopes(4),
                               softcap=3.0, attention_sinks=True).eval()
    sd = m.state_dict()
    sd["sinks"] = np.array([0.5, -1.0, 1.0, 0.0], np.float32)
    m.load_state_dict(sd)
    lens = [3, 0, 1, 7]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    xs = x(rng, int(cu[-1]), 16)
    out, w, lse = m(xs, xs, xs, need_weights=False, is_causal=True, need_lse=True, cu_seqlens_q=cu)
    assert w is None and out.shape == (cu[-1], 16) and lse.shape == (4, cu[-1])
    for s, n in enumerate(lens):
        if n == 0:
            continue
        sl = slice(cu[s], cu[s + 1])
        one, _, one_lse = m(xs[sl], xs[sl], xs[sl], need_weights=False, is_causal=True, need_lse=True)
        np.testing.assert_allclose(out[sl], one, atol=2e-6, rtol=2e-6)
        np.testing.assert_allclose(lse[:, sl], one_lse, atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="weights"):
        m(xs, xs, xs, cu_seqlens_q=cu)  # need_weights defaults to True
    with pytest.raises(ValueError, match="must not decrease"):
        m(xs, xs, xs, need_weights=False, cu_seqlens_q=[0, 5, 3, 11])
    with pytest.raises(ValueError, match="needs cu_seqlens_q"):
        m(xs, xs, xs, need_weights=False, cu_seqlens_k=cu)
    with pytest.raises(TypeError, match="integer"):
        m(xs, xs, xs, need_weights=False, cu_seqlens_q=[0.0, 11.0])


def test_attend_paged_cache_equals_sdpa_over_the_held_keys(rng):
    m = mha.MultiheadAttention(16, 4, num_kv_heads=2, batch_first=True, seed=5).eval()
    cache = m.new_paged_cache(num_blocks=6, block_size=3)
    seqs = [cache.add_sequence(), cache.add_sequence()]
    xs = x(rng, 2, 7, 16)
    m.forward_incremental(xs, xs, xs, cache, seqs=seqs, new_lengths=[7, 4])
    q = x(rng, 2, 4, 1, 4)  # d = 16 / 4
    out, lse = mha.attend_paged_cache(q, cache, seqs, splits=2)
    assert out.shape == (2, 4, 1, 4) and lse.shape == (2, 4, 1)
    for b, s in enumerate(seqs):
        n = cache.length(s)
        k = np.array([[[cache._c.k_at(s, g, p, c) for c in range(4)] for p in range(n)] for g in range(2)], np.float32)
        v = np.array([[[cache._c.v_at(s, g, p, c) for c in range(4)] for p in range(n)] for g in range(2)], np.float32)
        want, want_lse = mha.sdpa(q[b:b + 1], k[None], v[None], return_lse=True)
        np.testing.assert_allclose(out[b:b + 1], want, atol=2e-6, rtol=2e-6)
        np.testing.assert_allclose(lse[b], want_lse[0], atol=2e-6)
    with pytest.raises(ValueError, match=r"attend_paged_cache: seqs\[1\] = 9 is not a live sequence"):
        mha.attend_paged_cache(q, cache, [seqs[0], 9])
    with pytest.raises(TypeError, match="PagedKvCache"):
        mha.attend_paged_cache(q, m.new_cache(2, 8), seqs)


def test_int8_cache_close_to_f32_and_refuses_non_finite(rng):
    m = mha.MultiheadAttention(32, 4, num_kv_heads=2, batch_first=True, seed=3).eval()
    xs = x(rng, 1, 9, 32)
    flat, small = m.new_cache(1, 16), m.new_cache(1, 16, dtype="int8")
    paged = m.new_paged_cache(num_blocks=4, block_size=4, dtype="int8")
    seqs = [paged.add_sequence()]
    for cache, kw in ((flat, {}), (small, {}), (paged, {"seqs": seqs})):
        m.forward_incremental(xs[:, :5], xs[:, :5], xs[:, :5], cache, **kw)
    step = xs[:, 5:6]
    want = m.forward_incremental(step, step, step, flat)
    got = m.forward_incremental(step, step, step, small)
    np.testing.assert_allclose(got, want, atol=0.02)  # a few int8 steps (max|x|/127) of O(1) values
    np.testing.assert_array_equal(m.forward_incremental(step, step, step, paged, seqs=seqs), got)
    assert small.nbytes == 2 * 2 * 16 * (8 + 4)  # a byte per element and a float scale per row
    bad = xs[:, 6:7].copy()
    bad[0, 0, 0] = np.nan
    for cache, kw in ((small, {}), (paged, {"seqs": seqs})):
        with pytest.raises(ValueError, match="finite"):
            m.forward_incremental(bad, bad, bad, cache, **kw)
    assert small.length(0) == 6 and paged.length(seqs[0]) == 6


def test_int8_per_channel_key_scales(rng):
    # KIVI's key quantisation: one scale per channel of each group of key_group positions. Decoding
    # through it stays within a few int8 steps of the float32 cache, and the bytes hold the groups'
    # scales plus each head's open group in float32.
    m = mha.MultiheadAttention(32, 4, num_kv_heads=2, batch_first=True, seed=3).eval()
    xs = x(rng, 1, 12, 32)
    flat = m.new_cache(1, 16)
    kivi = m.new_cache(1, 16, dtype="int8", int8_keys="per-channel", key_group=4)
    for cache in (flat, kivi):
        m.forward_incremental(xs[:, :5], xs[:, :5], xs[:, :5], cache)
    for t in range(5, 12):
        step = xs[:, t:t + 1]
        want = m.forward_incremental(step, step, step, flat)
        np.testing.assert_allclose(m.forward_incremental(step, step, step, kivi), want, atol=0.02)
    # K: 2·16·8 bytes and (2, 4 groups, 8) scales and (2, 4 rows, 8) open rows; V: bytes and a scale per row.
    assert kivi.nbytes == 2 * 16 * 8 + 4 * 2 * 4 * 8 + 4 * 2 * 4 * 8 + 2 * 16 * (8 + 4)
    with pytest.raises(ValueError, match="per-channel key scales need an int8, non-ring cache"):
        m.new_cache(1, 16, int8_keys="per-channel")
    with pytest.raises(ValueError, match="int8_keys must be"):
        m.new_cache(1, 16, dtype="int8", int8_keys="per-head")


def test_transposed_key_layout(rng):
    # Keys across SIMD lanes: the same decoding as the row layout (to float rounding), for every
    # dtype with per-token scales, in a ring too; capacity 20 ends inside a tile of 16.
    m = mha.MultiheadAttention(32, 4, num_kv_heads=2, batch_first=True, seed=5).eval()
    xs = x(rng, 2, 30, 32)
    for dtype in ("f32", "bf16", "int8"):
        for ring in (False, True):
            cap = 20 if ring else 30
            rows = m.new_cache(2, cap, dtype=dtype, ring=ring)
            lanes = m.new_cache(2, cap, dtype=dtype, ring=ring, key_layout="transposed")
            opts = {"window": 20} if ring else {}
            for cache in (rows, lanes):
                m.forward_incremental(xs[:, :7], xs[:, :7], xs[:, :7], cache, **opts)
            for t in range(7, 30):
                step = xs[:, t:t + 1]
                want = m.forward_incremental(step, step, step, rows, **opts)
                np.testing.assert_allclose(m.forward_incremental(step, step, step, lanes, **opts), want,
                                           atol=1e-5, rtol=1e-5)
            # K rounded up to whole tiles of 16 positions: 2 sequences · 2 heads · 32 slots · 8 channels.
            elem = {"f32": 4, "bf16": 2, "int8": 1}[dtype]
            assert lanes.nbytes - rows.nbytes == 2 * 2 * (32 - cap) * 8 * elem
    with pytest.raises(ValueError, match="key_layout must be"):
        m.new_cache(1, 16, key_layout="columns")
    with pytest.raises(ValueError, match="transposed keys"):
        m.new_cache(1, 16, dtype="int8", int8_keys="per-channel", key_layout="transposed")


def test_paged_transposed_key_layout(rng):
    # A paged pool with keys across lanes decodes as the contiguous transposed cache does, bitwise.
    m = mha.MultiheadAttention(32, 4, num_kv_heads=2, batch_first=True, seed=6).eval()
    xs = x(rng, 1, 40, 32)
    flat = m.new_cache(1, 40, key_layout="transposed")
    paged = m.new_paged_cache(4, 16, key_layout="transposed")
    seq = paged.add_sequence()
    np.testing.assert_array_equal(m.forward_incremental(xs[:, :9], xs[:, :9], xs[:, :9], paged, seqs=[seq]),
                                  m.forward_incremental(xs[:, :9], xs[:, :9], xs[:, :9], flat))
    for t in range(9, 40):
        step = xs[:, t:t + 1]
        np.testing.assert_array_equal(m.forward_incremental(step, step, step, paged, seqs=[seq]),
                                      m.forward_incremental(step, step, step, flat))
    with pytest.raises(ValueError, match="multiple of 16"):
        m.new_paged_cache(4, 8, key_layout="transposed")
