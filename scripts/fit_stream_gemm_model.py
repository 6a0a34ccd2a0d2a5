#!/usr/bin/env python3
"""Fits the streaming GEMM's time model (StreamCostModel, src/ops/cuda/gemm/fp8_gemm_heuristic.h)
to gemm_bench rows: the stream_split sweep (--sweep) and every fp8_gemm / fp8_gemm[...] row whose
shape names a streaming split. Each row's time is taken as launch + stream_time_us(...), the
launch (graph launch and the kernel's own launch, ~4.5 us in a one-kernel graph) fitted too.
Prints the fitted constants, then each row's measured and predicted time.

Usage: scripts/fit_stream_gemm_model.py rows.jsonl [more.jsonl ...]
"""
import json
import re
import sys

SMS, CTAS_PER_SM, STEP_BYTES = 132, 2, 128 * 128


def resident(s):
    slots = SMS * CTAS_PER_SM
    return slots // s * s


def stream_time(p, tiles, ks, s, blocks, tokens):
    slots = resident(s)
    ctas = tiles * s * blocks
    per = -(-ks // s)
    # step time by token width, linear between the 8- and 64-token figures
    step = p["step8"] + (p["step64"] - p["step8"]) * (tokens - 8) / 56.0
    chain = per * step

    def wave(n):
        return p["wave_start"] + max(chain, n / blocks * per * STEP_BYTES / p["bw"])

    full, rem = divmod(ctas, slots)
    t = full * wave(slots) + (wave(rem) if rem else 0.0)
    if s > 1:
        t += p["split"] + p["split_rank"] * s
    return t


def width(m):
    m = min(m, 64)
    return 8 if m <= 8 else 16 if m <= 16 else 32 if m <= 32 else 64


def rows(paths):
    out = []
    for path in paths:
        for line in open(path):
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            sh = r["shape"]
            sp = re.search(r"splits=(\d+)", sh)
            if not sp or "grouped" in r["kernel"] or "+" in sh:
                continue
            if r["kernel"] not in ("stream_split", "fp8_gemm", "fp8_gemm[stream]",
                                   "fp8_gemm[old split]"):
                continue
            if r["kernel"] == "fp8_gemm" and "path=stream" not in sh:
                continue
            m = int(re.search(r" m=(\d+)", sh).group(1))
            n = int(re.search(r" n=(\d+)", sh).group(1))
            k = int(re.search(r" k=(\d+)", sh).group(1))
            out.append((sh, r["kernel"], m, n, k, int(sp.group(1)), r["us"]))
    return out


def loss(p, data):
    e = 0.0
    for _, _, m, n, k, s, us in data:
        pred = p["launch"] + stream_time(p, -(-n // 128), k // 128, s, -(-m // 64), width(m))
        e += ((pred - us) / us) ** 2
    return e


def fit(data):
    p = {"launch": 4.5, "bw": 4.0e6, "wave_start": 2.0, "step8": 0.25, "step64": 2.3,
         "split": 0.5, "split_rank": 0.05}
    step = {k: v * 0.25 for k, v in p.items()}
    best = loss(p, data)
    for _ in range(60):
        improved = False
        for key in p:
            for sign in (1, -1):
                q = dict(p)
                q[key] = max(0.0, q[key] + sign * step[key])
                l = loss(q, data)
                if l < best - 1e-12:
                    p, best, improved = q, l, True
        if not improved:
            step = {k: v * 0.5 for k, v in step.items()}
    return p, best


def main():
    data = rows(sys.argv[1:])
    if not data:
        sys.exit("no streaming rows with a split in the input")
    p, best = fit(data)
    print("fitted:", {k: round(v, 4) for k, v in p.items()}, "rms rel err",
          round((best / len(data)) ** 0.5, 3))
    for sh, kern, m, n, k, s, us in data:
        pred = p["launch"] + stream_time(p, -(-n // 128), k // 128, s, -(-m // 64), width(m))
        print(f"{us:8.2f} {pred:8.2f}  {kern:20s} {sh}")


if __name__ == "__main__":
    main()
