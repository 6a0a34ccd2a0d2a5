#!/usr/bin/env python3
"""CTest's multinode_test: the multi-node control plane with N processes on one host (loopback),
CPU backend, make-tiny checkpoints. Each case starts node 0 and the other nodes as separate
`dsv4` processes that meet at 127.0.0.1:PORT:

- `dsv4 logits` over 2 and 4 nodes for several (dp, ep, tp) tuples (prefill and chunked
  prefill) writes a file byte-identical to the one-rank run;
- `dsv4 generate` (sampled, T 0.8) prints the one-rank run's tokens;
- `dsv4 serve --nnodes 2` answers a completion as the one-rank server does, and SIGTERM to node 0
  stops both nodes with exit 0 (needs the tokenizer; skipped without it);
- errors: bad --node-rank, a world that does not divide over the nodes, --comm inproc with
  several nodes, a node given another layout (both nodes fail, neither hangs), a node that
  cannot load its checkpoint (node 1, then node 0: both nodes exit non-zero naming that node
  and the file);
- `dsv4 serve` over 2 nodes with a node killed once the first token of a stream came: node 1
  killed: the stream ends with the step failure naming node 1, /health and a new request get
  503, node 0 exits non-zero; node 0 killed: node 1 exits non-zero, lost node 0 (both need the
  tokenizer, like the serve case).

Usage: run.py [DSV4_CLI]  (else $DSV4_CLI). About 30 s on 2 cores.

run.py DSV4_CLI --backend cuda: the CUDA path over NCCL with a GPU per rank (needs 2 GPUs; exits
77 with fewer): `dsv4 logits --backend cuda --dp 2 --ep 2` as one process with 2 GPUs and as 2
nodes of one GPU each (CUDA_VISIBLE_DEVICES), both within the end-to-end tolerance of one rank
(tests/support/golden.h's E2eTolerance) and bit-identical to each other (the same ranks run the
same kernels on the same inputs; only the control plane differs).
"""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
ARGS = [a for a in sys.argv[1:] if a not in ("--backend", "cuda")]
CUDA = "cuda" in sys.argv[1:]
CLI = ARGS[0] if ARGS else os.environ.get("DSV4_CLI", "dsv4")
# Every process this starts keeps NVLink multicast off.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
TIMEOUT = 120
failures = []


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def run_nodes(args, nnodes, port=None, extra=None, env=None, addr="127.0.0.1", args_of=None):
    """Runs `dsv4 ARGS --nnodes N --node-rank r` for every r; returns [(rc, stdout, stderr)].
    env(r): node r's extra environment; args_of(r): node r's ARGS, when they differ."""
    port = port or free_port()
    procs = []
    for r in reversed(range(nnodes)):  # the followers first: they wait for node 0
        a = [CLI] + (args_of(r) if args_of else args) + ["--nnodes", str(nnodes), "--node-rank", str(r),
                            "--master-addr", addr, "--master-port", str(port)]
        if extra and r in extra:
            a += extra[r]
        procs.append(subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env={**os.environ, **(env(r) if env else {})}))
    out = []
    for p in reversed(procs):
        try:
            o, e = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
            e += "\n(timed out: killed)"
        out.append((p.returncode, o, e))
    return out


def logits_cases(model, work):
    prompt = ",".join(str((7 * i + 3) % 500) for i in range(140))
    base = ["logits", "--model", model, "--prompt-ids", prompt]
    for chunk in ["0", "50"]:
        ref = work / f"one-{chunk}.safetensors"
        subprocess.run([CLI] + base + ["--out", str(ref), "--prefill-chunk", chunk], check=True)
        for dp, ep, tp, nn in [(2, 2, 1, 2), (1, 4, 1, 2), (2, 2, 2, 2), (1, 4, 1, 4)]:
            if chunk != "0" and (dp, ep, tp, nn) != (2, 2, 1, 2):
                continue
            out = work / f"nodes-{dp}{ep}{tp}{nn}-{chunk}.safetensors"
            res = run_nodes(base + ["--out", str(out), "--prefill-chunk", chunk, "--dp", str(dp),
                                    "--ep", str(ep), "--tp", str(tp)], nn)
            what = f"logits dp {dp} ep {ep} tp {tp} over {nn} nodes, prefill chunk {chunk}"
            if any(rc != 0 for rc, _, _ in res):
                check(False, f"{what}: exit codes {[r[0] for r in res]}: {res[0][2][-300:]}")
                continue
            check(out.read_bytes() == ref.read_bytes(), f"{what}: byte-identical to one rank")


