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
