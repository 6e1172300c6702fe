"""The refusion Python package against refusion itself: the same answers and dicts as
`refusion serve` on the same file, threads calling one model at once, streaming, tracing,
scoring, errors and Ctrl-C.

REFUSION_TEST_MODEL: a GGUF file (the trained tiny model, f32); REFUSION_TEST_SLOW_MODEL: a
file whose decodes take seconds (a synthetic 0.6B), for Ctrl-C; REFUSION_BIN: the refusion
binary (for the server). .ci/run sets them.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from refusion import Refusion

MODEL = os.environ["REFUSION_TEST_MODEL"]
BIN = os.environ.get("REFUSION_BIN", "refusion")
QUESTIONS = ["What is 23 + 16?", "Add 86 and 88.", "What is 7 + 5?", "Add 40 and 2."]


@pytest.fixture(scope="module")
def llm():
    return Refusion(MODEL, n_threads=2, n_ctx=2048)


@pytest.fixture(scope="module")
def server():
    p = subprocess.Popen([BIN, "serve", "-m", MODEL, "--port", "0", "-t", "2", "-c", "2048"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    base = None
    for line in p.stderr:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            base = m.group(1)
            break
    assert base, "the server did not start"
    threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
    yield base
    p.kill()
    p.wait()


def post(base, path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())


def core(d):
    """What must agree between the package and the server (ids and times differ)."""
    return {"object": d["object"], "choices": d["choices"], "usage": d["usage"]}


def test_chat_completions_are_the_servers(llm, server):
    for q in QUESTIONS[:2]:
        msgs = [{"role": "user", "content": q}]
        for extra in ({}, {"logprobs": True, "top_logprobs": 2}, {"max_tokens": 7, "strategy": "ar"}):
            ours = llm.create_chat_completion(msgs, **extra)
            theirs = post(server, "/v1/chat/completions", {"messages": msgs, **extra})
            assert core(ours) == core(theirs), extra


def test_completions_are_the_servers_echo_and_scores_included(llm, server):
    ids = llm.tokenize("What is 23 + 16? The answer is")
    for extra in ({"max_tokens": 8}, {"max_tokens": 0, "echo": True, "logprobs": 3},
                  {"max_tokens": 1, "echo": True, "logprobs": 1}, {"max_tokens": 4, "echo": True},
                  {"max_tokens": 32, "suffix": "\nThe answer is 39."}):
        ours = llm.create_completion(ids, **extra)
        theirs = post(server, "/v1/completions", {"prompt": [ids], **extra})
        assert core(ours) == core(theirs), extra
    scored = llm.create_completion(ids, max_tokens=0, echo=True, logprobs=1)["choices"][0]["logprobs"]
    assert scored["token_logprobs"][0] is None and len(scored["tokens"]) == len(ids)
    assert all(lp <= 0 for lp in scored["token_logprobs"][1:])


def test_generate_gives_the_figures_and_the_same_answer_as_chat(llm):
    r = llm.generate(QUESTIONS[0])
    chat = llm.create_chat_completion([{"role": "user", "content": QUESTIONS[0]}])
    assert r["text"] == chat["choices"][0]["message"]["content"]
    assert r["tpf"] > 1 and r["forwards"] > 0 and r["completion_tokens"] == len(r["tokens"])
    assert llm.detokenize(r["tokens"], special=False).decode() == r["text"]
    traced = llm.generate(QUESTIONS[0], trace=True)
    assert traced["tokens"] == r["tokens"] and traced["steps"]
    last = {}
    for step in traced["steps"]:
        for i, state, tok in step:
            last[i] = (state, tok)
    done = [last[i] for i in range(len(r["tokens"]))]
    assert all(s in ("committed", "infilled") for s, _ in done)
    assert [t for _, t in done] == r["tokens"]


def test_a_template_s_gaps_are_filled_as_the_cli_fills_them(llm):
    q = "What is 23 + 16?"
    t = "We add 23 and 16 column by column.\n{{gap}}\nThe answer is {{gap:8}}."
    r = llm.generate(q, template=t)
    assert r["gaps"] and len(r["gaps"]) == 2, r
    assert r["text"].startswith("We add 23 and 16 column by column.\n"), r["text"]
    assert r["text"].endswith(".") and r["gaps"][1]["text"].strip() == "39", r
    cli = subprocess.run([BIN, "generate", "-m", MODEL, "-p", q, "--template", t, "-t", "2", "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(cli)["gaps"] == r["gaps"], cli
    with pytest.raises(ValueError, match="template"):
        llm.generate(q, template="no gap here")
    # Checked as the infill strategy's settings (slot decoding's blocks need not split).
    odd = llm.generate(q, template=t, serial_blocks=3)
    assert odd["gaps"], odd


def test_threads_calling_one_model_at_once_get_their_own_answers(llm):
    alone = {q: llm.generate(q)["tokens"] for q in QUESTIONS}
    got, errors = {}, []

    def ask(q):
        try:
            got[q] = llm.generate(q)["tokens"]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(q,)) for q in QUESTIONS * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == alone
    batch = llm.generate_batch(QUESTIONS)
    assert [b["tokens"] for b in batch] == [alone[q] for q in QUESTIONS]


def test_the_gil_is_released_while_decoding(llm):
    ticks, stop = [0], threading.Event()

    def tick():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    t = threading.Thread(target=tick)
    t.start()
    before = ticks[0]
    llm.generate(QUESTIONS[1], max_tokens=64)
    during = ticks[0] - before
    stop.set()
    t.join()
    assert during > 5, during


def test_streams_are_the_whole_answer(llm):
    msgs = [{"role": "user", "content": QUESTIONS[2]}]
    whole = llm.create_chat_completion(msgs)["choices"][0]
    chunks = list(llm.create_chat_completion(msgs, stream=True))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    stopped = llm.create_completion(llm.tokenize("What is 7 + 5?"), max_tokens=32, stop=["+"])
    streamed = "".join(c["choices"][0]["text"] for c in
                       llm.create_completion(llm.tokenize("What is 7 + 5?"), max_tokens=32, stop=["+"], stream=True))
    assert streamed == stopped["choices"][0]["text"] and "+" not in streamed


def test_mistakes_are_python_exceptions_with_the_servers_words(llm, server):
    with pytest.raises(ValueError, match="max_tokens must be between 1 and"):
        llm.create_completion("x", max_tokens=0)
    with pytest.raises(ValueError, match="unknown strategy 'beam'"):
        llm.generate("x", strategy="beam")
    with pytest.raises(ValueError, match="logprobs is not supported with stream"):
        llm.create_chat_completion([{"role": "user", "content": "x"}], logprobs=True, stream=True)
    with pytest.raises(ValueError, match="beyond the vocabulary"):
        llm.detokenize([10**8])
    with pytest.raises(TypeError, match="unexpected keyword argument 'top_p'"):
        llm.generate("x", top_p=0.5)
    with pytest.raises(OSError, match="no-such-file.gguf"):
        Refusion("no-such-file.gguf")
    too_long = llm.tokenize("a") * 2100
    with pytest.raises(ValueError, match="exceeds the context"):
        llm.generate(too_long, max_tokens=8)


CTRL_C = r"""
import os, signal, sys, threading, time
from refusion import Refusion
# Python keeps SIGINT ignored when it starts ignored (a background job of a script): a user's
# Ctrl-C is what is tested, so it gets Python's own handler whatever ran the tests.
signal.signal(signal.SIGINT, signal.default_int_handler)
llm = Refusion(sys.argv[1], n_threads=2, n_ctx=4096)
threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
t = time.time()
try:
    llm.generate([1, 2, 3], max_tokens=2048, strategy="ar")
    print("finished")
except KeyboardInterrupt:
    print("interrupted after %.1f s" % (time.time() - t))
r = llm.generate([1, 2, 3], max_tokens=3, strategy="ar")
print("then", r["finish_reason"], len(r["tokens"]))
"""


def test_ctrl_c_stops_a_decode_and_the_model_still_answers():
    slow = os.environ["REFUSION_TEST_SLOW_MODEL"]
    out = subprocess.run([sys.executable, "-c", CTRL_C, slow], capture_output=True, text=True, timeout=600)
    assert "interrupted after" in out.stdout, out.stdout + out.stderr
    secs = float(out.stdout.split("interrupted after ")[1].split()[0])
    assert secs < 30, out.stdout
    assert "then length 3" in out.stdout, out.stdout + out.stderr
