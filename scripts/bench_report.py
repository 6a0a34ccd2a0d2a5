#!/usr/bin/env python3
"""Markdown tables from the benchmarks' JSON lines (DSV4_BENCH_OUT): one table per kernel, each
row with our time, TFLOPS, effective TB/s, the roofline (bytes / 4.3 TB/s or FLOPs at the
measured tensor rates) and the peer measured in the same run. Ratios are what to read: the
fraction of the roofline, and peer time / our time (> 1: we are faster).

Usage: scripts/bench_report.py results.jsonl [--kernel SUBSTR ...] > results.md
"""
import argparse
import collections
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl")
    ap.add_argument("--kernel", action="append", default=[], help="only kernels containing this")
    args = ap.parse_args()
    rows = []
    with open(args.jsonl) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    if not rows:
        print(f"{args.jsonl}: no results", file=sys.stderr)
        return 1
    meta = {(r.get("gpu"), r.get("date"), r.get("commit")) for r in rows}
    for gpu, date, commit in sorted(meta, key=str):
        print(f"GPU {gpu}, date {date}, commit {commit}\n")
    by_kernel = collections.OrderedDict()
    for r in rows:
        if args.kernel and not any(k in r["kernel"] for k in args.kernel):
            continue
        by_kernel.setdefault(r["kernel"], []).append(r)
    for kernel, rs in by_kernel.items():
        print(f"### {kernel}\n")
        print("| shape | µs | TFLOPS | TB/s | roofline µs | of roofline | peer | peer µs | peer/ours |")
        print("|---|---:|---:|---:|---:|---:|---|---:|---:|")
        for r in rs:
            us = float(r["us"])
            peer_us = float(r.get("peer_us") or 0)
            ratio = f"{peer_us / us:.2f}" if peer_us > 0 and us > 0 else ""
            print(f"| {r['shape']} | {us:.2f} | {float(r['TFLOPS']):.1f} | {float(r['TBps']):.3f} | "
                  f"{float(r['roofline_us']):.2f} | {float(r['of_roofline']):.3f} | "
                  f"{r.get('peer', '')} | {peer_us:.2f} | {ratio} |")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
