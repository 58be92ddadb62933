"""Seeded random differential test: mha.torch.MultiheadAttention and the numpy module against
torch.nn.MultiheadAttention computed in float64, over configurations the hand-written cases of
test_torch.py leave out together: unbatched inputs, kdim/vdim, bias off, add_bias_kv and
add_zero_attn, T_q != T_k down to 1, (T_q, T_k) and (B·h, T_q, T_k) masks, bool, uint8 and float,
bool and float key padding (a float one beside an attn_mask added as PyTorch 2 adds it), is_causal
(top-left) beside any of them, per-head and averaged weights, and every gradient under a random
cotangent. Rows that see no key are compared where torch is finite; mha's output, weights and
gradients must be finite there (docs/semantics.md, 'Fully masked rows').

A compact form of a 10k-case fuzz run (2026-12-07) that found no numeric difference: it guards the
combinations, not one bug. Skipped with a message when torch is not installed (MHA_REQUIRE_TORCH=1
makes that a failure)."""
import os
import random
import warnings

import numpy as np
import pytest

if os.environ.get("MHA_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch", reason="PyTorch is not installed: the mha.torch tests need python3-torch")
import mha  # noqa: E402
import mha.torch as mt  # noqa: E402

torch.set_num_threads(1)
NEG = float("-inf")


def draw(seed):
    r = random.Random(seed)
    h = r.choice([1, 2, 3, 4])
    E = h * r.choice([1, 2, 4, 8])
    cfg = dict(embed_dim=E, num_heads=h, bias=r.random() < 0.7, add_bias_kv=r.random() < 0.25,
               add_zero_attn=r.random() < 0.25, batch_first=r.random() < 0.5)
    if r.random() < 0.35:
        cfg["kdim"], cfg["vdim"] = r.randint(1, 9), r.randint(1, 9)
    batched = r.random() < 0.8
    B = r.choice([1, 2, 3]) if batched else 1
    self_attn = "kdim" not in cfg and r.random() < 0.4
    Tq = r.choice([1, 2, 3, 5, 8])
    Tk = Tq if self_attn else r.choice([1, 2, 4, 7])
    am = None
    kind = r.choice(["none", "bool2", "bool3", "uint8", "float2", "float3"])
    if kind != "none":
        dims = (Tq, Tk) if kind[-1] in "28" else (B * h if batched else h, Tq, Tk)
        g = torch.Generator().manual_seed(seed)
        if kind.startswith("float"):
            am = torch.randn(dims, generator=g).masked_fill(torch.rand(dims, generator=g) < 0.3, NEG)
        else:
            am = torch.rand(dims, generator=g) < r.choice([0.2, 0.5, 0.9])
            am = am.to(torch.uint8) if kind == "uint8" else am
    kpm = None
    kk = r.choice(["none", "bool", "float"])
    if kk != "none":
        g = torch.Generator().manual_seed(seed + 1)
        pad = torch.rand((B, Tk) if batched else (Tk,), generator=g) < 0.3
        kpm = pad if kk == "bool" else torch.randn(pad.shape, generator=g).masked_fill(pad, NEG)
    case = dict(B=B, Tq=Tq, Tk=Tk, batched=batched, self_attn=self_attn, am=am, kpm=kpm,
                causal=r.random() < 0.3, need_weights=r.random() < 0.7, avg=r.random() < 0.5)
    return cfg, case


def torch_masks(cfg, case):
    """The masks mha is given, as one float (B·h, T_q, T_k) attn_mask for torch 1.13: which refuses a
    float key_padding_mask beside an attn_mask (PyTorch 2 adds them) and has no is_causal."""
    h, B, Tq, Tk = cfg["num_heads"], case["B"], case["Tq"], case["Tk"]
    m = torch.zeros(B, h, Tq, Tk, dtype=torch.float64)
    if case["am"] is not None:
        a = case["am"]
        a = torch.zeros(a.shape, dtype=torch.float64).masked_fill(a.bool(), NEG) if not a.is_floating_point() else a
        m = m + (a.double().reshape(B, h, Tq, Tk) if a.dim() == 3 else a.double())
    if case["kpm"] is not None:
        p = case["kpm"] if case["batched"] else case["kpm"][None]
        p = torch.zeros(p.shape, dtype=torch.float64).masked_fill(p, NEG) if p.dtype == torch.bool else p.double()
        m = m + p[:, None, None, :]
    if case["causal"]:
        m = m.masked_fill(torch.triu(torch.ones(Tq, Tk, dtype=torch.bool), 1), NEG)
    return m.reshape(B * h, Tq, Tk) if case["batched"] else m[0]


