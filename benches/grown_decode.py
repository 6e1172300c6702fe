#!/usr/bin/env python3
"""ReFusion's speedup measured end to end on real-sized files: the trained tiny model grown to a
real shape (`refusion convert --synthetic 0.6b|8b --grow-from models/refusion-tiny`), decoding
the same held-out questions in ReFusion (`refusion bench --decode`) and in llama.cpp, on the
same GGUF file, in one run.

    python3 benches/grown_decode.py --refusion target/release/refusion \\
        --llama-build ~/.cache/llama-bench/build-native-noamx/bin \\
        --llama-avx2-build ~/.cache/llama-bench/build-avx2/bin \\
        --llama-cpp-python /tmp/llama_cpp_python-0.3.36 \\
        --file 24:bd/grown-0.6b-q4_k_m.gguf --file 12:bd/grown-8b-q4_k_m.gguf --out grown.json

For each file (`N:PATH`: N questions, spread over the 200 so every kind is in) and each CPU path
(native; AVX2: `REFUSION_CPU=avx2` against llama.cpp built for AVX2 only):
- ReFusion: `refusion bench --decode card,gsm8k --prompts N` (committed tokens/s, TPF, accuracy);
- llama.cpp, autoregressive: `llama-bench -p 0 -n 128 -fa 0,1` (the faster), and its greedy
  decode of the same questions through llama-cpp-python over the build's own libllama (answer
  tokens/s over the whole decode, prompt included as in ours, and accuracy by
  train/corpus.py's `extract`).
Not part of CI: minutes to an hour on 2 cores. Needs llama-cpp-python's Python package only
(its sdist's `llama_cpp` folder on PYTHONPATH, numpy, typing_extensions, diskcache, jinja2).
"""
import argparse
import json
import os
import platform
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


def llama_bench(build, gguf, threads):
    cmd = [os.path.join(build, "llama-bench"), "-m", gguf, "-p", "0", "-n", "128", "-fa", "0,1",
           "-t", str(threads), "-r", "3", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    by_fa = {r["flash_attn"]: r["avg_ts"] for r in rows}
    return {"tg128_fa0": by_fa.get(False, by_fa.get(0)), "tg128_fa1": by_fa.get(True, by_fa.get(1)),
            "best": max(by_fa.values())}


def llama_greedy(build, gguf, held, threads, pkg):
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
    out = subprocess.run([sys.executable, "-c", code, gguf, str(threads)], env=env,
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
    ap.add_argument("--llama-cpp-python", required=True, help="folder holding the llama_cpp package")
    ap.add_argument("--file", action="append", required=True, help="N:PATH")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    held = json.load(open(os.path.join(ROOT, "models/refusion-tiny/heldout.json")))
    paths = [("native", a.llama_build, False)]
    if a.llama_avx2_build:
        paths.append(("avx2", a.llama_avx2_build, True))
    results = {"machine": platform.processor() or platform.machine(), "threads": a.threads,
               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": []}
    for spec in a.file:
        n, gguf = spec.split(":", 1)
        qs = questions(held, int(n))
        for path, build, avx2 in paths:
            run = {"file": os.path.basename(gguf), "path": path, "prompts": len(qs)}
            run["refusion"] = refusion_decode(a.refusion, gguf, len(qs), a.threads, avx2)
            run["llama_bench"] = llama_bench(build, gguf, a.threads)
            run["llama_greedy"] = llama_greedy(build, gguf, qs, a.threads, a.llama_cpp_python)
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    print_table(results)


def print_table(results):
    print("| file | path | setting | ReFusion t/s | TPF | acc | llama-bench tg128 (fa0 / fa1) | "
          "vs tg128 | llama.cpp greedy t/s | acc | vs greedy |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results["runs"]:
        lb, g = r["llama_bench"], r["llama_greedy"]
        for row in r["refusion"]:
            print(f"| {r['file']} | {r['path']} | {row['test']} | {row['tokens_per_s']:.1f} | "
                  f"{row['tpf']:.2f} | {100 * row['accuracy']:.0f}% | {lb['best']:.1f} "
                  f"({lb['tg128_fa0']:.1f} / {lb['tg128_fa1']:.1f}) | "
                  f"{row['tokens_per_s'] / lb['best']:.2f}x | {g['tokens_per_s']:.1f} | "
                  f"{100 * g['accuracy']:.0f}% | {row['tokens_per_s'] / g['tokens_per_s']:.2f}x |")


if __name__ == "__main__":
    main()
