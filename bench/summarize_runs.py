#!/usr/bin/env python3
"""Summarise JSON-lines runs of `mha bench --json` (bench/short_seqs.sh's output, or any file whose
lines carry the bench's keys plus `args` and `bin`): per configuration and build, the median time
over rounds, the median fraction of the same run's FMA peak, the lowest threads' busy balance, and
the ratio of the first build's median time to each other build's (above 1: that build is faster).

  bench/short_seqs.sh BEFORE_MHA AFTER_MHA 3 > runs.jsonl
  /usr/bin/python3 bench/summarize_runs.py runs.jsonl [--json]
"""
import argparse
import json
import statistics
import sys


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", help="a JSON-lines file (one bench run a line, with `args` and `bin`)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    a = p.parse_args()
    groups = {}  # (args, bin) -> runs, in first-seen order
    bad = 0
    try:
        f = open(a.runs)
    except OSError as e:
        sys.exit(f"summarize_runs: cannot read {a.runs}: {e.strerror}")
    with f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if "median_ms" not in r:
                bad += 1
                continue
            groups.setdefault((r.get("args", ""), r.get("bin", "")), []).append(r)
    if not groups:
        sys.exit(f"summarize_runs: no bench runs in {a.runs}")
    configs = list(dict.fromkeys(k[0] for k in groups))
    bins = list(dict.fromkeys(k[1] for k in groups))
    rows = []
    for cfg in configs:
        row = {"args": cfg, "builds": {}}
        for b in bins:
            rs = groups.get((cfg, b))
            if not rs:
                continue
            row["builds"][b] = {
                "rounds": len(rs),
                "median_ms": statistics.median(r["median_ms"] for r in rs),
                "fraction_of_peak": statistics.median(r.get("fraction_of_peak", 0.0) for r in rs),
                "min_busy_balance": min(r.get("busy_balance", 1.0) for r in rs),
            }
        first = row["builds"].get(bins[0])
        for b, s in row["builds"].items():
            s["first_over_this"] = first["median_ms"] / s["median_ms"] if first and s["median_ms"] > 0 else None
        rows.append(row)
    if a.json:
        json.dump({"file": a.runs, "builds": bins, "unreadable_lines": bad, "rows": rows}, sys.stdout, indent=1)
        print()
        return
    print(f"{a.runs}: medians over rounds; ratio = {bins[0]} ms / build ms (above 1: that build is faster)")
    for row in rows:
        print(row["args"])
        for b, s in row["builds"].items():
            ratio = f"{s['first_over_this']:.3f}" if s["first_over_this"] is not None else "-"
            print(f"  {b:10s} {s['median_ms']:10.2f} ms  {s['fraction_of_peak']:.3f} of peak  "
                  f"balance ≥ {s['min_busy_balance']:.2f}  ratio {ratio}  ({s['rounds']} rounds)")
    if bad:
        print(f"({bad} unreadable lines skipped)")


if __name__ == "__main__":
    main()
