"""ALiBi slopes, logit softcap and attention-sink logits through mha.sdpa_varlen, mha.attend_cache and
mha.attend_paged_cache: against a float64 oracle written from docs/semantics.md ('Score edits'),
against mha.sdpa on each sequence (varlen: bitwise) or on the whole sequence (token-by-token decode),
paged caches bitwise equal to contiguous ones, and bad values refused with ValueError."""
import numpy as np
import pytest

import mha

H, KV, D, DV = 4, 2, 16, 8
SLOPES = mha.alibi_slopes(H)
SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
EDITS = {
    "alibi": dict(alibi_slopes=SLOPES),
    "softcap": dict(softcap=1.5),
    "sinks": dict(sinks=SINKS),
    "all": dict(alibi_slopes=SLOPES, softcap=2.0, sinks=SINKS),
}


def oracle(q, k, v, q_pos, k_pos, *, causal=True, window=0, alibi_slopes=None, softcap=0.0, sinks=None):
    """float64 attention of q (h, T_q, d) at positions q_pos over k (kv, T_k, d), v (kv, T_k, d_v) at
    k_pos, in the library's order: scale, softcap c·tanh(t/c), ALiBi −m_h·(q_pos − k_pos), the causal
    (and window) mask, softmax whose denominator also holds e^{z_h}. Returns out (h, T_q, d_v) and lse
    (h, T_q); a row with neither key nor sink gives zeros and −inf."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    s = np.einsum("hid,hjd->hij", q, k) / np.sqrt(q.shape[-1])
    if softcap:
        s = softcap * np.tanh(s / softcap)
    dist = np.asarray(q_pos, np.float64)[:, None] - np.asarray(k_pos, np.float64)[None, :]
    if alibi_slopes is not None:
        s -= np.asarray(alibi_slopes, np.float64)[:, None, None] * dist
    seen = np.ones(dist.shape, bool)
    if causal:
        seen &= dist >= 0
    if window:
        seen &= dist < window
    s = np.where(seen, s, -np.inf)
    z = np.full(q.shape[0], -np.inf) if sinks is None else np.asarray(sinks, np.float64)
    m = np.maximum(s.max(-1, initial=-np.inf), z[:, None])
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe[..., None])
    denom = e.sum(-1) + np.exp(z[:, None] - m_safe)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(denom[..., None] > 0, (e @ v) / denom[..., None], 0.0)
        lse = m_safe + np.log(denom)
    return out, lse


def heads_first(a):
    """(T, heads, d) rows of a packed batch as a (1, heads, T, d) batch of one."""
    return a[None].transpose(0, 2, 1, 3)


# ---- sdpa_varlen ---------------------------------------------------------------------------------

LENS_Q = [3, 0, 1, 20, 4, 7]
LENS_K = [5, 2, 1, 33, 2, 7]  # sequence 4: 4 queries over 2 keys, its first rows see no key bottom-right
CAUSAL = {"none": None, "top_left": mha.Causal.top_left(), "bottom_right": mha.Causal.bottom_right(),
          "offset": mha.Causal.offset(1)}


@pytest.fixture
def packed():
    rng = np.random.default_rng(11)
    cu_q, cu_k = np.cumsum([0] + LENS_Q), np.cumsum([0] + LENS_K)
    q = 2.0 * rng.standard_normal((cu_q[-1], H, D)).astype(np.float32)  # large enough for the cap to bite
    k = rng.standard_normal((cu_k[-1], KV, D)).astype(np.float32)
    v = rng.standard_normal((cu_k[-1], KV, DV)).astype(np.float32)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal", list(CAUSAL))
@pytest.mark.parametrize("edits", list(EDITS))
def test_varlen_score_edits_match_the_oracle_and_sdpa_per_sequence(packed, causal, edits):
    q, k, v, cu_q, cu_k = packed
    kw = dict(causal=CAUSAL[causal], **EDITS[edits])
    out, lse = mha.sdpa_varlen(q, k, v, cu_q, cu_k, return_lse=True, threads=2, **kw)
    assert out.shape == (cu_q[-1], H, DV) and lse.shape == (cu_q[-1], H)
    for s, (tq, tk) in enumerate(zip(LENS_Q, LENS_K)):
        if tq == 0:
            continue
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        offset = {"top_left": 0, "offset": 1}.get(causal, tk - tq)  # ALiBi: bottom-right without a mask
        want, want_lse = oracle(q[rows].transpose(1, 0, 2), k[keys].transpose(1, 0, 2), v[keys].transpose(1, 0, 2),
                                np.arange(tq) + offset, np.arange(tk), causal=causal != "none", **EDITS[edits])
        np.testing.assert_allclose(out[rows], want.transpose(1, 0, 2), atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(lse[rows], want_lse.T, atol=2e-5, rtol=2e-5)
        # docs/semantics.md, 'Packed variable-length sequences': bitwise the sequence run alone.
        one, one_lse = mha.sdpa(heads_first(q[rows]), heads_first(k[keys]), heads_first(v[keys]), return_lse=True,
                                threads=2, **kw)
        np.testing.assert_array_equal(out[rows], one[0].transpose(1, 0, 2))
        np.testing.assert_array_equal(lse[rows], one_lse[0].T)


def test_varlen_row_without_keys_gives_the_sink(packed):
    q, k, v, cu_q, cu_k = packed
    out, lse = mha.sdpa_varlen(q, k, v, cu_q, cu_k, causal=mha.Causal.bottom_right(), sinks=SINKS, return_lse=True)
    blind = slice(cu_q[4], cu_q[4] + 2)  # 4 queries over 2 keys: rows 0 and 1 are before every key
    assert not out[blind].any()
    np.testing.assert_array_equal(lse[blind], np.broadcast_to(SINKS, (2, H)))
    _, no_sink_lse = mha.sdpa_varlen(q, k, v, cu_q, cu_k, causal=mha.Causal.bottom_right(), return_lse=True)
    assert np.all(no_sink_lse[blind] == -np.inf)


@pytest.mark.parametrize("edits", ["alibi", "all"])
def test_varlen_bf16_and_window_with_edits_equal_sdpa_per_sequence(packed, edits):
    q, k, v, cu_q, cu_k = packed
    kw = dict(causal=mha.Causal.bottom_right(), window=3, dtype="bf16", **EDITS[edits])
    out = mha.sdpa_varlen(q, k, v, cu_q, cu_k, **kw)
    for s in range(len(LENS_Q)):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if rows.start == rows.stop:
            continue
        one = mha.sdpa(heads_first(q[rows]), heads_first(k[keys]), heads_first(v[keys]), **kw)
        np.testing.assert_array_equal(out[rows], one[0].transpose(1, 0, 2))


def test_varlen_bad_score_edits_are_refused(packed):
    q, k, v, cu_q, cu_k = packed

    def call(**kw):
        return mha.sdpa_varlen(q, k, v, cu_q, cu_k, **kw)

    with pytest.raises(ValueError, match=r"sdpa_varlen: alibi slopes has 3 entries, expected one per query head \(4\)"):
        call(alibi_slopes=[0.5, 0.25, 0.125])
    with pytest.raises(ValueError, match=r"^sdpa_varlen: alibi_slopes must be finite, got alibi_slopes\[2\] = inf$"):
        call(alibi_slopes=[0.5, 0.25, np.inf, 0.1])
    with pytest.raises(ValueError, match=r"sdpa_varlen: sinks has 5 entries, expected one per query head \(4\)"):
        call(sinks=np.zeros(5))
    with pytest.raises(ValueError, match=r"^sdpa_varlen: sinks must be finite, got sinks\[0\] = nan$"):
        call(sinks=[np.nan, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"^sdpa_varlen: sinks\[1\] = -1e\+39 is finite but beyond float32's range$"):
        call(sinks=[0.0, -1e39, 0.0, 0.0])  # finite as given, -inf in the library's float32
    for bad in (-1.0, np.inf, np.nan):
        with pytest.raises(ValueError, match="sdpa_varlen: softcap must be a finite c > 0"):
            call(softcap=bad)
    with pytest.raises(TypeError, match="sdpa_varlen: softcap must be a number"):
        call(softcap="2")
    with pytest.raises(TypeError, match="sdpa_varlen: alibi_slopes must be a 1-D sequence"):
        call(alibi_slopes=np.ones((2, 2)))
    with pytest.raises(TypeError, match="sdpa_varlen: sinks must be a 1-D sequence"):
        call(sinks=0.5)


# ---- attend_cache / attend_paged_cache --------------------------------------------------------------

def qkv(rng, B, T):
    return (2.0 * rng.standard_normal((B, H, T, D)).astype(np.float32),
            rng.standard_normal((B, KV, T, D)).astype(np.float32),
            rng.standard_normal((B, KV, T, DV)).astype(np.float32))


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("edits", list(EDITS))
def test_decode_token_by_token_equals_the_full_causal_sdpa(rng, edits, window):
    """Prefill 4 tokens (their queries at positions 0 … 3), then decode one token at a time: ALiBi by
    absolute positions gives the full forward's distances, so the rows equal mha.sdpa's."""
    B, T, prefill = 2, 13, 4
    q, k, v = qkv(rng, B, T)
    cache = mha.KvCache(B, KV, D, 16, value_dim=DV)
    cache.append(k[:, :, :prefill], v[:, :, :prefill])
    steps = [mha.attend_cache(q[:, :, :prefill], cache, q_start=[0, 0], window=window, **EDITS[edits])]
    for t in range(prefill, T):
        cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        steps.append(mha.attend_cache(q[:, :, t:t + 1], cache, q_start=[t, t], window=window, **EDITS[edits]))
    out, lse = (np.concatenate(r, axis=2) for r in zip(*steps))
    want, want_lse = mha.sdpa(q, k, v, causal=mha.Causal.bottom_right(), window=window, return_lse=True,
                              **EDITS[edits])
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5, rtol=1e-5)
    for b in range(B):
        ref, ref_lse = oracle(q[b], k[b], v[b], np.arange(T), np.arange(T), window=window, **EDITS[edits])
        np.testing.assert_allclose(out[b], ref, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(lse[b], ref_lse, atol=2e-5, rtol=2e-5)


def test_ring_cache_alibi_uses_absolute_positions(rng):
    """A ring of 8 slots wraps twice; with window 8 each step sees exactly what the ring holds, and
    ALiBi's distances are those of positions, not of slots."""
    T, window = 21, 8
    q, k, v = qkv(rng, 1, T)
    cache = mha.KvCache(1, KV, D, window, value_dim=DV, ring=True)
    kw = EDITS["all"]
    steps = []
    for t in range(T):
        cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        steps.append(mha.attend_cache(q[:, :, t:t + 1], cache, q_start=[t], window=window, **kw))
    out, lse = (np.concatenate(r, axis=2) for r in zip(*steps))
    want, want_lse = mha.sdpa(q, k, v, causal=mha.Causal.bottom_right(), window=window, return_lse=True, **kw)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5, rtol=1e-5)
    # A query placed before every held position sees no key: the sink takes the row.
    blind, blind_lse = mha.attend_cache(q[:, :, :1], cache, q_start=[3], **kw)
    assert not blind.any()
    np.testing.assert_array_equal(blind_lse[0, :, 0], SINKS)


