#!/usr/bin/env python3
"""ReFusion's speedup measured end to end on real-sized files: the trained tiny model grown to a
real shape (`refusion convert --synthetic 0.6b|8b --grow-from models/refusion-tiny`), decoding
the same held-out questions in ReFusion (`refusion bench --decode`) and in llama.cpp, on the
same GGUF file, in one run.

    python3 benches/grown_decode.py --refusion target/release/refusion \\
        --llama-build ~/.cache/llama-bench/build-native-noamx/bin \\
        --llama-avx2-build ~/.cache/llama-bench/build-avx2/bin \\
        --llama-cpp-python /tmp/llama_cpp_python-0.3.36 \\
        --file 24:bd/grown-0.6b-q4_k_m.gguf --file 12:bd/grown-8b-q4_k_m.gguf --out grown.json \\
        [--rounds 3] [--python /path/to/venv/bin/python]

For each file (`N:PATH`: N questions, spread over the 200 so every kind is in) and each CPU path
(native; AVX2: `REFUSION_CPU=avx2` against llama.cpp built for AVX2 only):
- ReFusion: `refusion bench --decode card,gsm8k --prompts N` (committed tokens/s, TPF, accuracy);
- llama.cpp, autoregressive: `llama-bench -p 0 -n 128 -fa 0,1` (the faster), and its greedy
  decode of the same questions through llama-cpp-python over the build's own libllama (answer
  tokens/s over the whole decode, prompt included as in ours, and accuracy by
  train/corpus.py's `extract`).
With `--rounds R` each round runs ReFusion's decode and llama-bench one after the other (llama.cpp's
greedy decode, slower, in the first round only, unless `--greedy-every-round`), and the table
gives each side's median over the rounds and the median and range of the rounds' own ratios: a
VM's speed drifts by up to 30% between minutes, so one run decides nothing.
Not part of CI: minutes to an hour on 2 cores. Needs llama-cpp-python's Python package only
(its sdist's `llama_cpp` folder on PYTHONPATH, numpy, typing_extensions, diskcache, jinja2).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "train"))
import corpus  # noqa: E402


def questions(gguf_held, n):
    return [gguf_held[i * len(gguf_held) // n] for i in range(n)]


def refusion_decode(binary, gguf, n, threads, avx2):
    env = dict(os.environ)
    if avx2:
        env["REFUSION_CPU"] = "avx2"
    cmd = [binary, "bench", "-m", gguf, "--decode", "card,gsm8k", "--prompts", str(n),
           "-t", str(threads), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    rows = json.loads(out.stdout)
    for r in rows:
        r.pop("forward_sizes", None)
    return rows


def llama_bench(build, gguf, threads, reps=3):
    cmd = [os.path.join(build, "llama-bench"), "-m", gguf, "-p", "0", "-n", "128", "-fa", "0,1",
           "-t", str(threads), "-r", str(reps), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    by_fa = {r["flash_attn"]: r["avg_ts"] for r in rows}
    return {"tg128_fa0": by_fa.get(False, by_fa.get(0)), "tg128_fa1": by_fa.get(True, by_fa.get(1)),
            "best": max(by_fa.values())}


def llama_greedy(build, gguf, held, threads, pkg, python=sys.executable):
    """Greedy decoding of the questions in a subprocess (the library is chosen by env)."""
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=build, PYTHONPATH=pkg)
    code = r"""
