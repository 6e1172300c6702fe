#!/usr/bin/env python3
"""Gap filling on the trained tiny ReFusion's 200 held-out questions (benches/README.md).

    python3 benches/infill_quality.py --refusion target/release/refusion \
        -m refusion-demo/refusion-tiny-Q4_K_M.gguf --out benches/infill-quality.json

Needs `tokenizers` (train/requirements.txt) to size gaps. For each question's worked answer:

- second line / last line hidden: the answer with that line a gap, filled (`--template`), the
  gap sized to the line (its tokens and newline: "exact") or a generous 32 tokens; a fill is
  right when its first line is the hidden line. Against ordinary generation of the same
  question (no suffix), right when its line at that index is the hidden line;
- working from the answer: only the last line ("The answer is N.") given after a 96-token gap;
  right when the fill's own final answer (its "The answer is", train/corpus.py `extract`) is
  N, and when the stitched text's final line is N's (always, by construction) the working is
  judged alone. Against ordinary generation's final answer;
- the same with the newline before the hidden line inside the gap ("exact_nl"): spans are
  tokenized on their own, and a span ending inside one of the training text's tokens (")\n"
  then "```" where the model learned ")\n```") misleads the model;
- TPF and committed tokens/s of every run (`generate --json`: a template's are its fills').
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "train"))
import corpus  # noqa: E402


def run(a, question, extra):
    cmd = [a.refusion, "generate", "-m", a.model, "-p", question, "--json", "-t", str(a.threads)]
    out = subprocess.run(cmd + extra, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd + extra)}: {out.stderr.strip()}")
    return json.loads(out.stdout)


def first_line(text):
    return text.split("\n", 1)[0]


class Tally:
    def __init__(self):
        self.right, self.n, self.tpf, self.tokens, self.seconds = 0, 0, [], 0, 0.0

    def add(self, ok, r):
        self.right += bool(ok)
        self.n += 1
        self.tpf.append(r["tpf"])
        fills = r.get("gaps")
        self.tokens += sum(len(g["tokens"]) for g in fills) if fills else r["answer_tokens"]
        self.seconds += r["timings"]["generate_ms"] / 1e3

    def row(self):
        return {"right": self.right, "n": self.n,
                "accuracy": round(self.right / max(self.n, 1), 3),
                "mean_tpf": round(statistics.mean(self.tpf), 2) if self.tpf else None,
                "tokens_per_s": round(self.tokens / max(self.seconds, 1e-9), 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--refusion", required=True)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--heldout", default=os.path.join(ROOT, "models/refusion-tiny/heldout.json"))
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "models/refusion-tiny/tokenizer.json"))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(a.tokenizer)
    size = lambda text: len(tok.encode(text, add_special_tokens=False).ids)
    held = json.load(open(a.heldout))
    t = {k: Tally() for k in ["plain", "second_exact", "second_exact_nl", "second_32",
                              "second_plain", "last_exact", "last_exact_nl", "last_32",
                              "last_plain", "working", "working_plain"]}
    start = time.time()
    for h in held:
        lines = h["response"].split("\n")
        plain = run(a, h["question"], [])
        plain_lines = plain["text"].split("\n")
        t["plain"].add(corpus.extract(h["kind"], plain["text"]) == corpus.extract(h["kind"], h["response"]), plain)
        hidden = [("second", 1)] if len(lines) >= 3 else []
        hidden.append(("last", len(lines) - 1))
        for name, i in hidden:
            line = lines[i]
            before = "".join(l + "\n" for l in lines[:i])
            after = "\n".join(lines[i + 1:])
            gap_text = line + ("\n" if after else "")
            for label, n in [("exact", size(gap_text)), ("32", 32)]:
                r = run(a, h["question"], ["--template", f"{before}{{{{gap:{n}}}}}{after}"])
                t[f"{name}_{label}"].add(first_line(r["gaps"][0]["text"]) == line, r)
            # The gap holding the newline before the line instead (the spans then end and
            # start where the training text's tokens do: "...)\n```" is not "...)\n" + "```").
            before_nl, gap_nl = "\n".join(lines[:i]), "\n" + line
            after_nl = "\n" + after if after else ""
            r = run(a, h["question"],
                    ["--template", f"{before_nl}{{{{gap:{size(gap_nl)}}}}}{after_nl}"])
            t[f"{name}_exact_nl"].add(first_line(r["gaps"][0]["text"].lstrip("\n")) == line, r)
            ok = len(plain_lines) > i and plain_lines[i] == line
            t[f"{name}_plain"].add(ok, plain)
        if h["kind"] != "code":
            r = run(a, h["question"], ["--template", f"{{{{gap:96}}}}{lines[-1]}"])
            fill = r["gaps"][0]["text"]
            t["working"].add(corpus.extract(h["kind"], fill) == h["answer"], r)
            t["working_plain"].add(corpus.extract(h["kind"], plain["text"]) == h["answer"], plain)
    rows = {k: v.row() for k, v in t.items()}
    doc = {"model": os.path.basename(a.model), "questions": len(held), "threads": a.threads,
           "seconds": round(time.time() - start, 1), "results": rows}
    print(json.dumps(doc, indent=1))
    if a.out:
        json.dump(doc, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
