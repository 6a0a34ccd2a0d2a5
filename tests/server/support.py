"""Helpers the server tests share: raw SSE reads, tokenization through the server, and the
CUDA backend's comparison of a response with its solo run."""

import array
import http.client
import json
import math
import struct

from conftest import TIME_SCALE, run_cli

EOS = 1


def tokenize(server, text):
    status, body = server.post("/tokenize", {"prompt": text})
    assert status == 200, body
    return body["tokens"]


def stream(server, path, body, timeout=120):
    """POSTs a streaming request; returns (events, saw_done): every `data:` JSON event in order
    and whether `data: [DONE]` ended the stream (nothing may follow it)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout * TIME_SCALE)
    headers = {"Content-Type": "application/json"}
    if server.api_key:
        headers["Authorization"] = f"Bearer {server.api_key}"
    conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers=headers)
    r = conn.getresponse()
    assert r.status == 200, r.read()
    assert r.getheader("Content-Type", "").startswith("text/event-stream")
    events, done = [], False
    buf = b""
    while True:
        chunk = r.read1(65536) if hasattr(r, "read1") else r.read(1)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            raw, buf = buf.split(b"\n\n", 1)
            line = raw.decode("utf-8")  # strict: a streamed event is always valid UTF-8
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            assert not done, "an event after [DONE]"
            if payload == "[DONE]":
                done = True
            else:
                events.append(json.loads(payload))
    conn.close()
    assert buf == b"", buf
    return events, done


def chat_stream_text(events):
    """Per choice: (reasoning, content, tool_calls assembled from deltas, finish_reason)."""
    out = {}
    for e in events:
        for c in e.get("choices", []):
            o = out.setdefault(c["index"], {"reasoning": "", "content": "", "calls": {},
                                            "finish": None})
            d = c["delta"]
            o["reasoning"] += d.get("reasoning_content") or ""
            o["content"] += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                call = o["calls"].setdefault(tc["index"], {"id": None, "name": "",
                                                           "arguments": ""})
                if tc.get("id"):
                    call["id"] = tc["id"]
                fn = tc.get("function") or {}
                call["name"] += fn.get("name") or ""
                call["arguments"] += fn.get("arguments") or ""
            if c.get("finish_reason"):
                assert o["finish"] is None, "two finish_reasons for one choice"
                o["finish"] = c["finish_reason"]
    return out


def chat(server, **body):
    body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    status, r = server.post("/v1/chat/completions", body)
    assert status == 200, r
    return r


def read_logits(path):
    """float32 tensor `logits` [T, vocab] of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header["logits"]
    assert meta["dtype"] == "F32"
    rows, vocab = meta["shape"]
    a = array.array("f")
    b, e = meta["data_offsets"]
    a.frombytes(data[b:e])
    return [a[r * vocab:(r + 1) * vocab] for r in range(rows)]


def log_softmax_at(row, ids):
    m = max(row)
    lse = m + math.log(sum(math.exp(x - m) for x in row))
    return [row[i] - lse for i in ids]


# The CUDA backend's kernels are not batch-invariant: a response run in a batch, after a
# preemption or from a prefix-cache hit is held to the end-to-end tolerance of its solo run
# (../shared/golden/README.md, tests/support/golden.h E2eTolerance): logits within 0.7, the
# argmax equal except where the reference's top two are within 0.1. The server reports
# log-softmax values: a logit change of at most 0.7 moves one by at most 0.7 + 0.7 (its own and
# the log-sum-exp's).
E2E_MAX_ABS = 0.7
E2E_NEAR_TIE = 0.1
LOGPROB_TOL = 2 * E2E_MAX_ABS
CUDA_TOP_LOGPROBS = 5  # what a CUDA comparison asks for, to see near ties


def with_logprobs(req):
    """`req` asking for what check_near_solo reads: token ids and the top logprobs of each
    generated token. (The CPU tests send their requests unchanged.)"""
    r = dict(req)
    if "messages" in r:
        r.update(logprobs=True, top_logprobs=max(CUDA_TOP_LOGPROBS, r.get("top_logprobs", 0)))
    else:
        r["logprobs"] = max(CUDA_TOP_LOGPROBS, r.get("logprobs") or 0)
    r["return_tokens_as_token_ids"] = True
    return r


def token_id(name):
    assert name.startswith("token_id:"), name
    return int(name[len("token_id:"):])


def choice_tokens(choice):
    """[(id, logprob, {id: logprob of the top})] of a choice's generated tokens (a response to
    a with_logprobs request, chat or completion, without echo)."""
    lp = choice["logprobs"]
    if "content" in lp:
        return [(token_id(e["token"]), e["logprob"],
                 {token_id(t["token"]): t["logprob"] for t in e["top_logprobs"]})
                for e in lp["content"]]
    return [(token_id(t), v, {token_id(k): x for k, x in top.items()})
            for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]


