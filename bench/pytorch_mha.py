#!/usr/bin/python3
"""PyTorch's nn.MultiheadAttention (or its attention core) on the shapes `mha bench` times.

Two module anchors (--anchor): `nn` is torch.nn.MultiheadAttention (what the lessons teach);
`sdpa` is the module a PyTorch user writes for speed: one nn.Linear for Q/K/V, the functional
scaled_dot_product_attention (torch 2.x: its CPU flash kernel; 1.13: the private
_scaled_dot_product_attention) and nn.Linear for the output. --need-weights averaged|per-head
times nn.MultiheadAttention returning its attention weights (PyTorch's default).

Eval mode, need_weights=False, batch_first=True, self-attention (query = key = value, PyTorch's
fast path) unless --kv-seq differs, the same thread count, the same FLOP convention (attention
core 4·B·h·T_q·T_k·d, halved when causal; projections 2·rows·in·out per GEMM). Causal is an
attn_mask (PyTorch 1.13's module has no is_causal), which takes PyTorch off its fast path.

OMP_WAIT_POLICY=passive must be in the environment before torch loads its OpenMP runtime
(PyTorch is up to 4x faster here with it): if it is not, this script re-executes itself with it.

  /usr/bin/python3 bench/pytorch_mha.py --seq 1024 --embed-dim 512 --heads 8 --threads 2 [--json]
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

if os.environ.get("OMP_WAIT_POLICY", "").lower() != "passive":
    os.environ["OMP_WAIT_POLICY"] = "passive"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch  # noqa: E402  (after the environment is settled)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--kv-seq", type=int, default=0)
    p.add_argument("--embed-dim", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, default=0, help="core only: K/V heads, expanded for PyTorch")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--core", action="store_true", help="time the attention core (SDPA) alone")
    p.add_argument("--core-impl", choices=["sdpa", "math", "best"], default="best",
                   help="core: 1.13's private SDPA, softmax(QKᵀ)V in ops, or the faster of the two (default)")
    p.add_argument("--backward", action="store_true",
                   help="module: forward + backward through autograd (loss = sum(output * fixed random)); "
                        "core: the backward of softmax(QKᵀ)V alone (FLOPs 2.5x the forward core)")
    p.add_argument("--anchor", choices=["nn", "sdpa"], default="nn",
                   help="module: nn.MultiheadAttention (default) or nn.Linear + scaled_dot_product_attention")
    p.add_argument("--need-weights", choices=["none", "averaged", "per-head"], default="none",
                   help="module (nn anchor): return attention weights, averaged over heads or per head")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    a.kv_seq = a.kv_seq or a.seq
    a.kv_heads = a.kv_heads or a.heads
    for name in ("batch", "seq", "kv_seq", "embed_dim", "heads", "kv_heads", "repeat"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.embed_dim % a.heads or a.heads % a.kv_heads:
        p.error("--heads must divide --embed-dim and --kv-heads must divide --heads")
    if a.kv_heads != a.heads and not a.core:
        p.error("nn.MultiheadAttention has no grouped-query attention: --kv-heads needs --core")
    if a.need_weights != "none" and (a.core or a.anchor != "nn" or a.backward):
        p.error("--need-weights is for the nn anchor's module forward")
    if a.anchor == "sdpa" and a.kv_seq != a.seq:
        p.error("--anchor sdpa is self-attention only (no --kv-seq)")
    return a


def functional_sdpa():
    """(q, k, v, is_causal) -> out: torch 2.x's public SDPA, 1.13's private one, else None."""
    f = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
    if f is not None:
        return lambda q, k, v, causal: f(q, k, v, is_causal=causal)
    f = getattr(torch.nn.functional, "_scaled_dot_product_attention", None)
    if f is not None:  # 1.13: (out, weights)
        return lambda q, k, v, causal: f(q, k, v, None, 0.0, False, causal)[0]
    return None


class SdpaModule(torch.nn.Module):
    """The fast module a PyTorch user writes: packed Q/K/V Linear, functional SDPA, output Linear."""

    def __init__(self, embed_dim, heads, causal):
        super().__init__()
        self.h, self.causal = heads, causal
        self.in_proj = torch.nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = torch.nn.Linear(embed_dim, embed_dim)
        self.sdpa = functional_sdpa()
        if self.sdpa is None:
            sys.exit(f"pytorch_mha.py: torch {torch.__version__} has no scaled_dot_product_attention")

    def forward(self, x):
        B, T, E = x.shape
        q, k, v = self.in_proj(x).view(B, T, 3, self.h, E // self.h).permute(2, 0, 3, 1, 4)
        o = self.sdpa(q, k, v, self.causal)
        return self.out_proj(o.transpose(1, 2).reshape(B, T, E))


def flops(a):
    """The same convention as `mha bench`: backward is 2.5x the forward core and 2x each GEMM."""
    d = a.embed_dim // a.heads
    core = 4.0 * a.batch * a.heads * a.seq * a.kv_seq * d * (0.5 if a.causal else 1.0)
    if a.core:
        if a.backward:  # the sdpa impl times forward + backward together
            return 3.5 * core if a.core_impl == "sdpa" else 2.5 * core
        return core
    E, kvd = a.embed_dim, a.kv_heads * d
    nq, nk = a.batch * a.seq, a.batch * a.kv_seq
    proj = 2.0 * nq * E * E + 2.0 * 2.0 * nk * E * kvd + 2.0 * nq * E * E
    return 3.5 * core + 3.0 * proj if a.backward else core + proj


def causal_mask(a):
    # True = may NOT attend (PyTorch's polarity), top-left aligned like is_causal.
    return torch.ones(a.seq, a.kv_seq, dtype=torch.bool).triu(1)


def make_core(a, dtype):
    d = a.embed_dim // a.heads
    g = torch.Generator().manual_seed(0)
    q = torch.rand(a.batch, a.heads, a.seq, d, generator=g).mul_(2).sub_(1).to(dtype)
    k = torch.rand(a.batch, a.kv_heads, a.kv_seq, d, generator=g).mul_(2).sub_(1).to(dtype)
    v = torch.rand(a.batch, a.kv_heads, a.kv_seq, d, generator=g).mul_(2).sub_(1).to(dtype)
    if a.kv_heads != a.heads:  # PyTorch 1.13 has no GQA: the baseline copies K/V per query head
        k = k.repeat_interleave(a.heads // a.kv_heads, dim=1)
        v = v.repeat_interleave(a.heads // a.kv_heads, dim=1)
    mask = causal_mask(a) if a.causal else None
    scale = d ** -0.5

    def math():
        s = (q @ k.transpose(-2, -1)) * scale
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    impls = {"math": math}
    sdpa = functional_sdpa()  # torch 2.x: the CPU flash kernel; 1.13: its private SDPA
    if sdpa is not None:
        impls["sdpa"] = lambda: sdpa(q, k, v, a.causal)
    if a.core_impl == "best":
        return impls
    if a.core_impl not in impls:
        sys.exit(f"pytorch_mha.py: --core-impl {a.core_impl} is not in torch {torch.__version__}")
    return {a.core_impl: impls[a.core_impl]}


def make_module(a, dtype):
    torch.manual_seed(0)
    if a.anchor == "sdpa":
        m = SdpaModule(a.embed_dim, a.heads, a.causal).eval().to(dtype)
    else:
        m = torch.nn.MultiheadAttention(a.embed_dim, a.heads, batch_first=True).eval().to(dtype)
    x = torch.rand(a.batch, a.seq, a.embed_dim).mul_(2).sub_(1).to(dtype)
    if a.kv_seq == a.seq:
        key = value = x  # the same object: PyTorch's self-attention fast path
    else:
        key = torch.rand(a.batch, a.kv_seq, a.embed_dim).mul_(2).sub_(1).to(dtype)
        value = torch.rand(a.batch, a.kv_seq, a.embed_dim).mul_(2).sub_(1).to(dtype)
    mask = causal_mask(a) if a.causal and a.anchor == "nn" else None
    name = "nn.MultiheadAttention" if a.anchor == "nn" else "Linear+SDPA module"
    call = (lambda: m(x)) if a.anchor == "sdpa" else (lambda: m(x, key, value, need_weights=False, attn_mask=mask)[0])
    if a.backward:
        # Training mode off (no dropout configured anyway), autograd on: the parameters and the
        # input require grad, so every gradient mha's backward returns is computed here too.
        x.requires_grad_(True)
        g = torch.Generator().manual_seed(1)
        d_out = torch.rand(a.batch, a.seq, a.embed_dim, generator=g).mul_(2).sub_(1).to(dtype)

        def step():
            m.zero_grad(set_to_none=True)
            x.grad = None
            (call() * d_out).sum().backward()
        return {f"{name} fwd+bwd": step}
    if a.need_weights != "none":
        avg = a.need_weights == "averaged"
        return {f"{name} need_weights={a.need_weights}":
                lambda: m(x, key, value, need_weights=True, attn_mask=mask, average_attn_weights=avg)}
    return {name: call}


def make_core_backward(a, dtype):
    d = a.embed_dim // a.heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.rand(a.batch, a.heads, n, d, generator=g).mul_(2).sub_(1).to(dtype).requires_grad_(True)
               for n in (a.seq, a.kv_seq, a.kv_seq))
    mask = causal_mask(a) if a.causal else None
    s = (q @ k.transpose(-2, -1)) * d ** -0.5
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    out = torch.softmax(s, dim=-1) @ v
    d_out = torch.rand(out.shape, generator=g).mul_(2).sub_(1).to(dtype)
    # The graph is kept so only the backward is timed, as `mha bench --core --backward` does.
    impls = {"math backward": lambda: torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)}
    sdpa = functional_sdpa()
    if a.core_impl == "sdpa" and sdpa is not None:
        # Forward and backward of the functional SDPA (torch 2.x: the CPU flash kernel and its
        # backward), timed together: compare with mha's core forward + core backward.
        def fwd_bwd():
            o = sdpa(q, k, v, a.causal)
            return torch.autograd.grad(o, (q, k, v), d_out)
        return {"sdpa fwd+bwd": fwd_bwd}
    return impls


def time_runs(name, fn, repeat):
    fn()  # warm-up
    times = []
    for i in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        print(f"torch {name}: run {i + 1}/{repeat}: {times[-1]:.3f} ms", file=sys.stderr)
    return times


def main():
    a = parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    what = "attention core (SDPA)" if a.core else (
        "nn.MultiheadAttention" if a.anchor == "nn" else "nn.Linear + scaled_dot_product_attention module")
    print(f"torch {torch.__version__}: {what}, B={a.batch} T={a.seq} S={a.kv_seq} E={a.embed_dim} h={a.heads} "
          f"causal={a.causal} dtype={a.dtype} threads={torch.get_num_threads()} "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, warm-up + {a.repeat} runs", file=sys.stderr)
    if a.backward:
        impls = make_core_backward(a, dtype) if a.core else make_module(a, dtype)
        runs = {name: time_runs(name, fn, a.repeat) for name, fn in impls.items()}
    else:
        with torch.inference_mode():
            impls = make_core(a, dtype) if a.core else make_module(a, dtype)
            # With several implementations of the core, PyTorch is credited with its fastest.
            runs = {name: time_runs(name, fn, a.repeat) for name, fn in impls.items()}
    impl, times = min(runs.items(), key=lambda kv: statistics.median(kv[1]))
    med = statistics.median(times)
    f = flops(a)
    result = {
        "target": "core" if a.core else "module", "pass": "backward" if a.backward else "forward", "batch": a.batch, "seq": a.seq, "kv_seq": a.kv_seq,
        "embed_dim": a.embed_dim, "heads": a.heads, "kv_heads": a.kv_heads, "causal": a.causal,
        "dtype": a.dtype, "threads": torch.get_num_threads(), "repeat": a.repeat, "torch": torch.__version__,
        "impl": impl,
        "times_ms": times, "median_ms": med, "flops": f, "gflops": f / (med * 1e6),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
    }
    if a.json:
        print(json.dumps(result))
    else:
        print(f"{what} ({impl}): median {med:.3f} ms, {result['gflops']:.2f} GFLOP/s, peak RSS {result['peak_rss_mb']:.1f} MiB")


if __name__ == "__main__":
    main()
