"""mha.torch against torch.nn.MultiheadAttention (skipped with a message when torch is not installed,
unless MHA_REQUIRE_TORCH=1, as scripts/test.sh sets: then a missing torch fails the run)."""
import os

import numpy as np
import pytest

if os.environ.get("MHA_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch", reason="PyTorch is not installed: the mha.torch tests need python3-torch")
import mha  # noqa: E402
import mha.torch as mt  # noqa: E402

torch.set_num_threads(1)


def pair(**kw):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(**kw)
    if kw.get("add_bias_kv"):
        with torch.no_grad():
            ref.bias_k.normal_()
            ref.bias_v.normal_()
    with torch.no_grad():
        if ref.in_proj_bias is not None:
            ref.in_proj_bias.normal_()
            ref.out_proj.bias.normal_()
    return ref, mt.MultiheadAttention.from_torch(ref)


CONFIGS = [
    dict(embed_dim=16, num_heads=4, batch_first=True),
    dict(embed_dim=16, num_heads=2, batch_first=False),
    dict(embed_dim=16, num_heads=4, kdim=10, vdim=6, batch_first=True),
    dict(embed_dim=12, num_heads=3, bias=False, add_bias_kv=True, add_zero_attn=True, batch_first=True),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("masks", ["none", "bool", "float", "kpm", "causal"])
def test_matches_torch_forward_and_every_gradient(cfg, masks):
    ref, new = pair(**cfg)
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in new.named_parameters()]
    B, T, S = 2, 5, 7
    E = cfg["embed_dim"]
    kd, vd = cfg.get("kdim", E), cfg.get("vdim", E)
    g = torch.Generator().manual_seed(1)
    bf = cfg["batch_first"]
    shape = lambda t, d: (B, t, d) if bf else (t, B, d)  # noqa: E731
    self_attn = kd == E and vd == E and masks == "causal"
    Sk = T if masks == "causal" else S
    q = torch.randn(shape(T, E), generator=g)
    k = q if self_attn else torch.randn(shape(Sk, kd), generator=g)
    v = q if self_attn else torch.randn(shape(Sk, vd), generator=g)
    kw = {}
    if masks == "bool":
        m = torch.rand(T, Sk, generator=g) > 0.7
        m[:, 0] = False
        kw["attn_mask"] = m
    elif masks == "float":
        kw["attn_mask"] = torch.randn(B * cfg["num_heads"], T, Sk, generator=g)
    elif masks == "kpm":
        kpm = torch.zeros(B, Sk, dtype=torch.bool)
        kpm[1, 3:] = True
        kw["key_padding_mask"] = kpm
    elif masks == "causal":
        kw["attn_mask"] = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)  # what is_causal means
    outs, grads = [], []
    for mod, extra in ((ref, {}), (new, {})):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        if self_attn:
            kk = vv = qq
        kwargs = dict(kw)
        if mod is new and masks == "causal":
            kwargs = {"is_causal": True}
        out, w = mod(qq, kk, vv, **kwargs)
        d = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        (out * d).sum().backward()
        outs.append((out.detach(), w))
        grads.append({"q": qq.grad, "k": kk.grad, "v": vv.grad,
                      **{n: p.grad for n, p in mod.named_parameters()}})
        mod.zero_grad()
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=2e-5, rtol=1e-4)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-4, rtol=1e-4, msg=name)


