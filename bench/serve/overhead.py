#!/usr/bin/env python3
"""The server's overhead: tokens/s through HTTP (load.py against `dsv4 serve`) over tokens/s of
the engine loop alone (engine_loop_bench), same model, workload and concurrency (64 by
default). Starts and stops the server itself. Target: >= 0.95.

  bench/serve/overhead.py --cli build/tools/dsv4 --engine-bench build/bench/serve/engine_loop_bench \\
      --model DIR [--backend cuda] [--concurrency 64] [--input-len L] [--output-len O]
"""

import argparse
import json
import pathlib
import re
import subprocess
import sys
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import load  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cli", required=True)
    p.add_argument("--engine-bench", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=0, help="default 2 x concurrency")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--cache-mb", type=int, default=0)
    p.add_argument("--jsonl")
    a = p.parse_args()
    requests = a.requests or 2 * a.concurrency
    max_len = a.input_len + a.output_len
    common = ["--backend", a.backend, "--cache-mb", str(a.cache_mb)]
    engine = json.loads(subprocess.run(
        [a.engine_bench, "--model", a.model, "--requests", str(requests), "--concurrency",
         str(a.concurrency), "--input-len", str(a.input_len), "--output-len", str(a.output_len),
         "--max-model-len", str(max_len), *common],
        check=True, capture_output=True, text=True).stdout)
    server = subprocess.Popen(
        [a.cli, "serve", "--model", a.model, "--port", "0", "--max-running", str(a.concurrency),
         "--max-waiting", str(requests), "--max-model-len", str(max_len), *common],
        stdout=subprocess.PIPE, text=True)
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
        model = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
        args = argparse.Namespace(url=url, model=model, api_key=None, input_len=a.input_len,
                                  output_len=a.output_len, requests=requests, timeout=3600)
        http = load.run_level(args, a.concurrency, vocab=120000)
    finally:
        server.terminate()
        server.wait(120)
    ratio = http["output_tokens_per_s"] / engine["output_tokens_per_s"]
    row = {"bench": "serve_overhead", "backend": a.backend, "concurrency": a.concurrency,
           "requests": requests, "input_len": a.input_len, "output_len": a.output_len,
           "http_output_tokens_per_s": http["output_tokens_per_s"],
           "engine_output_tokens_per_s": engine["output_tokens_per_s"],
           "http_errors": http["errors"], "ratio": ratio}
    print(json.dumps(row))
    if a.jsonl:
        with open(a.jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 1 if http["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