import json, sys, time
from llama_cpp import Llama
gguf, threads, qs = sys.argv[1], int(sys.argv[2]), json.load(sys.stdin)
llm = Llama(model_path=gguf, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
out = []
for q in qs:
    text = "<|im_start|>user\n" + q + "<|im_end|>\n<|im_start|>assistant\n"
    toks = llm.tokenize(text.encode(), add_bos=False, special=True)
    t = time.perf_counter()
    r = llm.create_completion(toks, max_tokens=512, temperature=0.0, top_k=1)
    out.append({"seconds": time.perf_counter() - t, "tokens": r["usage"]["completion_tokens"],
                "text": r["choices"][0]["text"]})
print(json.dumps(out))
"""
    out = subprocess.run([python, "-c", code, gguf, str(threads)], env=env,
                         input=json.dumps([h["question"] for h in held]), capture_output=True,
                         text=True, check=True)
    answers = json.loads(out.stdout)
    right = sum(corpus.extract(h["kind"], a["text"]) == corpus.extract(h["kind"], h["response"])
                for h, a in zip(held, answers))
    tokens = sum(a["tokens"] for a in answers)
    seconds = sum(a["seconds"] for a in answers)
    return {"tokens_per_s": tokens / seconds, "accuracy": right / len(held), "tokens": tokens}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--refusion", default=os.path.join(ROOT, "target/release/refusion"))
    ap.add_argument("--llama-build", required=True, help="folder with llama-bench and libllama.so")
    ap.add_argument("--llama-avx2-build", help="the same, built for AVX2 only")
    ap.add_argument("--llama-cpp-python", help="folder holding the llama_cpp package")
    ap.add_argument("--file", action="append", required=True, help="N:PATH")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--llama-reps", type=int, default=3, help="llama-bench's -r in each round")
    ap.add_argument("--greedy-every-round", action="store_true")
    ap.add_argument("--no-greedy", action="store_true")
    ap.add_argument("--python", default=sys.executable,
                    help="the Python that runs llama-cpp-python (needs numpy, diskcache, jinja2)")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.rounds < 1 or a.llama_reps < 1:
        ap.error("--rounds and --llama-reps must be at least 1")
    if not a.llama_cpp_python:
        a.no_greedy = True
    held = json.load(open(os.path.join(ROOT, "models/refusion-tiny/heldout.json")))
    paths = [("native", a.llama_build, False)]
    if a.llama_avx2_build:
        paths.append(("avx2", a.llama_avx2_build, True))
    results = {"machine": platform.processor() or platform.machine(), "threads": a.threads,
               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": a.rounds, "runs": []}
    runs = {}
    for rnd in range(a.rounds):
        for spec in a.file:
            n, gguf = spec.split(":", 1)
            qs = questions(held, int(n))
            for path, build, avx2 in paths:
                run = runs.setdefault((gguf, path), {"file": os.path.basename(gguf), "path": path,
                                                     "prompts": len(qs), "rounds": []})
                r = {"refusion": refusion_decode(a.refusion, gguf, len(qs), a.threads, avx2),
                     "llama_bench": llama_bench(build, gguf, a.threads, a.llama_reps)}
                if not a.no_greedy and (rnd == 0 or a.greedy_every_round):
                    r["llama_greedy"] = llama_greedy(build, gguf, qs, a.threads,
                                                     a.llama_cpp_python, a.python)
                run["rounds"].append(r)
                print(json.dumps({"round": rnd + 1, "file": run["file"], "path": path, **r}),
                      flush=True)
    results["runs"] = list(runs.values())
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    print_table(results)


def med(xs):
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def print_table(results):
    print(f"{results['rounds']} round(s), each both sides one after the other; t/s: median over "
          "the rounds; ratios: median of the rounds' own (range)")
    print("| file | path | setting | ReFusion t/s | TPF | acc | llama-bench tg128 (fa0 / fa1) | "
          "vs tg128 (range) | llama.cpp greedy t/s | acc | vs greedy |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results["runs"]:
        rounds = r["rounds"]
        greedy = [x["llama_greedy"] for x in rounds if "llama_greedy" in x]
        g_ts = med(g["tokens_per_s"] for g in greedy)
        g_acc = f"{100 * greedy[0]['accuracy']:.0f}%" if greedy else "-"
        for i, row in enumerate(rounds[0]["refusion"]):
            ours = [x["refusion"][i]["tokens_per_s"] for x in rounds]
            best = [x["llama_bench"]["best"] for x in rounds]
            ratios = [o / b for o, b in zip(ours, best)]
            fa0 = med(x["llama_bench"]["tg128_fa0"] for x in rounds)
            fa1 = med(x["llama_bench"]["tg128_fa1"] for x in rounds)
            # The greedy rounds against ReFusion's rounds that ran beside them.
            vs_g = [x["refusion"][i]["tokens_per_s"] / x["llama_greedy"]["tokens_per_s"]
                    for x in rounds if "llama_greedy" in x]
            print(f"| {r['file']} | {r['path']} | {row['test']} | {med(ours):.1f} | "
                  f"{row['tpf']:.2f} | {100 * row['accuracy']:.0f}% | {med(best):.1f} "
                  f"({fa0:.1f} / {fa1:.1f}) | **{med(ratios):.2f}x** ({min(ratios):.2f}-"
                  f"{max(ratios):.2f}) | {g_ts:.1f} | {g_acc} | "
                  + (f"{med(vs_g):.2f}x |" if vs_g else "- |"))


if __name__ == "__main__":
    main()