def test_parameters_are_real_and_train():
    torch.manual_seed(0)
    m = mt.MultiheadAttention(16, 4, batch_first=True)
    assert isinstance(m.in_proj_weight, torch.nn.Parameter)
    assert set(m.state_dict()) == set(torch.nn.MultiheadAttention(16, 4).state_dict())
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    x = torch.randn(4, 6, 16)
    target = torch.randn(4, 6, 16)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        out, _ = m(x, x, x, need_weights=False)
        loss = ((out - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


def test_swap_into_transformer_encoder_layer():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, 16, requires_grad=True)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1, 4] = True
    ref = layer(x, src_key_padding_mask=kpm)
    (ref.sum()).backward()
    gx = x.grad.clone()
    x.grad = None
    layer.self_attn = mt.MultiheadAttention.from_torch(layer.self_attn)
    out = layer(x, src_key_padding_mask=kpm)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    out.sum().backward()
    torch.testing.assert_close(x.grad, gx, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kdim", [None, 10])
def test_nan_in_padded_key_rows_reaches_no_gradient(kdim):
    """Cross-attention over a memory whose padded positions hold NaN (SEMANTICS 5): the output and
    every gradient, the projection weights' included, are those of finite values there, bit for bit
    (torch 1.13's own module gives a NaN output and NaN gradients here: PyTorch issue #101967)."""
    torch.manual_seed(0)
    m = mt.MultiheadAttention(16, 4, kdim=kdim, vdim=kdim, batch_first=True)
    g = torch.Generator().manual_seed(3)
    kd = kdim or 16
    q = torch.randn(2, 5, 16, generator=g)
    k, v = torch.randn(2, 6, kd, generator=g), torch.randn(2, 6, kd, generator=g)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    results = []
    for poison in (False, True):
        kk, vv = k.clone(), v.clone()
        if poison:
            kk[1, 4:] = float("nan")
            vv[1, 4:] = float("inf")
        kk.requires_grad_(), vv.requires_grad_()
        out, _ = m(q, kk, vv, key_padding_mask=kpm, need_weights=False)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(4))).sum().backward()
        results.append([out.detach(), kk.grad, vv.grad] + [p.grad.clone() for _, p in m.named_parameters()])
        m.zero_grad()
    for clean, poisoned in zip(*results):
        assert torch.isfinite(poisoned).all()
        assert torch.equal(clean, poisoned)


def test_errors():
    m = mt.MultiheadAttention(16, 4)
    with pytest.raises(TypeError, match="float32"):
        m(torch.zeros(3, 2, 16, dtype=torch.float64), torch.zeros(3, 2, 16), torch.zeros(3, 2, 16))
    with pytest.raises(TypeError, match="torch.Tensor"):
        m(np.zeros((3, 2, 16), np.float32), torch.zeros(3, 2, 16), torch.zeros(3, 2, 16))
    with pytest.raises(ValueError):
        m(torch.zeros(3, 2, 16), torch.zeros(3, 2, 15), torch.zeros(3, 2, 16))
    with pytest.raises(ValueError):
        mt.MultiheadAttention(16, 5)
    with pytest.raises(TypeError):
        mt.MultiheadAttention.from_torch(m)


@pytest.mark.parametrize("mask", ["none", "bool", "float", "causal"])
def test_scaled_dot_product_attention(mask):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, requires_grad=True) for _ in range(3))
    kw = {}
    if mask == "bool":
        kw["attn_mask"] = torch.rand(5, 5, generator=g) > 0.3
        kw["attn_mask"][:, 0] = True
    elif mask == "float":
        kw["attn_mask"] = torch.randn(2, 3, 5, 5, generator=g)
    elif mask == "causal":
        kw["is_causal"] = True
    out = mt.scaled_dot_product_attention(q, k, v, scale=0.4, **kw)
    # the reference: PyTorch's documented math
    s = q @ k.transpose(-2, -1) * 0.4
    if mask == "bool":
        s = s.masked_fill(~kw["attn_mask"], float("-inf"))
    elif mask == "float":
        s = s + kw["attn_mask"]
    elif mask == "causal":
        s = s.masked_fill(torch.triu(torch.ones(5, 5, dtype=torch.bool), 1), float("-inf"))
    ref = torch.softmax(s, -1) @ v
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    d = torch.randn(out.shape, generator=g)
    ga = torch.autograd.grad((out * d).sum(), (q, k, v))
    gb = torch.autograd.grad((ref * d).sum(), (q, k, v))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError):
        mt.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 5, dtype=torch.bool), is_causal=True)


def test_deep_copies_pickles_and_stacks_in_a_transformer_encoder(tmp_path):
    """nn.TransformerEncoder deep-copies its layer; the core (a C++ object) used to make that, pickle
    and torch.save raise TypeError."""
    import copy
    import io
    import pickle

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    ref_stack = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    stack = copy.deepcopy(ref_stack)
    for lyr in stack.layers:
        lyr.self_attn = mt.MultiheadAttention.from_torch(lyr.self_attn)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(stack(x), ref_stack(x), atol=2e-5, rtol=1e-4)
    # The stack built from an mha layer: the copies are independent modules with their own cores.
    layer.self_attn = mt.MultiheadAttention.from_torch(layer.self_attn)
    built = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    assert built.layers[0].self_attn._core is not built.layers[1].self_attn._core
    with torch.no_grad():
        built.layers[1].self_attn.out_proj.weight.zero_()
    assert not torch.equal(built.layers[0].self_attn.out_proj.weight, built.layers[1].self_attn.out_proj.weight)
    m = stack.layers[0].self_attn
    for clone in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        torch.testing.assert_close(clone(x, x, x)[0], m(x, x, x)[0], atol=0, rtol=0)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    torch.testing.assert_close(torch.load(buf)(x, x, x)[0], m(x, x, x)[0], atol=0, rtol=0)


