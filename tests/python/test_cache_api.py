"""KV caches filled and read directly (KvCache.append, PagedKvCache.append, attend_cache): K/V as a
caller's own projections made them, attention against a float64 reference over the values the
cache holds, contiguous and paged caches equal, bad input refused without changes."""
import numpy as np
import pytest

import mha


def x(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def held(cache, b, kv, n, d, dv):
    """K (kv, n, d) and V (kv, n, dv) of positions 0 … n − 1 as the cache stores them."""
    k = np.array([[[cache.k_at(b, g, p, c) for c in range(d)] for p in range(n)] for g in range(kv)])
    v = np.array([[[cache.v_at(b, g, p, c) for c in range(dv)] for p in range(n)] for g in range(kv)])
    return k, v


def reference(q, k, v, positions, key_positions, window=0):
    """float64 causal attention of q (h, T, d) at `positions` over k (kv, n, d), v (kv, n, dv) at
    `key_positions`; returns out (h, T, dv) and lse (h, T)."""
    h, T, d = q.shape
    kv = k.shape[0]
    out = np.zeros((h, T, v.shape[2]))
    lse = np.full((h, T), -np.inf)
    for i in range(h):
        g = i // (h // kv)
        for t in range(T):
            pos = positions[t]
            seen = [j for j, p in enumerate(key_positions) if p <= pos and (window == 0 or p > pos - window)]
            if not seen:
                continue
            s = k[g, seen].astype(np.float64) @ q[i, t].astype(np.float64) / np.sqrt(d)
            m = s.max()
            e = np.exp(s - m)
            out[i, t] = e @ v[g, seen] / e.sum()
            lse[i, t] = m + np.log(e.sum())
    return out, lse


@pytest.mark.parametrize("dtype", ["f32", "bf16", "int8"])
@pytest.mark.parametrize("layout", ["rows", "transposed"])
def test_append_then_attend_cache_matches_the_reference(rng, dtype, layout):
    kv, h, d, dv = 2, 4, 8, 6
    cache = mha.KvCache(2, kv, d, 40, value_dim=dv, dtype=dtype, key_layout=layout)
    k1, v1 = x(rng, 2, kv, 20, d), x(rng, 2, kv, 20, dv)
    cache.append(k1, v1, counts=[20, 17])  # sequence 1 takes its first 17 rows only
    k2, v2 = x(rng, 2, kv, 3, d), x(rng, 2, kv, 3, dv)
    cache.append(k2, v2)
    assert cache.lengths() == [23, 20]
    # What was appended is what the cache holds, to the dtype's rounding.
    tol = {"f32": 0, "bf16": 2.0**-8, "int8": 1 / 127}[dtype]
    k_b1, v_b1 = held(cache, 1, kv, 20, d, dv)
    np.testing.assert_allclose(k_b1[:, :17], k1[1, :, :17], atol=tol * 4, rtol=tol)
    np.testing.assert_allclose(v_b1[:, 17:], v2[1], atol=tol * 4, rtol=tol)
    # Two new tokens a sequence, right after the cache (q_start defaults to the lengths), then three
    # placed earlier with a window.
    q = x(rng, 2, h, 2, d)
    out, lse = mha.attend_cache(q, cache, splits=2)
    assert out.shape == (2, h, 2, dv) and lse.shape == (2, h, 2)
    q3 = x(rng, 2, h, 3, d)
    out3, lse3 = mha.attend_cache(q3, cache, q_start=[5, 11], window=4)
    atol = 2e-4 if dtype == "int8" else 2e-6  # int8 rounds q and P to 16 bits (docs/semantics.md)
    for b, n in enumerate(cache.lengths()):
        kh, vh = held(cache, b, kv, n, d, dv)
        want, want_lse = reference(q[b], kh, vh, [n, n + 1], range(n))
        np.testing.assert_allclose(out[b], want, atol=atol, rtol=atol)
        np.testing.assert_allclose(lse[b], want_lse, atol=atol, rtol=atol)
        start = [5, 11][b]
        want3, want_lse3 = reference(q3[b], kh, vh, [start, start + 1, start + 2], range(n), window=4)
        np.testing.assert_allclose(out3[b], want3, atol=atol, rtol=atol)
        np.testing.assert_allclose(lse3[b], want_lse3, atol=atol, rtol=atol)
    # Threads never change the result; the split count is fixed here.
    for threads in (1, 2, 3):
        got, got_lse = mha.attend_cache(q, cache, splits=2, threads=threads)
        np.testing.assert_array_equal(got, out)
        np.testing.assert_array_equal(got_lse, lse)


def test_ring_cache_attends_to_the_positions_it_holds(rng):
    kv, h, d = 1, 2, 4
    cache = mha.KvCache(1, kv, d, 8, ring=True)
    k, v = x(rng, 1, kv, 13, d), x(rng, 1, kv, 13, d)
    cache.append(k[:, :, :6], v[:, :, :6])
    cache.append(k[:, :, 6:], v[:, :, 6:])  # wraps: positions 5 … 12 remain
    assert cache.length() == 13 and cache.stored() == 8 and cache.remaining() > 2**62
    q = x(rng, 1, h, 1, d)
    out, lse = mha.attend_cache(q, cache)
    want, want_lse = reference(q[0], k[0, :, 5:], v[0, :, 5:], [13], range(5, 13))
    np.testing.assert_allclose(out[0], want, atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(lse[0], want_lse, atol=2e-6)


@pytest.mark.parametrize("dtype", ["f32", "int8"])
def test_paged_append_equals_the_contiguous_cache(rng, dtype):
    kv, h, d = 2, 4, 8
    flat = mha.KvCache(2, kv, d, 32, dtype=dtype)
    paged = mha.PagedKvCache(kv, d, block_size=4, num_blocks=16, dtype=dtype)
    seqs = [paged.add_sequence(), paged.add_sequence()]
    for T in (7, 1, 5):
        k, v = x(rng, 2, kv, T, d), x(rng, 2, kv, T, d)
        flat.append(k, v)
        paged.append(seqs[0], k[0], v[0])  # (kv, T, d)
        paged.append(seqs[1], k[1:], v[1:])  # (1, kv, T, d)
    assert [paged.length(s) for s in seqs] == flat.lengths() == [13, 13]
    assert paged.k_at(seqs[1], 1, 12, 3) == flat.k_at(1, 1, 12, 3)
    q = x(rng, 2, h, 1, d)
    out, lse = mha.attend_cache(q, flat, splits=1)
    got, got_lse = mha.attend_paged_cache(q, paged, seqs, splits=1)
    np.testing.assert_array_equal(got, out)
    np.testing.assert_array_equal(got_lse, lse)


def test_bad_appends_and_queries_are_refused_without_changes(rng):
    cache = mha.KvCache(2, 2, 8, 10, dtype="int8")
    cache.append(x(rng, 2, 2, 4, 8), x(rng, 2, 2, 4, 8))
    before = cache.k_at(1, 1, 3, 7)
    with pytest.raises(ValueError, match=r"key \(2, 2, 3, 4\) and value \(2, 2, 3, 8\) must be \(2, 2, 3, 8\)"):
        cache.append(x(rng, 2, 2, 3, 4), x(rng, 2, 2, 3, 8))  # d of 4 for a head dim of 8
    with pytest.raises(ValueError, match="4-D"):
        cache.append(x(rng, 2, 3, 8), x(rng, 2, 3, 8))
    with pytest.raises(ValueError, match="exceed the capacity"):
        cache.append(x(rng, 2, 2, 7, 8), x(rng, 2, 2, 7, 8))
    with pytest.raises(ValueError, match="counts"):
        cache.append(x(rng, 2, 2, 2, 8), x(rng, 2, 2, 2, 8), counts=[1])
    bad = x(rng, 2, 2, 1, 8)
    bad[1, 0, 0, 5] = np.inf
    with pytest.raises(ValueError, match="finite"):
        cache.append(bad, x(rng, 2, 2, 1, 8))
    assert cache.lengths() == [4, 4] and cache.k_at(1, 1, 3, 7) == before
    assert cache.stored(1) == 4 and cache.remaining(1) == 6
    with pytest.raises(ValueError):
        cache.k_at(0, 0, 4, 0)  # position 4 not held yet
    with pytest.raises(ValueError):
        mha.attend_cache(x(rng, 3, 4, 1, 8), cache)  # three sequences against a batch of two
    with pytest.raises(ValueError):
        mha.attend_cache(x(rng, 2, 3, 1, 8), cache)  # 3 query heads over 2 K/V heads
    with pytest.raises(ValueError, match="4-D"):
        mha.attend_cache(x(rng, 2, 4, 8), cache)
    with pytest.raises(TypeError, match="KvCache"):
        mha.attend_cache(x(rng, 2, 4, 1, 8), mha.PagedKvCache(2, 8, num_blocks=2))
    paged = mha.PagedKvCache(2, 8, block_size=4, num_blocks=1)
    s = paged.add_sequence()
    with pytest.raises(ValueError):
        paged.append(s, x(rng, 2, 5, 8), x(rng, 2, 5, 8))  # 5 positions need 2 blocks of a pool of 1
    assert paged.length(s) == 0 and paged.free_blocks() == 1
    with pytest.raises(ValueError):
        paged.append(7, x(rng, 2, 1, 8), x(rng, 2, 1, 8))  # no sequence 7


def test_own_projections_into_a_cache_give_the_modules_decoding(rng):
    # The inference-engine way: Q/K/V projected outside mha, K/V appended, attend_cache, W_O outside;
    # equal to the module's own forward_incremental (prefill, then token by token).
    E, h, kv, d = 16, 4, 2, 4
    m = mha.MultiheadAttention(E, h, num_kv_heads=kv, batch_first=True, seed=3).eval()
    sd = m.state_dict()
    w, b = sd["in_proj_weight"], sd["in_proj_bias"]
    w_q, w_k, w_v = w[:E], w[E:E + kv * d], w[E + kv * d:]
    b_q, b_k, b_v = b[:E], b[E:E + kv * d], b[E + kv * d:]

    def heads(y, n):  # (B, T, n·d) → (B, n, T, d)
        return y.reshape(y.shape[0], y.shape[1], n, d).transpose(0, 2, 1, 3)

    def step(xs, cache, start):
        cache.append(heads(xs @ w_k.T + b_k, kv), heads(xs @ w_v.T + b_v, kv))
        out, _ = mha.attend_cache(heads(xs @ w_q.T + b_q, h), cache, q_start=[start])
        o = out.transpose(0, 2, 1, 3).reshape(xs.shape[0], xs.shape[1], E)
        return o @ sd["out_proj.weight"].T + sd["out_proj.bias"]

    xs = x(rng, 1, 9, E)
    theirs, mine = m.new_cache(1, 12), mha.KvCache(1, kv, d, 12)
    prompt = xs[:, :6]
    np.testing.assert_allclose(step(prompt, mine, 0), m.forward_incremental(prompt, prompt, prompt, theirs),
                               atol=1e-5, rtol=1e-5)
    for t in range(6, 9):
        tok = xs[:, t:t + 1]
        np.testing.assert_allclose(step(tok, mine, t), m.forward_incremental(tok, tok, tok, theirs),
                                   atol=1e-5, rtol=1e-5)
    assert mine.lengths() == theirs.lengths() == [9]


def test_integer_arguments_out_of_range_name_themselves(rng):
    """An int beyond 64 bits (or a float where an int goes) beside arrays in a call: a short error
    naming the argument, where pybind11's TypeError printed every argument, whole arrays included."""
    cache = mha.KvCache(batch=1, kv_heads=2, head_dim=4, capacity=8)
    paged = mha.PagedKvCache(kv_heads=2, head_dim=4, block_size=4, num_blocks=4)
    k, v = x(rng, 1, 2, 3, 4), x(rng, 1, 2, 3, 4)
    cache.append(k, v)
    q = x(rng, 1, 4, 1, 4)
    m = mha.MultiheadAttention(16, 4, num_kv_heads=2, batch_first=True).eval()
    tok = x(rng, 1, 1, 16)
    w = np.full((2, 3, 3), 1 / 3, np.float32)
    huge = 10**19
    calls = {
        "query_offset": lambda: mha.analyze(w, query_offset=huge),
        "window": lambda: mha.attend_cache(q, cache, window=huge),
        "splits": lambda: mha.attend_cache(q, cache, splits=-huge),
        "threads": lambda: mha.attend_cache(q, cache, threads=huge),
        "q_start": lambda: mha.attend_cache(q, cache, q_start=[huge]),
        "counts": lambda: cache.append(k, v, counts=[huge]),
        "new_lengths": lambda: m.forward_incremental(tok, tok, tok, mha.KvCache(1, 2, 4, 8), new_lengths=[huge]),
        "capacity": lambda: mha.KvCache(1, 2, 4, huge),
        "num_blocks": lambda: mha.PagedKvCache(2, 4, 4, num_blocks=huge),
        "embed_dim": lambda: mha.MultiheadAttention(huge, 1),
        "b": lambda: cache.length(huge),
        "seq": lambda: paged.alive(huge),
        "x": lambda: cache.k_at(0, 0, 0, huge),
        "block": lambda: paged.refcount(huge),
        "num_heads": lambda: mha.alibi_slopes(huge),
        "bytes": lambda: mha.set_tensor_cache_limit(huge),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"{name} must fit in 64 bits, got -?{huge}$"):
            call()
    with pytest.raises(TypeError, match="window must be an int, got float"):
        mha.attend_cache(q, cache, window=2.5)
    with pytest.raises(ValueError, match="seq must fit in 64 bits"):
        paged.append(huge, k[0], v[0])
    with pytest.raises(ValueError, match="threads must fit in 64 bits"):
        m(tok, tok, tok, threads=huge)
    # Floats and strings where ints, numbers or names go: int() and float() took 2.5, "8" and "0.1".
    wrong = {
        "KvCache: batch must be an int, got float": lambda: mha.KvCache(2.5, 2, 4, 8),
        "new_cache: capacity|KvCache: capacity must be an int, got float": lambda: m.new_cache(1, 8.9),
        "KvCache: dtype must be a str, got NoneType": lambda: mha.KvCache(1, 2, 4, 8, dtype=None),
        "KvCache.length: b must be an int, got str": lambda: cache.length("0"),
        "alibi_slopes: num_heads must be an int, got float": lambda: mha.alibi_slopes(2.5),
        "attend_cache: scale must be a number, got str": lambda: mha.attend_cache(q, cache, scale="a"),
        "MultiheadAttention: dropout must be a number, got str": lambda: mha.MultiheadAttention(16, 2, dropout="0.1"),
        "head_importance: module must be an mha.MultiheadAttention, got NoneType":
            lambda: mha.head_importance(None, tok, tok, tok),
        "set_tensor_cache_limit: bytes must be an int, got float": lambda: mha.set_tensor_cache_limit(1.5),
    }
    for message, call in wrong.items():
        with pytest.raises(TypeError, match=message):
            call()
    with pytest.raises(ValueError, match="set_tensor_cache_limit: bytes must be >= 0"):
        mha.set_tensor_cache_limit(-1)
    with pytest.raises(TypeError, match="alibi_slopes must be a 1-D sequence"):  # was flattened silently
        mha.MultiheadAttention(16, 2, alibi_slopes=[[1, 2], [3, 4]])
    # Numbers as numpy and torch give them still work: scalars and 0-d arrays, integers where
    # integers go (FlashAttention-style code passes max_seqlen as a torch scalar); dropout=False
    # as torch takes it.
    mha.MultiheadAttention(16, 2, dropout=np.array(0.1), scale=np.float32(0.5), softcap=np.float64(30.0))
    mha.MultiheadAttention(16, 2, dropout=False)
    mha.attend_cache(q, cache, scale=np.array(0.25))
    assert mha.KvCache(np.array(1), np.int32(2), 4, np.uint16(8)).capacity == 8
    assert cache.length(np.array(0)) == cache.length(0)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        assert mha.KvCache(torch.tensor(1), 2, 4, torch.tensor([3, 8]).max()).capacity == 8
        mha.MultiheadAttention(16, 2, dropout=torch.tensor(0.1))
    with pytest.raises(TypeError, match="KvCache: capacity must be an int, got float"):
        mha.KvCache(1, 2, 4, np.float64(8.0))
    # Strings, bools and complex numbers inside numpy or torch scalars are no numbers either.
    for bad in (np.array("0.5"), np.array(True), np.complex128(0.1 + 5j)):
        with pytest.raises(TypeError, match="attend_cache: scale must be a number"):
            mha.attend_cache(q, cache, scale=bad)
    if torch is not None:
        for bad in (torch.tensor(True), torch.tensor(1 + 2j)):
            with pytest.raises(TypeError, match="attend_cache: scale must be a number"):
                mha.attend_cache(q, cache, scale=bad)
        with pytest.raises(TypeError, match="KvCache: batch must be an int, got Tensor"):
            mha.KvCache(torch.tensor(True), 2, 4, 8)
    with pytest.raises(TypeError, match="MultiheadAttention: scale must be a single number"):
        mha.MultiheadAttention(16, 2, scale=np.array([0.1, 0.2]))


def test_numpy_arrays_of_positions_and_lengths_work_like_lists(rng):
    """q_start and new_lengths were tested for truth (`q_start or []`): np.array([0]) was taken as
    "not given" (another position, a wrong result) and a longer array raised numpy's ambiguity error."""
    cache = mha.KvCache(2, 1, 8, 10)
    cache.append(x(rng, 2, 1, 4, 8), x(rng, 2, 1, 4, 8))
    q = x(rng, 2, 1, 1, 8)
    for starts in ([0, 2], [3, 1]):
        want = mha.attend_cache(q, cache, q_start=starts)
        for got in (mha.attend_cache(q, cache, q_start=np.array(starts)),
                    mha.attend_cache(q, cache, q_start=np.array(starts, np.int32))):
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
    paged = mha.PagedKvCache(1, 8, 4, num_blocks=4)
    s = paged.add_sequence()
    paged.append(s, x(rng, 1, 4, 8), x(rng, 1, 4, 8))
    np.testing.assert_array_equal(mha.attend_paged_cache(q[:1], paged, [s], q_start=np.array([0]))[0],
                                  mha.attend_paged_cache(q[:1], paged, [s], q_start=[0])[0])
    m = mha.MultiheadAttention(16, 4, batch_first=True).eval()
    X = x(rng, 1, 5, 16)
    a, b = m.new_cache(1, 8), m.new_cache(1, 8)
    ya = m.forward_incremental(X, X, X, a, new_lengths=[0])
    yb = m.forward_incremental(X, X, X, b, new_lengths=np.array([0]))
    assert a.lengths() == b.lengths() == [0]
    np.testing.assert_array_equal(ya, yb)


def test_negative_threads_and_far_first_positions_are_refused(rng):
    """threads < 0 was taken as the default on the cache paths (sdpa refused it); a q_start near
    2**63 overflowed in the kernel and hid every key. Both are errors now."""
    cache = mha.KvCache(1, 1, 4, 8)
    cache.append(x(rng, 1, 1, 5, 4), x(rng, 1, 1, 5, 4))
    q = x(rng, 1, 1, 1, 4)
    with pytest.raises(ValueError, match="attend_cache: threads must be >= 0"):
        mha.attend_cache(q, cache, threads=-1)
    m = mha.MultiheadAttention(8, 2, batch_first=True).eval()
    tok = x(rng, 1, 1, 8)
    with pytest.raises(ValueError, match="forward_incremental: threads must be >= 0"):
        m.forward_incremental(tok, tok, tok, m.new_cache(1, 4), threads=-1)
    with pytest.raises(ValueError, match=r"q_start\[0\] = 9223372036854775807 is outside"):
        mha.attend_cache(q, cache, q_start=[2**63 - 1])
    out, lse = mha.attend_cache(q, cache, q_start=[2**40 - 1])  # the edge sees all 5 keys
    np.testing.assert_array_equal(lse, mha.attend_cache(q, cache, q_start=[5])[1])


def test_decoding_applies_no_dropout_in_training_mode(rng):
    m = mha.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)  # training mode
    X = x(rng, 1, 4, 8)
    a = m.forward_incremental(X, X, X, m.new_cache(1, 4))
    m.eval()
    np.testing.assert_array_equal(a, m.forward_incremental(X, X, X, m.new_cache(1, 4)))


def test_counts_past_a_c_int_are_capped_like_the_library_caps_them(rng):
    """threads and splits are C ints in the core: 2**31 and up raised pybind11's TypeError listing every
    argument; they are capped now, as the library caps any count to what it can use."""
    cache = mha.KvCache(1, 1, 4, 8)
    cache.append(x(rng, 1, 1, 5, 4), x(rng, 1, 1, 5, 4))
    q = x(rng, 1, 1, 1, 4)
    want = mha.attend_cache(q, cache)
    for kw in (dict(threads=2**31), dict(splits=2**40), dict(threads=2**62, splits=2**31)):
        got = mha.attend_cache(q, cache, **kw)
        np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(mha.sdpa(q, q, q, threads=2**31), mha.sdpa(q, q, q))
    with pytest.raises(ValueError, match="attend_cache: splits must be >= 0"):
        mha.attend_cache(q, cache, splits=-1)
    try:
        mha.set_num_threads(2**40)
        assert mha.num_threads() >= 1
    finally:
        mha.set_num_threads(0)
    with pytest.raises(ValueError, match="set_num_threads: threads must be >= 0"):
        mha.set_num_threads(-1)


def test_threads_appending_to_one_cache_fill_it_exactly():
    """append releases the GIL; without the cache's lock two threads raced past its capacity check
    (length 257 of 256, then heap corruption). Each token lands once, the last append that does not
    fit is refused, and a paged pool's sequences grow by what was appended."""
    import threading

    C, KV, D = 256, 2, 64
    one = np.ones((1, KV, 1, D), np.float32)
    for _ in range(400):
        cache = mha.KvCache(1, KV, D, C)
        done = [0, 0]

        def fill(i):
            while True:
                try:
                    cache.append(one, one)
                except ValueError:
                    return
                done[i] += 1

        threads = [threading.Thread(target=fill, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert cache.length(0) == C and sum(done) == C
    paged = mha.PagedKvCache(KV, D, 4, num_blocks=64)
    seqs = [paged.add_sequence() for _ in range(2)]

    def grow(s):
        for _ in range(50):
            paged.append(s, one, one)
            mha.attend_paged_cache(np.ones((1, KV, 1, D), np.float32), paged, [s])

    threads = [threading.Thread(target=grow, args=(s,)) for s in seqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [paged.length(s) for s in seqs] == [50, 50]
