"""Every endpoint besides generation, the error contract, the API key, 503 while loading."""

import json
import shutil
import subprocess
import time

import pytest

from conftest import Server, cli_path, tokenizer_file
from support import tokenize


def test_models_lists_the_served_name_and_context(server):
    m = server.get_json("/v1/models")
    assert m["object"] == "list"
    assert [d["id"] for d in m["data"]] == ["tiny"]
    assert m["data"][0]["max_model_len"] == 1024
    assert m["data"][0]["object"] == "model"
    # The openai client reads the same.
    assert [x.id for x in server.client().models.list()] == ["tiny"]


def test_health_is_503_while_loading_then_200(tiny_model):
    s = Server(tiny_model, wait_ready=False)
    try:
        statuses = []
        deadline = time.time() + 60
        while time.time() < deadline:
            status, _, body = s.request("GET", "/health")
            statuses.append(status)
            if status == 503:
                assert json.loads(body)["error"]["message"] == "the model is loading"
                # Generation requests are refused the same way while loading.
                st, _, _ = s.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
                assert st in (503, 200)
            if status == 200:
                break
            time.sleep(0.02)
        # HTTP came up before the model: the first answers were 503, then 200 for good.
        assert statuses[0] == 503, statuses
        assert statuses[-1] == 200, statuses
        assert set(statuses) == {503, 200}
        s.wait_ready()
        assert s.request("GET", "/health")[0] == 200
    finally:
        assert s.stop() == 0


def test_metrics_has_the_vllm_names_labelled_by_model(server):
    server.wait_idle()
    m = server.metrics()
    label = 'model_name="tiny"'
    for gauge in ["vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc"]:
        assert f"{gauge}{{{label}}}" in m
    assert m[f"vllm:num_requests_running{{{label}}}"] == 0
    assert 0 <= m[f"vllm:kv_cache_usage_perc{{{label}}}"] <= 1
    for counter in ["vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                    "vllm:num_preemptions_total"]:
        assert f"{counter}{{{label}}}" in m
    for reason in ["stop", "length", "abort", "error"]:
        assert f'vllm:request_success_total{{finished_reason="{reason}",{label}}}' in m
    _, headers, text = server.request("GET", "/metrics")
    assert headers["Content-Type"].startswith("text/plain")
    text = text.decode()
    for hist in ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds"]:
        assert f"# TYPE {hist} histogram" in text
        buckets = [(k, v) for k, v in m.items() if k.startswith(hist + "_bucket{")]
        assert buckets and buckets[-1][0] == f'{hist}_bucket{{le="+Inf",{label}}}'
        counts = [v for _, v in buckets]
        assert counts == sorted(counts), "buckets are cumulative"
        assert m[f"{hist}_count{{{label}}}"] == counts[-1]
        assert f"{hist}_sum{{{label}}}" in m


def test_metrics_count_a_request(server):
    server.wait_idle()
    before = server.metrics()
    r = server.client().completions.create(model="tiny", prompt="Count me", max_tokens=3,
                                           temperature=0, extra_body={"ignore_eos": True})
    server.wait_idle()
    after = server.metrics()
    label = 'model_name="tiny"'
    d = lambda k: after[k.format(label)] - before[k.format(label)]
    assert d("vllm:generation_tokens_total{{{}}}") == 3
    assert d("vllm:prompt_tokens_total{{{}}}") == r.usage.prompt_tokens
    assert d('vllm:request_success_total{{finished_reason="length",{}}}') == 1
    assert d("vllm:time_to_first_token_seconds_count{{{}}}") == 1
    assert d("vllm:inter_token_latency_seconds_count{{{}}}") == 2
    assert d("vllm:e2e_request_latency_seconds_count{{{}}}") == 1


def test_tokenize_and_detokenize_round_trip(server):
    text = "Hello, 世界! <｜User｜>"
    status, t = server.post("/tokenize", {"prompt": text})
    assert status == 200
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 1024
    assert t["tokens"][-1] == 128803  # the control token is matched, not spelled out
    status, d = server.post("/detokenize", {"tokens": t["tokens"]})
    assert status == 200 and d["prompt"] == text


def test_tokenize_messages_renders_like_the_official_encoder(server):
    # encoding_dsv4.md, fixture T12 (response_format on the system message): the server puts
    # the request's response_format there.
    status, t = server.post("/tokenize", {
        "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
        "response_format": {"type": "json_object"}})
    assert status == 200, t
    assert t["tokens"] == [0, 53, 271, 372, 17038, 29478, 979, 3476, 74366, 29851, 42917, 304,
                           270, 2502, 37913, 304, 20430, 1137, 24313, 4611, 3362, 582, 14479,
                           55774, 62773, 128803, 51, 128804, 128822]
    # Thinking mode opens <think> after the assistant token; add_special_tokens false drops BOS.
    status, t = server.post("/tokenize", {"messages": [{"role": "user", "content": "Q"}],
                                          "chat_template_kwargs": {"thinking": True},
                                          "add_special_tokens": False})
    assert status == 200
    assert t["tokens"] == [128803, 51, 128804, 128821]


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400,
     None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
     404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
     400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 10 ** 9}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 1.5}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 17}, 400,
     None),  # above --max-running: the engine refuses it
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400,
     "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": [""]}, 400,
     "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"description": "x"}}]},
     400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "retrieval"}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {
                                  "name": "f", "parameters": "not a schema"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}},
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "thinking": {"type": "sometimes"}}, 400, "thinking"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "reasoning_effort": "extreme"}, 400, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "yaml"}}, 400, "response_format"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 999999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1.5]]}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": " ".join(map(str, range(2000)))}, 400,
     None),  # longer than --max-model-len
    ("/tokenize", {}, 400, None),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_malformed_requests_get_4xx_and_the_server_keeps_serving(server, path, body, status,
                                                                 param):
    got, _, data = server.request("POST", path, body,
                                  headers={"Content-Type": "application/json"})
    assert got == status, data
    err = json.loads(data)["error"]
    assert err["message"] and err["code"] == status
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param:
        assert err["param"] == param, err
    # ... and the next request is served.
    ok, _, _ = server.request("POST", "/v1/completions", {"prompt": "ok", "max_tokens": 1})
    assert ok == 200