def close(got, want, rel, what):
    got, want = got.double(), want.double()
    assert got.shape == want.shape, what
    finite = torch.isfinite(want)
    assert torch.isfinite(got).all(), f"{what}: mha gave a non-finite value"
    scale = 1.0 + (want[finite].abs().max().item() if finite.any() else 0.0)
    err = (got - want)[finite].abs().max().item() if finite.any() else 0.0
    assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel * scale:.3g}"


@pytest.mark.parametrize("seed", range(60))
def test_random_configurations_match_torch_in_float64(seed):
    cfg, case = draw(seed)
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(**cfg)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "bias" in n:
                p.normal_(0, 0.5)
    new = mt.MultiheadAttention.from_torch(ref)
    ref64 = ref.double()  # in place: torch computes in float64 from here on; new holds float32 copies
    E = cfg["embed_dim"]
    kd, vd = cfg.get("kdim", E), cfg.get("vdim", E)
    B, Tq, Tk = case["B"], case["Tq"], case["Tk"]
    g = torch.Generator().manual_seed(1000 + seed)

    def lay(t):
        if not case["batched"]:
            return t[0]
        return t if cfg["batch_first"] else t.transpose(0, 1).contiguous()

    q = lay(torch.randn(B, Tq, E, generator=g))
    k = q if case["self_attn"] else lay(torch.randn(B, Tk, kd, generator=g))
    v = q if case["self_attn"] else lay(torch.randn(B, Tk, vd, generator=g))
    kw = dict(need_weights=case["need_weights"], average_attn_weights=case["avg"])
    outs = {}
    for name, mod, dtype in (("torch", ref64, torch.float64), ("mha", new, torch.float32)):
        qq = q.to(dtype).detach().requires_grad_()
        kk = qq if case["self_attn"] else k.to(dtype).detach().requires_grad_()
        vv = qq if case["self_attn"] else v.to(dtype).detach().requires_grad_()
        if name == "torch":
            masks = dict(attn_mask=torch_masks(cfg, case))
        else:
            masks = dict(key_padding_mask=case["kpm"], attn_mask=case["am"], is_causal=case["causal"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out, w = mod(qq, kk, vv, **masks, **kw)
        d = torch.randn(out.shape, generator=torch.Generator().manual_seed(2000 + seed), dtype=torch.float64)
        (out * d.to(dtype)).sum().backward()
        grads = {"query": qq.grad, "key": kk.grad, "value": vv.grad, **{n: p.grad for n, p in mod.named_parameters()}}
        outs[name] = (out.detach(), w, grads)
        mod.zero_grad()
    (t_out, t_w, t_g), (m_out, m_w, m_g) = outs["torch"], outs["mha"]
    close(m_out, t_out, 2e-5, "output")
    assert (m_w is None) == (t_w is None)
    if t_w is not None:
        close(m_w, t_w, 1e-5, "weights")
    if torch.isfinite(t_out).all():  # torch's gradients are NaN wherever a row saw no key
        for n in t_g:
            close(m_g[n], t_g[n], 5e-5, f"d {n}")
    else:
        for n in m_g:
            assert torch.isfinite(m_g[n]).all(), f"d {n}: not finite beside a fully masked row"

    # the numpy module: the same weights, the same masks in PyTorch's polarity
    nm = mha.MultiheadAttention(E, cfg["num_heads"], 0.0, cfg["bias"], cfg["add_bias_kv"], cfg["add_zero_attn"],
                                cfg.get("kdim"), cfg.get("vdim"), cfg["batch_first"]).eval()
    nm.load_state_dict({n: p.detach().float() for n, p in new.state_dict().items()})
    np_out, np_w = nm(q.numpy(), k.numpy(), v.numpy(), is_causal=case["causal"],
                      key_padding_mask=None if case["kpm"] is None else case["kpm"].numpy(),
                      attn_mask=None if case["am"] is None else case["am"].numpy(), **kw)
    close(torch.from_numpy(np_out), t_out, 2e-5, "numpy output")
    if t_w is not None:
        close(torch.from_numpy(np_w), t_w, 1e-5, "numpy weights")
