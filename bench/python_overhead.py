#!/usr/bin/python3
"""Python-call overhead: mha.MultiheadAttention.forward from Python vs `mha bench` (C++), same module.

    PYTHONPATH=build/python /usr/bin/python3 bench/python_overhead.py [--cli build/mha] [--repeat 15]

Module forward, self-attention, B=1, E=512, h=8, no weights, no mask, eval mode, at T = 128, 512
and 4096; inputs (T, B, E) as in `mha bench`. Prints the median of each side and the overhead
(Python median / C++ median − 1). Targets (issue 11): ≤ 5 % at T=512, ≤ 20 % at T=128.
Each side runs every T in a fresh process (--same-process times all T in one Python process:
there, on this machine, T=4096 after the smaller sizes ran markedly slower, an allocator effect
that a long-lived C++ process would see too). A benchmark, not a test: it asserts nothing.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import mha

HERE = os.path.dirname(os.path.abspath(__file__))


def cpp_median_ms(cli: str, T: int, repeat: int, threads: int) -> float:
    cmd = [cli, "bench", "-B", "1", "-T", str(T), "-E", "512", "-H", "8", "--repeat", str(repeat), "--json"]
    if threads:
        cmd += ["--threads", str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(json.loads(r.stdout)["median_ms"])


def py_median_ms(T: int, repeat: int, threads: int) -> float:
    mha.set_num_threads(threads)  # as `mha bench --threads` does (the GEMMs follow the library default)
    m = mha.MultiheadAttention(512, 8).eval()
    x = np.random.default_rng(0).standard_normal((T, 1, 512)).astype(np.float32)
    m(x, x, x, need_weights=False, threads=threads)  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        m(x, x, x, need_weights=False, threads=threads)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cli", default=os.path.join(HERE, "..", "build", "mha"), help="the mha CLI binary")
    ap.add_argument("--repeat", type=int, default=15, help="timed runs per point (median)")
    ap.add_argument("--threads", type=int, default=0, help="threads (0 = library default)")
    ap.add_argument("--seq", type=int, nargs="*", default=[128, 512, 4096])
    ap.add_argument("--same-process", action="store_true",
                    help="time every T in this process (default: a fresh process per T, as `mha bench` runs)")
    ap.add_argument("--py-only", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.py_only:
        print(py_median_ms(a.py_only, a.repeat, a.threads))
        return
    print(f"{'T':>6} {'C++ ms':>10} {'Python ms':>10} {'overhead':>9}")
    for T in a.seq:
        reps = max(3, a.repeat // 3) if T >= 4096 else a.repeat
        # interleave so that machine-load drift hits both sides alike
        c1 = cpp_median_ms(a.cli, T, reps, a.threads)
        if a.same_process:
            p = py_median_ms(T, reps, a.threads)
        else:
            cmd = [sys.executable, os.path.abspath(__file__), "--py-only", str(T), "--repeat", str(reps),
                   "--threads", str(a.threads)]
            p = float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        c2 = cpp_median_ms(a.cli, T, reps, a.threads)
        c = min(c1, c2)
        print(f"{T:>6} {c:>10.3f} {p:>10.3f} {100 * (p / c - 1):>8.1f}%")


if __name__ == "__main__":
    main()