def test_attend_cache_with_ragged_lengths_matches_the_oracle(rng):
    """Sequences of different lengths, queries at explicit and default positions."""
    q, k, v = qkv(rng, 2, 3)
    _, kf, vf = qkv(rng, 2, 11)
    cache = mha.KvCache(2, KV, D, 16, value_dim=DV)
    cache.append(kf, vf, counts=[11, 6])
    kw = dict(alibi_slopes=[0.3, -0.2, 0.0, 1.0], softcap=3.0, sinks=SINKS)  # any finite slopes
    for q_start in (None, [2, 4]):
        out, lse = mha.attend_cache(q, cache, q_start=q_start, splits=2, **kw)
        for b, n in enumerate(cache.lengths()):
            start = n if q_start is None else q_start[b]
            want, want_lse = oracle(q[b], kf[b, :, :n], vf[b, :, :n], start + np.arange(3), np.arange(n), **kw)
            np.testing.assert_allclose(out[b], want, atol=2e-5, rtol=2e-5)
            np.testing.assert_allclose(lse[b], want_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "int8"])
@pytest.mark.parametrize("edits", list(EDITS))
def test_paged_cache_equals_contiguous_cache_bitwise_with_edits(rng, dtype, edits):
    flat = mha.KvCache(2, KV, D, 32, value_dim=DV, dtype=dtype)
    paged = mha.PagedKvCache(KV, D, block_size=4, num_blocks=16, value_dim=DV, dtype=dtype)
    seqs = [paged.add_sequence(), paged.add_sequence()]
    for T in (6, 1, 7):
        _, k, v = qkv(rng, 2, T)
        flat.append(k, v)
        for b, s in enumerate(seqs):
            paged.append(s, k[b], v[b])
    q = qkv(rng, 2, 3)[0]
    for kw in (dict(splits=1), dict(splits=3, q_start=[5, 11], window=6), dict(threads=1)):
        want = mha.attend_cache(q, flat, **kw, **EDITS[edits])
        got = mha.attend_paged_cache(q, paged, seqs, **kw, **EDITS[edits])
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    # The edits change the result (they reach the kernel).
    assert not np.array_equal(mha.attend_paged_cache(q, paged, seqs)[1], got[1])


