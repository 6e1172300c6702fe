#!/usr/bin/env python3
"""refusion's CPU kernel paths next to llama.cpp's own `llama-bench`, on the same GGUF files.

    python3 benches/cpu_paths.py -m 0.6b-q4_k_m.gguf [-m ...] [--refusion target/release/refusion]
        [--llama-native ~/.cache/llama-bench/build-native/bin/llama-bench]
        [--llama-avx2 ~/.cache/llama-bench/build-avx2/bin/llama-bench] [-r 5] [-t 2]

For each file: n new tokens (1, 16, 32, 64) over a 256-entry cache, as `refusion bench` and
`llama-bench -n 0 -d 256` measure them, median of -r runs. refusion runs on every kernel path
the CPU has (`REFUSION_CPU`) and on candle's kernels; llama.cpp natively and as its AVX2-only
build (../shared/tools/build-llama-bench.sh builds both), each with flash attention off and on,
the faster per shape. The ratio compares like with like: our best native path against native
llama.cpp, our `avx2` path against the AVX2-only build. Prints one markdown table.
Not run in CI.
"""
import argparse
import json
import os
import subprocess

SIZES = [1, 16, 32, 64]


def refusion(binary, model, env, reps, threads):
    cmd = [binary, "bench", "-m", model, "-p", ",".join(map(str, SIZES)), "-d", "256", "-r", str(reps),
           "-t", str(threads), "-c", "512", "--json"]
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["n_tokens"]: r["tokens_per_s"] for r in rows}, rows[0].get("kernels", "?")


def llama(binary, model, reps, threads):
    cmd = [binary, "-m", model, "-p", ",".join(map(str, SIZES)), "-n", "0", "-d", "256", "-fa", "0,1",
           "-t", str(threads), "-r", str(reps), "-o", "json"]
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    best = {}
    for r in rows:
        n, ts = r["n_prompt"], r["avg_ts"]
        if ts > best.get(n, (0, None))[0]:
            best[n] = (ts, r["flash_attn"])
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", action="append", required=True)
    ap.add_argument("--refusion", default="target/release/refusion")
    home = os.path.expanduser("~/.cache/llama-bench")
    ap.add_argument("--llama-native", default=f"{home}/build-native/bin/llama-bench")
    ap.add_argument("--llama-avx2", default=f"{home}/build-avx2/bin/llama-bench")
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    print("| file | test | path | refusion t/s | llama.cpp t/s (build, fa) | ratio |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for model in a.model:
        name = os.path.basename(model)
        native, kernels = refusion(a.refusion, model, {}, a.reps, a.threads)
        avx2, _ = refusion(a.refusion, model, {"REFUSION_CPU": "avx2"}, a.reps, a.threads)
        candle, _ = refusion(a.refusion, model, {"REFUSION_NO_NATIVE_KQUANTS": "1"}, a.reps, a.threads)
        l_native = llama(a.llama_native, model, a.reps, a.threads)
        l_avx2 = llama(a.llama_avx2, model, a.reps, a.threads)
        for n in SIZES:
            for path, ours, theirs, build in [(kernels, native, l_native, "native"),
                                              ("avx2", avx2, l_avx2, "avx2"),
                                              ("candle", candle, l_native, "native")]:
                ts, fa = theirs[n]
                print(f"| {name} | pp{n} @ d256 | {path} | {ours[n]:.2f} | {ts:.2f} ({build}, fa {fa}) | "
                      f"{ours[n] / ts:.2f} |")


if __name__ == "__main__":
    main()
