#!/usr/bin/env python3
"""Markdown tables from e2e_depth_bench's JSON lines (bench/cuda/e2e_depth_bench.cu): the decode
step measured on N real-shape layers and EXTRAPOLATED to full depth, per layer kind (graph
events), per op class and per kernel (one eager replay under CUPTI), the MTP block and the 8K
prefill, each beside its roofline (bytes / 4.3 TB/s or FLOPs at the tensor rates).

The per-kernel attribution checks itself in the bench (e2e_depth_trace_check and
e2e_depth_block_check lines): rows whose check failed are marked FAILED / ⚠ here and must not be
read as measurements; lines from a bench without the check are marked "unchecked".

Usage: scripts/e2e_depth_report.py results.jsonl [--top N] > results.md
"""
import argparse
import collections
import json
import sys

OPS = ["mhc", "fp8_gemm", "wo_a", "attention", "moe", "norm_quant", "head", "sampling", "copy", "other"]


def fmt_us(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 10000 else f"{us:.0f} µs" if us >= 100 else f"{us:.1f} µs"


def check_mark(r) -> str:
    """' ⚠' when the row's attribution check failed; '' when it passed or the line predates the
    check (the self-check section says so once)."""
    if r is None or "check" not in r:
        return ""
    return "" if int(r["check"]) else " ⚠"


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
        print("⚠: the kind's attribution check failed (see the self-check); ≠: eager launches differ from the "
              "graph's.\n")
        print("| ctx | b | kind | measured | µs per layer | roofline | × | launches (graph) | launches (eager) "
              "| kernel sum (eager) | kernel sum / graph layer |")
        print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in sorted(by["e2e_depth_kind"], key=lambda r: (key(r), r["kind"])):
            la = launches.get((key(r), r["kind"]))
            gl = glaunch.get((key(r), r["kind"]))
            cells = ["", "", ""]
            if la:
                m = check_mark(la)
                ks = float(la["kernel_sum_us"])
                # The kind's median launches against the graph's: a difference shows even without the
                # bench's own check (lines from before it).
                ne = " ≠" if gl and int(la["launches"]) != int(gl["launches"]) else ""
                cells = [f"{int(la['launches'])}{ne}{m}", f"{fmt_us(ks)}{m}",
                         f"{ks / float(r['us']):.2f}{m}" if float(r["us"]) > 0 else ""]
            print(f"| {int(r['ctx'])} | {int(r['batch'])} | {r['kind']} | {int(r['measured_count'])}/{int(r['real_count'])} "
                  f"| {fmt_us(float(r['us']))} | {fmt_us(float(r['roofline_us']))} | {ratio(r)} "
                  f"| {int(gl['launches']) if gl else ''} | " + " | ".join(cells) + " |")
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

        checks = by["e2e_depth_trace_check"]
        if by["e2e_depth_launches"] and not checks:
            print("### Trace self-check\n\nThese lines come from a bench without the attribution self-check: "
                  "every per-kernel figure below is unchecked.\n")
        if checks:
            print("### Trace self-check (the eager CUPTI replay's attribution of kernels to blocks)\n")
            print("Per case: the marker records found (the forward's block events, n_layers + 2), other "
                  "cudaEventRecord calls ignored, ops outside the blocks (a decode replay must have none), ops "
                  "without a launch record, blocks whose eager launches differ from the graph's, blocks whose "
                  "kernel time exceeds their own event time, and the kernel time in the blocks against all "
                  "traced.\n")
            print("| phase | ctx | b | result | markers | other records | outside | no launch | launches ≠ graph "
                  "| kernels > events | kernels in blocks | traced | block events |")
            print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for r in sorted(checks, key=lambda r: (r["phase"] != "decode", key(r))):
                pre_ = r["phase"] == "prefill"
                print(f"| {r['phase']} | {'' if pre_ else int(r['ctx'])} | {'' if pre_ else int(r['batch'])} "
                      f"| {'ok' if int(r['check']) else '**FAILED**'} "
                      f"| {int(r['markers'])}/{int(r['markers_expected'])} | {int(r['foreign_event_records'])} "
                      f"| {int(r['ops_outside'])} of {int(r['ops'])} | {int(r['ops_no_launch'])} "
                      f"| {int(r['launch_mismatch_blocks'])} | {int(r['over_time_blocks'])} "
                      f"| {fmt_us(float(r['us']))} | {fmt_us(float(r['kernel_total_us']))} "
                      f"| {fmt_us(float(r['eager_blocks_us']))} |")
            bad = [r for r in by["e2e_depth_block_check"] if not int(r["check"])]
            if bad:
                print(f"\nBlocks that failed ({len(bad)}; the first 20):\n")
                print("| phase | ctx | b | block | kind | launches (eager) | launches (graph) | kernels | block event "
                      "| graph block |")
                print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
                for r in bad[:20]:
                    pre_ = r["phase"] == "prefill"
                    g = int(r["graph_launches"])
                    ev, gu = float(r["eager_us"]), float(r["graph_us"])
                    print(f"| {r['phase']} | {'' if pre_ else int(r['ctx'])} | {'' if pre_ else int(r['batch'])} "
                          f"| {int(r['block'])} | {r['kind']} | {int(r['launches'])} | {g if g >= 0 else '–'} "
                          f"| {fmt_us(float(r['us']))} | {fmt_us(ev) if ev >= 0 else '–'} "
                          f"| {fmt_us(gu) if gu >= 0 else '–'} |")
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
                mark = check_mark(next(iter(v.values())))
                print(f"| {phase} | {k[0] if phase == 'decode' else ''} | {b} | {kind}{mark} | " + " | ".join(cells) + " |")
            print()

        pre = by["e2e_depth_prefill_kind"]
        if pre:
            print("### Prefill of 8192 tokens (one sequence, eager, events between blocks)\n")
            print("| kind | measured | µs per layer | roofline | × | launches | kernel sum (traced run) |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            pl = {r["kind"]: r for r in by["e2e_depth_launches"] if r["phase"] == "prefill"}
            for r in pre:
                la = pl.get(r["kind"])
                m = check_mark(la)
                print(f"| {r['kind']} | {int(r['measured_count'])}/{int(r['real_count'])} | {fmt_us(float(r['us']))} "
                      f"| {fmt_us(float(r['roofline_us']))} | {ratio(r)} | {str(int(la['launches'])) + m if la else ''} "
                      f"| {fmt_us(float(la['kernel_sum_us'])) + m if la else ''} |")
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
                          f"| {kind}{check_mark(r)} | {int(r['position'])} | `{name}` | {r['op']} | {float(r['us']):.1f} |")
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
