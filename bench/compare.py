#!/usr/bin/python3
"""mha against PyTorch, in one run: `mha bench --json` and bench/pytorch_mha.py alternately.

Modes (default forward; `all` runs every mode but gemm):
  forward  module forward over T, mha vs nn.MultiheadAttention; table, results/forward.json and
           results/forward_gflops.png (GFLOP/s against T, log2 axis)
  core     the attention core over T, mha's sdpa vs PyTorch's; results/core.json, core_gflops.png
  causal   causal vs non-causal (attention core unless --target module), default T=4096
  bf16     bfloat16 vs float32 attention core, default T=4096
  threads  1 vs 2 threads (module forward unless --target core), default T=4096
  memory   peak RSS of the module forward at T=16384 against the tensors it must hold + 64 MiB
  backward the attention core's backward (vs sgemm and PyTorch's autograd of softmax(QKᵀ)V) and the
           module's forward + backward vs nn.MultiheadAttention under autograd, default T=4096
  gemm     bench/gemm_compare (OpenBLAS vs BLIS vs oneDNN), when it is built
  anchors  issue 15's table: mha against two PyTorch anchors — nn.MultiheadAttention and the module a
           PyTorch user writes for speed (nn.Linear + scaled_dot_product_attention) — under PyTorch
           2.x (../shared/tools/torch2, Debian 13) and Debian 12's 1.13 (OpenBLAS for OpenMP), at 1
           and 2 threads, for the module forward (B=1, T=4096), the forward with attention weights
           (T=2048), batches (B=64, T=128), training (module forward + backward, T=4096) and the
           attention core's forward + backward (T=4096); --rounds interleaved rounds, medians;
           results/anchors.json

Defaults are the issue's: B=1, E=512, h=8, 2 threads, float32. The ratio column is torch ms /
mha ms (above 1: mha is faster). PyTorch runs with OMP_WAIT_POLICY=passive (see pytorch_mha.py).

  /usr/bin/python3 bench/compare.py [mode] [--seqs 128,256,512] [--repeat 3] [--mha build-bench/mha]
"""
import argparse
import glob
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
MODES = ["forward", "core", "causal", "bf16", "threads", "memory", "backward", "gemm", "anchors"]
DEFAULT_SEQS = {"forward": [128, 256, 512, 1024, 2048, 4096, 8192, 16384],
                "core": [128, 256, 512, 1024, 2048, 4096, 8192, 16384],
                "causal": [4096], "bf16": [4096], "threads": [4096], "memory": [16384], "backward": [4096]}
DEFAULT_TARGET = {"forward": "module", "core": "core", "causal": "core", "bf16": "core", "threads": "module",
                  "memory": "module"}
MEMORY_SLACK_MB = 64.0


def find_mha():
    candidates = [p for p in glob.glob(os.path.join(ROOT, "build*", "mha")) if os.access(p, os.X_OK)]
    if not candidates:
        sys.exit("compare.py: no build*/mha found; build mha_cli or pass --mha PATH")
    return max(candidates, key=os.path.getmtime)


def run_json(cmd, env=None):
    """Runs a benchmark that prints one JSON object on stdout (progress passes through on stderr)."""
    print("+ " + " ".join(cmd), file=sys.stderr)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sys.stderr.write(p.stderr)
    if p.returncode != 0:
        lines = p.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {p.returncode}"}
    return json.loads(p.stdout)


def shape_args(a, seq, target, causal=False, dtype="f32", threads=None, backward=False):
    args = ["--batch", str(a.batch), "--seq", str(seq), "--embed-dim", str(a.embed_dim), "--heads", str(a.heads),
            "--threads", str(threads or a.threads), "--repeat", str(a.repeat), "--dtype", dtype, "--json"]
    if backward:
        args.append("--backward")
    if target == "core":
        args.append("--core")
    if causal:
        args.append("--causal")
    return args


def mha(a, seq, target, **kw):
    return run_json([a.mha, "bench"] + shape_args(a, seq, target, **kw))


