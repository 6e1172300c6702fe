#!/usr/bin/env python3
"""Gap filling on the trained tiny ReFusion's 200 held-out questions, judged strictly
(benches/README.md#filling-the-gaps).

    python3 benches/infill_quality.py --refusion target/release/refusion \
        -m refusion-demo/refusion-tiny-Q4_K_M.gguf --out benches/infill-quality.json

Needs `tokenizers` (train/requirements.txt) to size gaps. Every case hides part of a question's
worked answer and asks `refusion generate --template` to fill it; the case is right when the
answer the user gets, the whole stitched text (`text` of `--json`), is the worked answer
exactly: no repeated suffix, no doubled or missing character at either junction.

- a line hidden (one per question, chosen at random), behind a gap of 1, 2 and 4 times its
  tokens (with its newline) and behind `{{gap}}` (the file's gen length, 512);
- a cursor inside a line: the rest of a random line hidden, from a random point in it, behind
  `{{gap}}` (what an editor asks);
- code completion: for the 50 code answers, 3 cursors at random points inside the function's
  body, the rest of that line hidden, behind `{{gap}}`.

Each is run with the gap as a maximum (`{{gap:N}}`, the fill takes the length its text needs:
the new behaviour) and as an exact size (`{{gap:=N}}`, filled to its end: the old behaviour of
`{{gap:N}}`). Ordinary generation of the same questions (no template: is the whole answer the
worked one) is the ceiling. Forwards are compared with an exactly sized gap (`{{gap:=L}}`, L the
hidden text's tokens) on the same text.
"""

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
KINDS = ("add", "story", "list", "code")


def run(a, question, template=None):
    cmd = [a.refusion, "generate", "-m", a.model, "-p", question, "--json", "-t", str(a.threads)]
    if template is not None:
        cmd += ["--template", template]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: {out.stderr.strip()}")
    return json.loads(out.stdout)


class Tally:
    def __init__(self):
        self.right = collections.Counter()
        self.n = collections.Counter()
        self.forwards, self.exact_forwards = 0, 0

    def add(self, kind, ok, forwards=0, exact_forwards=0):
        self.right[kind] += bool(ok)
        self.n[kind] += 1
        self.forwards += forwards
        self.exact_forwards += exact_forwards

    def row(self):
        out = {k: {"right": self.right[k], "n": self.n[k]} for k in KINDS if self.n[k]}
        total_r, total_n = sum(self.right.values()), sum(self.n.values())
        out["all"] = {"right": total_r, "n": total_n,
                      "accuracy": round(total_r / max(total_n, 1), 3)}
        if self.exact_forwards:
            out["forwards_vs_exact"] = round(self.forwards / self.exact_forwards, 3)
        return out


def cases(h, rng, size):
    """(name, text before, hidden text, text after) for one question."""
    lines = h["response"].split("\n")
    out = []
    i = rng.randrange(len(lines))
    before = "".join(l + "\n" for l in lines[:i])
    after = "\n".join(lines[i + 1:])
    out.append(("line", before, lines[i] + ("\n" if after else ""), after))
    j = rng.randrange(len(lines))
    while len(lines[j]) < 2:
        j = rng.randrange(len(lines))
    p = rng.randrange(1, len(lines[j]))
    out.append(("cursor", "".join(l + "\n" for l in lines[:j]) + lines[j][:p], lines[j][p:],
                ("\n" if j + 1 < len(lines) else "") + "\n".join(lines[j + 1:])))
    if h["kind"] == "code":
        body = [k for k, l in enumerate(lines) if l.startswith("    ")]
        for _ in range(3):
            k = rng.choice(body)
            p = rng.randrange(1, len(lines[k]))
            out.append(("code_cursor", "".join(l + "\n" for l in lines[:k]) + lines[k][:p],
                        lines[k][p:], "\n" + "\n".join(lines[k + 1:])))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--refusion", required=True)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--heldout", default=os.path.join(ROOT, "models/refusion-tiny/heldout.json"))
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "models/refusion-tiny/tokenizer.json"))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out")
    ap.add_argument("--misses", help="write every wrong case (template, truth, answer) here")
    a = ap.parse_args()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(a.tokenizer)
    size = lambda text: max(1, len(tok.encode(text, add_special_tokens=False).ids))
    held = json.load(open(a.heldout))
    rng = random.Random(a.seed)
    t = collections.defaultdict(Tally)
    start = time.time()
    misses = []

    def judge(row, kind, template, r, truth, *fw):
        t[row].add(kind, r["text"] == truth, *fw)
        if r["text"] != truth and not row.endswith("_old"):
            misses.append({"row": row, "kind": kind, "template": template, "truth": truth,
                           "answer": r["text"], "forwards": r["forward_calls"]})

    for h in held:
        q, truth, kind = h["question"], h["response"], h["kind"]
        plain = run(a, q)
        judge("plain", kind, None, plain, truth)
        for name, before, hidden, after in cases(h, rng, size):
            n = size(hidden)
            exact = run(a, q, f"{before}{{{{gap:={n}}}}}{after}")
            ex_fw = exact["forward_calls"]
            gaps = [("1x", n), ("2x", 2 * n), ("4x", 4 * n), ("gap", None)] if name == "line" \
                else [("gap", None)]
            for label, m in gaps:
                fit = "{{gap}}" if m is None else f"{{{{gap:{m}}}}}"
                r = run(a, q, f"{before}{fit}{after}")
                judge(f"{name}_{label}", kind, f"{before}{fit}{after}", r, truth,
                      r["forward_calls"], ex_fw)
                old = f"{{{{gap:={m if m is not None else 512}}}}}"
                r = run(a, q, f"{before}{old}{after}")
                t[f"{name}_{label}_old"].add(kind, r["text"] == truth)
    rows = {k: v.row() for k, v in sorted(t.items())}
    doc = {"model": os.path.basename(a.model), "questions": len(held), "threads": a.threads,
           "seed": a.seed, "seconds": round(time.time() - start, 1), "results": rows}
    print(json.dumps(doc, indent=1))
    if a.out:
        json.dump(doc, open(a.out, "w"), indent=1)
    if a.misses:
        json.dump(misses, open(a.misses, "w"), indent=1)


if __name__ == "__main__":
    main()
