#!/usr/bin/env python3
"""How much speed survives a busy neighbour: decode tokens/s on a quiet machine and with one
other process spinning (one core's worth of work on a 2-core machine), for `refusion generate`
(slot decoding, each binary given) and for llama.cpp's `llama-bench -n` on the same file.

    python3 benches/busy_neighbour.py --refusion target/release/refusion [--refusion OTHER] \
        --llama-bench ~/.cache/llama-bench/build-native/bin/llama-bench -m refusion-demo/refusion-tiny-Q4_K_M.gguf

Rounds interleave the settings (quiet and busy, each program) so that drift in the machine
falls on all of them; each figure is the median over rounds. refusion's tokens/s counts every
committed id over the decoder's time (`--json`'s `generate_ms`), over a fixed set of questions
the trained tiny model knows; llama.cpp's is llama-bench's `-p 0 -n 128`, the faster of
`-fa 0/1`. Not part of CI.
"""
import argparse
import json
import statistics
import subprocess
import sys

QUESTIONS = [
    "What is 47 + 38?",
    "Add 86 and 88.",
    "What is 125 + 67?",
    "Tom has 12 apples and buys 9 more. How many apples does he have?",
    "List three fruits.",
    "Write a Python function `add` that returns the sum of two numbers.",
    "What is 301 + 499?",
    "A box holds 24 pens and another holds 17. How many pens are there?",
]


def refusion(binary, model, threads):
    toks, ms = 0, 0.0
    for q in QUESTIONS:
        out = subprocess.run([binary, "generate", "-m", model, "-p", q, "--json", "-t", str(threads)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout)
        toks += len(r["tokens"])
        ms += r["timings"]["generate_ms"]
    return toks / (ms / 1e3)


def llama(binary, model, threads):
    best = 0.0
    for fa in ("0", "1"):
        out = subprocess.run([binary, "-m", model, "-p", "0", "-n", "128", "-fa", fa, "-t", str(threads),
                              "-r", "3", "-o", "json"], capture_output=True, text=True, check=True)
        best = max(best, json.loads(out.stdout)[0]["avg_ts"])
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--refusion", action="append", required=True)
    ap.add_argument("--llama-bench")
    ap.add_argument("-m", required=True)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    programs = [(f"refusion {b}", lambda b=b: refusion(b, a.m, a.t)) for b in a.refusion]
    if a.llama_bench:
        programs.append(("llama.cpp tg128", lambda: llama(a.llama_bench, a.m, a.t)))
    results = {(name, busy): [] for name, _ in programs for busy in (False, True)}
    for r in range(a.rounds):
        for busy in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                for name, run in programs:
                    v = run()
                    results[(name, busy)].append(v)
                    print(f"round {r} {'busy' if busy else 'quiet'} {name}: {v:.0f} t/s", flush=True)
            finally:
                if hog:
                    hog.kill()
                    hog.wait()
    print("\n| program | quiet t/s | busy neighbour t/s | kept |")
    print("| --- | ---: | ---: | ---: |")
    for name, _ in programs:
        q = statistics.median(results[(name, False)])
        b = statistics.median(results[(name, True)])
        print(f"| {name} | {q:.0f} | {b:.0f} | {100 * b / q:.0f}% |")


if __name__ == "__main__":
    main()