def torch(a, seq, target, **kw):
    if a.no_torch:
        return {"error": "skipped (--no-torch)"}
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    return run_json(["/usr/bin/python3", os.path.join(HERE, "pytorch_mha.py")] + shape_args(a, seq, target, **kw),
                    env=env)


def num(r, key, fmt="{:.2f}"):
    return fmt.format(r[key]) if key in r else "n/a"


def ratio(num_, den):
    return num_ / den if num_ and den else None


def fmt_ratio(x):
    return f"{x:.2f}x" if x else "n/a"


def print_table(header, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
    sys.stdout.flush()


def save(name, payload):
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, name + ".json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {os.path.relpath(path, ROOT)}")


def matplotlib_pyplot():
    """matplotlib, installed through apt if missing (only for the plot); None if unavailable."""
    try:
        import matplotlib
    except ImportError:
        print("compare.py: installing python3-matplotlib for the plot", file=sys.stderr)
        subprocess.run(["apt-get", "install", "-y", "python3-matplotlib"], stdout=subprocess.DEVNULL)
        try:
            import matplotlib
        except ImportError:
            print("compare.py: matplotlib unavailable; no plot", file=sys.stderr)
            return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(name, title, rows):
    plt = matplotlib_pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (("mha", "mha"), ("torch", "PyTorch 1.13")):
        pts = [(r["seq"], r[key]["gflops"]) for r in rows if "gflops" in r[key]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    sg = [(r["seq"], r["mha"]["sgemm_gflops"]) for r in rows if "sgemm_gflops" in r["mha"]]
    if sg:
        ax.plot(*zip(*sg), linestyle="--", color="gray", label="sgemm (same run)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    path = os.path.join(RESULTS, name + "_gflops.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {os.path.relpath(path, ROOT)}")


def config(a, mode, target):
    return {"mode": mode, "target": target, "batch": a.batch, "embed_dim": a.embed_dim, "heads": a.heads,
            "threads": a.threads, "repeat": a.repeat, "mha": a.mha}


def sweep(a, mode, target=None, backward=False):
    """forward / core (/ backward): mha and PyTorch alternately over T."""
    target = target or a.target or DEFAULT_TARGET[mode]
    rows, table = [], []
    for seq in a.seqs or DEFAULT_SEQS[mode]:
        m = mha(a, seq, target, backward=backward)
        t = torch(a, seq, target, backward=backward)
        r = ratio(t.get("median_ms"), m.get("median_ms"))
        rows.append({"seq": seq, "mha": m, "torch": t, "ratio": r})
        table.append([seq, num(m, "median_ms", "{:.3f}"), num(m, "gflops"), num(t, "median_ms", "{:.3f}"),
                      num(t, "gflops"), fmt_ratio(r), num(m, "sgemm_gflops", "{:.1f}"),
                      num(m, "fraction_of_sgemm", "{:.3f}")])
    what = ("module forward" if target == "module" else "attention core") + (
        " + backward" if backward and target == "module" else " backward" if backward else "")
    print(f"\n{what}: B={a.batch} E={a.embed_dim} h={a.heads} threads={a.threads} float32, median of "
          f"{a.repeat}; ratio = torch ms / mha ms; dispatch: {rows[0]['mha'].get('dispatch', 'n/a')}")
    print_table(["T", "mha ms", "mha GFLOP/s", "torch ms", "torch GFLOP/s", "ratio", "sgemm GFLOP/s", "fraction"],
                table)
    save(mode if not backward else f"backward_{target}", {"config": config(a, mode, target), "rows": rows})
    if not a.no_plot and not backward:
        plot(mode, f"{what}, B={a.batch} E={a.embed_dim} h={a.heads}, {a.threads} threads, float32", rows)


def pairs(a, mode, variants, label, target_ratio):
    """causal / bf16 / threads: the same shape two ways, for mha and PyTorch; speed-up of the second."""
    target = a.target or DEFAULT_TARGET[mode]
    rows, table = [], []
    for seq in a.seqs or DEFAULT_SEQS[mode]:
        row = {"seq": seq}
        for who, fn in (("mha", mha), ("torch", torch)):
            base, other = (fn(a, seq, target, **kw) for kw in variants)
            speedup = ratio(other.get("gflops") if mode == "bf16" else base.get("median_ms"),
                            base.get("gflops") if mode == "bf16" else other.get("median_ms"))
            row[who] = {"base": base, "other": other, "speedup": speedup}
            table.append([seq, who, num(base, "median_ms", "{:.3f}"), num(other, "median_ms", "{:.3f}"),
                          num(base, "gflops"), num(other, "gflops"), fmt_ratio(speedup),
                          other.get("error", base.get("error", ""))])
        rows.append(row)
    print(f"\n{mode} ({target}): B={a.batch} E={a.embed_dim} h={a.heads}; speed-up = {label} "
          f"(target for mha: ≥ {target_ratio}x)")
    print_table(["T", "who", "base ms", "other ms", "base GFLOP/s", "other GFLOP/s", "speed-up", "note"], table)
    save(mode, {"config": config(a, mode, target), "variants": variants, "rows": rows})


def memory(a):
    target = a.target or DEFAULT_TARGET["memory"]
    rows, table = [], []
    for seq in a.seqs or DEFAULT_SEQS["memory"]:
        saved = a.repeat
        a.repeat = 1  # memory does not need a median
        m = mha(a, seq, target)
        t = torch(a, seq, target)
        a.repeat = saved
        limit = m["expected_tensor_mb"] + MEMORY_SLACK_MB if "expected_tensor_mb" in m else None
        ok = limit is not None and m["peak_rss_mb"] <= limit
        rows.append({"seq": seq, "mha": m, "torch": t, "limit_mb": limit, "within": ok})
        table.append([seq, num(m, "expected_tensor_mb", "{:.1f}"), f"{limit:.1f}" if limit else "n/a",
                      num(m, "peak_rss_mb", "{:.1f}"), "yes" if ok else "NO", num(t, "peak_rss_mb", "{:.1f}")])
    print(f"\nmemory ({target}): peak RSS vs the tensors it must hold + {MEMORY_SLACK_MB:.0f} MiB")
    print_table(["T", "tensors MiB", "limit MiB", "mha peak MiB", "within", "torch peak MiB"], table)
    save("memory", {"config": config(a, "memory", target), "rows": rows})


def gemm(a):
    exe = os.path.join(os.path.dirname(a.mha), "bench", "gemm_compare")
    if not os.access(exe, os.X_OK):
        print(f"\ngemm: {exe} is not built (needs libblis-dev and libdnnl-dev)")
        return
    out = subprocess.run([exe] + (["--quick"] if a.quick_gemm else []), stdout=subprocess.PIPE, text=True).stdout
    print("\n" + out, end="")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "gemm.txt"), "w") as f:
        f.write(out)
    print("wrote bench/results/gemm.txt")


