#!/usr/bin/python3
"""The attention core's rows of issue 17, interleaved in one run: mha (and optionally an older mha
build) beside PyTorch 2.x's F.scaled_dot_product_attention (../shared/tools/torch2, OpenBLAS for
OpenMP, torch.set_num_threads), at 1 and 2 threads.

Rows: T=4096 at d=64 and d=128, causal, bf16 at d=64 and d=128 (against mha's own float32 and
PyTorch's bf16 SDPA: on AMD Zen 4/5 PyTorch's CPU bf16 path is 30-50x slower than its float32, on
an Intel Xeon with AMX it runs its products on the tiles through oneDNN and is a real anchor), and
batches of short sequences (B=64, T=128/256/512, causal and not: mha's fraction of peak and its
threads' busy balance).

Every mha run measures the FMA peak of the dispatched target before and after the timed runs;
rounds whose peak fell below --min-peak-ratio of that are dropped (a neighbour took the machine).
Medians over the kept rounds; ratios are anchor time / mha time (above 1: mha is faster).

usage: /usr/bin/python3 bench/core_suite.py [--rounds 3] [--base OLD_MHA] [--rows d64,short] [--no-torch-rows bf16]
       [--out bench/results/core_suite.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
E = ["--embed-dim", "512"]

# (label, mha bench args, pytorch_mha.py args or None)
ROWS = [
    ("d64 T=4096", ["--core", "--seq", "4096", "--heads", "8"] + E, ["--core", "--seq", "4096", "--heads", "8"] + E),
    ("d128 T=4096", ["--core", "--seq", "4096", "--heads", "4"] + E, ["--core", "--seq", "4096", "--heads", "4"] + E),
    ("causal d64 T=4096", ["--core", "--causal", "--seq", "4096", "--heads", "8"] + E,
     ["--core", "--causal", "--seq", "4096", "--heads", "8"] + E),
    ("bf16 d64 T=4096", ["--core", "--dtype", "bf16", "--seq", "4096", "--heads", "8"] + E,
     ["--core", "--dtype", "bf16", "--seq", "4096", "--heads", "8"] + E),
    ("bf16 d128 T=4096", ["--core", "--dtype", "bf16", "--seq", "4096", "--heads", "4"] + E,
     ["--core", "--dtype", "bf16", "--seq", "4096", "--heads", "4"] + E),
]
for t in (128, 256, 512):
    for causal in ([], ["--causal"]):
        label = f"short B=64 T={t}{' causal' if causal else ''}"
        ROWS.append((label, ["--core", "--batch", "64", "--seq", str(t), "--heads", "8"] + causal + E, None))


def run_json(cmd):
    try:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
                             timeout=900).stdout
        return json.loads(out.strip().splitlines()[-1])
    except Exception as e:  # a failed run is reported, never fatal: this is a benchmark
        return {"error": f"{' '.join(cmd[:3])}…: {e}"}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--mha", default=os.path.join(ROOT, "build", "mha"))
    p.add_argument("--base", help="an older mha binary to interleave with (before/after)")
    p.add_argument("--torch2", default=os.path.join(ROOT, "..", "shared", "tools", "torch2"))
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    p.add_argument("--rows", type=lambda s: s.split(","), help="only rows whose label contains one of these")
    p.add_argument("--no-torch-rows", type=lambda s: s.split(","), default=[],
                   help="no PyTorch run for rows whose label contains one of these (e.g. bf16 on a CPU without "
                   "AMX, where PyTorch's bf16 SDPA takes seconds a run)")
    p.add_argument("--min-peak-ratio", type=float, default=0.85)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "core_suite.json"))
    a = p.parse_args()
    rows = [r for r in ROWS if not a.rows or any(k in r[0] for k in a.rows)]
    bins = [("mha", a.mha)] + ([("base", a.base)] if a.base else [])
    torch_ok = not a.no_torch and os.access(a.torch2, os.X_OK)
    runs = []  # every run's JSON with who/row/threads/round added
    for rnd in range(a.rounds):
        for th in a.threads:
            for label, margs, targs in rows:
                for who, binary in bins:
                    r = run_json([binary, "bench"] + margs + ["--threads", str(th), "-r", str(a.repeat), "--json"])
                    runs.append(dict(r, who=who, row=label, threads=th, round=rnd))
                if targs and torch_ok and not any(k in label for k in a.no_torch_rows):
                    r = run_json([a.torch2, os.path.relpath(os.path.join(HERE, "pytorch_mha.py"), ROOT)] + targs +
                                 ["--core-impl", "sdpa", "--threads", str(th), "--repeat", str(a.repeat), "--json"])
                    runs.append(dict(r, who="torch2", row=label, threads=th, round=rnd))
        print(f"core_suite: round {rnd + 1}/{a.rounds} done", file=sys.stderr)

    def kept(who, label, th):
        rs = [r for r in runs if r["who"] == who and r["row"] == label and r["threads"] == th and "error" not in r]
        if who != "torch2":
            rs = [r for r in rs if r.get("peak_ratio_after_before", 1.0) >= a.min_peak_ratio]
        return rs

    table = []
    print(f"\ncore_suite: medians of {a.rounds} interleaved rounds (mha rounds whose FMA peak fell below "
          f"{a.min_peak_ratio} of its start dropped); ratio = anchor ms / mha ms")
    hdr = f"{'row':26s} {'thr':>3s} {'mha ms':>9s} {'of peak':>8s} {'balance':>8s}"
    hdr += f" {'base ms':>9s} {'base/mha':>8s}" if a.base else ""
    hdr += f" {'torch2 ms':>10s} {'torch2/mha':>10s}" if torch_ok else ""
    print(hdr)
    f32_ms = {}
    for label, _, _ in rows:
        for th in a.threads:
            m = kept("mha", label, th)
            if not m:
                print(f"{label:26s} {th:3d}  no kept run")
                continue
            ms = statistics.median(r["median_ms"] for r in m)
            frac = statistics.median(r["fraction_of_peak"] for r in m if "fraction_of_peak" in r)
            bal = [r["busy_balance"] for r in m if "busy_balance" in r]
            entry = {"row": label, "threads": th, "mha_ms": ms, "fraction_of_peak": frac, "rounds_kept": len(m),
                     "mha_rounds_ms": [r["median_ms"] for r in m]}
            line = f"{label:26s} {th:3d} {ms:9.1f} {frac:8.2f} {statistics.median(bal) if bal else float('nan'):8.2f}"
            if bal:
                entry["busy_balance"] = statistics.median(bal)
            if a.base:
                b = kept("base", label, th)
                bms = statistics.median(r["median_ms"] for r in b) if b else float("nan")
                entry["base_ms"] = bms
                line += f" {bms:9.1f} {bms / ms:8.2f}"
            if torch_ok:
                t = kept("torch2", label, th)
                if t:
                    tms = statistics.median(r["median_ms"] for r in t)
                    entry["torch2_ms"] = tms
                    line += f" {tms:10.1f} {tms / ms:10.2f}"
            if label.startswith("d"):  # the float32 row a bf16 row of the same head dim is compared with
                f32_ms[(label, th)] = ms
            f32_key = (label[len("bf16 "):], th)
            if label.startswith("bf16") and f32_key in f32_ms:
                entry["speedup_over_f32"] = f32_ms[f32_key] / ms
                line += f"  ({f32_ms[f32_key] / ms:.2f}x mha f32)"
            print(line)
            table.append(entry)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("cpu family")), "?")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"cpu_family": cpu, "rounds": a.rounds, "rows": table, "runs": runs}, f, indent=1)
    print(f"wrote {os.path.relpath(a.out, ROOT)}")


if __name__ == "__main__":
    main()
