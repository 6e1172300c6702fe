#!/usr/bin/env python3
"""The tiny ReFusion's held-out chats, asked of `refusion serve` as a client would ask them
(benches/README.md#conversations-tools-and-json).

    python3 benches/chat_quality.py --refusion target/release/refusion \
        -m refusion-demo/refusion-tiny-Q4_K_M.gguf

No dependencies beyond the standard library and train/corpus.py. Each held-out chat is sent
whole to `/v1/chat/completions` at the server's default settings, and judged on what the
client gets:
- a conversation (2-4 questions of the tiny model's kinds): the last answer's exact answer is
  the worked one's (`corpus.extract`), so the second, third and fourth questions are scored;
- a tool call (`tools` given, `tool_choice` auto): `message.tool_calls` holds exactly the
  expected call (name and arguments); then with `tool_choice: "required"`;
- an answer after the tool's result: the exact answer;
- a JSON answer with `response_format` `json_object`: the text parses and `answer` is right.
Prints one JSON object: accuracy by kind; `whole_answer_counts`, stricter, where the answer is
text: the whole answer is the worked one character for character (a conversation's last
answer, an answer from a tool's result, a JSON answer's text); and the answers that were wrong.
"""

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "train"))
import corpus  # noqa: E402


def post(base, body):
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"error": json.loads(e.read())}


def judge(base, h):
    """(kind, right, what the client got) for one held-out chat."""
    kind = h["kind"]
    body = {"messages": h["messages"], "max_tokens": 256}
    if h["tools"]:
        body["tools"] = h["tools"]
    if kind == "json":
        body["response_format"] = {"type": "json_object"}
    got = post(base, body)
    if "error" in got:
        return kind, False, got["error"]
    msg = got["choices"][0]["message"]
    text = msg.get("content") or ""
    if kind.startswith("chat:"):
        base_kind = kind.split(":")[1]
        right = corpus.extract(base_kind, text) == corpus.extract(base_kind, h["response"])
        return kind, right, text
    if kind == "tool_call":
        want = json.loads(h["response"].split("\n")[1])
        calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                 for c in msg.get("tool_calls") or []]
        return kind, calls == [want], calls or text
    if kind == "tool_answer":
        return kind, corpus.extract("add", text) == h["answer"], text
    try:
        value = json.loads(text)["answer"]
    except (ValueError, KeyError, TypeError):
        return kind, False, text
    want = json.loads(h["response"])["answer"]
    return kind, value == want, text


def required(base, h):
    """The tool call again, with `tool_choice: "required"`."""
    want = json.loads(h["response"].split("\n")[1])
    got = post(base, {"messages": h["messages"], "tools": h["tools"], "tool_choice": "required",
                      "parallel_tool_calls": False, "max_tokens": 128})
    if "error" in got:
        return False
    calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
             for c in got["choices"][0]["message"].get("tool_calls") or []]
    return calls == [want]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@contextlib.contextmanager
def serving(refusion, model, threads):
    """`refusion serve -m MODEL` on a free port until the block ends: its base URL."""
    port = free_port()
    server = subprocess.Popen([refusion, "serve", "-m", model, "--port", str(port), "-t", str(threads)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        yield base
    finally:
        server.terminate()
        server.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--refusion", default=os.path.join(ROOT, "target/release/refusion"))
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--chats", default=None,
                    help="held-out chats (default: the model folder's heldout_chats.json, else "
                         "corpus.split_dialogues of the training seed)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    default = os.path.join(ROOT, "models/refusion-tiny/heldout_chats.json")
    if a.chats:
        held = json.load(open(a.chats))
    elif os.path.exists(default):
        held = json.load(open(default))
    else:
        held = corpus.split_dialogues(20261201)
    by_kind, whole, wrong = {}, {}, []
    with serving(a.refusion, a.model, a.threads) as base:
        for h in held:
            kind, right, got = judge(base, h)
            k = by_kind.setdefault(kind.split(":")[0], [0, 0])
            k[0] += right
            k[1] += 1
            if isinstance(got, str):
                # Stricter: the whole answer is the worked one, character for character.
                w = whole.setdefault(kind.split(":")[0], [0, 0])
                w[0] += got.strip() == h["response"].strip()
                w[1] += 1
            if not right:
                wrong.append({"kind": kind, "question": h["question"], "got": got})
            if kind == "tool_call":
                k = by_kind.setdefault("tool_call_required", [0, 0])
                k[0] += required(base, h)
                k[1] += 1
    print(json.dumps({"model": a.model, "chats": len(held),
                      "accuracy": {k: round(v[0] / v[1], 3) for k, v in by_kind.items()},
                      "counts": by_kind, "whole_answer_counts": whole, "wrong": wrong[:20]}, indent=1))


if __name__ == "__main__":
    main()
