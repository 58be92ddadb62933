"""mha.torch.MultiheadAttention's score edits (scale, alibi_slopes, softcap, attention_sinks):
against the numpy module (same library, same edits), a float64 torch reimplementation of
docs/semantics.md 'Score edits' for every gradient, and through everything else the module
supports (state_dict, copies, pickles, functional_call, parametrizations, dropout, threads)."""
import copy
import io
import os
import pickle

import numpy as np
import pytest

if os.environ.get("MHA_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch", reason="PyTorch is not installed: the mha.torch tests need python3-torch")
import mha  # noqa: E402
import mha.torch as mt  # noqa: E402

torch.set_num_threads(1)

EDITS = {
    "sinks": dict(attention_sinks=True),
    "softcap": dict(softcap=0.7),
    "alibi": dict(alibi_slopes="standard"),
    "scale": dict(scale=0.9),
    "all": dict(scale=0.45, alibi_slopes="standard", softcap=1.3, attention_sinks=True),
}


def edits(name, num_heads):
    kw = dict(EDITS[name])
    if kw.get("alibi_slopes") == "standard":
        kw["alibi_slopes"] = mha.alibi_slopes(num_heads)
    return kw


def build(E=16, h=4, edit="all", seed=0, **kw):
    """An mha.torch module with the edits, every parameter random (sinks and biases included)."""
    torch.manual_seed(seed)
    m = mt.MultiheadAttention(E, h, **kw, **edits(edit, h))
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 if p.dim() < 2 else 0.6))
    return m


def numpy_twin(m, **kw):
    """mha.MultiheadAttention with m's configuration, edits and parameters."""
    n = mha.MultiheadAttention(m.embed_dim, m.num_heads, kdim=m.kdim, vdim=m.vdim, batch_first=m.batch_first,
                               bias=m.in_proj_bias is not None, num_kv_heads=m.num_kv_heads, scale=m.scale,
                               alibi_slopes=m.alibi_slopes, softcap=m.softcap or 0.0,
                               attention_sinks=m.attention_sinks, **kw)
    n.load_state_dict({k: v.detach().numpy() for k, v in m.state_dict().items()})
    return n