def test_dropout_masks_come_from_torch_generator():
    """Every module's dropout seed started at 0 and counted calls, so all layers of a model dropped
    the same positions and torch.manual_seed changed nothing."""
    torch.manual_seed(0)
    a = mt.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
    b = mt.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
    b.load_state_dict(a.state_dict())
    x = torch.ones(1, 64, 8)
    kw = dict(average_attn_weights=False)
    torch.manual_seed(123)
    wa = a(x, x, x, **kw)[1]
    wb = b(x, x, x, **kw)[1]
    assert not torch.equal(wa == 0, wb == 0)  # two layers, two masks
    torch.manual_seed(123)
    assert torch.equal(a(x, x, x, **kw)[1], wa)  # the generator's seed reproduces them
    frac = (wa == 0).float().mean().item()
    assert 0.4 < frac < 0.6
    c = mt.MultiheadAttention(8, 2, dropout=np.float32(0.5), batch_first=True)  # a numpy rate drew seed 0 each call
    assert not torch.equal(c(x, x, x, **kw)[1] == 0, c(x, x, x, **kw)[1] == 0)


def test_second_backward_and_double_backward_give_clear_errors_sdpa_retains():
    torch.manual_seed(0)
    m = mt.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8, requires_grad=True)
    o, _ = m(x, x, x, need_weights=False)
    o.sum().backward(retain_graph=True)
    # The module releases its activations after a backward (a training loop held two sets through
    # the next forward): a second one says so instead of failing inside the binding.
    with pytest.raises(RuntimeError, match="backward already ran and released"):
        o.sum().backward()
    q, k, v = (torch.randn(1, 2, 4, 4, requires_grad=True) for _ in range(3))
    out = mt.scaled_dot_product_attention(q, k, v)
    out.sum().backward(retain_graph=True)
    gq = q.grad.clone()
    out.sum().backward()
    torch.testing.assert_close(q.grad, 2 * gq, atol=0, rtol=0)
    # A gradient penalty's first step asks for a graph of the gradient: refused at once, whether or
    # not the incoming gradient requires grad (torch's once_differentiable let o.sum()'s through,
    # and the gradient came back a constant: a penalty through it failed later, misleadingly).
    for loss in (lambda o: o.pow(2).sum(), lambda o: o.sum()):
        o, _ = m(x, x, x, need_weights=False)
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(loss(o), x, create_graph=True)
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(loss(mt.scaled_dot_product_attention(q, k, v)), q, create_graph=True)


def test_parameters_are_read_as_torch_reads_them():
    """functional_call, pruning and parametrizations put other tensors where torch's module reads its
    weights; mha read named_parameters() and computed with the stale ones."""
    import torch.nn.utils.prune as prune
    from torch.nn.utils import parametrize

    try:
        from torch.func import functional_call
    except ImportError:  # torch 1.13
        from torch.nn.utils.stateless import functional_call

    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)

    def both():
        r = copy_of(ref)
        return r, mt.MultiheadAttention.from_torch(r)

    def copy_of(mod):
        import copy

        return copy.deepcopy(mod)

    r, n = both()
    other = {k: torch.randn_like(p) for k, p in r.named_parameters()}
    torch.testing.assert_close(functional_call(n, other, (x, x, x))[0], functional_call(r, other, (x, x, x))[0],
                               atol=2e-5, rtol=1e-4)
    r, n = both()
    for mod in (r, n):
        prune.l1_unstructured(mod, "in_proj_weight", amount=0.5)
    torch.testing.assert_close(n(x, x, x)[0], r(x, x, x)[0], atol=2e-5, rtol=1e-4)

    class Halve(torch.nn.Module):
        def forward(self, w):
            return w * 0.5

    r, n = both()
    for mod in (r, n):
        parametrize.register_parametrization(mod.out_proj, "weight", Halve())
    xr = x.clone().requires_grad_()
    torch.testing.assert_close(n(xr, xr, xr)[0], r(xr, xr, xr)[0], atol=2e-5, rtol=1e-4)
    grads = []
    for mod in (r, n):
        mod.zero_grad()
        mod(x, x, x, need_weights=False)[0].pow(2).sum().backward()
        grads.append(mod.out_proj.parametrizations.weight.original.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-4, rtol=1e-4)
    # Two calls with different parameters in one graph: each backward uses its own call's.
    r, n = both()
    p2 = {k: torch.randn_like(p) for k, p in r.named_parameters()}
    xs = [x.clone().requires_grad_() for _ in range(2)]
    for mod, xx in ((r, xs[0]), (n, xs[1])):
        (mod(xx, xx, xx, need_weights=False)[0].sum() + functional_call(mod, p2, (xx, xx, xx))[0].pow(2).sum()
         ).backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, atol=1e-3, rtol=1e-3)


