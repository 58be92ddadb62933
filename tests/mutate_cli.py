#!/usr/bin/python3
"""CLI mutation run (issue 16): mutate the shared conformance cases and run `mha forward` on each.

Every run must either exit 0 having written a valid safetensors file holding a float32 `output`, or
exit 1 with exactly one line on stderr. Anything else (a signal, another exit code, more or fewer
lines, a missing or malformed output, a run over the time limit) fails the test.

usage: mutate_cli.py MHA_CLI CASES_DIR [--count N] [--seed S] [--jobs J] [--timeout SECONDS]
The test suite runs a few hundred mutants; pass e.g. --count 5000 for a long run.
Mutations: bit flips anywhere, bit flips in the header, truncation, and JSON-header edits (huge,
zero and negative extents, huge or zero metadata sizes, flipped flags, bogus offsets and dtypes).
"""
import argparse
import collections
import concurrent.futures
import json
import os
import random
import struct
import subprocess
import sys
import tempfile

HUGE = [2**31, 2**32 + 1, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 0, -1, 200000]


def split(data):
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(header, body):
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def edit_header(rng, data):
    header, body = split(data)
    tensors = [k for k in header if k != "__metadata__"]
    meta = header.setdefault("__metadata__", {})
    kind = rng.randrange(6)
    if kind == 0:  # an extent of one tensor
        t = header[rng.choice(tensors)]
        if t["shape"]:
            t["shape"][rng.randrange(len(t["shape"]))] = rng.choice(HUGE)
        else:
            t["shape"] = [rng.choice(HUGE)]
    elif kind == 1:  # an extent and the offsets to match (as far as 64 bits allow)
        name = rng.choice(tensors)
        t = header[name]
        t["shape"] = [rng.choice(HUGE), 2, 0] if rng.random() < 0.5 else t["shape"] + [rng.choice(HUGE)]
    elif kind == 2:  # a size in the metadata
        key = rng.choice(["embed_dim", "num_heads", "num_kv_heads", "kdim", "vdim", "head_dim", "rope_dims"])
        meta[key] = str(rng.choice(HUGE + [1, 3, 20000]))
    elif kind == 3:  # a flag in the metadata
        key = rng.choice(["need_weights", "average_attn_weights", "is_causal", "bias", "add_bias_kv",
                          "add_zero_attn", "batch_first", "rope"])
        meta[key] = rng.choice(["true", "false", "True", "1", "maybe", "", "half_split"])
    elif kind == 4:  # offsets
        t = header[rng.choice(tensors)]
        t["data_offsets"] = [rng.choice(HUGE), rng.choice(HUGE)]
    else:  # dtype, or a tensor removed / renamed
        name = rng.choice(tensors)
        r = rng.random()
        if r < 0.4:
            header[name]["dtype"] = rng.choice(["BOOL", "U8", "F16", "BF16", "F64", "I64", "F8", ""])
        elif r < 0.7:
            del header[name]
        else:
            header[name + "x"] = header.pop(name)
    return join(header, body)


def mutate(rng, data):
    kind = rng.randrange(4)
    buf = bytearray(data)
    if kind == 0:  # bit flips anywhere
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        return "bitflip", bytes(buf)
    if kind == 1:  # bit flips in the length and the JSON header
        n = min(struct.unpack("<Q", data[:8])[0] + 8, len(buf))
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(n)
            buf[i] ^= 1 << rng.randrange(8)
        return "header-bitflip", bytes(buf)
    if kind == 2:
        return "truncate", bytes(buf[:rng.randrange(len(buf))])
    return "json-edit", edit_header(rng, data)


def valid_output(path):
    """A float32 safetensors file with an `output` tensor whose sizes add up."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        header, body = split(data)
        info = header["output"]
        if info["dtype"] != "F32":
            return False
        for name, t in header.items():
            if name == "__metadata__":
                continue
            n = 4
            for s in t["shape"]:
                n *= s
            b, e = t["data_offsets"]
            if e - b != n or e > len(body):
                return False
        return True
    except Exception:  # noqa: BLE001 — any failure to parse means not valid
        return False


def run_one(cli, workdir, index, kind, data, timeout):
    case = os.path.join(workdir, f"m{index}.safetensors")
    out = os.path.join(workdir, f"o{index}.safetensors")
    with open(case, "wb") as f:
        f.write(data)
    try:
        r = subprocess.run([cli, "forward", "--weights", case, "--inputs", case, "--output", out],
                           capture_output=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    except subprocess.TimeoutExpired:
        return index, kind, "timeout", ""
    err = r.stderr.decode(errors="replace")
    if r.returncode == 0:
        outcome = "exit 0" if valid_output(out) else "exit 0, invalid output"
    elif r.returncode == 1:
        outcome = "exit 1" if err.count("\n") == 1 and err.strip() else "exit 1, not one line"
    elif r.returncode < 0:
        outcome = f"signal {-r.returncode}"
    else:
        outcome = f"exit {r.returncode}"
    for p in (case, out):
        if os.path.exists(p):
            os.remove(p)
    return index, kind, outcome, err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cli")
    ap.add_argument("cases")
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60)
    args = ap.parse_args()

    cases = sorted(os.path.join(args.cases, f) for f in os.listdir(args.cases) if f.endswith(".safetensors"))
    if not cases:
        print(f"mutate_cli: no cases in {args.cases}", file=sys.stderr)
        return 1
    originals = {c: open(c, "rb").read() for c in cases}
    rng = random.Random(args.seed)
    mutants = []
    for i in range(args.count):
        kind, data = mutate(rng, originals[cases[i % len(cases)]])
        mutants.append((i, kind, data))

    histogram = collections.Counter()
    by_kind = collections.Counter()
    failures = []
    with tempfile.TemporaryDirectory() as workdir, \
            concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_one, args.cli, workdir, i, k, d, args.timeout) for i, k, d in mutants]
        for fut in concurrent.futures.as_completed(futures):
            index, kind, outcome, err = fut.result()
            histogram[outcome] += 1
            by_kind[(kind, outcome)] += 1
            if outcome not in ("exit 0", "exit 1"):
                failures.append((index, kind, outcome, err))
                with open(f"mutant-{index}.safetensors", "wb") as f:
                    f.write(mutants[index][2])

    print(f"mutate_cli: {args.count} mutants of {len(cases)} cases (seed {args.seed})")
    for outcome, n in sorted(histogram.items()):
        print(f"  {outcome}: {n}")
    for (kind, outcome), n in sorted(by_kind.items()):
        print(f"    {kind:15s} {outcome}: {n}")
    for index, kind, outcome, err in sorted(failures)[:20]:
        print(f"FAIL mutant {index} ({kind}): {outcome}; kept as mutant-{index}.safetensors; stderr: {err[-400:]!r}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