def generate_cases(model):
    base = ["generate", "--model", model, "--prompt-ids", "5,6,7,8", "--max-new-tokens", "12",
            "--temperature", "0.8", "--seed", "11", "--ignore-eos"]
    one = subprocess.run([CLI] + base, check=True, capture_output=True, text=True).stdout
    for dp, ep, tp, nn in [(2, 2, 1, 2), (1, 4, 1, 4)]:
        # A host name as the master address once.
        addr = "localhost" if nn == 2 else "127.0.0.1"
        res = run_nodes(base + ["--dp", str(dp), "--ep", str(ep), "--tp", str(tp)], nn, addr=addr)
        what = f"generate dp {dp} ep {ep} tp {tp} over {nn} nodes (master {addr})"
        check(all(r[0] == 0 for r in res) and res[0][1] == one and len(one.split(",")) == 12,
              f"{what}: the one-rank tokens ({one.strip()} vs {res[0][1].strip()})")
        check(all(r[1] == "" for r in res[1:]), f"{what}: nodes > 0 print nothing on stdout")


def error_cases(model):
    base = ["logits", "--model", model, "--prompt-ids", "1,2,3", "--out", "/dev/null/x"]
    for extra, needle in [
        (["--ep", "2", "--nnodes", "2", "--node-rank", "2"], "--node-rank 2 must be below"),
        (["--ep", "2", "--nnodes", "4"], "do not divide over --nnodes 4"),
        (["--dp", "2", "--nnodes", "2", "--backend", "cuda", "--comm", "inproc"],
         "--comm inproc"),
    ]:
        p = subprocess.run([CLI] + base[:-2] + ["--out", "x.safetensors"] + extra,
                           capture_output=True, text=True, timeout=60)
        check(p.returncode != 0 and needle in p.stderr, f"error '{needle}' ({p.stderr.strip()})")

    # Node 1 given another layout: it refuses, node 0 fails (no hang).
    gen = ["generate", "--model", model, "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]
    res = run_nodes(gen + ["--ep", "2"], 2, extra={0: ["--dp", "2"], 1: ["--dp", "1"]})
    check(res[1][0] != 0 and "node 0 runs --nnodes 2 --dp 2" in res[1][2],
          f"a node with another layout refuses ({res[1][2].strip()[-200:]})")
    check(res[0][0] != 0 and "node 1" in res[0][2],
          f"node 0 fails naming node 1 ({res[0][2].strip()[-200:]})")

    # A node that cannot load its checkpoint (a weight file cut short): every node fails, non-zero,
    # each naming the node and the cause; none hangs, none exits 0.
    for victim in [1, 0]:
        broken = pathlib.Path(model).parent / f"broken-{victim}"
        if not broken.exists():
            shutil.copytree(model, broken)
            for f in sorted(broken.glob("*.safetensors")):
                f.write_bytes(f.read_bytes()[:len(f.read_bytes()) // 2])
        res = run_nodes(None, 2, args_of=lambda r: [
            a if a != model or r != victim else str(broken) for a in gen] + ["--ep", "2", "--dp", "2"])
        needle = f"multi-node run: node {victim} failed to start: "
        for r in [0, 1]:
            rc, _, err = res[r]
            check(rc not in (0, None) and needle in err and str(broken) in err,
                  f"node {victim} cannot load: node {r} fails (exit {rc}) saying '{needle}' and "
                  f"the file ({err.strip()[-300:]})")


class Server:
    def __init__(self, args):
        self.p = subprocess.Popen([CLI] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        self.url = None
        deadline = time.time() + TIMEOUT
        while time.time() < deadline:
            line = self.p.stdout.readline()
            if not line:
                break
            if "ready:" in line:
                self.url = line.split(" at ")[-1].strip()
                return
        raise RuntimeError(f"server did not come up: {self.p.stderr.read()[-500:]}")

    def complete(self, prompt):
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8,
                           "temperature": 0, "logprobs": 2}).encode()
        req = urllib.request.Request(self.url + "/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            c = json.load(r)["choices"][0]
        return c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]

    def stream(self, prompt, max_tokens):
        """A streaming completion: the open response (read its SSE lines)."""
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "stream": True, "ignore_eos": True}).encode()
        req = urllib.request.Request(self.url + "/completions", body,
                                     {"Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=TIMEOUT)

    def get(self, path):
        """(status, body) of GET path on the server's root; (None, why) when nothing answers."""
        try:
            with urllib.request.urlopen(self.url.rsplit("/v1", 1)[0] + path, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except (urllib.error.URLError, ConnectionError) as e:
            return None, str(e)

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        self.p.communicate(timeout=TIMEOUT)
        return self.p.returncode


def tok_model(work):
    """A tiny checkpoint with the real tokenizer (the server needs one), or None (skipped)."""
    if os.environ.get("DSV4_MULTINODE_SERVE", "1") == "0":
        print("skip serve: this build has no server")
        return None
    tok = pathlib.Path(os.environ.get(
        "DSV4_TOKENIZER_DIR", HERE.parents[2] / "shared" / "tokenizer" / "deepseek-v4"))
    if not (tok / "tokenizer.json").exists():
        print(f"skip serve: no tokenizer.json in {tok} (set DSV4_TOKENIZER_DIR)")
        return None
    model = work / "tiny-tok"
    if not model.exists():
        subprocess.run([CLI, "make-tiny", "--preset", "flash", "--layers", "2", "--seed", "5",
                        "--out", str(model), "--tokenizer", str(tok / "tokenizer.json")],
                       check=True, stdout=subprocess.DEVNULL)
    return str(model)


def serve_case(work):
    model = tok_model(work)
    if model is None:
        return
    args = ["serve", "--model", model, "--served-model-name", "tiny", "--port", "0",
            "--max-model-len", "512", "--max-running", "2"]
    # A short prompt, then a long one twice: the second finds the first's prefix snapshot (a
    # fork: node 0 posts the copies to node 1).
    long = [(13 * i + 7) % 1000 + 10 for i in range(300)]
    prompts = [[10, 20, 30, 40, 50], long, long]
    one = Server(args)
    want = [one.complete(p) for p in prompts]
    check(one.stop() == 0, "one-rank server stops with exit 0")
    port = str(free_port())
    nodes = ["--dp", "2", "--ep", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", port]
    follower = subprocess.Popen([CLI] + args + nodes + ["--node-rank", "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    two = Server(args + nodes + ["--node-rank", "0"])
    got = [two.complete(p) for p in prompts]
    for i in range(len(prompts)):
        check(got[i] == want[i], f"serve over 2 nodes answers request {i} as one rank "
                                 f"({got[i][0]!r} vs {want[i][0]!r})")
    hits = urllib.request.urlopen(two.url.rsplit("/v1", 1)[0] + "/metrics").read().decode()
    hit_lines = [l for l in hits.splitlines() if "prefix_cache_hits" in l and not l.startswith("#")]
    check(any(float(l.split()[-1]) > 0 for l in hit_lines),
          f"the resent prompt hit the prefix cache over 2 nodes ({hit_lines})")
    check(two.stop() == 0, "node 0's server stops with exit 0 on SIGTERM")
    try:
        follower.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        follower.kill()
    check(follower.returncode == 0, f"node 1 stops with node 0 (exit {follower.returncode})")


def first_token(resp):
    """Reads SSE lines until the first one with text; returns the lines read."""
    lines = []
    for raw in resp:
        line = raw.decode().strip()
        lines.append(line)
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
            return lines
    raise RuntimeError(f"the stream ended before a token: {lines[-5:]}")


def kill_cases(work):
    """A node killed mid-run, once the first token streamed (so the nodes are stepping):
    node 1 killed: node 0's stream ends with the step's error naming node 1, /health and new
    requests get 503 naming it while node 0 lives, and node 0 exits non-zero saying why. Node 0
    killed: node 1 exits non-zero saying it lost node 0."""
    model = tok_model(work)
    if model is None:
        return
    args = ["serve", "--model", model, "--served-model-name", "tiny", "--port", "0",
            "--max-model-len", "100000", "--max-running", "2"]
    step_failure = "multi-node run: node 1 went away during a step (its process ended?)"
    post_failure = "multi-node run: rendezvous: sending to node 1"
    for victim in [1, 0]:
        port = str(free_port())
        nodes = ["--dp", "2", "--ep", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
                 "--master-port", port]
        follower = subprocess.Popen([CLI] + args + nodes + ["--node-rank", "1"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        leader = Server(args + nodes + ["--node-rank", "0"])
        resp = leader.stream("Once upon a time", 90000)
        first_token(resp)
        (follower if victim == 1 else leader.p).kill()
        if victim == 1:
            rest = resp.read().decode()
            check(any(n in rest for n in [step_failure, post_failure])
                  and "the engine failed" in rest,
                  f"node 1 killed after the first token: the stream ends with the step's error "
                  f"({rest.strip()[-300:]})")
            # dsv4 serve answers 503 for 2 s after the failure, then exits.
            health = leader.get("/health")
            check(health[0] == 503 and "the engine failed" in health[1],
                  f"node 1 killed: /health says 503 ({health})")
            try:
                leader.complete("again")
                again = (200, "")
            except urllib.error.HTTPError as e:
                again = (e.code, e.read().decode())
            except (urllib.error.URLError, ConnectionError) as e:
                again = (None, str(e))
            check(again[0] == 503 and "the engine failed" in again[1],
                  f"node 1 killed: a new request gets 503 naming the failure ({again})")
            try:
                leader.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                leader.p.kill()
            err = leader.p.stderr.read()
            check(leader.p.returncode not in (0, None) and "the engine failed" in err
                  and (step_failure in err or post_failure in err),
                  f"node 1 killed: node 0's server exits non-zero (exit {leader.p.returncode}) "
                  f"naming the step failure ({err.strip()[-300:]})")
            follower.wait()
        else:
            try:
                resp.read()
            except Exception:
                pass
            try:
                _, err = follower.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                follower.kill()
                _, err = follower.communicate()
                err += "(hung: killed after 60 s)"
            leader.p.wait()
            check(follower.returncode not in (0, None)
                  and "multi-node run: node 1 lost node 0" in err,
                  f"node 0 killed after the first token: node 1 exits non-zero (exit "
                  f"{follower.returncode}) saying it lost node 0 ({err.strip()[-300:]})")


def read_logits(path):
    """The "logits" tensor of a dsv4 logits file: (rows, vocab, flat float list)."""
    import array
    b = pathlib.Path(path).read_bytes()
    n = int.from_bytes(b[:8], "little")
    t = json.loads(b[8:8 + n])["logits"]
    lo, hi = t["data_offsets"]
    a = array.array("f")
    a.frombytes(b[8 + n + lo:8 + n + hi])
    return t["shape"][0], t["shape"][1], a


def e2e_close(what, ours, ref, min_cos=0.999, mean_cos=0.9999, max_abs=0.7, argmax=0.97,
              near_tie=0.1):
    """tests/support/golden.h's E2eTolerance on two logits files' contents."""
    rows, V, a = ours
    _, _, b = ref
    coss, worst, agree, same = [], 0.0, 0, 0
    for r in range(rows):
        x, y = a[r * V:(r + 1) * V], b[r * V:(r + 1) * V]
        dot = sum(p * q for p, q in zip(x, y))
        nx, ny = sum(p * p for p in x) ** 0.5, sum(q * q for q in y) ** 0.5
        coss.append(dot / (nx * ny) if nx and ny else 1.0)
        worst = max(worst, max(abs(p - q) for p, q in zip(x, y)))
        mine = max(range(V), key=lambda i: x[i])
        agree += y[mine] >= max(y) - near_tie
        same += sum(p == q for p, q in zip(x, y))
    print(f"  {what}: min cos {min(coss):.6f}, mean cos {sum(coss) / rows:.6f}, max |d| "
          f"{worst:.4g}, argmax (near ties excused) {agree / rows:.4f}, bit-identical "
          f"{same / (rows * V):.4f}")
    return (min(coss) >= min_cos and sum(coss) / rows >= mean_cos and worst <= max_abs
            and agree / rows >= argmax)


def cuda_main(work):
    try:
        gpus = len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
                   .stdout.strip().splitlines())
    except OSError:
        gpus = 0
    if gpus < 2:
        print(f"multinode_test --backend cuda skipped: NCCL with 2 ranks needs 2 GPUs ({gpus})")
        return 77
    model = str(work / "tiny")
    subprocess.run([CLI, "make-tiny", "--preset", "flash", "--format", "nvfp4", "--out", model],
                   check=True, stdout=subprocess.DEVNULL)
    prompt = ",".join(["0"] + [str(2 + (37 * i) % 500) for i in range(69)])
    base = ["logits", "--model", model, "--prompt-ids", prompt, "--backend", "cuda"]
    subprocess.run([CLI] + base + ["--out", "one.safetensors"], check=True)
    one = read_logits("one.safetensors")
    layout = ["--dp", "2", "--ep", "2"]
    p = subprocess.run([CLI] + base + layout + ["--out", "procs.safetensors"],
                       capture_output=True, text=True)
    check(p.returncode == 0, f"one process, 2 GPUs over NCCL runs ({p.stderr.strip()[-300:]})")
    res = run_nodes(base + layout + ["--out", "nodes.safetensors"], 2,
                    env=lambda r: {"CUDA_VISIBLE_DEVICES": str(r)})
    check(all(r[0] == 0 for r in res),
          f"2 nodes of one GPU each run (exit {[r[0] for r in res]}: {res[0][2].strip()[-300:]} "
          f"| {res[1][2].strip()[-300:]})")
    if failures:
        return 1
    check(e2e_close("one process, 2 GPUs", read_logits("procs.safetensors"), one),
          "one process over NCCL within the end-to-end tolerance of one rank")
    check(e2e_close("2 nodes", read_logits("nodes.safetensors"), one),
          "2 nodes over NCCL within the end-to-end tolerance of one rank")
    check(pathlib.Path("nodes.safetensors").read_bytes()
          == pathlib.Path("procs.safetensors").read_bytes(),
          "2 nodes bit-identical to one process with 2 GPUs")
    print(f"{len(failures)} failure(s)" if failures else "all passed")
    return 1 if failures else 0


def main():
    if CUDA:
        with tempfile.TemporaryDirectory(prefix="dsv4-multinode-cuda-") as d:
            os.chdir(d)
            return cuda_main(pathlib.Path(d))
    with tempfile.TemporaryDirectory(prefix="dsv4-multinode-") as d:
        work = pathlib.Path(d)
        os.chdir(work)
        model = str(work / "tiny")
        subprocess.run([CLI, "make-tiny", "--preset", "flash", "--layers", "2", "--vocab", "512",
                        "--out", model], check=True, stdout=subprocess.DEVNULL)
        logits_cases(model, work)
        generate_cases(model)
        error_cases(model)
        serve_case(work)
        kill_cases(work)
    print(f"{len(failures)} failure(s)" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
