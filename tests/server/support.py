"""Helpers the server tests share: raw SSE reads, tokenization through the server."""

import http.client
import json

from conftest import TIME_SCALE

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