@pytest.mark.parametrize("paged", [False, True])
def test_cache_bad_score_edits_are_refused(rng, paged):
    q = qkv(rng, 1, 1)[0]
    if paged:
        cache = mha.PagedKvCache(KV, D, block_size=4, num_blocks=4, value_dim=DV)
        seq = cache.add_sequence()
        cache.append(seq, *qkv(rng, 1, 3)[1:])
        fn = "attend_paged_cache"  # (its errors once said attend_paged_blocks, the function it calls)

        def call(**kw):
            return mha.attend_paged_cache(q, cache, [seq], **kw)
    else:
        cache = mha.KvCache(1, KV, D, 8, value_dim=DV)
        cache.append(*qkv(rng, 1, 3)[1:])
        fn = "attend_cache"

        def call(**kw):
            return mha.attend_cache(q, cache, **kw)

    with pytest.raises(ValueError, match=fn + r": alibi slopes has 2 entries, expected one per query head \(4\)"):
        call(alibi_slopes=[0.5, 0.25])
    with pytest.raises(ValueError, match="^" + fn + r": alibi_slopes must be finite, got alibi_slopes\[3\] = -inf$"):
        call(alibi_slopes=[0.5, 0.25, 0.1, -np.inf])
    with pytest.raises(ValueError, match=fn + r": sinks has 8 entries, expected one per query head \(4\)"):
        call(sinks=np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="^" + fn + r": sinks must be finite, got sinks\[1\] = inf$"):
        call(sinks=[0.0, np.inf, 0.0, 0.0])
    for bad in (-0.5, np.inf, np.nan):
        with pytest.raises(ValueError, match=fn + ": softcap must be a finite c > 0"):
            call(softcap=bad)
    with pytest.raises(TypeError, match=fn + ": softcap must be a number"):
        call(softcap=None)
    with pytest.raises(TypeError, match=fn + ": alibi_slopes must be a 1-D sequence"):
        call(alibi_slopes="0.5")
    with pytest.raises(TypeError, match=fn + ": sinks must be a 1-D sequence"):
        call(sinks=[True, False, True, False])
    # Nothing was changed by the refused calls; the same call with good values works.
    out, lse = call(alibi_slopes=SLOPES, softcap=1.0, sinks=SINKS)
    assert out.shape == (1, H, 1, DV) and np.isfinite(lse).all()
