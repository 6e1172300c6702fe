#!/usr/bin/env python3
"""Talks to `refusion serve` with the official `openai` client and plain HTTP.

    openai_client.py BASE_URL MODE
MODE: "api" (completions, streaming, errors), "load" (8 clients x 25 requests),
"busy" (a full queue answers 503), "auth" (API key), "llama" (llama-server's /tokenize,
/detokenize and /props), "tools" (a tool call's round trip, JSON mode with a schema), "demo" (the
trained tiny model's tool call, conversation and JSON answers, checked for their content). Prints
OK and exits 0, or raises."""
import concurrent.futures
import json
import sys
import threading
import time
import urllib.error
import urllib.request

import openai

base, mode = sys.argv[1], sys.argv[2]
KNOBS = {"slot_size": 4, "serial_blocks": 2}


def raw(path, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(path):
    with urllib.request.urlopen(base + path, timeout=30) as r:
        return r.status, json.loads(r.read())


def get_text(path):
    with urllib.request.urlopen(base + path, timeout=30) as r:
        return r.status, r.read().decode()


def check_error(status, body, want_status, needle):
    assert status == want_status, (status, body)
    err = body["error"]
    assert needle in err["message"], err
    assert err["type"], err


if mode == "api":
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    models = client.models.list()
    assert len(models.data) == 1, models
    model = models.data[0].id
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                          extra_body=KNOBS)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens > 0 and full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    deltas = []
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                                stream=True, extra_body=KNOBS):
        if chunk.choices and chunk.choices[0].delta.content:
            deltas.append(chunk.choices[0].delta.content)
    assert "".join(deltas) == text, ("".join(deltas), text)
    # Unknown fields are ignored; ReFusion knobs are accepted.
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                       extra_body={"foo": 1, "slot_threshold": 0.9, "token_threshold": 0.4, **KNOBS})
    assert r.choices[0].message.content is not None
    # Text completions, plain and streamed.
    c = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0, extra_body=KNOBS)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True, extra_body=KNOBS))
    assert streamed == c.choices[0].text, (streamed, c.choices[0].text)
    # A prompt as token ids (OpenAI's and llama-server's completions take them), plain or as a
    # list holding one list; ids beyond the vocabulary are refused.
    ids = [9707, 11, 1879, 0]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0, extra_body=KNOBS)
    assert by_ids.usage.prompt_tokens == len(ids), by_ids.usage
    nested = client.completions.create(model=model, prompt=[ids], max_tokens=8, temperature=0, extra_body=KNOBS)
    assert nested.choices[0].text == by_ids.choices[0].text
    check_error(*raw("/v1/completions", {"prompt": [1, 10**9], "max_tokens": 4}), 400, "beyond the vocabulary")
    # Several prompts in one request: one choice each, in order, each the answer it gets alone,
    # plain and streamed; the usage sums them.
    texts = ["Once upon a time", "The sea is"]
    alone = [client.completions.create(model=model, prompt=t, max_tokens=8, temperature=0, extra_body=KNOBS)
             for t in texts]
    many = client.completions.create(model=model, prompt=texts, max_tokens=8, temperature=0, extra_body=KNOBS)
    assert [c.index for c in many.choices] == [0, 1], many.choices
    assert [c.text for c in many.choices] == [a.choices[0].text for a in alone], many.choices
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone), many.usage
    parts = {0: "", 1: ""}
    for ch in client.completions.create(model=model, prompt=texts, max_tokens=8, temperature=0, stream=True,
                                        extra_body=KNOBS):
        for c in ch.choices:
            parts[c.index] += c.text
    assert [parts[0], parts[1]] == [a.choices[0].text for a in alone], parts
    by_lists = client.completions.create(model=model, prompt=[ids, ids], max_tokens=8, temperature=0, extra_body=KNOBS)
    assert [c.text for c in by_lists.choices] == [by_ids.choices[0].text] * 2
    check_error(*raw("/v1/completions", {"prompt": [], "max_tokens": 4}), 400, "empty list")
    # n > 1 is refused, never silently one choice.
    check_error(*raw("/v1/chat/completions", {"messages": messages, "max_tokens": 4, "n": 2}), 400, "n must be 1")
    # stream_options.include_usage: a last chunk with no choices and the usage, then [DONE].
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=KNOBS))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens, chunks[-1]
    # ... and only there: a client summing usage over the chunks counts it once.
    assert sum(c.usage.total_tokens for c in chunks if c.usage) == full.usage.total_tokens, chunks
    chunks = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body=KNOBS))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0, chunks[-1]
    assert [c for c in chunks[:-1] if c.usage] == [], chunks
    # Errors, OpenAI-style.
    check_error(*raw("/v1/chat/completions", b"{not json"), 400, "malformed JSON")
    check_error(*raw("/v1/chat/completions", {"messages": []}), 400, "messages must not be empty")
    check_error(*raw("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}), 400,
                "temperature")
    check_error(*raw("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "slot_threshold": 2}), 400,
                "slot threshold")
    check_error(*raw("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}), 400,
                "max_tokens")
    check_error(*raw("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 64}),
                400, "exceeds the context")
    check_error(*raw("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (2 << 20)}]}), 413, "too large")
    check_error(*raw("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}), 400, "unknown role")
    check_error(*raw("/v1/nothing", {}), 404, "unknown endpoint")
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=0)
        raise AssertionError("max_tokens=0 accepted")
    except openai.BadRequestError as e:
        assert "max_tokens" in str(e)
    # A client that disconnects mid-stream cancels its generation; the server goes on.
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(
        {"messages": [{"role": "user", "content": "long"}], "max_tokens": 512, "stream": True, **KNOBS}).encode(),
        headers={"content-type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=60)
    resp.readline()
    resp.close()
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, extra_body=KNOBS)
    assert r.choices[0].message.content is not None
    s, h = get("/health")
    assert s == 200 and h["status"] == "ok" and h["slots_idle"] + h["slots_processing"] == 4, h

elif mode == "load":
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    failures = []

    def worker(i):
        for j in range(25):
            try:
                r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"client {i} request {j}"}],
                                                   max_tokens=8, extra_body=KNOBS)
                assert r.choices[0].message.content is not None
            except Exception as e:  # noqa: BLE001
                failures.append(repr(e))

    t = time.time()
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        list(ex.map(worker, range(8)))
    assert not failures, failures[:3]
    s, h = get("/health")
    assert s == 200 and h["status"] == "ok", h
    # Prometheus' text: the 200 requests answered, batches of several requests at a time.
    s, metrics = get_text("/metrics")
    values = dict(line.split(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
    assert int(values["refusion_requests_finished_total"]) >= 200, metrics
    assert int(values["refusion_forwards_total"]) > 0 and int(values["refusion_kv_entries"]) > 0, metrics
    assert values["refusion_requests_running"] == "0", metrics
    print(f"200 requests in {time.time() - t:.1f} s", file=sys.stderr)

elif mode == "busy":
    codes = []
    lock = threading.Lock()

    def hit(i):
        s, b = raw("/v1/chat/completions", {"messages": [{"role": "user", "content": f"busy {i}"}], "max_tokens": 256, **KNOBS})
        with lock:
            codes.append((s, b))

    threads = [threading.Thread(target=hit, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    busy = [b for s, b in codes if s == 503]
    assert busy, [s for s, _ in codes]
    assert "busy" in busy[0]["error"]["message"], busy[0]
    assert any(s == 200 for s, _ in codes)

elif mode == "auth":
    check_error(*raw("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}), 401, "API key")
    s, b = raw("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, **KNOBS},
               {"authorization": "Bearer sekrit"})
    assert s == 200, b
    client = openai.OpenAI(base_url=base + "/v1", api_key="sekrit")
    assert client.models.list().data

elif mode == "llama":
    text = "Tell me about the sea."
    s, b = raw("/tokenize", {"content": text})
    assert s == 200 and b["tokens"] and all(isinstance(t, int) for t in b["tokens"]), b
    ids = b["tokens"]
    s, b = raw("/detokenize", {"tokens": ids})
    assert s == 200 and b["content"] == text, b
    s, b = raw("/tokenize", {"content": text, "with_pieces": True})
    assert [p["id"] for p in b["tokens"]] == ids and "".join(p["piece"] for p in b["tokens"]) == text, b
    # The ids from /tokenize as a completions prompt: the same answer as the text.
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    by_text = client.completions.create(model="m", prompt=text, max_tokens=8, temperature=0, extra_body=KNOBS)
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=8, temperature=0, extra_body=KNOBS)
    assert by_text.choices[0].text == by_ids.choices[0].text
    check_error(*raw("/detokenize", {"tokens": [10**9]}), 400, "outside the vocabulary")
    assert raw("/detokenize", {"tokens": [10**9]})[1]["error"]["param"] == "tokens"
    check_error(*raw("/tokenize", {"text": text}), 400, "content")
    s, b = get("/props")
    assert s == 200 and b["total_slots"] == 4, b
    assert b["default_generation_settings"]["n_ctx"] > 0, b
    assert b["default_generation_settings"]["params"]["n_predict"] > 0, b
    # Thresholds as typed (0.6), not as their f32 reads in f64 (0.6000000238418579).
    for k in ("slot_threshold", "token_threshold"):
        x = b["default_generation_settings"]["params"][k]
        assert x == round(x, 6), (k, x)
    assert "im_start" in b["chat_template"], b["chat_template"][:200]
    # JSON errors name the field in plain words and set `param`.
    msgs = [{"role": "user", "content": "hi"}]
    for body, param, words in [
        ({"messages": msgs, "max_tokens": "many"}, "max_tokens", "max_tokens must be an integer of 0 or more"),
        ({"messages": msgs, "max_tokens": -3}, "max_tokens", "max_tokens must be an integer of 0 or more"),
        ({"messages": msgs, "temperature": "hot"}, "temperature", "temperature must be a number"),
        ({"messages": msgs, "stream": "yes"}, "stream", "stream must be true or false"),
        ({"messages": msgs, "stop": 5}, "stop", "stop must be a string or a list of strings"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "must be a string or a list of text parts"),
        ({"max_tokens": 4}, "messages", "messages is required"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role", "messages[0].role is required"),
    ]:
        s, b = raw("/v1/chat/completions", body)
        check_error(s, b, 400, words)
        assert b["error"]["param"] == param, (body, b)
    s, b = raw("/v1/completions", {"prompt": {"text": "hi"}})
    check_error(s, b, 400, "prompt must be a string, a list of one string, or token ids")

elif mode == "tools":
    # The agent's loop with the official client: a required call, the tool's answer given
    # back, then the answer; JSON mode with a schema; a streamed call accumulated.
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    tools = [{"type": "function", "function": {
        "name": "weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                       "required": ["unit"], "additionalProperties": False}}}]
    msgs = [{"role": "user", "content": "What is the weather in Oslo?"}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=tools, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=96)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", r
    call = choice.message.tool_calls[0]
    assert call.function.name == "weather" and json.loads(call.function.arguments)["unit"] in ("c", "f"), call
    msgs.append(choice.message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": "12 degrees"})
    r = client.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=8)
    assert r.usage.prompt_tokens > 0 and r.choices[0].finish_reason in ("stop", "length", "tool_calls"), r
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.chat.completions.create(
        model="m", messages=msgs[:1], max_tokens=32,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool), r
    calls = {}
    for chunk in client.chat.completions.create(model="m", messages=msgs[:1], tools=tools, stream=True,
                                                tool_choice={"type": "function", "function": {"name": "weather"}},
                                                max_tokens=96):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            c = calls.setdefault(d.index, {"name": "", "arguments": ""})
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
    assert calls[0]["name"] == "weather" and json.loads(calls[0]["arguments"])["unit"] in ("c", "f"), calls

elif mode == "demo":
    # The trained tiny model (its corpus's tools: train/corpus.py), as an agent uses it: the
    # call it chooses, the tool's result given back, the answer from it; a conversation's
    # second question; a JSON answer under a schema.
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    tools = [{"type": "function", "function": {
        "name": "weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {
            "name": "add", "description": "Add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"]}}}]
    msgs = [{"role": "user", "content": "Call add to compute 120 + 345."}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", r
    call = choice.message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 120, "b": 345}, call
    msgs.append(choice.message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": "465"})
    r = client.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=64)
    assert r.choices[0].finish_reason == "stop", r
    assert r.choices[0].message.content.endswith("The answer is 465."), r
    # Streamed, the call goes out as it is committed (its name first, then its arguments, in
    # as many chunks as the decode commits them: tested piece by piece in tool_stream.rs).
    calls, chunks = {}, 0
    for chunk in client.chat.completions.create(model="m", messages=msgs[:1], tools=tools, stream=True,
                                                max_tokens=64):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            chunks += 1
            c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += d.id or ""
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            assert chunk.choices[0].finish_reason == "tool_calls", chunk
    assert list(calls) == [0] and calls[0]["name"] == "add" and calls[0]["id"], calls
    assert json.loads(calls[0]["arguments"]) == {"a": 120, "b": 345} and chunks >= 1, (calls, chunks)
    # The weather tool's result, as a tool would give it, read into the answer.
    msgs = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
                "name": "weather", "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "tool_call_id": "call_0",
             "content": json.dumps({"city": "Paris", "degrees": 21, "sky": "sunny"})}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=64)
    assert r.choices[0].message.content.endswith("The answer is 21."), r
    chat = [{"role": "user", "content": "What is 47 + 38?"}]
    r = client.chat.completions.create(model="m", messages=chat, max_tokens=128)
    first = r.choices[0].message.content
    assert first.endswith("The answer is 85."), first
    chat += [{"role": "assistant", "content": first},
             {"role": "user", "content": "Mia has 12 apples and gets 7 more. How many apples does Mia have now?"}]
    r = client.chat.completions.create(model="m", messages=chat, max_tokens=128)
    assert r.choices[0].message.content.endswith("The answer is 19."), r
    schema = {"type": "object", "properties": {"answer": {"type": "array", "items": {"type": "integer"}}},
              "required": ["answer"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Reverse the list [12, 7, 30, 5]. Answer in JSON."}],
        max_tokens=64, response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert json.loads(r.choices[0].message.content) == {"answer": [5, 30, 7, 12]}, r

print("OK")