# anchors: (label, mha bench arguments, PyTorch arguments per anchor, anchors)
ANCHOR_ROWS = [
    ("module B=1 T=4096", ["--batch", "1", "--seq", "4096"], [], ["nn", "sdpa"]),
    ("module + weights T=2048", ["--batch", "1", "--seq", "2048", "--need-weights", "averaged"],
     ["--need-weights", "averaged"], ["nn"]),
    ("module B=64 T=128", ["--batch", "64", "--seq", "128"], [], ["nn", "sdpa"]),
    ("training: module fwd+bwd T=4096", ["--batch", "1", "--seq", "4096", "--backward"], ["--backward"], ["nn", "sdpa"]),
    ("training: core fwd+bwd T=4096", ["--batch", "1", "--seq", "4096", "--core"],
     ["--core", "--backward", "--core-impl", "sdpa"], ["core"]),
]


def torch_runners(a):
    """{version label: command prefix and environment} for the PyTorch builds available."""
    script = os.path.join(HERE, "pytorch_mha.py")
    env13 = {k: v for k, v in os.environ.items() if not k.startswith("OPENBLAS_")}  # the CPU's own kernels
    env13["OMP_WAIT_POLICY"] = "passive"
    runners = {}
    if "2" in a.versions:
        if os.access(a.torch2, os.X_OK):
            runners["torch 2.x"] = ([a.torch2, os.path.relpath(script, ROOT)],
                                    dict(os.environ, OMP_WAIT_POLICY="passive"))
        else:
            print(f"compare.py: {a.torch2} not found: no PyTorch 2.x column", file=sys.stderr)
    if "1.13" in a.versions:
        runners["torch 1.13"] = (["/usr/bin/python3", script], env13)
        blas = subprocess.run(["update-alternatives", "--query", "libblas.so.3-x86_64-linux-gnu"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
        if "openblas-openmp" not in blas:
            print("compare.py: warning: Debian 12's torch 1.13 is not on OpenBLAS for OpenMP "
                  "(apt-get install libopenblas0-openmp); its figures will be far from its best", file=sys.stderr)
    return runners


def anchors(a):
    import statistics
    runners = {} if a.no_torch else torch_runners(a)
    rows = [r for r in ANCHOR_ROWS if not a.rows or any(k in r[0] for k in a.rows)]
    cells = {}  # (row, threads, who) -> [median per round]
    fracs = {}  # (row, threads) -> mha's fraction of the same-run peak, per round
    failed = {}  # (row, threads, who) -> the error of a failed run

    def add(key, r):
        if "median_ms" in r:
            cells.setdefault(key, []).append(r["median_ms"])
        elif "error" in r:
            cells.setdefault(key, [])
            failed.setdefault(key, r["error"])

    common = ["--embed-dim", str(a.embed_dim), "--heads", str(a.heads), "--repeat", str(a.repeat), "--json"]
    for rnd in range(a.rounds):
        for threads in a.thread_counts:
            for label, mha_args, torch_args, kinds in rows:
                t = ["--threads", str(threads)]
                m = run_json([a.mha, "bench"] + mha_args + common + t)
                if label.startswith("training: core"):  # mha: core forward + core backward, summed
                    mb = run_json([a.mha, "bench"] + mha_args + ["--backward"] + common + t)
                    if "median_ms" in m and "median_ms" in mb:
                        # The pair's fraction of the peak: each run's FLOPs over their summed time,
                        # i.e. the two fractions weighted by time (each against its own same-run peak).
                        tf, tb = m["median_ms"], mb["median_ms"]
                        ff, fb = m.get("fraction_of_peak"), mb.get("fraction_of_peak")
                        both = None if ff is None or fb is None else (ff * tf + fb * tb) / (tf + tb)
                        m = dict(m, median_ms=tf + tb, fraction_of_peak=both, backward=mb)
                    else:
                        m = {"error": m.get("error") or mb.get("error")}
                add((label, threads, "mha"), m)
                if isinstance(m.get("fraction_of_peak"), (int, float)):
                    fracs.setdefault((label, threads), []).append(m["fraction_of_peak"])
                for version, (prefix, env) in runners.items():
                    for kind in kinds:
                        anchor = [] if kind == "core" else ["--anchor", kind]
                        shape = [x for x in mha_args if x not in ("--core", "--backward", "--need-weights", "averaged")]
                        r = run_json(prefix + shape + torch_args + anchor + common + t, env=env)
                        add((label, threads, f"{version} {kind}"), r)
        print(f"anchors: round {rnd + 1}/{a.rounds} done", file=sys.stderr)

    who = ["mha"] + [f"{v} {k}" for v in runners for k in ("nn", "sdpa", "core")]
    who = [w for w in who if any(key[2] == w for key in cells)]
    med = {k: statistics.median(v) for k, v in cells.items() if v}
    table, out = [], []
    for label, _, _, _ in rows:
        for threads in a.thread_counts:
            m = med.get((label, threads, "mha"))
            line = [label, threads, f"{m:.1f}" if m else "n/a"]
            # The median over rounds, as for the times (a round whose peak a neighbour took reads
            # low; one run's value would be whichever round came last).
            frac = statistics.median(fracs[(label, threads)]) if fracs.get((label, threads)) else None
            line.append(f"{frac:.2f}" if isinstance(frac, (int, float)) else "n/a")
            entry = {"row": label, "threads": threads, "mha_ms": m, "fraction_of_peak": frac, "anchors": {}}
            for w in who[1:]:
                t_ms = med.get((label, threads, w))
                r = ratio(t_ms, m)
                line.append(f"{t_ms:.1f} ({fmt_ratio(r)})" if t_ms else "—")
                if t_ms:
                    entry["anchors"][w] = {"ms": t_ms, "ratio": r}
            entry["rounds"] = {w: cells.get((label, threads, w), []) for w in who}
            entry["rounds_fraction_of_peak"] = fracs.get((label, threads), [])
            table.append(line)
            out.append(entry)
    print(f"\nanchors: E={a.embed_dim} h={a.heads} float32; medians of {a.rounds} interleaved rounds of "
          f"{a.repeat} runs; in brackets: anchor ms / mha ms (above 1: mha is faster)")
    print_table(["path", "thr", "mha ms", "mha frac. of peak"] + [f"{w} ms" for w in who[1:]], table)
    errors = {" / ".join(map(str, k)): v for k, v in failed.items()}
    for k, v in errors.items():
        print(f"  error: {k}: {v}")
    save("anchors", {"config": config(a, "anchors", "mixed"), "rows": out, "errors": errors})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="forward", choices=MODES + ["all"])
    p.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], help="comma-separated T values")
    p.add_argument("--max-seq", type=int, default=0, help="drop T values above this")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--target", choices=["module", "core"], help="override the mode's default")
    p.add_argument("--mha", default=None, help="path of the mha binary (default: newest build*/mha)")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quick-gemm", action="store_true")
    p.add_argument("--rounds", type=int, default=3, help="anchors: interleaved rounds (medians over them)")
    p.add_argument("--thread-counts", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2],
                   help="anchors: thread counts (default 1,2)")
    p.add_argument("--versions", type=lambda s: s.split(","), default=["2", "1.13"],
                   help="anchors: PyTorch builds to run: 2 (../shared/tools/torch2) and/or 1.13 (Debian 12's)")
    p.add_argument("--rows", type=lambda s: s.split(","), help="anchors: only rows whose label contains one of these")
    p.add_argument("--torch2", default=os.path.join(ROOT, "..", "shared", "tools", "torch2"),
                   help="anchors: the PyTorch 2.x runner (default ../shared/tools/torch2)")
    a = p.parse_args()
    a.mha = os.path.abspath(a.mha) if a.mha else find_mha()
    if a.max_seq:
        for k in DEFAULT_SEQS:
            DEFAULT_SEQS[k] = [t for t in DEFAULT_SEQS[k] if t <= a.max_seq] or [a.max_seq]
        if a.seqs:
            a.seqs = [t for t in a.seqs if t <= a.max_seq]
    modes = [m for m in MODES if m not in ("gemm", "anchors")] if a.mode == "all" else [a.mode]
    for mode in modes:
        if mode in ("forward", "core"):
            sweep(a, mode)
        elif mode == "causal":
            pairs(a, mode, [{}, {"causal": True}], "non-causal ms / causal ms", 1.8)
        elif mode == "bf16":
            pairs(a, mode, [{}, {"dtype": "bf16"}], "bf16 GFLOP/s / f32 GFLOP/s", 1.7)
        elif mode == "threads":
            pairs(a, mode, [{"threads": 1}, {"threads": 2}], "1-thread ms / 2-thread ms", 1.85)
        elif mode == "memory":
            memory(a)
        elif mode == "backward":  # the core's backward vs sgemm, and the module's training step vs autograd
            for target in ([a.target] if a.target else ["core", "module"]):
                sweep(a, mode, target=target, backward=True)
        elif mode == "anchors":
            anchors(a)
        else:
            gemm(a)


if __name__ == "__main__":
    main()
