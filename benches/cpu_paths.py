#!/usr/bin/env python3
"""refusion's CPU kernel paths next to llama.cpp's own `llama-bench`, on the same GGUF files,
both sides interleaved over rounds.

    python3 benches/cpu_paths.py -m 0.6b-q4_k_m.gguf [-m ...] [--refusion target/release/refusion]
        [--llama-native ~/.cache/llama-bench/build-native/bin/llama-bench]
        [--llama-avx2 ~/.cache/llama-bench/build-avx2/bin/llama-bench]
        [-p 1,16,64,128] [--rounds 5] [-r 3] [-t 2] [--paths native,avx2,candle] [--json out.json]

For each file: n new tokens over a 256-entry cache, as `refusion bench` and `llama-bench -n 0
-d 256` measure them (each the median of -r runs). refusion runs on its native kernel path, on
`REFUSION_CPU=avx2` and on candle's kernels (`--paths` picks); llama.cpp natively and as its
AVX2-only build (../shared/tools/build-llama-bench.sh builds both), each with flash attention
off and on, the faster per shape. Like with like: our native path against native llama.cpp,
our `avx2` path against the AVX2-only build.

A VM's speed drifts by up to 30% within minutes, so one run decides nothing: each round runs
every side once, one after the other (the memory-bandwidth anchor, `refusion bench --membw`,
too), and the table gives each side's median over the rounds, the median of the rounds' own
ratios and their range. One-token rows also give the weights' bytes read per second (the file's
tensors but the embedding table, which a token reads one row of) as a share of the anchor.
Not run in CI.
"""
import argparse
import json
import os
import platform
import statistics
import struct
import subprocess
import time


def gguf_weight_bytes(path):
    """Bytes a one-token forward reads of the file's tensors: all but token_embd's (unless the
    output layer is token_embd itself, as in tied files)."""
    return os.path.getsize(path) - embd_bytes(path)


def embd_bytes(path):
    """token_embd's bytes, read from the GGUF header (v3) without loading anything."""
    with open(path, "rb") as f:
        def u32():
            return struct.unpack("<I", f.read(4))[0]

        def u64():
            return struct.unpack("<Q", f.read(8))[0]

        def string():
            return f.read(u64()).decode("utf-8", "replace")

        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

        def skip(t):
            if t == 8:
                string()
            elif t == 9:
                et, n = u32(), u64()
                for _ in range(n):
                    skip(et)
            else:
                f.read(sizes[t])

        assert f.read(4) == b"GGUF"
        u32()
        n_t, n_kv = u64(), u64()
        for _ in range(n_kv):
            string()
            skip(u32())
        infos = []
        for _ in range(n_t):
            name = string()
            dims = [u64() for _ in range(u32())]
            infos.append((name, dims, u32(), u64()))
        offs = sorted(o for _, _, _, o in infos)
        # Offsets count from the data section: the header's end, aligned (32 by default).
        data = (f.tell() + 31) // 32 * 32
        end = os.path.getsize(path) - data
        if not any(name == "output.weight" for name, _, _, _ in infos):
            return 0
        for name, _, _, off in infos:
            if name == "token_embd.weight":
                later = [o for o in offs if o > off]
                return (later[0] if later else end) - off
    return 0


def refusion(model, env, sizes, reps, threads):
    cmd = [ARGS.refusion, "bench", "-m", model, "-p", ",".join(map(str, sizes)), "-d", "256",
           "-r", str(reps), "-t", str(threads), "-c", "1024", "--json"]
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                         check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["n_tokens"]: r["tokens_per_s"] for r in rows}, rows[0].get("kernels", "?")


def llama(binary, model, sizes, reps, threads):
    cmd = [binary, "-m", model, "-p", ",".join(map(str, sizes)), "-n", "0", "-d", "256", "-fa",
           "0,1", "-t", str(threads), "-r", str(reps), "-o", "json"]
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    best = {}
    for r in rows:
        n, ts = r["n_prompt"], r["avg_ts"]
        if ts > best.get(n, (0, None))[0]:
            best[n] = (ts, int(r["flash_attn"]) if not isinstance(r["flash_attn"], str)
                       else r["flash_attn"])
    return best