def test_masks_that_require_grad_are_refused_and_integer_sdpa_masks_too():
    m = mt.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 3, 8)
    bias = torch.zeros(3, 3, requires_grad=True)
    with pytest.raises(ValueError, match="attn_mask requires grad"):
        m(x, x, x, attn_mask=bias)
    with pytest.raises(ValueError, match="key_padding_mask requires grad"):
        m(x, x, x, key_padding_mask=torch.zeros(1, 3, requires_grad=True))
    with torch.no_grad():
        m(x, x, x, attn_mask=bias)  # no graph, nothing to lose
    m(x, x, x, attn_mask=bias.detach())
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="attn_mask requires grad"):
        mt.scaled_dot_product_attention(q, q, q, attn_mask=bias)
    for dtype in (torch.uint8, torch.int64):
        with pytest.raises(TypeError, match=f"attn_mask must be a bool or float tensor, got {dtype}"):
            mt.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 3, dtype=dtype))


def test_sdpa_backward_refuses_inputs_modified_in_place():
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    k, v = torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4)
    q = x * 1
    o = mt.scaled_dot_product_attention(q, k, v)
    with torch.no_grad():
        q.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(o.sum(), x)
    o = mt.scaled_dot_product_attention(x * 1, k, v)
    with torch.no_grad():
        o.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()


def test_sdpa_gradients_under_an_hf_style_finfo_min_mask_match_torch():
    """Padded query rows under torch.finfo(float32).min on every key (Hugging Face's padding masks):
    the forward agreed, but the fused backward's P = exp(S - lse) summed to T per such row (lse =
    finfo.min + log T rounds to finfo.min) and the gradients were off by up to 2x torch's."""
    torch.manual_seed(0)
    T = 6
    q, k, v = (torch.randn(1, 2, T, 8, requires_grad=True) for _ in range(3))
    mask = torch.zeros(1, 1, T, T)
    mask[..., :, 4:] = torch.finfo(torch.float32).min  # keys 4, 5 are padding
    mask[..., 4:, :] = torch.finfo(torch.float32).min  # so are query rows 4, 5: every key
    g = torch.randn(1, 2, T, 8)
    got = torch.autograd.grad(mt.scaled_dot_product_attention(q, k, v, attn_mask=mask), (q, k, v), g)
    ref = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5 + mask, -1) @ v  # torch's math SDPA
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def test_module_gradients_with_one_sequence_wholly_padded_by_finfo_min_match_torch():
    """A float key_padding_mask of finfo.min over every key of one sequence (Hugging Face's padding):
    that sequence's rows are renormalised in the backward, and the other sequence's must not be
    touched (a first form left them NaN)."""
    torch.manual_seed(3)
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    m = mt.MultiheadAttention.from_torch(ref)
    x = torch.randn(2, 5, 8)
    kpm = torch.zeros(2, 5)
    kpm[1, :] = torch.finfo(torch.float32).min
    grads = []
    for mod in (ref, m):
        xi = x.clone().requires_grad_(True)
        y, _ = mod(xi, xi, xi, key_padding_mask=kpm, need_weights=False)
        y[0].sum().backward()
        grads.append([xi.grad] + [p.grad for p in mod.parameters()])
        mod.zero_grad()
    for want, got in zip(*grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_sdpa_takes_torch_25s_enable_gqa():
    """torch 2.5 added enable_gqa; code that passes it must run on mha's drop-in too (grouped heads
    work either way), with the same numbers as repeating the K/V heads."""
    q = torch.randn(1, 4, 3, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    want = mt.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    for flag in (True, False):
        torch.testing.assert_close(mt.scaled_dot_product_attention(q, k, v, enable_gqa=flag), want, atol=0, rtol=0)
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        mt.scaled_dot_product_attention(q, k, v, enable_gqa="yes")


def test_sdpa_shape_errors_name_the_shapes_passed():
    q = torch.zeros(2, 4, 6)
    kv = torch.zeros(2, 3, 5, 6)
    with pytest.raises(ValueError, match=r"all 3-D or all 4-D, got \(2, 4, 6\), \(2, 3, 5, 6\), \(2, 3, 5, 6\)"):
        mt.scaled_dot_product_attention(q, kv, kv)


def test_sdpa_errors_name_attn_mask_and_the_function_called():
    """The core's errors said "sdpa: allowed mask has shape (1, 1, 3, 3)" for a (3, 3) attn_mask:
    a function, an argument and a shape the caller of scaled_dot_product_attention never wrote."""
    q, kv = torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 3, 4)
    for mask in (torch.zeros(3, 3, dtype=torch.bool), torch.zeros(2, 2)):
        with pytest.raises(ValueError, match=r"^scaled_dot_product_attention: attn_mask of shape "
                                             rf"\({mask.shape[0]}, {mask.shape[1]}\) does not broadcast to "
                                             r"\(N, h, L, S\) = \(1, 2, 2, 3\)$"):
            mt.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)
    with pytest.raises(ValueError, match=r"^scaled_dot_product_attention: attn_mask of shape \(1, 1, 1, 2, 3\)"):
        mt.scaled_dot_product_attention(q, kv, kv, attn_mask=torch.zeros(1, 1, 1, 2, 3))
    with pytest.raises(ValueError, match=r"attn_mask of shape \(2, 2, 3\) does not broadcast to \(N, L, S\) = "
                                         r"\(1, 2, 3\)"):
        mt.scaled_dot_product_attention(q[:, 0], kv[:, 0], kv[:, 0], attn_mask=torch.zeros(2, 2, 3))
    with pytest.raises(ValueError, match=r"^scaled_dot_product_attention: batch sizes differ"):
        mt.scaled_dot_product_attention(torch.zeros(2, 2, 2, 4), kv, kv)
    # broadcastable masks still go through: (S), (L, S), (1, h, L, S), (N, 1, 1, S)
    for shape in ((3,), (2, 3), (1, 2, 2, 3), (1, 1, 1, 3)):
        assert mt.scaled_dot_product_attention(q, kv, kv, attn_mask=torch.zeros(shape)).shape == (1, 2, 2, 4)


