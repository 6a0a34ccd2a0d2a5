"""Serving under load: every response equals its solo run (batch invariance, preemption, a
prefix sent twice), disconnects free their pages, the waiting queue is bounded (429), SIGTERM
drains, and a bounded load run leaves no errors, no pages and flat memory."""

import concurrent.futures as futures
import json
import random
import socket
import threading
import time

import pytest

from conftest import TIME_SCALE, Server, backend
from support import check_response_near_solo, stream, tokenize, with_logprobs

# The prefix cache's documented hit granularity (tokens); an identical resend of a P-token
# prompt (P > 2B) reports at least P - B cached tokens.
PREFIX_BLOCK = 256  # EngineOptions::prefix_block: the documented hit granularity


def lasting(cpu_tokens, cuda_tokens):
    """max_tokens for a request that must still run while the test acts on it: the CUDA backend
    decodes the tiny model tens of times faster than the CPU one."""
    return cpu_tokens if backend() == "cpu" else cuda_tokens


def wait_for(condition, timeout=10):
    """Polls until condition() holds (the gauges are published by the engine loop after it
    admits: a stream's first event, the role chunk, can come before that)."""
    deadline = time.time() + timeout * TIME_SCALE
    while not condition() and time.time() < deadline:
        time.sleep(0.02)
    return condition()


def ids_prompt(rng, n):
    return [0] + [rng.randrange(100, 120000) for _ in range(n - 1)]


def run_raw(server, req):
    path = "/v1/chat/completions" if "messages" in req else "/v1/completions"
    status, r = server.post(path, req)
    assert status == 200, r
    return r


def run(server, req):
    return digest(run_raw(server, req))


def digest(r):
    # What must not depend on the rest of the batch: the tokens (as ids), their logprobs, the
    # finish reasons and the usage (tool-call ids are random by design).
    for c in r["choices"]:
        for call in (c.get("message") or {}).get("tool_calls") or []:
            call["id"] = "call_"
    return [(c.get("text", c.get("message")), c["logprobs"], c["finish_reason"])
            for c in r["choices"]], r["usage"]["completion_tokens"]


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}]
CALL = ("Let me look.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"lookup\">\n"
        "<｜DSML｜parameter name=\"q\" string=\"true\">dsv4</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")


def mixed_requests(server, seed, count):
    """Mixed lengths, endpoints and sampling; some chat requests write a forced tool call."""
    rng = random.Random(seed)
    call = tokenize(server, CALL) + [1]
    reqs = []
    for i in range(count):
        req = {"max_tokens": rng.choice([2, 4, 6]), "seed": 1000 + i, "ignore_eos": True}
        kind = i % 4
        if kind == 0:
            req["temperature"] = 0
        elif kind == 1:
            req.update(temperature=0.8, top_k=40, logprobs=2)
        elif kind == 2:
            req.update(temperature=1.0, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3,
                       repetition_penalty=1.1)
        else:
            req.update(temperature=0.7, min_p=0.05, n=2, logit_bias={"1000": 5})
        if i % 3 == 0:
            req["messages"] = [{"role": "user", "content": f"Question {i}: " + "x y " * i}]
            if "logprobs" in req:
                req.update(logprobs=True, top_logprobs=2)
            if i % 6 == 3:
                req.update(tools=TOOLS, forced_output=call, max_tokens=len(call),
                           ignore_eos=False)
        else:
            req["prompt"] = ids_prompt(rng, rng.choice([1, 4, 17, 40, 90]))
            req["return_tokens_as_token_ids"] = True
        reqs.append(req)
    return reqs


def concurrently(server, reqs, workers=None, how=run):
    with futures.ThreadPoolExecutor(max_workers=workers or len(reqs)) as pool:
        return list(pool.map(lambda r: how(server, r), reqs))


def check_near_solo_runs(server, reqs, solo, got, workdir):
    """CUDA: each response of `got` within the end-to-end tolerance of its solo run
    (support.check_near_solo; the requests asked for logprobs through with_logprobs)."""
    same = total = 0
    for i, (req, s, g) in enumerate(zip(reqs, solo, got)):
        try:
            same += check_response_near_solo(server, req, s, g, workdir)
        except AssertionError as e:
            raise AssertionError(f"request {i} {json.dumps(req)[:300]}: {e}") from None
        total += s["usage"]["completion_tokens"]
    print(f"CUDA: {same} of {total} tokens equal to the solo runs'")


