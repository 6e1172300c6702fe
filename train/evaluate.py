#!/usr/bin/env python3
"""How good and how fast the trained tiny ReFusion is, on its 200 held-out questions.

    .venv/bin/python train/evaluate.py --bin target/release/refusion --out benches/tiny-eval.json \
        --llama-bench ~/.cache/llama-bench/build-native/bin/llama-bench \
        --cost-model /tmp/bd/8b-q4_k_m.gguf

Quality (exact answer, train/corpus.py `extract`), at f32, Q8_0 and Q4_K_M:
- `slot`: `refusion generate` with the file's defaults (the model card's: k 4, 32 serial blocks,
  thresholds 0.6 / 0.3, 512 tokens);
- `l2r`: left-to-right slot decoding, the paper's serial ablation: one slot per serial block
  (`--serial-blocks 128`), so slots are planned and committed strictly in order;
- `ar`: plain autoregressive greedy decoding in llama.cpp (llama-cpp-python) on the same GGUF.

Speed, on the Q4_K_M file: TPF and tokens/s of `refusion generate` at the card's defaults and the
paper's GSM8K / HumanEval settings, next to llama.cpp's autoregressive tokens/s (`llama-bench -n`,
flash attention off and on, the faster). With --cost-model, the same decodes are carried to
another model's shape: `refusion bench` measures t(n), the time of one forward of n tokens, on that
file, each decode's forward sizes (generate's `forward_sizes`) are priced with it, and the
projected tokens/s is set against llama-bench's measured `-n` tokens/s on the same file.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SPEED = {  # name: extra generate flags
    "card": [],
    "gsm8k": ["--slot-size", "32", "--serial-blocks", "4", "--slot-threshold", "0.9",
              "--token-threshold", "0.4"],
    "humaneval": ["--slot-size", "32", "--serial-blocks", "4", "--slot-threshold", "0.9",
                  "--token-threshold", "0.4"],
}
L2R = ["--serial-blocks", "128"]


def generate(binary, gguf, question, extra, threads):
    cmd = [binary, "generate", "-m", gguf, "-p", question, "--json", "-t", str(threads)] + extra
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


class LlamaCpp:
    """Greedy autoregressive decoding in llama.cpp, through llama-cpp-python."""

    def __init__(self, gguf, threads):
        from llama_cpp import Llama
        self.llm = Llama(model_path=gguf, n_ctx=1024, n_threads=threads, verbose=False)

    def answer(self, question):
        text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        toks = self.llm.tokenize(text.encode(), add_bos=False, special=True)
        out = self.llm.create_completion(toks, max_tokens=512, temperature=0.0, top_k=1)
        return out["choices"][0]["text"]


def quality(a, files, held):
    rows = {}
    for quant, gguf in files.items():
        ar = LlamaCpp(gguf, a.threads) if not a.no_llama else None
        for mode in ("slot", "l2r", "ar"):
            if mode == "ar" and ar is None:
                continue
            right, kinds, tpf, wrong = 0, {}, [], []
            for h in held:
                if mode == "ar":
                    text = ar.answer(h["question"])
                else:
                    r = generate(a.bin, gguf, h["question"], L2R if mode == "l2r" else [], a.threads)
                    text = r["text"]
                    tpf.append(r["tpf"])
                ok = corpus.extract(h["kind"], text) == corpus.extract(h["kind"], h["response"])
                right += ok
                if not ok and len(wrong) < 4:
                    wrong.append({"question": h["question"], "answer": text})
                k = kinds.setdefault(h["kind"], [0, 0])
                k[0] += ok
                k[1] += 1
            rows[f"{quant}/{mode}"] = {
                "accuracy": right / len(held), "by_kind": {k: v[0] / v[1] for k, v in kinds.items()},
                "mean_tpf": sum(tpf) / len(tpf) if tpf else None, "wrong": wrong}
            print(quant, mode, json.dumps(rows[f"{quant}/{mode}"]), flush=True)
    return rows


def llama_bench(path, gguf, n, threads):
    best = None
    for fa in ("0", "1"):
        out = subprocess.run([path, "-m", gguf, "-p", "0", "-n", str(n), "-fa", fa, "-t",
                              str(threads), "-r", "3", "-o", "json"],
                             capture_output=True, text=True, check=True)
        ts = json.loads(out.stdout)[0]["avg_ts"]
        best = max(best or 0, ts)
    return best


def cost_curve(binary, gguf, threads):
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    out = subprocess.run([binary, "bench", "-m", gguf, "-p", ",".join(map(str, sizes)), "-n", "0",
                          "-d", "128", "-r", "2", "-t", str(threads), "-o", "json"],
                         capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    return {int(r["n_tokens"]): r["ms_per_forward"] / 1e3 for r in rows if r["test"].startswith("pp")}


def price(curve, n):
    """t(n), linear between measured sizes (and past the last two)."""
    xs = sorted(curve)
    for lo, hi in zip(xs, xs[1:]):
        if n <= hi or hi == xs[-1]:
            return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)
    return curve[xs[0]]


def speed(a, gguf, held):
    res = {}
    qs = [h for h in held][:: max(1, len(held) // a.speed_questions)][: a.speed_questions]
    curve = cost_curve(a.bin, a.cost_model, a.threads) if a.cost_model else None
    for name, extra in SPEED.items():
        runs = [generate(a.bin, gguf, h["question"], extra, a.threads) for h in qs]
        toks = sum(len(r["tokens"]) for r in runs)
        secs = sum(r["timings"]["generate_ms"] for r in runs) / 1e3
        rec = {"questions": len(runs), "mean_tpf": sum(r["tpf"] for r in runs) / len(runs),
               "tokens_per_forward": sum(r["forward_tokens"] for r in runs) / sum(r["forward_calls"] for r in runs),
               "generated_per_forward": toks / sum(r["forward_calls"] for r in runs),
               "tokens_per_s": toks / secs}
        if curve:
            t = sum(price(curve, n) for r in runs for n in r["forward_sizes"])
            rec["projected_tokens_per_s"] = toks / t
        res[name] = rec
        print("speed", name, json.dumps(rec), flush=True)
    if a.llama_bench:
        res["llama_ar_tokens_per_s"] = llama_bench(a.llama_bench, gguf, 128, a.threads)
        if a.cost_model:
            res["cost_curve_s"] = curve
            res["llama_ar_tokens_per_s_cost_model"] = llama_bench(a.llama_bench, a.cost_model, 32, a.threads)
        print("speed llama.cpp", json.dumps({k: v for k, v in res.items() if k.startswith("llama")}))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/refusion"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models/refusion-tiny"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--speed-questions", type=int, default=40)
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--cost-model", default=None, help="a bigger GGUF to project the speed to")
    ap.add_argument("--no-llama", action="store_true", help="skip llama-cpp-python")
    ap.add_argument("--skip-quality", action="store_true")
    a = ap.parse_args()
    held = json.load(open(os.path.join(a.model, "heldout.json")))[: a.questions]
    tmp = tempfile.mkdtemp()
    files = {}
    for q in ("f32", "q8_0", "q4_k_m"):
        files[q] = os.path.join(tmp, f"tiny-{q}.gguf")
        subprocess.run([a.bin, "convert", a.model, "-o", files[q], "--outtype", q, "-q"], check=True)
    t0 = time.time()
    report = {"machine": os.uname().machine, "threads": a.threads}
    if not a.skip_quality:
        report["quality"] = quality(a, files, held)
    report["speed"] = speed(a, files["q4_k_m"], held)
    report["seconds"] = round(time.time() - t0, 1)
    text = json.dumps(report, indent=1)
    if a.out:
        open(a.out, "w").write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