def test_batch_first_dropout_and_add_zero_attn_are_read_on_every_call():
    """torch's forward reads these attributes on every call; mha.torch once read them at construction
    and went on computing with the old layout, rate and keys, silently."""
    ref, m = pair(embed_dim=8, num_heads=2)
    x = torch.randn(3, 5, 8)
    for mod in (ref, m):
        mod.batch_first = True
    want, want_w = ref(x, x, x)
    got, got_w = m(x, x, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert got_w.shape == want_w.shape == (3, 5, 5)
    for mod in (ref, m):
        mod.add_zero_attn = True
    want, want_w = ref(x, x, x)
    got, got_w = m(x, x, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert got_w.shape == want_w.shape == (3, 5, 6)
    m.train()
    m.dropout = 0.9
    torch.manual_seed(1)
    _, w = m(x, x, x, average_attn_weights=False)
    assert 0.8 < (w == 0).float().mean().item() < 0.98
    m.dropout = 1.5
    with pytest.raises(ValueError, match="dropout"):
        m(x, x, x)
    m.dropout = "0.1"
    with pytest.raises(TypeError, match="dropout must be a float"):
        m(x, x, x)
    m.dropout = 0.99999999  # below 1, but 1.0 as a float32: named, not "got 1"
    with pytest.raises(ValueError, match="rounds to 1 in float32"):
        m(x, x, x)
    with pytest.raises(ValueError, match="rounds to 1 in float32"):
        mt.MultiheadAttention(8, 2, dropout=0.99999999)
    with pytest.raises(ValueError, match="rounds to 1 in float32"):
        mt.scaled_dot_product_attention(x, x, x, dropout_p=0.99999999)


def test_masks_are_tensors_of_the_dtypes_torch_takes():
    m = mt.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor or None, got list"):
        m(x, x, x, attn_mask=[[False] * 3] * 3)
    with pytest.raises(TypeError, match="key_padding_mask must be a torch.Tensor or None, got ndarray"):
        m(x, x, x, key_padding_mask=np.zeros((2, 3), bool))
    # torch 1.13 takes a uint8 attn_mask (deprecated) but no uint8 key_padding_mask
    with pytest.raises(TypeError, match="key_padding_mask must be a bool or float tensor, got torch.uint8"):
        m(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="attn_mask must be a bool, uint8 or float tensor, got torch.int64"):
        m(x, x, x, attn_mask=torch.zeros(3, 3, dtype=torch.int64))
    a, _ = m(x, x, x, attn_mask=torch.eye(3, dtype=torch.uint8))
    b, _ = m(x, x, x, attn_mask=torch.eye(3, dtype=torch.bool))
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_errors_name_the_forward_the_user_called():
    m = mt.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8, requires_grad=True)
    for need_weights in (True, False):
        with pytest.raises(ValueError, match=r"^mha\.torch\.MultiheadAttention\.forward: attn_mask"):
            m(x, x, x, attn_mask=torch.zeros(4, 4), need_weights=need_weights)


def test_float64_masks_beyond_float32_range_are_refused_naming_the_mask():
    """A float64 mask entry past float32's range became ±inf silently (1e300: a NaN output row),
    where mha refuses every other such value with a ValueError naming it."""
    m = mt.MultiheadAttention(4, 1, batch_first=True)
    x = torch.randn(1, 3, 4)
    am = torch.zeros(3, 3, dtype=torch.float64)
    am[0, 1] = 1e300
    kpm = torch.zeros(1, 3, dtype=torch.float64)
    kpm[0, 2] = -1e300
    for need_weights in (True, False):
        with pytest.raises(ValueError, match=r"attn_mask\[0, 1\] = 1e\+300 is finite but beyond float32's range"):
            m(x, x, x, attn_mask=am, need_weights=need_weights)
        with pytest.raises(ValueError, match=r"key_padding_mask\[0, 2\] = -1e\+300 is finite"):
            m(x.requires_grad_(), x, x, key_padding_mask=kpm, need_weights=need_weights)
    with pytest.raises(ValueError, match=r"scaled_dot_product_attention: attn_mask\[0, 1\] = 1e\+300 is finite"):
        mt.scaled_dot_product_attention(x, x, x, attn_mask=am)
    # a 3-D mask beside 3-D inputs: the index is the caller's (N, L, S) one, not its (N, 1, L, S) view's
    with pytest.raises(ValueError, match=r"scaled_dot_product_attention: attn_mask\[0, 0, 1\] = 1e\+300 is finite"):
        mt.scaled_dot_product_attention(x, x, x, attn_mask=am[None])
    am[0, 1], kpm[0, 2] = -2.0, 0.25  # in range: the float32 mask's bits, as before
    torch.testing.assert_close(m(x, x, x, attn_mask=am, key_padding_mask=kpm)[0],
                               m(x, x, x, attn_mask=am.float(), key_padding_mask=kpm.float())[0], atol=0, rtol=0)
    torch.testing.assert_close(mt.scaled_dot_product_attention(x, x, x, attn_mask=am),
                               mt.scaled_dot_product_attention(x, x, x, attn_mask=am.float()), atol=0, rtol=0)


def test_dropout_false_is_zero_as_in_torch():
    m = mt.MultiheadAttention(8, 2, dropout=False, batch_first=True)
    x = torch.randn(1, 3, 8)
    out, _ = m(x, x, x)
    m.dropout = 0.0
    torch.testing.assert_close(m(x, x, x)[0], out, atol=0, rtol=0)


def test_threads_share_one_module():
    """Each forward used to copy the parameters into the module's one core with set(), which frees
    the storage another thread's forward was reading: wrong outputs (up to 1e29) from two threads on
    one module. Every call now binds its own copy; results are those of the same calls made alone."""
    import threading

    torch.manual_seed(0)
    m = mt.MultiheadAttention(64, 4, batch_first=True).eval()
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 200, 64, generator=g) for _ in range(4)]
    with torch.no_grad():
        alone = [m(x, x, x, need_weights=False)[0] for x in xs]
    got = [[None] * len(xs) for _ in range(2)]
    errors = []

    def work(t):
        try:
            for _ in range(10):
                for i, x in enumerate(xs):
                    with torch.no_grad():
                        got[t][i] = m(x, x, x, need_weights=False)[0]
                    assert torch.equal(got[t][i], alone[i])
        except Exception as e:  # noqa: BLE001 (reported below, with the thread's number)
            errors.append((t, e))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    # Training from two threads: each backward uses the parameters its own forward bound.
    grads = []

    def train(x):
        xr = x.clone().requires_grad_(True)
        m(xr, xr, xr, need_weights=False)[0].square().sum().backward(inputs=[xr])
        grads.append((x, xr.grad))

    threads = [threading.Thread(target=train, args=(x,)) for x in xs[:4]]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for x, gx in grads:
        xr = x.clone().requires_grad_(True)
        m(xr, xr, xr, need_weights=False)[0].square().sum().backward(inputs=[xr])
        assert torch.equal(gx, xr.grad)


