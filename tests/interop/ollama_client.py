#!/usr/bin/env python3
"""Talks to `refusion serve` with the official `ollama` Python client and plain HTTP.

    ollama_client.py BASE_URL [demo]
"demo": the trained tiny model's tool call and the answer from its result. Prints OK and exits 0, or raises."""
import json
import sys
import urllib.error
import urllib.request

import ollama

base = sys.argv[1]
client = ollama.Client(host=base)

if sys.argv[2:] == ["demo"]:
    # The trained tiny model's tool call through ollama's client: the call, the tool's result,
    # the answer from it. The tool as the model was trained with it (train/corpus.py).
    add = {"type": "function", "function": {
        "name": "add", "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}}

    name = client.list().models[0].model
    msgs = [{"role": "user", "content": "Call add to compute 120 + 345."}]
    r = client.chat(model=name, messages=msgs, tools=[add], options={"temperature": 0})
    calls = r.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "add", r
    assert dict(calls[0].function.arguments) == {"a": 120, "b": 345}, calls
    msgs += [r.message, {"role": "tool", "content": "465", "tool_name": "add"}]
    r = client.chat(model=name, messages=msgs, tools=[add], options={"temperature": 0})
    assert r.message.content.endswith("The answer is 465."), r
    print("OK")
    sys.exit(0)

# The model list, as Open WebUI reads it.
tags = client.list()
assert len(tags.models) == 1, tags
m = tags.models[0]
name = m.model
assert m.size > 0 and m.details.format == "gguf" and m.details.family == "qwen3", m
assert m.details.quantization_level == "Q8_0", m.details
assert len(client.ps().models) == 1

messages = [{"role": "user", "content": "Tell me about the sea."}]
opts = {"temperature": 0, "num_predict": 16, "top_k": 40}  # top_k: greedy, so it changes nothing
full = client.chat(model=name, messages=messages, options=opts, stream=False)
assert full.done and full.done_reason in ("stop", "length"), full
assert full.message.role == "assistant"
assert 0 < full.eval_count <= 16 and full.prompt_eval_count > 0, full
text = full.message.content

# Streamed (the API's default; the Python client asks for it): the pieces add up to the same
# answer, the last one says done.
pieces = list(client.chat(model=name, messages=messages, options=opts, stream=True))
assert all(not p.done for p in pieces[:-1]) and pieces[-1].done, pieces
assert "".join(p.message.content for p in pieces) == text, pieces
assert pieces[-1].eval_count == full.eval_count

# /api/generate applies the chat template (one user message): the same answer.
gen = client.generate(model=name, prompt="Tell me about the sea.", options=opts, stream=False)
assert gen.done and gen.response == text, (gen.response, text)
streamed = "".join(p.response for p in client.generate(model=name, prompt="Tell me about the sea.", options=opts, stream=True))
assert streamed == text
# raw: the prompt as it is; a short limit is respected.
raw = client.generate(model=name, prompt="The sea", raw=True, options={"num_predict": 4}, stream=False)
assert raw.done and raw.eval_count <= 4, raw
# An empty prompt only "loads" the model.
assert client.generate(model=name, prompt="").done_reason == "load"

# An empty system message: the client drops the empty content field; still accepted.
empty = client.chat(model=name, messages=[{"role": "system", "content": ""}] + messages, options=opts, stream=False)
assert empty.done, empty

# Errors: ollama's {"error": ...} with the status code.
try:
    client.chat(model=name, messages=messages, options={"num_predict": -7}, stream=False)
    raise AssertionError("num_predict -7 was accepted")
except ollama.ResponseError as e:
    assert e.status_code == 400 and "num_predict" in e.error, (e.status_code, e.error)
try:
    client.chat(model=name, messages=[{"role": "wizard", "content": "hi"}], stream=False)
    raise AssertionError("an unknown role was accepted")
except ollama.ResponseError as e:
    assert e.status_code == 400 and "wizard" in e.error, e.error

# Structured output with a schema, and tools with a call and its answer given back.
schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
r = client.chat(model=name, messages=messages, format=schema, options={"num_predict": 32}, stream=False)
assert isinstance(json.loads(r.message.content)["ok"], bool), r
tools = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"unit": {"type": "string"}}, "required": ["unit"]}}}]
turns = messages + [{"role": "assistant", "content": "",
                     "tool_calls": [{"function": {"name": "weather", "arguments": {"unit": "c"}}}]},
                    {"role": "tool", "content": "12 degrees"}]
try:
    r = client.chat(model=name, messages=turns, tools=tools, options={"num_predict": 4}, stream=False)
    assert r.done and r.prompt_eval_count > 100, r
except ollama.ResponseError as e:
    # A random model may start a call it cannot finish in 4 tokens: said, never passed off as text.
    assert "malformed tool call" in e.error, e.error

# Plain HTTP: NDJSON with its content type, one object per line; the version.
req = urllib.request.Request(base + "/api/chat", data=json.dumps(
    {"model": name, "messages": messages, "options": opts}).encode(), headers={"content-type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    assert r.headers["content-type"] == "application/x-ndjson", r.headers
    lines = [json.loads(line) for line in r.read().decode().splitlines()]
assert lines[-1]["done"] is True and lines[-1]["model"] == name, lines[-1]
with urllib.request.urlopen(base + "/api/version", timeout=30) as r:
    assert json.loads(r.read())["version"]
print("OK")