def test_unknown_route_and_method_are_404(server):
    for method, path in [("GET", "/v2/anything"), ("POST", "/v1/embeddings"),
                         ("GET", "/v1/chat/completions")]:
        status, _, data = server.request(method, path, b"{}" if method == "POST" else None)
        assert status == 404, (method, path)
        assert json.loads(data)["error"]["type"] == "not_found_error"


def test_the_listen_backlog_holds_a_burst_of_clients(server):
    """cpp-httplib's compiled-in backlog (5 in Debian's build) would drop the handshakes of many
    clients starting at once; the server widens it. ss reports a listening socket's backlog as
    its Send-Q."""
    ss = shutil.which("ss")
    if not ss:
        pytest.skip("no ss (iproute2) to read the listen backlog")
    row = subprocess.run([ss, "-Hltn", f"sport = :{server.port}"], capture_output=True,
                         text=True, timeout=30).stdout.split()
    assert row[:1] == ["LISTEN"] and int(row[2]) >= 128, row


def test_a_body_over_the_limit_is_413(server):
    big = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    status, _, data = server.request("POST", "/v1/completions", big,
                                     headers={"Content-Type": "application/json"})
    assert status == 413
    assert "limit" in json.loads(data)["error"]["message"]
    assert server.request("GET", "/health")[0] == 200


@pytest.fixture(scope="module")
def keyed(tiny_model):
    s = Server(tiny_model, "--api-key", "sekrit", "--max-running", "2")
    yield s
    assert s.stop() == 0


