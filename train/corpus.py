"""The tiny ReFusion's world: chat questions with worked answers, generated from templates.

Nothing is downloaded. Four kinds of question, each with one exact answer a script can check:

- `add`: two-number addition, worked column by column ("Ones: 7 + 8 = 15, write 5, carry 1.").
- `story`: a one-step word problem (gets, buys, gives away, eats) with small numbers.
- `code`: a short Python function over a list, named by the question, from a dozen templates.
- `list`: reverse, or pick the largest of, a short list of numbers.

`split(seed)` gives the held-out questions (never trained on: the training stream skips their exact
question text) and `stream(seed)` an endless, seeded stream of training examples.
"""

import random
import re

NAMES = [
    "Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gia", "Hugo", "Iris", "Jack", "Kai", "Lena",
    "Mia", "Noah", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Vic", "Wen", "Zoe",
]
THINGS = [
    "apples", "pencils", "stickers", "marbles", "books", "shells", "coins", "cards", "stamps",
    "cookies", "balloons", "stones",
]
WORDS = [
    "scores", "prices", "ages", "values", "points", "sizes", "counts", "marks", "steps", "items",
    "weights", "grades", "totals", "levels", "votes", "ranks",
]

# name stem, description in the question, body lines (each template is one way to do it)
CODE = [
    ("sum", "the sum of", ["total = 0", "for x in {a}:", "    total += x", "return total"]),
    ("max", "the largest of", ["best = {a}[0]", "for x in {a}:", "    if x > best:",
                               "        best = x", "return best"]),
    ("min", "the smallest of", ["low = {a}[0]", "for x in {a}:", "    if x < low:",
                                "        low = x", "return low"]),
    ("count_even", "how many even numbers are in", ["count = 0", "for x in {a}:",
                                                    "    if x % 2 == 0:", "        count += 1",
                                                    "return count"]),
    ("count_odd", "how many odd numbers are in", ["count = 0", "for x in {a}:",
                                                  "    if x % 2 == 1:", "        count += 1",
                                                  "return count"]),
    ("double", "a new list with every number doubled from", ["return [x * 2 for x in {a}]"]),
    ("square", "a new list with the square of every number in", ["return [x * x for x in {a}]"]),
    ("evens", "a new list with only the even numbers of", ["return [x for x in {a} if x % 2 == 0]"]),
    ("positives", "a new list with only the positive numbers of",
     ["return [x for x in {a} if x > 0]"]),
    ("product", "the product of", ["result = 1", "for x in {a}:", "    result *= x",
                                   "return result"]),
    ("mean", "the average of", ["if not {a}:", "    return 0", "return sum({a}) / len({a})"]),
    ("reverse", "a reversed copy of", ["return {a}[::-1]"]),
]


def _add(r):
    a, b = r.randint(10, 99), r.randint(10, 99)
    q = r.choice(["What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}."]).format(a=a, b=b)
    lines = [f"We add {a} and {b} column by column."]
    o = a % 10 + b % 10
    lines.append(f"Ones: {a % 10} + {b % 10} = {o}, write {o % 10}" + (", carry 1." if o >= 10 else "."))
    t = a // 10 + b // 10 + o // 10
    carry = f" + {o // 10}" if o >= 10 else ""
    lines.append(f"Tens: {a // 10} + {b // 10}{carry} = {t}, write {t}.")
    lines.append(f"So {a} + {b} = {a + b}.")
    lines.append(f"The answer is {a + b}.")
    return q, "\n".join(lines), str(a + b)


