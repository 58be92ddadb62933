#!/usr/bin/python3
"""mha.torch's per-call cost against the numpy module and the C++ module, on the same shapes.

    PYTHONPATH=build/python /usr/bin/python3 bench/torch_overhead.py [--threads 1] [--rounds 5]
        [--shapes 64x128 1x4096 8x1024] [--json]

Self-attention, E=512, h=8, (T, B, E) inputs, no mask, no weights; threads set for both libraries
(torch.set_num_threads and mha.set_num_threads). Per shape it times, alternating in rounds so that
a neighbour's load drifting over the run hits every side alike:

* ``cpp``: the C++ MultiheadAttention::forward (eval), timed inside the library
  (mha._core._time_cpp_forward: no Python in the loop);
* ``np``: the numpy module's forward (eval, need_weights=False);
* ``torch``: mha.torch.MultiheadAttention's forward under torch.no_grad() (eval);
* ``np_step``: the numpy module's training step, ``gradients()`` (forward_train + backward);
* ``torch_step``: mha.torch's training step: forward with grad, ``out.backward(d)`` (the
  parameters require grad, the input does not; mha's backward computes every gradient either way).

Each prints its median milliseconds and its minor page faults per call (getrusage: a call that
maps fresh memory for its working buffers faults on every page it touches). The overheads are
torch/np − 1 for the forward and torch_step/np_step − 1 for the step (medians of per-round ratios).
A benchmark, not a test: it asserts nothing.
"""
import argparse
import json
import resource
import statistics
import time

import numpy as np
import torch

import mha
import mha.torch as mt
from mha import _core

E, H = 512, 8


def timed(call, repeat):
    """(milliseconds of each call, minor page faults per call)."""
    ms = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per shape (default 5)")
    ap.add_argument("--shapes", nargs="*", default=["64x128", "1x4096", "8x1024"], help="BxT")
    ap.add_argument("--sides", nargs="*", default=["cpp", "np", "torch", "np_step", "torch_step"])
    ap.add_argument("--json", action="store_true", help="one JSON object per shape")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    mha.set_num_threads(a.threads)
    for shape in a.shapes:
        B, T = (int(v) for v in shape.split("x"))
        per_round = 1 if B * T >= 4096 else 3
        torch.manual_seed(0)
        tm = mt.MultiheadAttention(E, H)
        nm = mha.MultiheadAttention(E, H)
        nm.load_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()})
        x = np.random.default_rng(0).standard_normal((T, B, E)).astype(np.float32)
        d = np.random.default_rng(1).standard_normal((T, B, E)).astype(np.float32)
        xt, dt = torch.from_numpy(x), torch.from_numpy(d)

        def torch_forward():
            with torch.no_grad():
                tm.eval()(xt, xt, xt, need_weights=False)

        def torch_step():
            # Gradients for the parameters only (accumulated into .grad in place after the first
            # step), so that torch allocates no input-sized gradient sums of its own in the timing.
            tm.train()(xt, xt, xt, need_weights=False)[0].backward(dt)

        sides = {
            "cpp": lambda k: (_core._time_cpp_forward(nm.eval()._m, x, k, 0), None),
            "np": lambda k: timed(lambda: nm.eval()(x, x, x, need_weights=False), k),
            "torch": lambda k: timed(torch_forward, k),
            "np_step": lambda k: timed(lambda: nm.train().gradients(x, x, x, d), k),
            "torch_step": lambda k: timed(torch_step, k),
        }
        sides = {n: sides[n] for n in a.sides}
        for run in sides.values():  # warm-up: every side's buffers and caches once
            run(1)
        ms = {n: [] for n in sides}
        faults = {n: [] for n in sides}
        rounds = []
        for r in range(a.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            got = {}
            for n in order:
                t, f = sides[n](per_round)
                ms[n] += t
                got[n] = statistics.median(t)
                if f is not None:
                    faults[n].append(f)
            rounds.append(got)
        row = {"B": B, "T": T, "threads": a.threads, "torch_version": torch.__version__}
        for n in sides:
            row[n + "_ms"] = statistics.median(ms[n])
            if faults[n]:
                row[n + "_faults"] = statistics.median(faults[n])
        for num, den in (("torch", "np"), ("torch_step", "np_step"), ("np", "cpp")):
            if num in sides and den in sides:
                row[f"{num}/{den}-1 %"] = 100 * (statistics.median(g[num] / g[den] for g in rounds) - 1)
        if a.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"B={B} T={T} threads={a.threads}: " + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                if k not in ("B", "T", "threads", "torch_version")), flush=True)


if __name__ == "__main__":
    main()
