#!/usr/bin/env python3
"""JSON answers three ways, on the tiny ReFusion's held-out JSON questions
(benches/README.md#structured-output-left-to-right-or-a-skeleton).

    python3 benches/structured_quality.py --refusion target/release/refusion \
        -m refusion-demo/refusion-tiny-Q4_K_M.gguf

No dependencies beyond the standard library (and chat_quality.py's server helpers). Each held-out JSON question
("What is 23 + 16? Answer in JSON.", trained to answer `{"answer": 39}`) goes to `refusion serve`'s `/v1/chat/completions`:
- `free`: no constraint, slot decoding (the model's own JSON);
- `schema`: `response_format` json_schema (`{"answer": integer}`, or an array of integers
  for the list questions), slot decoding at the answer's frontier (the default strategy):
  the schema's forced text committed without a forward, each slot drafted and verified with
  every token masked by the grammar;
- `schema_ar`: the same schema decoded left to right (`"strategy": "ar"`), one token a forward
  (the forced text without a forward too);
- `skeleton`: the schema's fixed text as known spans and the value as a gap
  (`{"answer": {{gap}}}` with `"infill": true`), decoded by slots in any order, unconstrained.
Each answer is judged as the client gets it: valid (the text parses and the schema holds),
right (and `answer` is the worked one); with the forwards, tokens per forward and decode time
the server reports (`timings`). Prints one JSON object.
"""

import argparse
import json
import os

from chat_quality import ROOT, post, serving


def schema_for(want):
    value = {"type": "array", "items": {"type": "integer"}} if isinstance(want, list) else {"type": "integer"}
    return {"type": "object", "properties": {"answer": value}, "required": ["answer"],
            "additionalProperties": False}


def holds(value, want):
    """The schema's check: an object with exactly `answer`, of the worked answer's type."""
    if not isinstance(value, dict) or set(value) != {"answer"}:
        return False
    v = value["answer"]
    if isinstance(want, list):
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    return isinstance(v, int) and not isinstance(v, bool)


def ask(base, h, way):
    want = json.loads(h["response"])["answer"]
    body = {"messages": list(h["messages"]), "max_tokens": 64}
    if way in ("schema", "schema_ar"):
        if way == "schema_ar":
            body["strategy"] = "ar"
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "answer", "schema": schema_for(want)}}
    elif way == "skeleton":
        body["messages"].append({"role": "assistant", "content": '{"answer": {{gap}}}'})
        body["infill"] = True
    got = post(base, body)
    if "error" in got:
        return {"valid": False, "right": False, "error": got["error"]}
    text = got["choices"][0]["message"].get("content") or ""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    valid = holds(value, want)
    t = got.get("timings", {})
    return {"valid": valid, "right": valid and value["answer"] == want, "text": text,
            "tokens": t.get("predicted_n", 0), "forwards": t.get("forward_calls", 0),
            "ms": t.get("predicted_ms", 0.0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--refusion", default=os.path.join(ROOT, "target/release/refusion"))
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--chats", default=os.path.join(ROOT, "models/refusion-tiny/heldout_chats.json"))
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    held = [h for h in json.load(open(a.chats)) if h["kind"] == "json"]
    ways = ["free", "schema", "schema_ar", "skeleton"]
    out = {w: {"valid": 0, "right": 0, "tokens": 0, "forwards": 0, "ms": 0.0, "wrong": []} for w in ways}
    with serving(a.refusion, a.model, a.threads) as base:
        for h in held:
            for w in ways:
                r = ask(base, h, w)
                o = out[w]
                o["valid"] += r["valid"]
                o["right"] += r["right"]
                for k in ("tokens", "forwards", "ms"):
                    o[k] += r.get(k, 0)
                if not r["right"] and len(o["wrong"]) < 5:
                    o["wrong"].append({"question": h["question"], "got": r.get("text", r.get("error"))})
    n = len(held)
    table = {w: {"valid": f"{o['valid']}/{n}", "right": f"{o['right']}/{n}",
                 "tpf": round(o["tokens"] / max(1, o["forwards"]), 2),
                 "forwards_per_answer": round(o["forwards"] / max(1, n), 2),
                 "ms_per_answer": round(o["ms"] / max(1, n), 1), "wrong": o["wrong"]}
             for w, o in out.items()}
    print(json.dumps({"model": a.model, "questions": n, "ways": table}, indent=1))


if __name__ == "__main__":
    main()
