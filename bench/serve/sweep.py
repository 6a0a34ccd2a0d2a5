#!/usr/bin/env python3
"""The serving benchmark (issue 11, point 8) in one command: a random checkpoint at the real
DeepSeek-V4-Flash shapes cut to --layers layers (`dsv4 make-tiny --config ... --layers N
--repeat-experts`), the engine loop alone at the overhead concurrency (engine_loop_bench), then
`dsv4 serve` driven by load.py at each concurrency level; TTFT, inter-token latency, output and
total tokens/s per level, and the server's overhead ratio (HTTP output tokens/s over the engine
loop's, same workload and concurrency; target >= 0.95). Appends JSON lines to OUT/serve-bench.jsonl
as each result arrives (a run cut short keeps what it measured) and writes OUT/serve-bench.md.

  bench/serve/sweep.py --cli build/tools/dsv4 --engine-bench build/bench/serve/engine_loop_bench \\
      --out DIR [--backend cuda] [--layers 8] [--concurrency 1,16,64,256] [--input-len 8192] \\
      [--output-len 1024] [--overhead-concurrency 64]
  bench/serve/sweep.py --report DIR/serve-bench.jsonl   # the table again from the lines

--random-weights: no checkpoint is written; the engine loop and the server generate the same
weights in memory (`dsv4 serve --random-weights CONFIG --repeat-experts`, README: Random
weights), so --layers 0 (the default then) runs the model at full depth. --dp/--ep/--tp go to
both (the parallel engine; --concurrency is the whole server's).
"""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import load  # noqa: E402

FLASH_CONFIG = HERE.parents[1] / "tests" / "data" / "deepseek-v4-flash.config.json"


