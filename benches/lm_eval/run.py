#!/usr/bin/env python3
"""lm-evaluation-harness (`lm-eval`, pinned in requirements.txt) against `refusion serve` on the
trained tiny model's held-out questions, both task kinds, both OpenAI APIs, checked against
refusion's own figures (benches/README.md#lm-evaluation-harness).

    python3 -m venv target/lm-eval-venv && target/lm-eval-venv/bin/pip install -r benches/lm_eval/requirements.txt
    target/lm-eval-venv/bin/python benches/lm_eval/run.py [--refusion target/release/refusion]

- `refusion_tiny_gen` (generate_until, 200 questions, exact final answer) through
  `local-completions` (the chat-rendered prompt, tokenized by the server's own /tokenize: vLLM's
  remote tokenizer) and `refusion_tiny_gen_chat` through `local-chat-completions`: each must equal
  `refusion bench --decode card --prompts 200` on the same file.
- `refusion_tiny_mc` (multiple_choice, the 50 held-out sums: after the question and the
  reference's worked columns, "So a + b = N.\nThe answer is N." for the right sum against three
  wrong ones, loglikelihood through `/v1/completions` with `echo` and `logprobs`): must equal
  the same choice made from refusion's own scores of each choice's tokens (`max_tokens: 0`).

Exits 1 when a figure differs. Not run in CI (lm-eval brings torch and transformers).
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


def post(base, path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())


def get(base, path):
    with urllib.request.urlopen(base + path) as r:
        return json.loads(r.read())


def serve(refusion, model):
    p = subprocess.Popen([refusion, "serve", "-m", model, "--port", "0", "-t", "2", "-np", "4",
                          "-c", "4096"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in p.stderr:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
            return p, m.group(1)
    sys.exit("the server did not start")


def wrong_sums(n, rng):
    """Three sums near `n` that are not `n` (an off-by-one, a carry missed, a digit slipped)."""
    out = []
    for c in [n + 1, n - 1, n + 10, n - 10, n + 2, n + 100]:
        if c >= 0 and c != n and c not in out:
            out.append(c)
    rng.shuffle(out)
    return out[:3]


def write_tasks(base, data_dir):
    """data/gen.jsonl (every held-out question) and data/mc.jsonl (the sums as choices)."""
    held = json.load(open(os.path.join(ROOT, "models", "refusion-tiny", "heldout.json")))
    os.makedirs(data_dir, exist_ok=True)
    rng = random.Random(7)
    mc = []
    with open(os.path.join(data_dir, "gen.jsonl"), "w") as f:
        for q in held:
            prompt = post(base, "/apply-template", {"messages": [{"role": "user", "content": q["question"]}]})["prompt"]
            f.write(json.dumps({"prompt": prompt, **q}) + "\n")
            if q["kind"] == "add":
                # The worked columns given; the sum they add up to is the choice.
                lines = q["response"].split("\n")
                at = next(i for i, l in enumerate(lines) if l.startswith("So "))
                context = prompt + "\n".join(lines[:at]) + "\n"
                so = lines[at].rsplit("= ", 1)[0]
                n = int(q["answer"])
                nums = [n] + wrong_sums(n, rng)
                rng.shuffle(nums)
                mc.append({"prompt": context, "choices": [f"{so}= {x}.\nThe answer is {x}." for x in nums],
                           "target": nums.index(n)})
    with open(os.path.join(data_dir, "mc.jsonl"), "w") as f:
        for d in mc:
            f.write(json.dumps(d) + "\n")
    return mc


def lm_eval(api, base, tasks, out_dir, gen_len, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    args = [sys.executable, "-m", "lm_eval", "--model", api,
            "--model_args", f"base_url={base}{path},model=refusion,num_concurrent=1,max_retries=1",
            "--tasks", ",".join(tasks), "--include_path", os.path.join(HERE, "tasks"),
            "--gen_kwargs", f"max_gen_toks={gen_len}", "--output_path", out_dir, "--batch_size", "1"]
    if chat:
        args.append("--apply_chat_template")
    done = subprocess.run(args, cwd=os.path.join(HERE, "tasks"), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"lm_eval failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    results = {}
    for dirpath, _, files in os.walk(out_dir):
        for name in files:
            if name.startswith("results") and name.endswith(".json"):
                results.update(json.load(open(os.path.join(dirpath, name)))["results"])
    return results


def own_mc(base, mc):
    """Each choice scored by refusion itself: the sum of its tokens' log-probabilities after
    the prompt (tokenized as lm-eval does: the whole, less the prompt's tokens)."""
    right = 0
    for d in mc:
        ctx = post(base, "/tokenize", {"content": d["prompt"]})["tokens"]
        scores = []
        for choice in d["choices"]:
            whole = post(base, "/tokenize", {"content": d["prompt"] + choice})["tokens"]
            lp = post(base, "/v1/completions", {"prompt": [whole], "echo": True, "logprobs": 1,
                                                "max_tokens": 0})["choices"][0]["logprobs"]
            scores.append(sum(lp["token_logprobs"][len(ctx):]))
        right += scores.index(max(scores)) == d["target"]
    return right / len(mc)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--refusion", default=os.path.join(ROOT, "target", "release", "refusion"))
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="refusion-lm-eval-")
    model = os.path.join(work, "tiny.gguf")
    subprocess.run([a.refusion, "convert", os.path.join(ROOT, "models", "refusion-tiny"), "-o", model,
                    "--outtype", "f32", "-q"], check=True)
    bench = subprocess.run([a.refusion, "bench", "-m", model, "--decode", "card", "--prompts", "200",
                            "-t", "2", "-o", "jsonl"], check=True, capture_output=True, text=True).stdout
    bench_acc = [json.loads(l) for l in bench.splitlines() if l.startswith("{")][0]["accuracy"]
    server, base = serve(a.refusion, model)
    try:
        gen_len = get(base, "/props")["default_generation_settings"]["params"]["n_predict"]
        mc = write_tasks(base, os.path.join(HERE, "tasks", "data"))
        cmpl = lm_eval("local-completions", base, ["refusion_tiny_gen", "refusion_tiny_mc"],
                       os.path.join(work, "completions"), gen_len, chat=False)
        chat = lm_eval("local-chat-completions", base, ["refusion_tiny_gen_chat"],
                       os.path.join(work, "chat"), gen_len, chat=True)
        mc_own = own_mc(base, mc)
    finally:
        server.kill()
    rows = [
        ("refusion_tiny_gen (generate_until, exact match)", "local-completions",
         cmpl["refusion_tiny_gen"]["exact_match,none"], bench_acc, "bench --decode card"),
        ("refusion_tiny_gen_chat (generate_until, exact match)", "local-chat-completions",
         chat["refusion_tiny_gen_chat"]["exact_match,none"], bench_acc, "bench --decode card"),
        ("refusion_tiny_mc (multiple_choice, acc)", "local-completions",
         cmpl["refusion_tiny_mc"]["acc,none"], mc_own, "own /v1/completions scores"),
    ]
    print("| task | lm-eval model | lm-eval | refusion's own | from |")
    print("| --- | --- | ---: | ---: | --- |")
    ok = True
    for task, api, theirs, ours, src in rows:
        same = abs(theirs - ours) < 1e-9
        ok &= same
        print(f"| {task} | {api} | {theirs:.4f} | {ours:.4f}{'' if same else ' (differs)'} | {src} |")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