@pytest.mark.parametrize("extra", [{}, {"rope": mha.Rope()}, {"num_kv_heads": 2}], ids=["plain", "rope", "gqa"])
def test_transformer_encoder_layer_inference_runs_mha(extra):
    """torch's encoder layer has an inference fast path (eval, no grad, batch_first) that reads
    self_attn.in_proj_weight and runs torch's own kernel when self_attn._qkv_same_embed_dim is True:
    mha's forward was never called, RoPE was dropped and grouped-query heads failed inside torch."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    layer.self_attn = mt.MultiheadAttention(16, 4, batch_first=True, **extra)
    layer.eval()
    calls = []
    layer.self_attn.register_forward_hook(lambda *a: calls.append(1))
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        fast = layer(x)
    assert calls, "the layer's inference did not call mha's forward"
    torch.testing.assert_close(fast, layer(x), atol=0, rtol=0)  # the same as with grad enabled
    stack = torch.nn.TransformerEncoder(layer, num_layers=2)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1, 3:] = True
    with torch.no_grad():
        out = stack(x, src_key_padding_mask=kpm)
    torch.testing.assert_close(out, stack(x, src_key_padding_mask=kpm), atol=0, rtol=0)


def test_from_torch_keeps_frozen_parameters_frozen():
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(16, 4, kdim=8, add_bias_kv=True)
    for name in ("q_proj_weight", "bias_k", "out_proj.weight"):
        ref.get_parameter(name).requires_grad_(False)
    new = mt.MultiheadAttention.from_torch(ref)
    assert {n: p.requires_grad for n, p in new.named_parameters()} == {
        n: p.requires_grad for n, p in ref.named_parameters()}
    q, kv = torch.randn(3, 1, 16), torch.randn(4, 1, 8)
    new(q, kv, torch.randn(4, 1, 16), need_weights=False)[0].sum().backward()
    assert new.q_proj_weight.grad is None and new.bias_k.grad is None and new.out_proj.weight.grad is None
    assert new.k_proj_weight.grad is not None


@pytest.mark.parametrize("arg", ["kdim", "vdim", "num_kv_heads"])
def test_zero_widths_are_refused_not_read_as_the_default(arg):
    """The core reads 0 as "the default" (embed_dim, num_heads): kdim=0 built a module with
    kdim=0 reported and (E, E) key weights taking E features; torch builds (E, 0) weights."""
    for cls in (mt.MultiheadAttention, mha.MultiheadAttention):
        with pytest.raises(ValueError, match=f"{arg} must be at least 1"):
            cls(8, 2, **{arg: 0})
        with pytest.raises(ValueError, match=f"{arg} must be at least 1"):
            cls(8, 2, **{arg: -3})


def test_bfloat16_masks_as_torch_takes_them():
    torch.manual_seed(0)
    ref, new = pair(embed_dim=16, num_heads=4, batch_first=True)
    x = torch.randn(2, 5, 16)
    am = torch.randn(5, 5).to(torch.bfloat16)
    kpm = torch.zeros(2, 5).to(torch.bfloat16)
    kpm[1, 4] = float("-inf")
    out = new(x, x, x, attn_mask=am, key_padding_mask=kpm)[0]
    torch.testing.assert_close(out, new(x, x, x, attn_mask=am.float(), key_padding_mask=kpm.float())[0], atol=0, rtol=0)
    # (torch 1.13 itself gives NaN for a float key padding mask beside an attention mask: the mask alone)
    torch.testing.assert_close(new(x, x, x, attn_mask=am)[0], ref(x, x, x, attn_mask=am.float())[0],
                               atol=2e-5, rtol=1e-4)


def _step(m, q, k, need_weights=False, is_causal=False):
    """One training step's results, without touching .grad: the output, the weights (when asked
    for) and the gradients of sum(output · g) with respect to q, k and every parameter."""
    qr, kr = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    mask = torch.ones(q.shape[-2], k.shape[-2]).triu(1).bool() if is_causal and q.shape[-2] == k.shape[-2] else None
    out, w = m(qr, kr, kr, need_weights=need_weights, attn_mask=mask)
    g = torch.Generator().manual_seed(out.numel())
    params = [p for _, p in m.named_parameters()]
    grads = torch.autograd.grad(out, [qr, kr, *params], torch.randn(out.shape, generator=g))
    return [out.detach(), *([] if w is None else [w]), *grads]


# (query shape, key shape): batched, unbatched, self- and cross-attention, growing and shrinking, so
# that a call finds buffers a larger or smaller call left in the module's workspace.
_CHANGING_SHAPES = [((3, 40, 32), (3, 40, 32)), ((1, 7, 32), (1, 9, 32)), ((5, 64, 32), (5, 30, 32)),
                    ((12, 32), (12, 32)), ((2, 1, 32), (2, 50, 32)), ((3, 40, 32), (3, 40, 32)),
                    ((6, 90, 32), (6, 90, 32)), ((1, 7, 32), (1, 9, 32))]


def _inputs(i, q_shape, k_shape):
    g = torch.Generator().manual_seed(100 + i)
    q = torch.randn(q_shape, generator=g)
    return q, (q if q_shape == k_shape else torch.randn(k_shape, generator=g))


def test_repeated_calls_with_changing_shapes_match_a_fresh_module():
    """Every call reuses the working buffers earlier calls on the module gave back (never zero-
    filled, possibly larger and holding their values): each call of a run of changing shapes gives
    bitwise what a fresh copy of the module (no buffers of its own yet) gives, weights and
    gradients included, in training and in inference."""
    import copy

    torch.manual_seed(0)
    m = mt.MultiheadAttention(32, 4, batch_first=True, num_kv_heads=2)
    for rnd in range(2):
        for i, (qs, ks) in enumerate(_CHANGING_SHAPES):
            q, k = _inputs(i, qs, ks)
            kw = dict(need_weights=(i + rnd) % 2 == 0, is_causal=i % 3 == 0)
            for g, w in zip(_step(m, q, k, **kw), _step(copy.deepcopy(m), q, k, **kw)):
                assert torch.equal(g, w), (rnd, qs, ks)
            with torch.no_grad():
                got = m(q, k, k, average_attn_weights=False)
                want = copy.deepcopy(m)(q, k, k, average_attn_weights=False)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (rnd, qs, ks)


def test_concurrent_training_calls_on_one_module_match_sequential_ones():
    """Two Python threads training through one module at once, each on shapes of its own that change
    from call to call, share its workspace (each call checks out buffers of its own): every
    output, weight and gradient is bitwise that of the same call made alone, one after another."""
    import threading

    torch.manual_seed(0)
    m = mt.MultiheadAttention(32, 4, batch_first=True, dropout=0.0)
    work = [[(i, *_CHANGING_SHAPES[i]) for i in range(t, len(_CHANGING_SHAPES), 2)] for t in range(2)]
    sequential = {i: _step(m, *_inputs(i, qs, ks), need_weights=i % 2 == 0, is_causal=i % 3 == 0)
                  for calls in work for i, qs, ks in calls}
    wrong, errors = [], []

    def run(calls):
        try:
            for _ in range(4):
                for i, qs, ks in calls:
                    got = _step(m, *_inputs(i, qs, ks), need_weights=i % 2 == 0, is_causal=i % 3 == 0)
                    if not all(torch.equal(g, w) for g, w in zip(got, sequential[i])):
                        wrong.append(i)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(calls,)) for calls in work]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert not wrong, wrong


def test_release_workspace_frees_the_kept_buffers_and_calls_go_on():
    """Both modules keep their working buffers between calls (mha.torch's calls since they share the
    module's workspace: before, each call's buffers were new, and freed with it);
    release_workspace() gives them back, and later calls allocate afresh, with the same results."""
    torch.manual_seed(0)
    m = mt.MultiheadAttention(64, 4)
    x = torch.randn(50, 3, 64)
    first = _step(m, x, x)
    kept = m._core.workspace_bytes()
    assert kept >= 2 * 4 * 4 * x.numel()  # a step's projections and heads, and its backward's rows
    again = _step(m, x, x)
    assert m._core.workspace_bytes() == kept  # reused, not grown
    m.release_workspace()
    assert m._core.workspace_bytes() == 0
    after = _step(m, x, x)
    for a, b, c in zip(first, again, after):
        assert torch.equal(a, b) and torch.equal(a, c)
    n = mha.MultiheadAttention(64, 4)
    y = x.numpy()
    want = n(y, y, y)[0]
    assert n._m.workspace_bytes() > 0
    n.release_workspace()
    assert n._m.workspace_bytes() == 0 and np.array_equal(n(y, y, y)[0], want)