def _story(r):
    name, thing = r.choice(NAMES), r.choice(THINGS)
    a = r.randint(2, 20)
    kind = r.choice(["gets", "buys", "gives", "eats"])
    if kind in ("gets", "buys"):
        b = r.randint(1, 20)
        verb = "gets" if kind == "gets" else "buys"
        q = f"{name} has {a} {thing} and {verb} {b} more. How many {thing} does {name} have now?"
        ans = a + b
        work = f"{name} starts with {a} {thing} and {verb} {b} more, so {a} + {b} = {ans}."
    else:
        b = r.randint(1, a)
        verb = "gives away" if kind == "gives" else "loses"
        q = f"{name} has {a} {thing} and {verb} {b}. How many {thing} does {name} have left?"
        ans = a - b
        work = f"{name} starts with {a} {thing} and {verb} {b}, so {a} - {b} = {ans}."
    return q, f"{work}\n{name} has {ans} {thing}.\nThe answer is {ans}.", str(ans)


def _code(r):
    stem, desc, body = r.choice(CODE)
    arg = r.choice(["nums", "values", "items", "xs", "data"])
    fname = f"{stem}_of_{r.choice(WORDS)}"
    q = f"Write a Python function `{fname}` that returns {desc} a list."
    code = [f"def {fname}({arg}):"] + ["    " + line.format(a=arg) for line in body]
    text = "```python\n" + "\n".join(code) + "\n```"
    return q, f"Here is the function.\n{text}", canonical_code(text)


def _list(r):
    xs = [r.randint(0, 99) for _ in range(r.randint(3, 6))]
    shown = ", ".join(map(str, xs))
    if r.random() < 0.5:
        q = f"Reverse the list [{shown}]."
        out = ", ".join(map(str, xs[::-1]))
        work = f"Reading the list from the end: [{out}]."
        return q, f"{work}\nThe answer is [{out}].", f"[{out}]"
    q = f"What is the largest number in [{shown}]?"
    best = max(xs)
    work = f"Comparing the numbers in [{shown}], the largest is {best}."
    return q, f"{work}\nThe answer is {best}.", str(best)


KINDS = {"add": _add, "story": _story, "code": _code, "list": _list}


def example(r):
    """One (kind, question, response, exact answer) drawn from the seeded generator `r`."""
    kind = r.choice(list(KINDS))
    q, resp, ans = KINDS[kind](r)
    return kind, q, resp, ans


def split(seed, n=200):
    """The held-out questions: `n` distinct questions, 50 of each kind."""
    r = random.Random(seed * 7919 + 1)
    out, seen = [], set()
    per = n // len(KINDS)
    for kind, make in KINDS.items():
        k = 0
        while k < per:
            q, resp, ans = make(r)
            if q in seen:
                continue
            seen.add(q)
            out.append({"kind": kind, "question": q, "response": resp, "answer": ans})
            k += 1
    return out


def stream(seed, held_out):
    """Training examples, endless and seeded, never one of the held-out questions."""
    skip = {h["question"] for h in held_out}
    r = random.Random(seed)
    while True:
        kind, q, resp, ans = example(r)
        if q not in skip:
            yield kind, q, resp, ans


def canonical_code(code):
    """The question does not name the parameter, so any name is right: it becomes `arg`."""
    m = re.search(r"def \w+\((\w+)\):", code)
    return re.sub(rf"\b{m.group(1)}\b", "arg", code) if m else code


def extract(kind, text):
    """The exact answer a response gives, or None."""
    if kind == "code":
        m = re.search(r"```python\n.*?\n```", text, re.S)
        return canonical_code(m.group(0)) if m else None
    m = re.search(r"The answer is (.+?)\.?\s*$", text.strip(), re.S)
    return m.group(1).strip() if m else None


# Conversations, tool calls and JSON answers (the demo holds a chat, calls tools, answers in
# JSON). Each is a chat: the messages before the answer, the tools offered, the answer.

CITIES = ["Oslo", "Paris", "Lima", "Cairo", "Tokyo", "Rome", "Quito", "Delhi", "Sydney", "Berlin",
          "Nairobi", "Madrid", "Seoul", "Dublin", "Hanoi", "Accra", "Lagos", "Vienna"]
