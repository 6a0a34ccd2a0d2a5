"""/v1/completions: prompt forms, echo, logprobs checked against `dsv4 logits`, streaming."""

import pytest

from conftest import backend, run_cli
from support import (E2E_NEAR_TIE, LOGPROB_TOL, check_response_near_solo, log_softmax_at,
                     read_logits, stream, tokenize, with_logprobs)


def completion(server, **body):
    status, r = server.post("/v1/completions", body)
    assert status == 200, r
    return r


def token_ids(entries):
    return [int(t.split(":")[1]) for t in entries]


def test_prompt_forms(server, workdir):
    ids = tokenize(server, "Once upon a time")
    base = dict(max_tokens=3, temperature=0)
    one = completion(server, prompt="Once upon a time", **base)
    assert one["object"] == "text_completion" and one["id"].startswith("cmpl-")
    assert one["usage"]["prompt_tokens"] == len(ids)
    text = one["choices"][0]["text"]
    assert completion(server, prompt=ids, **base)["choices"][0]["text"] == text
    other = completion(server, prompt="In a galaxy", **base)["choices"][0]["text"]
    for prompt in [["Once upon a time", "In a galaxy"], [ids, tokenize(server, "In a galaxy")]]:
        both = completion(server, prompt=prompt, **base)
        assert [c["index"] for c in both["choices"]] == [0, 1]
        assert both["usage"]["completion_tokens"] == 6
        if backend() == "cpu":
            assert [c["text"] for c in both["choices"]] == [text, other]
        else:  # two prompts in one batch: each within the tolerance of its solo run
            req = with_logprobs(dict(prompt=prompt, **base))
            solo = [completion(server, **{**req, "prompt": p}) for p in prompt]
            solo = {"choices": [{**c, "index": i} for i, c in
                                enumerate(solo[0]["choices"] + solo[1]["choices"])],
                    "usage": {k: solo[0]["usage"][k] + solo[1]["usage"][k]
                              for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
            check_response_near_solo(server, req, solo, completion(server, **req), workdir)
    # The openai client, n = 2 over two prompts: index = prompt * n + choice.
    r = server.client().completions.create(model="tiny", prompt=["a", "b"], n=2, max_tokens=2,
                                           temperature=1, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]


def test_echo(server):
    r = completion(server, prompt="Echo this", max_tokens=2, temperature=0, echo=True)
    plain = completion(server, prompt="Echo this", max_tokens=2, temperature=0)
    assert r["choices"][0]["text"] == "Echo this" + plain["choices"][0]["text"]


def test_logprobs_match_dsv4_logits(server, workdir):
    prompt = tokenize(server, "The quick brown fox")
    r = completion(server, prompt=prompt, max_tokens=4, temperature=0, logprobs=3, echo=True,
                   return_tokens_as_token_ids=True)
    lp = r["choices"][0]["logprobs"]
    ids = token_ids(lp["tokens"])
    assert ids[:len(prompt)] == prompt
    out = ids[len(prompt):]
    assert len(out) == 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    path = workdir / "logits.safetensors"
    run_cli("logits", "--model", server.model, "--backend", backend(), "--prompt-ids",
            ",".join(map(str, ids[:-1])), "--out", path)
    rows = read_logits(path)
    assert len(rows) == len(ids) - 1
    # CPU: the same sums as `dsv4 logits`, to float32 rounding. CUDA: one prefill there against
    # the server's prefill and decode steps, within the end-to-end tolerance (support.py).
    cpu = backend() == "cpu"
    tol = 2e-4 if cpu else LOGPROB_TOL
    for p in range(1, len(ids)):
        row = rows[p - 1]  # row p - 1 predicts token p
        want = log_softmax_at(row, [ids[p]])[0]
        assert lp["token_logprobs"][p] == pytest.approx(want, abs=tol), p
        top = lp["top_logprobs"][p]
        assert len(top) == 3
        best = sorted(range(len(row)), key=lambda i: -row[i])[:3]
        if cpu:
            assert sorted(token_ids(top)) == sorted(best)
        else:  # the same three, except where a near tie decides membership
            for i in token_ids(top):
                assert row[i] >= row[best[2]] - E2E_NEAR_TIE, (p, i, best)
        for name, value in top.items():
            assert value == pytest.approx(log_softmax_at(row, [token_ids([name])[0]])[0],
                                          abs=tol)
        if p >= len(prompt):  # greedy output: the argmax
            if cpu:
                assert ids[p] == best[0]
            else:
                assert row[best[0]] - row[ids[p]] <= E2E_NEAR_TIE, p
    # Offsets count the text of the tokens before.
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_echo_with_max_tokens_zero_scores_the_prompt(server):
    # The loglikelihood use (lm-eval's): echo, logprobs, nothing generated.
    prompt = tokenize(server, "Paris is the capital of France")
    r = completion(server, prompt=prompt, max_tokens=0, logprobs=1, echo=True,
                   return_tokens_as_token_ids=True)
    lp = r["choices"][0]["logprobs"]
    assert token_ids(lp["tokens"]) == prompt
    assert lp["token_logprobs"][0] is None
    assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
    assert r["usage"]["completion_tokens"] == 0
    with_output = completion(server, prompt=prompt, max_tokens=1, logprobs=1, echo=True,
                             temperature=0, return_tokens_as_token_ids=True)
    assert with_output["choices"][0]["logprobs"]["token_logprobs"][:len(prompt)] == \
        lp["token_logprobs"]


def test_seed_reproduces_a_sampled_completion(server):
    body = dict(prompt="Roll the dice:", max_tokens=6, temperature=1.2, top_k=100, seed=2024)
    a = completion(server, **body)["choices"][0]["text"]
    assert completion(server, **body)["choices"][0]["text"] == a
    assert completion(server, **{**body, "seed": 2025})["choices"][0]["text"] != a
    # Without a seed two draws differ.
    no_seed = {k: v for k, v in body.items() if k != "seed"}
    assert completion(server, **no_seed)["choices"][0]["text"] != \
        completion(server, **no_seed)["choices"][0]["text"]


def test_stream_structure(server):
    body = {"prompt": ["a b c", "d e"], "max_tokens": 3, "temperature": 0, "logprobs": 1,
            "stream_options": {"include_usage": True}}
    events, done = stream(server, "/v1/completions", body)
    assert done
    whole = completion(server, **{k: v for k, v in body.items() if k != "stream_options"})
    texts, finishes, lps = {}, {}, {}
    for e in events[:-1]:
        assert e["object"] == "text_completion" and e["usage"] is None
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["logprobs"]:
                lps.setdefault(c["index"], []).extend(c["logprobs"]["token_logprobs"])
            if c["finish_reason"]:
                assert c["index"] not in finishes
                finishes[c["index"]] = c["finish_reason"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    for c in whole["choices"]:
        assert texts[c["index"]] == c["text"]
        assert finishes[c["index"]] == c["finish_reason"] == "length"
        assert lps[c["index"]] == c["logprobs"]["token_logprobs"]
