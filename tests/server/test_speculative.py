"""Speculative decoding through HTTP: --speculative-tokens leaves responses, usage and streams
as plain decoding gives them, and /metrics counts drafts with vLLM's names. Drafts are forced
(forced_drafts, a test facility) from the plain server's output, so acceptance is known.
Every test runs against a server of each rollback (--speculative-rollback rerun, restore).

On CUDA (kernels not shape-invariant: a verify's k + 1 rows per sequence take other paths than
one row) the speculative response is held to the plain one as the suite holds batched runs to
solo ones (support.check_response_near_solo: logprobs within the end-to-end tolerance, tokens
equal except near ties, teacher-forced logits after a parting); the counts of all-right drafts
are checked exactly where every token equalled the plain run's (they follow from the tokens),
those of all-wrong drafts always (the drafts are a token the sampler cannot choose)."""

import pytest

from conftest import Server, backend
from support import check_response_near_solo, stream, with_logprobs

PROMPT = [0] + [1000 + 37 * i for i in range(40)]
LABEL = 'model_name="tiny"'
SPEC = ["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total"]


@pytest.fixture(scope="module", params=["rerun", "restore"])
def spec_server(tiny_model, request):
    """One server per rollback (--speculative-rollback): every test runs against both."""
    s = Server(tiny_model, "--test-forced-output", "--served-model-name", "tiny",
               "--max-running", "4", "--max-model-len", "256", "--speculative-tokens", "3",
               "--speculative-rollback", request.param)
    yield s
    assert s.stop() == 0, s.stderr_text()


def request(**extra):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True, **extra}
    return with_logprobs(body) if backend() == "cuda" else body


def completion(server, full=False, **extra):
    status, r = server.post("/v1/completions", request(**extra))
    assert status == 200, r
    c = r["choices"][0]
    ids = [int(t.split(":")[1]) for t in c["logprobs"]["tokens"]]
    return (ids, c, r["usage"], r) if full else (ids, c, r["usage"])


def same_as_plain(server, got, want, tmp_path):
    """got (the speculative response) as plain decoding's `want`: equal on the CPU; on CUDA
    near it (check_response_near_solo). True where every token is plain decoding's."""
    if backend() != "cuda":
        assert (got["choices"][0]["text"], got["choices"][0]["logprobs"], got["usage"]) == \
            (want["choices"][0]["text"], want["choices"][0]["logprobs"], want["usage"])
        return True
    n = len(want["choices"][0]["logprobs"]["tokens"])
    return check_response_near_solo(server, request(), want, got, tmp_path) == n


def counts(server):
    m = server.metrics()
    out = [m[f"{name}{{{LABEL}}}"] for name in SPEC]
    out.append([m[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{p}",{LABEL}}}']
                for p in range(3)])
    return out


def delta(a, b):
    return [b[i] - a[i] for i in range(3)] + [[y - x for x, y in zip(a[3], b[3])]]


def test_plain_server_has_no_spec_metrics(server):
    assert not any(k.startswith("vllm:spec_decode") for k in server.metrics())


def test_outputs_equal_plain_decoding_and_metrics_count_drafts(server, spec_server, tmp_path):
    want_ids, _, _, want = completion(server, full=True)
    assert len(want_ids) == 12
    spec_server.wait_idle()

    # Every draft right: 12 tokens as 1 (prefill) + 4 + 4 + 3 (the last verify has room for 2).
    before = counts(spec_server)
    _, _, _, got = completion(spec_server, full=True, forced_drafts=want_ids)
    spec_server.wait_idle()
    if same_as_plain(server, got, want, tmp_path):
        assert delta(before, counts(spec_server)) == [3, 8, 8, [3, 3, 2]]

    # Every draft wrong: one token per step, nothing accepted, the same output. The drafts are
    # one token the sampler cannot choose (logit_bias -100; logprobs are of the raw row, so
    # plain decoding's stay), so they are wrong whatever the speculative run samples — on CUDA
    # too, where its tokens may part from plain decoding's at a near tie: the counts are
    # checked unconditionally.
    before = counts(spec_server)
    never = next(t for t in range(5000, 129280) if t not in want_ids)
    got_ids, _, _, got = completion(spec_server, full=True, forced_drafts=[never] * 12,
                                    logit_bias={str(never): -100})
    spec_server.wait_idle()
    assert never not in got_ids and len(got_ids) == 12
    d = delta(before, counts(spec_server))
    assert d[0] == 10 and d[1] == 3 * 8 + 2 + 1 and d[2] == 0 and d[3] == [0, 0, 0]
    same_as_plain(server, got, want, tmp_path)

    # Opted out: no drafts.
    before = counts(spec_server)
    _, _, _, got = completion(spec_server, full=True, speculative_tokens=0)
    spec_server.wait_idle()
    same_as_plain(server, got, want, tmp_path)
    assert delta(before, counts(spec_server))[:3] == [0, 0, 0]


def test_streaming_is_unchanged(server, spec_server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    want, done = stream(server, "/v1/completions", body)
    assert done
    want_ids, _, _ = completion(server, max_tokens=10)
    got, done = stream(spec_server, "/v1/completions", {**body, "forced_drafts": want_ids})
    assert done
    text = lambda events: "".join(c["text"] for e in events for c in e.get("choices", []))
    # On CUDA the text is plain decoding's where the tokens are (a near tie may part them:
    # test_outputs_equal_plain_decoding_and_metrics_count_drafts judges the numbers).
    spec_ids, _, _ = completion(spec_server, max_tokens=10, forced_drafts=want_ids)
    if backend() != "cuda" or spec_ids == want_ids:
        assert text(got) == text(want)
    assert got[-1]["usage"] == want[-1]["usage"]
    assert [c["finish_reason"] for e in got for c in e["choices"] if c["finish_reason"]] == \
        ["length"]


def test_bad_speculative_fields_are_400(server, spec_server):
    for bad in [{"speculative_tokens": 4}, {"speculative_tokens": -1}]:
        status, r = spec_server.post("/v1/completions", {"model": "tiny", "prompt": "x", **bad})
        assert status == 400 and r["error"]["param"] == "speculative_tokens", r