SKIES = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy"]
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def call_text(name, args):
    """A tool call as Qwen3's chat template writes it (and the model is taught to)."""
    import json
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def _tool(r):
    """A question a tool answers: the call, or (after the tool's result) the answer."""
    tools = [WEATHER, ADD] if r.random() < 0.5 else [ADD, WEATHER]
    if r.random() < 0.5:
        city = r.choice(CITIES)
        q = r.choice(["What is the weather in {c}?", "How warm is it in {c} today?",
                      "Tell me the weather in {c}."]).format(c=city)
        name, args = "weather", {"city": city}
        deg, sky = r.randint(-5, 35), r.choice(SKIES)
        import json
        result = json.dumps({"city": city, "degrees": deg, "sky": sky})
        answer = f"It is {deg} degrees and {sky} in {city}.\nThe answer is {deg}."
        ans = str(deg)
    else:
        a, b = r.randint(10, 999), r.randint(10, 999)
        q = r.choice(["Use the add tool: what is {a} + {b}?", "With the add tool, add {a} and {b}.",
                      "Call add to compute {a} + {b}."]).format(a=a, b=b)
        name, args = "add", {"a": a, "b": b}
        result = str(a + b)
        answer = f"The add tool says {a} + {b} = {a + b}.\nThe answer is {a + b}."
        ans = str(a + b)
    messages = [{"role": "user", "content": q}]
    if r.random() < 0.5:
        return "tool_call", q, messages, tools, call_text(name, args), name
    messages.append({"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]})
    messages.append({"role": "tool", "content": result})
    return "tool_answer", q, messages, tools, answer, ans


def _json(r):
    """A question of the four kinds answered as a JSON object `{"answer": ...}`."""
    import json
    kind = r.choice(["add", "story", "list"])
    q, _, ans = KINDS[kind](r)
    q = q + r.choice([" Answer in JSON.", " Reply with a JSON object.", " Give the answer as JSON."])
    value = json.loads(ans) if kind == "list" else int(ans)
    return "json", q, [{"role": "user", "content": q}], None, json.dumps({"answer": value}), ans


def _chat(r):
    """Two to four questions in one conversation: the answer is the last one's."""
    messages, turns = [], r.randint(2, 4)
    for i in range(turns):
        kind = r.choice(list(KINDS))
        q, resp, ans = KINDS[kind](r)
        messages.append({"role": "user", "content": q})
        if i < turns - 1:
            messages.append({"role": "assistant", "content": resp})
    return "chat:" + kind, q, messages, None, resp, ans


DIALOGUES = {"tool": _tool, "json": _json, "chat": _chat}


def dialogue(r):
    """One training chat: (kind, last question, messages, tools, answer, exact answer): half the
    four kinds alone, 22% conversations, 18% tool calls and answers after a tool's result, 10%
    JSON answers."""
    x = r.random()
    if x < 0.5:
        kind, q, resp, ans = example(r)
        return kind, q, [{"role": "user", "content": q}], None, resp, ans
    make = _chat if x < 0.72 else _tool if x < 0.9 else _json
    return make(r)


def split_dialogues(seed, n=120):
    """Held-out chats: `n` conversations, tool calls and JSON answers (a third each), whose
    last question is never trained on."""
    r = random.Random(seed * 7919 + 2)
    out, seen = [], set()
    for make in (_chat, _tool, _json):
        k = 0
        while k < n // 3:
            kind, q, messages, tools, resp, ans = make(r)
            if q in seen:
                continue
            seen.add(q)
            out.append({"kind": kind, "question": q, "messages": messages, "tools": tools,
                        "response": resp, "answer": ans})
            k += 1
    return out


def stream_dialogues(seed, held_out):
    """Training chats, endless and seeded; a chat that asks a held-out question (of either
    held-out set, in any turn) is skipped."""
    skip = {h["question"] for h in held_out}
    r = random.Random(seed)
    while True:
        d = dialogue(r)
        asked = [m["content"] for m in d[2] if m["role"] == "user"] + [d[1]]
        if not any(q in c for c in asked for q in skip):
            yield d