def _close(what, got, ref_lp, ref_top):
    """One generated token against the reference's numbers for the same context: ref_lp(id)
    (None where unknown) and ref_top {id: logprob} (the reference's best, as many as it has)."""
    gid, glp, gtop = got
    for i, v in [(gid, glp), *gtop.items()]:
        r = ref_lp(i)
        if r is not None:
            assert abs(v - r) <= LOGPROB_TOL, f"{what}: logprob of {i} {v} vs {r}"
    best = sorted(ref_top.items(), key=lambda kv: -kv[1])
    if gtop and len(best) >= 2 and best[0][1] - best[1][1] >= E2E_NEAR_TIE:
        assert max(gtop, key=gtop.get) == best[0][0], f"{what}: argmax {gtop} vs {best[:2]}"


def check_near_solo(what, solo, got, greedy, teacher_forced):
    """CUDA: choice `got` against choice `solo` (both responses to the same with_logprobs
    request). Up to where their tokens part, both ran the same contexts: got's logprobs must be
    within the tolerance of solo's, its argmax solo's unless solo had a near tie. Where they part
    (a near tie that a non-batch-invariant sum may break either way), a greedy token must be
    within the near-tie margin of solo's best. After it, got's tokens are judged against the
    teacher-forced logits of its own tokens, teacher_forced(ids) -> rows predicting them (the
    solo path, `dsv4 logits`). Returns the number of tokens equal to solo's."""
    s, g = choice_tokens(solo), choice_tokens(got)
    assert got["finish_reason"] == solo["finish_reason"], what
    assert len(g) == len(s), what
    d = next((i for i, (a, b) in enumerate(zip(s, g)) if a[0] != b[0]), len(s))
    for i in range(min(d + 1, len(s))):
        ref = {**s[i][2], s[i][0]: s[i][1]}
        _close(f"{what} token {i}", g[i], ref.get, ref)
    if d == len(s):
        return d
    if greedy:
        gap = max(s[d][2].values()) - s[d][2].get(g[d][0], -math.inf)
        assert gap <= E2E_NEAR_TIE, f"{what}: greedy token {d} {g[d][0]}, solo {s[d][0]} " \
                                    f"(solo logprob gap {gap})"
    rows = teacher_forced([t[0] for t in g])
    assert len(rows) == len(g)
    for i in range(d + 1, len(g)):
        row = rows[i]
        ls = dict(zip(range(len(row)), log_softmax_at(row, range(len(row)))))
        top = dict(sorted(ls.items(), key=lambda kv: -kv[1])[:CUDA_TOP_LOGPROBS])
        _close(f"{what} token {i} (after parting)", g[i], ls.get, top)
        if greedy:
            assert max(row) - row[g[i][0]] <= E2E_NEAR_TIE, f"{what}: greedy token {i}"
    return d


def teacher_forced_rows(model, prompt_ids, workdir):
    """For check_near_solo: the logits rows of `dsv4 logits` (the backend under test) that
    predict `ids` after `prompt_ids`."""
    from conftest import backend

    def rows(ids):
        path = workdir / "teacher_forced.safetensors"
        seq = list(prompt_ids) + list(ids[:-1])
        run_cli("logits", "--model", model, "--backend", backend(), "--prompt-ids",
                ",".join(map(str, seq)), "--out", path)
        return read_logits(path)[len(prompt_ids) - 1:]
    return rows


def chat_prompt_ids(server, req):
    """The rendered prompt of a chat request, as /tokenize renders it."""
    body = {k: req[k] for k in ("messages", "tools", "tool_choice", "chat_template_kwargs",
                                "thinking", "reasoning_effort") if k in req}
    status, r = server.post("/tokenize", body)
    assert status == 200, r
    return r["tokens"]


def completion_prompts(server, prompt):
    """The token ids of each prompt of a /v1/completions request."""
    if isinstance(prompt, str):
        return [tokenize(server, prompt)]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    return [tokenize(server, p) if isinstance(p, str) else p for p in prompt]


def without_call_ids(message):
    m = json.loads(json.dumps(message))
    for call in m.get("tool_calls") or []:
        call["id"] = "call_"  # random by design
    return m


def check_response_near_solo(server, req, solo, got, workdir):
    """CUDA: every choice of response `got` against the same choice of `solo` (responses to the
    same with_logprobs request; check_near_solo), the same usage, and the same text where the
    tokens are the same. Returns how many tokens equalled the solo run's."""
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens may differ
    assert [got["usage"][k] for k in counts] == [solo["usage"][k] for k in counts]
    assert len(got["choices"]) == len(solo["choices"])
    greedy = req.get("temperature", 1.0) == 0 and "forced_output" not in req
    n = req.get("n", 1)
    prompts = None if "messages" in req else completion_prompts(server, req["prompt"])
    same = 0
    for k, (s, g) in enumerate(zip(solo["choices"], got["choices"])):
        assert s["index"] == g["index"] == k
        prompt = chat_prompt_ids(server, req) if prompts is None else prompts[k // n]
        d = check_near_solo(f"choice {k}", s, g, greedy,
                            teacher_forced_rows(server.model, prompt, workdir))
        if d == len(choice_tokens(s)):
            if "message" in s:
                assert without_call_ids(g["message"]) == without_call_ids(s["message"])
            else:
                assert g["text"] == s["text"]
        same += d
    return same
