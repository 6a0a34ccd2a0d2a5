#!/usr/bin/env python3
"""Markdown tables from e2e_depth_bench's JSON lines (bench/cuda/e2e_depth_bench.cu): the decode
step measured on N real-shape layers and EXTRAPOLATED to full depth, per layer kind (graph
events), per op class and per kernel (one eager replay under CUPTI), the MTP block and the 8K
prefill, each beside its roofline (bytes / 4.3 TB/s or FLOPs at the tensor rates).

Usage: scripts/e2e_depth_report.py results.jsonl [--top N] > results.md
"""
import argparse
import collections
import json
import sys

OPS = ["mhc", "fp8_gemm", "wo_a", "attention", "moe", "norm_quant", "head", "sampling", "copy", "other"]


def fmt_us(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 10000 else f"{us:.0f} µs" if us >= 100 else f"{us:.1f} µs"


def ratio(r) -> str:
    rl = float(r.get("roofline_us") or 0)
    return f"{float(r['us']) / rl:.1f}×" if rl > 0 else "–"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl")
    ap.add_argument("--top", type=int, default=8, help="kernels per kind and case in the kernel table")
    args = ap.parse_args()
    rows = [json.loads(l) for l in open(args.jsonl) if l.strip()]
    rows = [r for r in rows if str(r.get("kernel", "")).startswith("e2e_depth")]
    if not rows:
        print(f"{args.jsonl}: no e2e_depth_bench lines", file=sys.stderr)
        return 1
    groups = collections.OrderedDict()
    for r in rows:
        groups.setdefault((r["model"], r["fmt"]), []).append(r)
    for (model, fmt), rs in groups.items():
        r0 = rs[0]
        print(f"## {model} {fmt}: {int(r0['layers'])} of {int(r0['full_layers'])} layers measured + MTP\n")
        print(f"GPU {r0['gpu']}, date {r0['date']}, commit {r0['commit']}.\n")
        by = collections.defaultdict(list)
        for r in rs:
            by[r["kernel"]].append(r)
        kinds = collections.OrderedDict()
        for r in by["e2e_depth_kind"] + by["e2e_depth_prefill_kind"]:
            kinds[r["kind"]] = (int(r["measured_count"]), int(r["real_count"]))
        if kinds:
            print("Layer kinds (measured / in the real model): " +
                  ", ".join(f"{k} {m}/{n}" for k, (m, n) in kinds.items()) + ", MTP 1/1.\n")

        def key(r):
            return (int(r["ctx"]), int(r["batch"]))

        print("### Decode step (the engine's step: greedy samples on the device, one synchronisation)\n")
        print("The full-depth rows are EXTRAPOLATED: the measured step plus the missing layers of each "
              "kind at that kind's median measured time.\n")
        print("| ctx | b | measured step | roofline | × | with logits download | full depth (extrapolated) "
              "| roofline | × | tokens/s | with logits (extrap.) |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        samp = {key(r): r for r in by["e2e_depth_step_sampled"]}
        logi = {key(r): r for r in by["e2e_depth_step_logits"]}
        ext = {key(r): r for r in by["e2e_depth_step_extrapolated"]}
        extl = {key(r): r for r in by["e2e_depth_step_extrapolated_logits"]}
        for k in sorted(samp):
            s, l, e, el = samp[k], logi.get(k), ext.get(k), extl.get(k)
            tps = k[1] * 1e6 / float(e["us"]) if e else 0
            nf = int(s.get("nonfinite_rows", 0))
            print(f"| {k[0]} | {k[1]} | {fmt_us(float(s['us']))}{' (' + str(nf) + ' non-finite rows)' if nf else ''} "
                  f"| {fmt_us(float(s['roofline_us']))} | {ratio(s)} | {fmt_us(float(l['us'])) if l else ''} "
                  f"| {fmt_us(float(e['us'])) if e else ''} | {fmt_us(float(e['roofline_us'])) if e else ''} "
                  f"| {ratio(e) if e else ''} | {tps:.0f} | {fmt_us(float(el['us'])) if el else ''} |")
        print()

        launches = {(key(r), r["kind"]): r for r in by["e2e_depth_launches"] if r["phase"] == "decode"}
        glaunch = {(key(r), r["kind"]): r for r in by["e2e_depth_graph_launches"]}
        print("### Decode: per layer kind (CUDA events inside the graph; launches and kernel sum from the "
              "eager CUPTI replay)\n")
        print("| ctx | b | kind | measured | µs per layer | roofline | × | launches (graph) | launches (eager) "
              "| kernel sum (eager) |")
        print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in sorted(by["e2e_depth_kind"], key=lambda r: (key(r), r["kind"])):
            la = launches.get((key(r), r["kind"]))
            gl = glaunch.get((key(r), r["kind"]))
            print(f"| {int(r['ctx'])} | {int(r['batch'])} | {r['kind']} | {int(r['measured_count'])}/{int(r['real_count'])} "
                  f"| {fmt_us(float(r['us']))} | {fmt_us(float(r['roofline_us']))} | {ratio(r)} "
                  f"| {int(gl['launches']) if gl else ''} "
                  f"| {int(la['launches']) if la else ''} | {fmt_us(float(la['kernel_sum_us'])) if la else ''} |")
        heads = sorted(by["e2e_depth_head"], key=key)
        if heads:
            print("\nHead (hc_head, norm, logits GEMM): " + ", ".join(
                f"ctx {int(r['ctx'])} b={int(r['batch'])} {fmt_us(float(r['us']))} ({ratio(r)})" for r in heads) + ".")
        mtp = sorted(by["e2e_depth_mtp"], key=key)
        if mtp:
            print("\nMTP block (eager, events): " + ", ".join(
                f"ctx {int(r['ctx'])} b={int(r['batch'])} {fmt_us(float(r['us']))} ({ratio(r)})" for r in mtp) + ".")
        eager = sorted(by["e2e_depth_forward_eager"], key=key)
        if eager:
            print("\nThe forward eager (no graph, host-timed): " + ", ".join(
                f"ctx {int(r['ctx'])} b={int(r['batch'])} {fmt_us(float(r['us']))}" for r in eager) + ".")
        print()

        ops = collections.defaultdict(dict)
        for r in by["e2e_depth_op"]:
            ops[(r["phase"], key(r), r["kind"])][r["op"]] = r
        if ops:
            present = [o for o in OPS if any(o in v for v in ops.values())]
            print("### Op classes per layer kind (eager CUPTI replay: exclusive kernel time, × its roofline)\n")
            print("| phase | ctx | b | kind | " + " | ".join(present) + " |")
            print("|---|---:|---:|---|" + "---:|" * len(present))
            for (phase, k, kind), v in sorted(ops.items(), key=lambda x: (x[0][0] != "decode", x[0][1], x[0][2])):
                cells = []
                for o in present:
                    r = v.get(o)
                    cells.append("" if not r else f"{fmt_us(float(r['us']))} ({ratio(r)})" if float(r['roofline_us']) > 0
                                 else fmt_us(float(r['us'])))
                b = "" if phase == "prefill" else str(k[1])
                print(f"| {phase} | {k[0] if phase == 'decode' else ''} | {b} | {kind} | " + " | ".join(cells) + " |")
            print()

        pre = by["e2e_depth_prefill_kind"]
        if pre:
            print("### Prefill of 8192 tokens (one sequence, eager, events between blocks)\n")
            print("| kind | measured | µs per layer | roofline | × | launches |")
            print("|---|---:|---:|---:|---:|---:|")
            pl = {r["kind"]: r for r in by["e2e_depth_launches"] if r["phase"] == "prefill"}
            for r in pre:
                la = pl.get(r["kind"])
                print(f"| {r['kind']} | {int(r['measured_count'])}/{int(r['real_count'])} | {fmt_us(float(r['us']))} "
                      f"| {fmt_us(float(r['roofline_us']))} | {ratio(r)} | {int(la['launches']) if la else ''} |")
            for r in by["e2e_depth_prefill_step"] + by["e2e_depth_prefill_extrapolated"]:
                print(f"\n{r['shape']}: {fmt_us(float(r['us']))}, roofline {fmt_us(float(r['roofline_us']))} ({ratio(r)}).")
            print()

        kern = collections.defaultdict(list)
        for r in by["e2e_depth_kernel"]:
            kern[(r["phase"], key(r), r["kind"])].append(r)
        if kern:
            print(f"### Kernels per layer kind (eager CUPTI replay; the {args.top} longest per kind, median "
                  "over the kind's layers, exclusive time)\n")
            print("| phase | ctx | b | kind | # | kernel | op | µs |")
            print("|---|---:|---:|---|---:|---|---|---:|")
            for (phase, k, kind), v in sorted(kern.items(), key=lambda x: (x[0][0] != "decode", x[0][1], x[0][2])):
                for r in sorted(v, key=lambda r: -float(r["us"]))[: args.top]:
                    name = r["name"].replace("|", "\\|")
                    print(f"| {phase} | {k[0] if phase == 'decode' else ''} | {k[1] if phase == 'decode' else ''} "
                          f"| {kind} | {int(r['position'])} | `{name}` | {r['op']} | {float(r['us']):.1f} |")
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
