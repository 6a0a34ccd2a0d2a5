#!/usr/bin/env python3
"""Load generator for any OpenAI-compatible server (dsv4 serve, vLLM, SGLang, ...).

At each concurrency level, `concurrency` clients send streaming /v1/completions requests of
`--input-len` random token ids and `--output-len` tokens (EOS ignored) until `--requests`
(default 2 x concurrency) are done, and it reports per level: TTFT (mean, median, p99),
TPOT (time per output token after the first, mean), inter-chunk latency (median, p99), output
tokens/s and total (input + output) tokens/s over the level's wall time. Token counts come from
the usage chunk (stream_options.include_usage). Standard library only.

  bench/serve/load.py --url http://127.0.0.1:8000 --concurrency 1,16,64 \\
      --input-len 8192 --output-len 1024 [--waves W] [--model NAME] [--api-key K] [--jsonl OUT]
"""

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse


def percentile(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def one_request(url, model, api_key, prompt, output_len, timeout):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    body = {"prompt": prompt, "max_tokens": output_len, "stream": True, "temperature": 0.8,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    chunks, usage, buf = [], None, b""
    while True:
        data = r.read1(65536)
        if not data:
            break
        buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            payload = event[len(b"data: "):]
            if payload == b"[DONE]":
                continue
            j = json.loads(payload)
            if "error" in j:
                raise RuntimeError(f"stream error: {j['error']}")
            if j.get("usage"):
                usage = j["usage"]
            if any(c.get("text") for c in j.get("choices", [])):
                chunks.append(time.perf_counter())
    conn.close()
    if usage is None:
        raise RuntimeError("no usage chunk")
    return {"start": t0, "chunks": chunks, "end": time.perf_counter(),
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"]}


def run_level(args, concurrency, vocab):
    total = args.requests or getattr(args, "waves", 2) * concurrency
    rng = random.Random(concurrency)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(total)]
    results, errors, lock = [], [], threading.Lock()
    next_index = [0]

    def worker():
        while True:
            with lock:
                i = next_index[0]
                if i >= total:
                    return
                next_index[0] += 1
            try:
                r = one_request(args.url, args.model, args.api_key, prompts[i],
                                args.output_len, args.timeout)
                with lock:
                    results.append(r)
            except Exception as e:  # counted and reported; the level goes on
                with lock:
                    errors.append(str(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r["chunks"][0] - r["start"] for r in results if r["chunks"]]
    tpot = [(r["end"] - r["chunks"][0]) / (r["completion_tokens"] - 1)
            for r in results if r["chunks"] and r["completion_tokens"] > 1]
    itl = [b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    out_tokens = sum(r["completion_tokens"] for r in results)
    in_tokens = sum(r["prompt_tokens"] for r in results)
    return {"bench": "serve", "url": args.url, "concurrency": concurrency, "requests": total,
            "errors": len(errors), "first_error": errors[0] if errors else None,
            "input_len": args.input_len, "output_len": args.output_len,
            "seconds": round(wall, 3),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
            "ttft_median_s": statistics.median(ttft) if ttft else float("nan"),
            "ttft_p99_s": percentile(ttft, 99),
            "tpot_mean_s": statistics.fmean(tpot) if tpot else float("nan"),
            "itl_median_s": statistics.median(itl) if itl else float("nan"),
            "itl_p99_s": percentile(itl, 99),
            "output_tokens_per_s": out_tokens / wall,
            "total_tokens_per_s": (in_tokens + out_tokens) / wall}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="http://host:port of the server")
    p.add_argument("--model", help="model name to send (default: the server's first model)")
    p.add_argument("--api-key")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated levels")
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--requests", type=int, default=0, help="per level (default: waves x "
                   "concurrency)")
    p.add_argument("--waves", type=int, default=2, help="requests per client and level")
    p.add_argument("--extra", default="{}", help="a JSON object merged into every --jsonl line")
    p.add_argument("--vocab", type=int, default=120000, help="prompt ids are below this")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--jsonl", help="append one JSON line per level")
    args = p.parse_args(argv)
    u = urllib.parse.urlparse(args.url)
    deadline = time.time() + 600
    while True:  # a server still loading answers /health with 503
        try:
            conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                break
        except OSError:
            pass
        if time.time() > deadline:
            raise SystemExit(f"{args.url}/health did not answer 200")
        time.sleep(0.5)
    if not args.model:
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {args.api_key}"}
                     if args.api_key else {})
        args.model = json.loads(conn.getresponse().read())["data"][0]["id"]
    rows = []
    print(f"{'conc':>5} {'reqs':>5} {'err':>4} {'TTFT med s':>10} {'TTFT p99 s':>10} "
          f"{'TPOT ms':>8} {'ITL p99 ms':>10} {'out tok/s':>10} {'total tok/s':>11}")
    for c in [int(x) for x in args.concurrency.split(",")]:
        r = run_level(args, c, args.vocab)
        rows.append(r)
        print(f"{c:>5} {r['requests']:>5} {r['errors']:>4} {r['ttft_median_s']:>10.3f} "
              f"{r['ttft_p99_s']:>10.3f} {r['tpot_mean_s'] * 1e3:>8.1f} "
              f"{r['itl_p99_s'] * 1e3:>10.1f} {r['output_tokens_per_s']:>10.1f} "
              f"{r['total_tokens_per_s']:>11.1f}", flush=True)
        if r["errors"]:
            print(f"      first error: {r['first_error']}", file=sys.stderr)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps({**r, **json.loads(args.extra)}) + "\n")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