def test_api_key(keyed):
    import openai
    body = {"prompt": "x", "max_tokens": 1}
    for headers in [{"Authorization": "none"}, {"Authorization": "Bearer wrong"}]:
        for method, path, b in [("POST", "/v1/completions", body), ("GET", "/v1/models", None),
                                ("POST", "/tokenize", {"prompt": "x"})]:
            status, _, data = keyed.request(method, path, b, headers=headers)
            assert status == 401, (path, data)
            assert json.loads(data)["error"]["type"] == "authentication_error"
    # /health and /metrics need no key.
    assert keyed.request("GET", "/health", headers={"Authorization": "none"})[0] == 200
    assert keyed.request("GET", "/metrics", headers={"Authorization": "none"})[0] == 200
    assert keyed.request("POST", "/v1/completions", body)[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.base_url, api_key="wrong",
                      max_retries=0).models.list()
    assert keyed.client().models.list().data[0].id == keyed.model


def test_forced_output_needs_the_test_flag(keyed):
    status, body = keyed.post("/v1/completions", {"prompt": "x", "max_tokens": 1,
                                                  "forced_output": [5]})
    assert status == 400 and body["error"]["param"] == "forced_output"
    assert "--test-forced-output" in body["error"]["message"]


def test_tokenize_helper_agrees_with_messages(server):
    # The rendered chat prompt's ids are those of its text.
    status, t = server.post("/tokenize", {"messages": [{"role": "user", "content": "Q"}]})
    assert status == 200
    assert t["tokens"] == tokenize(server, "<｜begin▁of▁sentence｜><｜User｜>Q<｜Assistant｜></think>")


def test_make_tiny_takes_the_tokenizer_and_its_vocabulary(tiny_model, workdir):
    import pathlib
    import subprocess
    config = json.loads((pathlib.Path(tiny_model) / "config.json").read_text())
    assert config["vocab_size"] == 129280 and config["eos_token_id"] == 1
    assert (pathlib.Path(tiny_model) / "tokenizer.json").read_bytes() == \
        tokenizer_file().read_bytes()
    r = subprocess.run([cli_path(), "make-tiny", "--preset", "flash", "--out",
                        str(workdir / "too-small"), "--tokenizer", str(tokenizer_file()),
                        "--vocab", "1000"], capture_output=True, text=True)
    assert r.returncode != 0
    assert "--vocab 1000 is below the tokenizer's 129280 ids" in r.stderr


def test_random_weights_serve_refuses_a_vocabulary_below_the_tokenizer_before_generating(workdir):
    import subprocess
    # The command line's check (make-tiny's words), not the server's after loading the model
    # ("... ids, more than the model's vocabulary of 1000").
    r = subprocess.run([cli_path(), "serve", "--random-weights", "pro", "--tokenizer",
                        str(tokenizer_file()), "--vocab", "1000", "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--vocab 1000 is below the tokenizer's 129280 ids" in r.stderr
    assert "more than the model's vocabulary" not in r.stderr


def test_random_weights_serve_as_the_make_tiny_checkpoint(server):
    # The shared server's checkpoint (make-tiny --preset flash --seed 3 --tokenizer T) generated
    # in memory: the vocabulary is the tokenizer's as make-tiny's, the completion the same.
    r = Server(None, "--random-weights", "flash", "--weights-seed", "3", "--tokenizer",
               tokenizer_file(), "--max-model-len", "1024")
    try:
        assert [d["id"] for d in r.get_json("/v1/models")["data"]] == ["random-weights:flash"]
        ask = dict(prompt="The random weights", max_tokens=6, temperature=0, logprobs=2)
        a = server.client().completions.create(model="tiny", **ask)
        b = r.client().completions.create(model="random-weights:flash", **ask)
        assert b.choices[0].text == a.choices[0].text
        assert b.choices[0].logprobs.token_logprobs == a.choices[0].logprobs.token_logprobs
    finally:
        assert r.stop() == 0, r.stderr_text()