def emit(path, row):
    print(json.dumps(row), flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def report(rows):
    """The markdown table of a sweep's lines."""
    meta = next((r for r in rows if r.get("bench") == "serve_setup"), {})
    out = ["# Serving benchmark: dsv4 serve", ""]
    if meta:
        out += [f"GPU: {meta.get('gpu', '?')}. Commit: `{meta.get('commit', '?')}`. "
                f"Date: {meta.get('date', '?')}.", "",
                f"Model: the shapes of `{meta['config']}` with random weights, "
                f"**{meta['layers']} of its {meta['config_layers']} layers** (compress ratios "
                f"{meta['compress_ratios']}, "
                f"{'MTP block kept' if meta['layers'] == meta['config_layers'] else 'no MTP block'}"
                f"), routed experts in {meta['format']} "
                f"(each layer's {meta['experts']} experts repeat one random draw: `make-tiny "
                f"--repeat-experts`; the gate, hence the routing, is random), "
                + (f"generated in memory by the engine (`--random-weights`, no checkpoint "
                   f"file). " if meta.get("random_weights") else
                   f"{meta['checkpoint_gib']:.1f} GiB, written in {meta['write_s']:.0f} s. ")
                + f"Backend {meta['backend']}, dp {meta.get('dp', 1)} x ep {meta.get('ep', 1)} "
                f"x tp {meta.get('tp', 1)}. Workload: random prompt ids, {meta['input_len']} "
                f"input / {meta['output_len']} output tokens (EOS ignored, temperature 0.8), "
                f"streaming /v1/completions, {meta['waves']} request(s) per client per level.", ""]
    out += ["| concurrency | requests | errors | TTFT median s | TTFT p99 s | TPOT mean ms | "
            "ITL median ms | ITL p99 ms | output tok/s | total tok/s |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("bench") != "serve":
            continue
        out.append(f"| {r['concurrency']} | {r['requests']} | {r['errors']} | "
                   f"{r['ttft_median_s']:.3f} | {r['ttft_p99_s']:.3f} | "
                   f"{r['tpot_mean_s'] * 1e3:.1f} | {r['itl_median_s'] * 1e3:.1f} | "
                   f"{r['itl_p99_s'] * 1e3:.1f} | {r['output_tokens_per_s']:.1f} | "
                   f"{r['total_tokens_per_s']:.1f} |")
    eng = next((r for r in rows if r.get("bench") == "engine_loop"), None)
    ratio = next((r for r in rows if r.get("bench") == "serve_overhead"), None)
    if eng:
        out += ["", f"Engine loop alone (engine_loop_bench, concurrency {eng['concurrency']}, "
                f"{eng['requests']} requests): {eng['output_tokens_per_s']:.1f} output tok/s, "
                f"{eng['total_tokens_per_s']:.1f} total tok/s."]
    if ratio:
        met = "met" if ratio["ratio"] >= 0.95 else "NOT met"
        out += ["", f"Server overhead at concurrency {ratio['concurrency']}: HTTP "
                f"{ratio['http_output_tokens_per_s']:.1f} / engine "
                f"{ratio['engine_output_tokens_per_s']:.1f} output tok/s = "
                f"**{ratio['ratio']:.3f}** (target >= 0.95: {met})."]
    return "\n".join(out) + "\n"


def gpu_name():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                               "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", help="only print the table of this JSONL file")
    p.add_argument("--cli")
    p.add_argument("--engine-bench")
    p.add_argument("--out")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--config", default=str(FLASH_CONFIG))
    p.add_argument("--layers", type=int, default=None,
                   help="layers kept (default 8; with --random-weights 0 = all)")
    p.add_argument("--random-weights", action="store_true",
                   help="weights generated in memory by the engine: no checkpoint file")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--format", default="mxfp4", choices=["mxfp4", "nvfp4"])
    p.add_argument("--model-dir", default="/tmp/dsv4-serve-bench-model")
    p.add_argument("--concurrency", default="1,16,64,256")
    p.add_argument("--overhead-concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--waves", type=int, default=1, help="requests per client and level")
    p.add_argument("--max-step-tokens", type=int, default=0, help="0: the engine's default")
    p.add_argument("--skip-engine-loop", action="store_true",
                   help="no engine_loop_bench run (and no overhead ratio): time for the levels")
    a = p.parse_args()
    if a.report:
        rows = [json.loads(line) for line in open(a.report) if line.strip()]
        sys.stdout.write(report(rows))
        return 0
    if not (a.cli and a.engine_bench and a.out):
        p.error("--cli, --engine-bench and --out are required")
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "serve-bench.jsonl"
    levels = [int(x) for x in a.concurrency.split(",")]
    max_len = a.input_len + a.output_len
    model = pathlib.Path(a.model_dir)
    full = json.loads(pathlib.Path(a.config).read_text())
    if a.layers is None:
        a.layers = 0 if a.random_weights else 8
    if a.layers == 0 and not a.random_weights:
        p.error("--layers 0 (full depth) needs --random-weights (the disk has no room)")

    t0 = time.time()
    tok = pathlib.Path(os.environ.get("DSV4_TOKENIZER_DIR", HERE.parents[2] / "shared" /
                                      "tokenizer" / "deepseek-v4")) / "tokenizer.json"
    cut = ["--layers", str(a.layers)] if a.layers else []
    if a.random_weights:
        if not tok.exists():
            raise SystemExit(f"{tok}: no tokenizer (DSV4_TOKENIZER_DIR); serve needs one")
        # Both the engine loop and the server generate this model; the config's vocabulary
        # (>= the tokenizer's) for both.
        source = ["--random-weights", a.config, "--format", a.format, "--weights-seed", "1",
                  "--repeat-experts", "--vocab", str(full["vocab_size"]), *cut]
        model_args, serve_model = source, [*source, "--tokenizer", str(tok)]
        write_s, size = 0.0, 0
        layers = a.layers or full["num_hidden_layers"]
        ratios = full["compress_ratios"][:layers]
        cfg = {"compress_ratios": ratios, "n_routed_experts": full["n_routed_experts"],
               "vocab_size": full["vocab_size"]}
    else:
        subprocess.run([a.cli, "make-tiny", "--config", a.config, *cut,
                        "--repeat-experts", "--format", a.format, "--seed", "1", "--out",
                        str(model), "--force", *(["--tokenizer", str(tok)] if tok.exists() else [])],
                       check=True)
        write_s = time.time() - t0
        print(f"[{write_s:.0f} s] checkpoint written; the engine loop alone next", flush=True)
        cfg = json.loads((model / "config.json").read_text())
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        model_args = serve_model = ["--model", str(model)]
    emit(jsonl, {"bench": "serve_setup", "gpu": gpu_name(),
                 "commit": os.environ.get("DSV4_COMMIT", "unknown"),
                 "date": time.strftime("%Y-%m-%d", time.gmtime()), "backend": a.backend,
                 "config": pathlib.Path(a.config).name,
                 "config_layers": full["num_hidden_layers"],
                 "layers": a.layers or full["num_hidden_layers"],
                 "random_weights": a.random_weights, "dp": a.dp, "ep": a.ep, "tp": a.tp,
                 "compress_ratios": cfg["compress_ratios"], "experts": cfg["n_routed_experts"],
                 "format": a.format, "checkpoint_gib": size / 2**30, "write_s": write_s,
                 "input_len": a.input_len, "output_len": a.output_len, "waves": a.waves})

    common = ["--backend", a.backend, "--dp", str(a.dp), "--ep", str(a.ep), "--tp", str(a.tp)]
    step = ["--max-step-tokens", str(a.max_step_tokens)] if a.max_step_tokens else []
    c64 = a.overhead_concurrency
    # The engine loop alone first (the server would hold the GPU's memory).
    engine = None
    if not a.skip_engine_loop:
        r = subprocess.run([a.engine_bench, *model_args, "--requests", str(c64 * a.waves),
                            "--concurrency", str(c64), "--input-len", str(a.input_len),
                            "--output-len", str(a.output_len), "--max-model-len", str(max_len),
                            *common], capture_output=True, text=True)
        sys.stderr.write(r.stderr[-3000:])
        engine = json.loads(r.stdout) if r.returncode == 0 else None
        print(f"[{time.time() - t0:.0f} s] engine loop done (rc {r.returncode}); starting the "
              "server", flush=True)
        if engine:
            emit(jsonl, engine)

    server = subprocess.Popen(
        [a.cli, "serve", *serve_model, "--port", "0",
         # --max-running is per data-parallel rank.
         "--max-running", str(-(-max(levels) // a.dp)),
         "--max-waiting", str(max(levels) * a.waves * 2), "--max-model-len", str(max_len),
         *common, *step], stdout=subprocess.PIPE, text=True)
    rows = []
    try:
        url = None
        for line in server.stdout:
            m = re.search(r"http://[0-9.:]+", line)
            if m:
                url = m.group(0)
            if "ready" in line:
                break
        if url is None:
            raise SystemExit("dsv4 serve did not start")
        print(f"server ready at {url}, {time.time() - t0:.0f} s after the start", flush=True)
        args = argparse.Namespace(url=url, model=None, api_key=None, input_len=a.input_len,
                                  output_len=a.output_len, requests=0, waves=a.waves,
                                  timeout=3600)
        for c in levels:
            print(f"[{time.time() - t0:.0f} s] concurrency {c}", flush=True)
            row = load.run_level(args, c, vocab=min(120000, cfg["vocab_size"]))
            row.pop("url", None)
            rows.append(row)
            emit(jsonl, row)
            if c == c64 and engine:
                emit(jsonl, {"bench": "serve_overhead", "backend": a.backend, "concurrency": c,
                             "requests": row["requests"], "input_len": a.input_len,
                             "output_len": a.output_len,
                             "http_output_tokens_per_s": row["output_tokens_per_s"],
                             "engine_output_tokens_per_s": engine["output_tokens_per_s"],
                             "http_errors": row["errors"],
                             "ratio": row["output_tokens_per_s"] /
                             engine["output_tokens_per_s"]})
    finally:
        server.terminate()
        server.wait(120)
    all_rows = [json.loads(line) for line in open(jsonl) if line.strip()]
    (out / "serve-bench.md").write_text(report(all_rows))
    print(report(all_rows))
    failed_engine = engine is None and not a.skip_engine_loop
    return 1 if failed_engine or any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