def test_each_of_16_concurrent_requests_equals_its_solo_run(server, workdir):
    reqs = mixed_requests(server, 1, 16)
    if backend() == "cpu":
        solo = [run(server, r) for r in reqs]
        server.wait_idle()
        assert concurrently(server, reqs) == solo
    else:
        reqs = [with_logprobs(r) for r in reqs]
        solo_raw = [run_raw(server, r) for r in reqs]
        server.wait_idle()
        check_near_solo_runs(server, reqs, solo_raw, concurrently(server, reqs, how=run_raw),
                             workdir)
        solo = [digest(r) for r in solo_raw]
    server.wait_idle()
    # The forced tool calls were parsed, in the batch as alone; no markup became content.
    calls = [m for (choices, _) in solo for (m, _, f) in choices if f == "tool_calls"]
    assert len(calls) == sum(r.get("n", 1) for r in reqs if "forced_output" in r) > 0
    for m in calls:
        assert m["content"] == "Let me look."
        assert json.loads(m["tool_calls"][0]["function"]["arguments"]) == {"q": "dsv4"}


def test_a_prefix_sent_again_gives_the_cold_output(server, workdir):
    rng = random.Random(9)
    prompt = ids_prompt(rng, 2 * PREFIX_BLOCK + 50)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1,
            "return_tokens_as_token_ids": True}
    if backend() == "cuda":
        body = with_logprobs(body)
    status, cold = server.post("/v1/completions", body)
    status, warm = server.post("/v1/completions", body)
    assert status == 200
    if backend() == "cpu":
        assert warm["choices"] == cold["choices"]
    else:  # the hit resumes within the end-to-end tolerance of the cold run
        check_response_near_solo(server, body, cold, warm, workdir)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a fresh prompt
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt) - PREFIX_BLOCK


def test_an_identical_resend_reports_cached_tokens(server):
    rng = random.Random(10)
    prompt = ids_prompt(rng, 2 * PREFIX_BLOCK + 50)
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    q0 = server.metric("vllm:prefix_cache_hits_total")
    status, first = server.post("/v1/completions", body)
    events, _ = stream(server, "/v1/completions",
                       {**body, "stream_options": {"include_usage": True}})
    cached = events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= len(prompt) - PREFIX_BLOCK
    assert server.metric("vllm:prefix_cache_hits_total") - q0 >= cached