def inputs(m, T, S, batch=2, self_attn=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = lambda t, d: ((batch, t, d) if m.batch_first else (t, batch, d)) if batch else (t, d)  # noqa: E731
    q = torch.randn(shape(T, m.embed_dim), generator=g)
    if self_attn:
        return q, q, q
    return q, torch.randn(shape(S, m.kdim), generator=g), torch.randn(shape(S, m.vdim), generator=g)


# ---- the float64 reference ------------------------------------------------------------------------

def reference(m, params, q, k, v, key_padding_mask=None, is_causal=False):
    """docs/semantics.md's module math in float64 on (B, T, ·) inputs: softcap on the scaled scores,
    then ALiBi (bottom-right alignment without a causal mask, top-left with is_causal), then masks,
    then a softmax whose denominator also holds e^{sink}. Returns (output, per-head weights)."""
    h, kv, d = m.num_heads, m.num_kv_heads, m.head_dim
    B, T, _ = q.shape
    S = k.shape[1]
    if "in_proj_weight" in params:
        wq, wk, wv = params["in_proj_weight"].split([h * d, kv * d, kv * d])
    else:
        wq, wk, wv = params["q_proj_weight"], params["k_proj_weight"], params["v_proj_weight"]
    bq = bk = bv = 0.0
    if "in_proj_bias" in params:
        bq, bk, bv = params["in_proj_bias"].split([h * d, kv * d, kv * d])
    Q = (q @ wq.T + bq).view(B, T, h, d).transpose(1, 2)
    K = (k @ wk.T + bk).view(B, S, kv, d).transpose(1, 2).repeat_interleave(h // kv, dim=1)
    V = (v @ wv.T + bv).view(B, S, kv, d).transpose(1, 2).repeat_interleave(h // kv, dim=1)
    s = (m.scale if m.scale is not None else d ** -0.5) * Q @ K.transpose(-2, -1)
    if m.softcap:
        s = m.softcap * torch.tanh(s / m.softcap)
    i = torch.arange(T, dtype=torch.float64)[:, None]
    j = torch.arange(S, dtype=torch.float64)[None, :]
    if m.alibi_slopes:
        q_pos = i if is_causal else i + (S - T)
        slopes = torch.tensor(m.alibi_slopes, dtype=torch.float64).view(1, h, 1, 1)
        s = s - slopes * (q_pos - j)
    if key_padding_mask is not None:
        s = s.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    if is_causal:
        s = s.masked_fill(j > i, float("-inf"))
    if m.attention_sinks:
        z = params["sinks"].view(1, h, 1, 1).expand(B, h, T, 1)
        p = torch.softmax(torch.cat([s, z], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    o = (p @ V).transpose(1, 2).reshape(B, T, h * d) @ params["out_proj.weight"].T
    if "out_proj.bias" in params:
        o = o + params["out_proj.bias"]
    return o, p


CASES = {
    # name: (constructor kwargs, T, S, self-attention, masks)
    "self-causal": (dict(batch_first=True), 5, 5, True, dict(is_causal=True)),
    "cross-kpm": (dict(batch_first=False), 4, 7, False, dict(key_padding_mask="kpm")),
    "cross-kdim": (dict(batch_first=True, kdim=10, vdim=6), 6, 3, False, {}),
    "gqa-nobias": (dict(batch_first=True, num_kv_heads=2, bias=False), 5, 6, False, dict(key_padding_mask="kpm")),
}


def _masks(masks, batch, S):
    kw = dict(masks)
    if kw.get("key_padding_mask") == "kpm":
        kpm = torch.zeros(batch, S, dtype=torch.bool)
        kpm[-1, S // 2:] = True
        kw["key_padding_mask"] = kpm
    return kw


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_weights_equal_the_numpy_module(case, edit):
    cfg, T, S, self_attn, masks = CASES[case]
    m = build(edit=edit, **cfg)
    n = numpy_twin(m)
    q, k, v = inputs(m, T, S, self_attn=self_attn)
    kw = _masks(masks, 2, S)
    np_kw = {k_: (x.numpy() if isinstance(x, torch.Tensor) else x) for k_, x in kw.items()}
    for average in (True, False):
        want, want_w = n(q.numpy(), k.numpy(), v.numpy(), average_attn_weights=average, **np_kw)
        with torch.no_grad():
            got, got_w = m(q, k, v, average_attn_weights=average, **kw)
        assert np.array_equal(got.numpy(), want) and np.array_equal(got_w.numpy(), want_w)
        # With gradients: the output comes from forward_train, the weights from the weights-only pass.
        qq = q.clone().requires_grad_()
        got, got_w = m(qq, qq if self_attn else k, qq if self_attn else v, average_attn_weights=average, **kw)
        np.testing.assert_allclose(got.detach().numpy(), want, rtol=0, atol=1e-6)
        assert np.array_equal(got_w.numpy(), want_w)


@pytest.mark.parametrize("batch_first", [False, True])
def test_unbatched_inputs_equal_the_numpy_module_and_the_batched_call(batch_first):
    m = build(batch_first=batch_first)
    n = numpy_twin(m)
    q, k, v = inputs(m, 4, 6, batch=0)
    with torch.no_grad():
        out, w = m(q, k, v, average_attn_weights=False)
        out1, w1 = m(q.unsqueeze(0 if batch_first else 1), k.unsqueeze(0 if batch_first else 1),
                     v.unsqueeze(0 if batch_first else 1), average_attn_weights=False)
    want, want_w = n(q.numpy(), k.numpy(), v.numpy(), average_attn_weights=False)
    assert out.shape == (4, 16) and w.shape == (4, 4, 6)
    assert np.array_equal(out.numpy(), want) and np.array_equal(w.numpy(), want_w)
    torch.testing.assert_close(out, out1.squeeze(0 if batch_first else 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(w, w1.squeeze(0), atol=1e-6, rtol=0)


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("case", list(CASES))
def test_every_gradient_matches_a_float64_reference(case, edit):
    cfg, T, S, self_attn, masks = CASES[case]
    m = build(edit=edit, **cfg)
    B = 2
    q, k, v = inputs(m, T, S, batch=B, self_attn=self_attn)
    kw = _masks(masks, B, S)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    if self_attn:
        kk = vv = qq
    out, w = m(qq, kk, vv, average_attn_weights=False, **kw)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * d_out).sum().backward()
    got = {"query": qq.grad, "key": kk.grad, "value": vv.grad, **{n: p.grad for n, p in m.named_parameters()}}
    assert (m.sinks is not None) == m.attention_sinks

    # The reference, batch first, in float64, from the same float32 values.
    to_bf = (lambda t: t) if m.batch_first else (lambda t: t.transpose(0, 1))
    rq, rk, rv = (to_bf(t).double().detach().requires_grad_() for t in (q, k, v))
    if self_attn:
        rk = rv = rq
    params = {n: p.detach().double().requires_grad_() for n, p in m.named_parameters()}
    ref_out, ref_w = reference(m, params, rq, rk, rv, **kw)
    (ref_out * to_bf(d_out).double()).sum().backward()
    want = {"query": rq.grad, "key": rk.grad, "value": rv.grad, **{n: p.grad for n, p in params.items()}}
    torch.testing.assert_close(to_bf(out).double(), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(w.double(), ref_w, atol=2e-6, rtol=1e-4)
    if m.attention_sinks:  # the sink takes its share: rows sum to less than 1
        assert (w.sum(-1) <= 1).all() and (w.sum(-1) < 0.99).any()
    for name, g in want.items():
        mine = to_bf(got[name]) if name in ("query", "key", "value") else got[name]
        torch.testing.assert_close(mine.double(), g, atol=2e-4, rtol=1e-4, msg=lambda s, name=name: f"{name}: {s}")


def test_sinks_gradient_matches_finite_differences():
    m = build(edit="sinks", batch_first=True)
    q, k, v = inputs(m, 5, 5, self_attn=True)
    d_out = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))
    loss = lambda: (m(q, k, v, need_weights=False)[0].double() * d_out).sum()  # noqa: E731
    loss().backward()
    eps = 1e-2
    for i in range(m.num_heads):
        with torch.no_grad():
            base = m.sinks[i].item()
            m.sinks[i] = base + eps
            up = loss().item()
            m.sinks[i] = base - eps
            down = loss().item()
            m.sinks[i] = base
        assert abs((up - down) / (2 * eps) - m.sinks.grad[i].item()) < 2e-3 * max(1.0, abs(up - down) / (2 * eps))


def test_sinks_are_a_parameter_initialised_to_zero_and_sgd_trains_them():
    torch.manual_seed(0)
    m = mt.MultiheadAttention(16, 4, batch_first=True, attention_sinks=True)
    assert isinstance(m.sinks, torch.nn.Parameter) and m.sinks.shape == (4,)
    assert torch.equal(m.sinks, torch.zeros(4))
    np.testing.assert_array_equal(mha.MultiheadAttention(16, 4, attention_sinks=True).state_dict()["sinks"], 0)
    assert "sinks" in dict(m.named_parameters())
    # Same generator draws as a module without sinks: zeros take nothing from it.
    torch.manual_seed(0)
    plain = mt.MultiheadAttention(16, 4, batch_first=True)
    assert torch.equal(plain.in_proj_weight, m.in_proj_weight)
    assert plain.sinks is None and "sinks" not in plain.state_dict()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    before = m.sinks.detach().clone()
    m(x, x, x, need_weights=False)[0].square().sum().backward()
    assert m.sinks.grad is not None and torch.count_nonzero(m.sinks.grad) == 4
    opt.step()
    assert not torch.equal(m.sinks, before)
    torch.testing.assert_close(m.sinks.detach(), before - 0.5 * m.sinks.grad, atol=0, rtol=0)
    # Frozen sinks stay out of the gradients.
    m.zero_grad(set_to_none=True)
    m.sinks.requires_grad_(False)
    m(x, x, x, need_weights=False)[0].sum().backward()
    assert m.sinks.grad is None and m.in_proj_weight.grad is not None


def test_state_dict_round_trip():
    m = build(batch_first=True)
    sd = m.state_dict()
    assert list(sd) == ["in_proj_weight", "in_proj_bias", "sinks", "out_proj.weight", "out_proj.bias"]
    other = mt.MultiheadAttention(16, 4, batch_first=True, **edits("all", 4))
    other.load_state_dict(sd)
    assert torch.equal(other.sinks, m.sinks)
    q, k, v = inputs(m, 4, 6)
    with torch.no_grad():
        a, wa = m(q, k, v)
        b, wb = other(q, k, v)
    assert torch.equal(a, b) and torch.equal(wa, wb)
    # The numpy module takes the same dict (and gives its "sinks" back the same).
    n = mha.MultiheadAttention(16, 4, batch_first=True, **edits("all", 4))
    n.load_state_dict({k_: t.numpy() for k_, t in sd.items()})
    np.testing.assert_array_equal(n.state_dict()["sinks"], sd["sinks"].numpy())
    # A module without sinks does not take them, and one with them needs them (torch's strict rules).
    with pytest.raises(RuntimeError, match="sinks"):
        mt.MultiheadAttention(16, 4, batch_first=True).load_state_dict(sd)
    with pytest.raises(RuntimeError, match="sinks"):
        other.load_state_dict({k_: t for k_, t in sd.items() if k_ != "sinks"})


def test_deepcopy_pickle_and_torch_save_keep_the_edits():
    m = build(batch_first=True)
    q, k, v = inputs(m, 4, 6)
    with torch.no_grad():
        want, want_w = m(q, k, v, average_attn_weights=False)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m)), torch.load(buf)):
        assert (clone.scale, clone.alibi_slopes, clone.softcap, clone.attention_sinks) == \
            (m.scale, m.alibi_slopes, m.softcap, m.attention_sinks)
        assert clone._core is not m._core and clone._core.config() == m._core.config()
        assert torch.equal(clone.sinks, m.sinks) and clone.sinks is not m.sinks
        with torch.no_grad():
            got, got_w = clone(q, k, v, average_attn_weights=False)
        assert torch.equal(got, want) and torch.equal(got_w, want_w)
        clone(q.requires_grad_(), k, v, need_weights=False)[0].sum().backward()
        assert clone.sinks.grad is not None and m.sinks.grad is None
        q = q.detach()
    # The copies in an nn.TransformerEncoder are independent: training one's sinks leaves the other's.
    layer = torch.nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    layer.self_attn = m
    stack = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    with torch.no_grad():
        stack.layers[0].self_attn.sinks.add_(1.0)
    assert torch.equal(stack.layers[1].self_attn.sinks, m.sinks)


def test_a_pickle_from_before_the_edits_loads_without_them():
    m = mt.MultiheadAttention(8, 2, batch_first=True)
    state = m.__getstate__()
    del state["_score_args"]
    old = mt.MultiheadAttention.__new__(mt.MultiheadAttention)
    old.__setstate__(state)
    assert (old.scale, old.alibi_slopes, old.softcap, old.attention_sinks) == (None, None, None, False)
    x = torch.randn(1, 3, 8)
    with torch.no_grad():
        assert torch.equal(old(x, x, x)[0], m(x, x, x)[0])


def test_from_torch_sets_no_edits():
    new = mt.MultiheadAttention.from_torch(torch.nn.MultiheadAttention(8, 2))
    assert (new.scale, new.alibi_slopes, new.softcap, new.attention_sinks, new.sinks) == (None, None, None, False,
                                                                                          None)
    assert new._core.config()["alibi_slopes"] is None and not new._core.config()["attention_sinks"]


def test_edits_change_the_output_and_default_scale_is_one_over_sqrt_head_dim():
    base = build(edit="scale", batch_first=True)
    q, k, v = inputs(base, 4, 6)
    outs = {}
    for edit in EDITS:
        m = build(edit=edit, batch_first=True)
        with torch.no_grad():
            outs[edit] = m(q, k, v)[0]
    for a in outs:
        for b in outs:
            assert a == b or not torch.equal(outs[a], outs[b]), (a, b)
    m = build(edit="scale", batch_first=True)
    with torch.no_grad():
        explicit = m(q, k, v)[0]
    plain = mt.MultiheadAttention(16, 4, batch_first=True, scale=4 ** -0.5)
    default = mt.MultiheadAttention(16, 4, batch_first=True)
    default.load_state_dict(plain.state_dict())
    with torch.no_grad():
        assert torch.equal(plain(q, k, v)[0], default(q, k, v)[0])
    assert not torch.equal(explicit, plain(q, k, v)[0].detach())
    # softcap 0 is off, as in the numpy module and the library (None is off too).
    capped0 = mt.MultiheadAttention(16, 4, batch_first=True, softcap=0.0)
    capped0.load_state_dict(default.state_dict())
    with torch.no_grad():
        assert torch.equal(capped0(q, k, v)[0], default(q, k, v)[0])
    assert capped0.softcap is None


def test_functional_call_and_parametrizations_reach_the_sinks():
    from torch.nn.utils import parametrize

    try:
        from torch.func import functional_call
    except ImportError:  # torch 1.13
        from torch.nn.utils.stateless import functional_call

    m = build(batch_first=True)
    q, k, v = inputs(m, 4, 6)
    other_sinks = torch.tensor([2.0, -1.0, 0.5, 3.0])
    twin = copy.deepcopy(m)
    with torch.no_grad():
        twin.sinks.copy_(other_sinks)
        want = twin(q, k, v, average_attn_weights=False)
    got = functional_call(m, {"sinks": other_sinks}, (q, k, v), dict(average_attn_weights=False))
    assert torch.equal(got[0].detach(), want[0]) and torch.equal(got[1], want[1])
    # A gradient through functional_call goes to the tensor passed, not to the module's parameter.
    s = other_sinks.clone().requires_grad_()
    functional_call(m, {"sinks": s}, (q, k, v), dict(need_weights=False))[0].sum().backward()
    assert s.grad is not None and m.sinks.grad is None

    class Double(torch.nn.Module):
        def forward(self, z):
            return 2 * z

    p = copy.deepcopy(m)
    parametrize.register_parametrization(p, "sinks", Double())
    twin = copy.deepcopy(m)
    with torch.no_grad():
        twin.sinks.mul_(2)
    xa, xb = q.clone().requires_grad_(), q.clone().requires_grad_()
    a = p(xa, k, v, need_weights=False)[0]
    b = twin(xb, k, v, need_weights=False)[0]
    assert torch.equal(a.detach(), b.detach())
    a.sum().backward()
    b.sum().backward()
    torch.testing.assert_close(p.parametrizations.sinks.original.grad, 2 * twin.sinks.grad, atol=0, rtol=0)
    assert torch.equal(xa.grad, xb.grad)


def test_dropout_with_edits_is_the_numpy_modules_with_torchs_seed():
    m = build(batch_first=True, dropout=0.3)
    n = numpy_twin(m, dropout=0.3)
    q, k, v = inputs(m, 6, 6)
    m.train()
    torch.manual_seed(7)
    with torch.no_grad():
        out, w = m(q, k, v, average_attn_weights=False)
    torch.manual_seed(7)
    n.dropout_seed = int(torch.randint(0, 2**62, (1,)).item())
    want, want_w = n(q.numpy(), k.numpy(), v.numpy(), average_attn_weights=False)
    assert np.array_equal(out.numpy(), want) and np.array_equal(w.numpy(), want_w)
    assert (w == 0).any()
    # Training: the output from forward_train uses the same mask; eval drops nothing.
    torch.manual_seed(7)
    out_t, _ = m(q.clone().requires_grad_(), k, v, need_weights=False)
    np.testing.assert_allclose(out_t.detach().numpy(), want, rtol=0, atol=1e-6)
    m.eval()
    with torch.no_grad():
        _, w = m(q, k, v, average_attn_weights=False)
    assert (w > 0).all()
    # dropout changed between calls rebuilds the core with the edits kept
    m.dropout = 0.0
    m.train()
    with torch.no_grad():
        out0 = m(q, k, v)[0]
    n.eval()
    assert np.array_equal(out0.numpy(), n(q.numpy(), k.numpy(), v.numpy())[0])


def test_threads_share_a_module_with_sinks():
    import threading

    m = build(E=32, h=4, batch_first=True).eval()
    xs = [inputs(m, 50, 50, self_attn=True, seed=s)[0] for s in range(3)]
    with torch.no_grad():
        alone = [m(x, x, x, need_weights=False)[0] for x in xs]
    errors = []

    def work():
        try:
            for _ in range(3):
                for x, a in zip(xs, alone):
                    with torch.no_grad():
                        assert torch.equal(m(x, x, x, need_weights=False)[0], a)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("kw, match", [
    (dict(alibi_slopes=[0.5, 0.25, 0.125]), "alibi_slopes has 3 entries"),
    (dict(alibi_slopes=[0.5, float("nan"), 0.1, 0.1]), "alibi_slopes must be finite"),
    (dict(alibi_slopes=[0.5, float("inf"), 0.1, 0.1]), "alibi_slopes must be finite"),
    (dict(softcap=-2.0), "softcap must be a finite c > 0"),
    (dict(softcap=float("nan")), "softcap must be a finite c > 0"),
    (dict(softcap=float("inf")), "softcap must be a finite c > 0"),
    (dict(scale=float("nan")), "scale must be finite"),
    (dict(scale=float("inf")), "scale must be finite"),
    (dict(alibi_slopes=[0.5] * 4, add_bias_kv=True), "ALiBi"),
    (dict(alibi_slopes=[0.5] * 4, add_zero_attn=True), "ALiBi"),
])
def test_bad_values_raise_value_error_naming_the_argument(kw, match):
    with pytest.raises(ValueError, match=r"^mha\.torch\.MultiheadAttention: " + match):
        mt.MultiheadAttention(16, 4, **kw)


def test_bad_types_and_live_changes_and_non_finite_sinks():
    for kw, match in ((dict(softcap="1"), "softcap must be a number"), (dict(scale=[1.0]), "scale must be"),
                      (dict(attention_sinks=1), "attention_sinks must be a bool"),
                      (dict(alibi_slopes=["a"] * 4), "alibi_slopes must be a 1-D sequence")):
        with pytest.raises(TypeError, match=match):
            mt.MultiheadAttention(16, 4, **kw)
    m = mt.MultiheadAttention(16, 4, alibi_slopes=mha.alibi_slopes(4), attention_sinks=True)
    x = torch.randn(3, 2, 16)
    m.add_zero_attn = True  # read on every call, as torch's: ALiBi's keys then lack positions
    with pytest.raises(ValueError, match=r"^mha\.torch\.MultiheadAttention: ALiBi"):
        m(x, x, x)
    m.add_zero_attn = False
    m(x, x, x)
    with torch.no_grad():
        m.sinks[2] = float("inf")
    for need_weights in (True, False):
        with pytest.raises(ValueError, match=r"^mha\.torch\.MultiheadAttention\.forward: sinks must be finite"):
            m(x.clone().requires_grad_(), x, x, need_weights=need_weights)
    with pytest.raises(AttributeError):
        m.softcap = 2.0  # fixed at construction
