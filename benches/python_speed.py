#!/usr/bin/env python3
"""The Python package's decode speed against the CLI's on the same file: `refusion bench
--decode card --prompts N` (committed tokens over the decodes' time, one prompt at a time after
a warm-up) next to `Refusion.generate` on the same prompts the same way, both interleaved over
rounds (benches/README.md#the-python-package). Run with the package installed:

    python3 benches/python_speed.py -m FILE.gguf [--prompts 24] [--rounds 3] [-t 2] [--refusion target/release/refusion]
"""

import argparse
import json
import os
import statistics
import subprocess
import time

from refusion import Refusion


def cli(a):
    out = subprocess.run([a.refusion, "bench", "-m", a.model, "--decode", "card", "--prompts", str(a.prompts),
                          "-t", str(a.t), "-o", "jsonl"], check=True, capture_output=True, text=True).stdout
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")][0]["tokens_per_s"]


def questions(a):
    """The file's held-out questions as bench --decode spreads them (i * len / n)."""
    held = json.load(open(a.heldout))
    return [held[i * len(held) // a.prompts]["question"] for i in range(a.prompts)]


def python(llm, prompts):
    llm.generate(prompts[0])
    committed, seconds = 0, 0.0
    for p in prompts:
        t = time.perf_counter()
        r = llm.generate(p)
        seconds += time.perf_counter() - t
        committed += r["completion_tokens"]
    return committed / seconds


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--heldout", default=os.path.join(here, "..", "models", "refusion-tiny", "heldout.json"))
    ap.add_argument("--refusion", default=os.path.join(here, "..", "target", "release", "refusion"))
    a = ap.parse_args()
    llm = Refusion(a.model, n_threads=a.t)
    prompts = questions(a)
    ratios, ours, theirs = [], [], []
    for r in range(a.rounds):
        c = cli(a)
        p = python(llm, prompts)
        ours.append(p)
        theirs.append(c)
        ratios.append(p / c)
        print(f"round {r + 1}: python {p:.1f} t/s, cli {c:.1f} t/s, {p / c:.3f}", flush=True)
    print(f"| python t/s | cli t/s | python / cli (range) |\n| ---: | ---: | ---: |\n"
          f"| {statistics.median(ours):.1f} | {statistics.median(theirs):.1f} | "
          f"**{statistics.median(ratios):.3f}** ({min(ratios):.3f}-{max(ratios):.3f}) |")


if __name__ == "__main__":
    main()