def test_preemption_under_a_small_cache_gives_the_same_outputs(server, tiny_model, workdir):
    # Page size 1: an HCA page holds 128 tokens. 13 MiB leave, after the window rings of 3
    # running sequences and 3 prefix-cache snapshots, pages for about 480 tokens (3 HCA pages):
    # three requests crossing 128 tokens
    # cannot all hold their second page, so the scheduler preempts and recomputes.
    rng = random.Random(4)
    reqs = [{"prompt": ids_prompt(rng, 110), "max_tokens": 24, "temperature": t, "seed": i,
             "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True}
            for i, t in enumerate([0, 0.9, 0.5])]
    cpu = backend() == "cpu"
    if not cpu:
        reqs = [with_logprobs(r) for r in reqs]
    # CPU: = solo (batch invariance, above). CUDA: solo runs, the tolerance's reference.
    want = concurrently(server, reqs) if cpu else [run_raw(server, r) for r in reqs]
    small = Server(tiny_model, "--page-size", "1", "--max-running", "3", "--cache-mb", "13")
    try:
        if cpu:
            assert concurrently(small, reqs) == want
        else:
            check_near_solo_runs(server, reqs, want, concurrently(small, reqs, how=run_raw),
                                 workdir)
        assert small.metric("vllm:num_preemptions_total") > 0
        small.wait_idle()
        # A request larger than the whole pool can never run: an error, not a hang.
        big = {"prompt": ids_prompt(rng, 600), "max_tokens": 2}
        status, r = small.post("/v1/completions", big)
        assert status == 400 and "cannot be scheduled" in r["error"]["message"], r
        events, done = stream(small, "/v1/completions", big)
        assert done and "cannot be scheduled" in events[-1]["error"]["message"]
        assert small.post("/v1/completions", {"prompt": "small", "max_tokens": 1})[0] == 200
        small.wait_idle()
    finally:
        assert small.stop() == 0


def open_stream(server, body):
    """A raw streaming request; returns the socket after the first event arrived."""
    s = socket.create_connection((server.host, server.port))
    data = json.dumps({**body, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    got = b""
    while b"data: " not in got:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    return s


def test_a_client_that_disconnects_frees_its_pages(server):
    server.wait_idle()
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    s = open_stream(server, {"prompt": "Tell me a long story", "max_tokens": lasting(500, 1000),
                             "ignore_eos": True})
    assert wait_for(lambda: server.metric("vllm:num_requests_running") == 1)
    assert server.metric("vllm:kv_cache_usage_perc") > 0
    s.close()
    server.wait_idle(timeout=10)
    # Non-streaming too: the response never comes, the request is cancelled.
    c = socket.create_connection((server.host, server.port))
    data = json.dumps({"prompt": "Another long one", "max_tokens": lasting(500, 1000),
                       "ignore_eos": True}).encode()
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    assert wait_for(lambda: server.metric("vllm:num_requests_running") == 1)
    c.close()
    server.wait_idle(timeout=10)
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 2


def test_the_waiting_queue_is_bounded(tiny_model):
    s = Server(tiny_model, "--max-running", "1", "--max-waiting", "1")
    a = b = None
    try:
        body = {"prompt": "long", "max_tokens": lasting(300, 4000), "ignore_eos": True}
        a = open_stream(s, body)  # running
        assert wait_for(lambda: s.metric("vllm:num_requests_running") == 1)
        b = socket.create_connection((s.host, s.port))  # waiting
        data = json.dumps({**body, "stream": True}).encode()
        b.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        assert wait_for(lambda: s.metric("vllm:num_requests_waiting") == 1)
        assert s.metric("vllm:num_requests_running") == 1
        status, r = s.post("/v1/completions", {"prompt": "one more", "max_tokens": 1})
        assert status == 429 and r["error"]["type"] == "rate_limit_error"
        a.close()
        b.close()
        a = b = None
        s.wait_idle()
        assert s.post("/v1/completions", {"prompt": "now", "max_tokens": 1})[0] == 200
    finally:
        for c in (a, b):  # a failed check must not leave the drain waiting on open streams
            if c:
                c.close()
        assert s.stop() == 0


def test_sigterm_drains_in_flight_requests(tiny_model):
    s = Server(tiny_model, "--max-running", "4")
    results = {}

    def client(i):
        results[i] = stream(s, "/v1/completions", {"prompt": f"drain {i}",
                                                   "max_tokens": lasting(12, 400),
                                                   "ignore_eos": True, "temperature": 0})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.time() + 10 * TIME_SCALE
    while s.metric("vllm:num_requests_running") < 2 and time.time() < deadline:
        time.sleep(0.02)
    s.proc.send_signal(15)
    s.expect("stopping", 10 * TIME_SCALE)
    # New work is refused while draining.
    try:
        status, _, _ = s.request("POST", "/v1/completions", {"prompt": "late", "max_tokens": 1},
                                 timeout=5)
        assert status == 503
    except (ConnectionError, OSError):
        pass  # or the server has already stopped listening
    for t in threads:
        t.join(60 * TIME_SCALE)
    assert s.proc.wait(60 * TIME_SCALE) == 0
    for i in range(2):
        events, done = results[i]
        assert done
        text_events = [c for e in events for c in e["choices"]]
        assert text_events[-1]["finish_reason"] == "length"


def test_bounded_load_run(server):
    """64 streaming clients on loopback for a bounded time: no errors, every request
    complete, nothing left running, no pages held, memory flat."""
    clients, seconds = 64, 12
    server.wait_idle()

    def client(i, until, counts):
        rng = random.Random(i)
        while time.time() < until:
            body = {"prompt": ids_prompt(rng, rng.randrange(2, 30)),
                    "max_tokens": rng.randrange(1, 6), "temperature": 0.8, "seed": i,
                    "ignore_eos": True}
            events, done = stream(server, "/v1/completions", body)
            assert done and events[-1]["choices"][0]["finish_reason"] == "length"
            counts[i] = counts.get(i, 0) + 1

    def phase(duration):
        counts = {}
        until = time.time() + duration
        with futures.ThreadPoolExecutor(max_workers=clients) as pool:
            for f in [pool.submit(client, i, until, counts) for i in range(clients)]:
                f.result()  # re-raises any client's error
        return sum(counts.values())

    phase(3)  # warm-up: thread stacks and allocator pools reach their working size
    server.wait_idle()
    rss0 = server.rss_bytes()
    done = phase(seconds)
    server.wait_idle()
    rss1 = server.rss_bytes()
    assert done >= clients  # every client got through at least one request
    assert server.metric("vllm:request_success_total", finished_reason="error") == 0
    assert rss1 < rss0 * 1.1 + (32 << 20), (rss0, rss1)