def membw(threads):
    out = subprocess.run([ARGS.refusion, "bench", "--membw", "-r", "1", "-t", str(threads),
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    return max(r["gbps"] for r in json.loads(out))


def med_range(xs):
    return statistics.median(xs), min(xs), max(xs)


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", action="append", required=True)
    ap.add_argument("--refusion", default="target/release/refusion")
    home = os.path.expanduser("~/.cache/llama-bench")
    ap.add_argument("--llama-native", default=f"{home}/build-native/bin/llama-bench")
    ap.add_argument("--llama-avx2", default=f"{home}/build-avx2/bin/llama-bench")
    ap.add_argument("-p", "--sizes", default="1,16,32,64")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--paths", default="native,avx2,candle")
    ap.add_argument("--json")
    ARGS = a = ap.parse_args()
    if a.rounds < 1 or a.reps < 1:
        ap.error("--rounds and -r must be at least 1")
    sizes = [int(s) for s in a.sizes.split(",")]
    paths = a.paths.split(",")
    sides = {"native": ({}, a.llama_native), "avx2": ({"REFUSION_CPU": "avx2"}, a.llama_avx2),
             "candle": ({"REFUSION_NO_NATIVE_KQUANTS": "1"}, a.llama_native)}
    results = {"machine": platform.processor() or platform.machine(), "threads": a.threads,
               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": a.rounds, "reps": a.reps,
               "membw": [], "files": {}}
    for model in a.model:
        results["files"][model] = {"weight_bytes": gguf_weight_bytes(model), "paths": {}}
    for rnd in range(a.rounds):
        results["membw"].append(membw(a.threads))
        for model in a.model:
            per = results["files"][model]["paths"]
            llama_done = {}
            for path in paths:
                env, lbin = sides[path]
                ours, kernels = refusion(model, env, sizes, a.reps, a.threads)
                if lbin not in llama_done:
                    llama_done[lbin] = llama(lbin, model, sizes, a.reps, a.threads)
                theirs = llama_done[lbin]
                p = per.setdefault(path, {"kernels": kernels, "rounds": []})
                p["rounds"].append({"ours": ours, "theirs": {n: theirs[n][0] for n in sizes},
                                    "fa": {n: theirs[n][1] for n in sizes}})
                print(f"round {rnd + 1}: {os.path.basename(model)} {path}: " + " ".join(
                    f"pp{n} {ours[n]:.1f}/{theirs[n][0]:.1f}" for n in sizes), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    bw = statistics.median(results["membw"])
    print(f"\nmemory anchor (refusion bench --membw, best way, median of {a.rounds} rounds): "
          f"{bw:.1f} GB/s ({min(results['membw']):.1f}-{max(results['membw']):.1f})\n")
    print(f"| file | test | path | refusion t/s | llama.cpp t/s (build, fa) | ratio (range) | "
          f"refusion of anchor | llama.cpp of anchor |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for model in a.model:
        f = results["files"][model]
        for n in sizes:
            for path in paths:
                p = f["paths"][path]
                rs = p["rounds"]
                ours = statistics.median(r["ours"][n] for r in rs)
                theirs = statistics.median(r["theirs"][n] for r in rs)
                ratio, lo, hi = med_range([r["ours"][n] / r["theirs"][n] for r in rs])
                fas = sorted({r["fa"][n] for r in rs})
                build = "native" if path != "avx2" else "avx2"
                share = ""
                if n == 1:
                    share = (f"{100 * f['weight_bytes'] * ours / 1e9 / bw:.0f}% | "
                             f"{100 * f['weight_bytes'] * theirs / 1e9 / bw:.0f}%")
                else:
                    share = " | "
                print(f"| {os.path.basename(model)} | pp{n} @ d256 | {p['kernels'] if path == 'native' else path} | "
                      f"{ours:.2f} | {theirs:.2f} ({build}, fa {'/'.join(map(str, fas))}) | "
                      f"**{ratio:.2f}** ({lo:.2f}-{hi:.2f}) | {share} |")


ARGS = None

if __name__ == "__main__":
    main()
