#!/usr/bin/env python3
"""KV cache types at depth: `refusion bench -ctk K -ctv V -d D` next to llama.cpp's own
`llama-bench -ctk K -ctv V -d D`, on the same GGUF file, both sides interleaved over rounds
(benches/README.md#kv-cache-types-at-depth). A type `K/V` gives keys and values their own.

    python3 benches/kv_depth.py -m syn-0.6b-q4_k_m.gguf --types f32,f16,q8_0,q4_0,q8_0/f16 \
        -p 1,16 -d 4096 --rounds 3 [-r 3] [-t 2] \
        [--llama ~/.cache/llama-bench/build-native/bin/llama-bench] [--refusion target/release/refusion]

n new tokens over a cache of D entries, each the median of -r runs. llama.cpp runs flash
attention off and on where it can (a quantized V cache needs it on) and the faster counts, per
shape and round. Each round runs every (type, side) once, in turn; the table gives each side's
median over the rounds, the median of the rounds' own ratios and their range. Not run in CI.
"""
import argparse
import json
import os
import statistics
import subprocess


def pair(ty):
    """The key and value types of `K` or `K/V`."""
    k, _, v = ty.partition("/")
    return k, v or k


def refusion(a, ty, depth):
    k, v = pair(ty)
    cmd = [a.refusion, "bench", "-m", a.model, "-p", a.p, "-d", str(depth), "-r", str(a.r),
           "-t", str(a.t), "-c", str(depth + max(map(int, a.p.split(","))) + 64),
           "-ctk", k, "-ctv", v, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["n_tokens"]: r["tokens_per_s"] for r in rows}


def llama(a, ty, depth):
    """The faster of flash attention off and on per size (on only, for a quantized V)."""
    k, v = pair(ty)
    fa = "0,1" if v in ("f32", "f16", "bf16") else "1"
    cmd = [a.llama, "-m", a.model, "-p", a.p, "-n", "0", "-d", str(depth), "-fa", fa,
           "-ctk", k, "-ctv", v, "-t", str(a.t), "-r", str(a.r), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        # llama-bench 0.3.36 refuses some types (an f32 cache): no comparison there.
        return {}
    rows = json.loads(done.stdout)
    best = {}
    for r in rows:
        n, ts = r["n_prompt"], r["avg_ts"]
        if ts > best.get(n, (0, None))[0]:
            best[n] = (ts, r["flash_attn"])
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--types", default="f32,f16,q8_0,q4_0")
    ap.add_argument("-p", default="1,16")
    ap.add_argument("-d", "--depths", default="4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--llama", default=os.path.expanduser(
        "~/.cache/llama-bench/build-native/bin/llama-bench"))
    ap.add_argument("--refusion", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "../target/release/refusion"))
    a = ap.parse_args()
    types, depths = a.types.split(","), [int(d) for d in a.depths.split(",")]
    runs = {}
    for rnd in range(a.rounds):
        for depth in depths:
            for ty in types:
                ours = refusion(a, ty, depth)
                theirs = llama(a, ty, depth)
                for n, ts in ours.items():
                    fa = theirs.get(n, (None, None))
                    runs.setdefault((ty, depth, n), []).append((ts, fa[0], fa[1]))
                print(f"round {rnd + 1}: {ty} d{depth} {ours} {theirs}", flush=True)
    print("| type | test | refusion t/s | llama.cpp t/s (fa) | ratio (range) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for (ty, depth, n), rs in runs.items():
        ours = statistics.median(r[0] for r in rs)
        have = [r for r in rs if r[1]]
        if not have:
            print(f"| {ty} | pp{n} @ d{depth} | {ours:.2f} | - | - |")
            continue
        theirs = statistics.median(r[1] for r in have)
        fas = sorted({str(r[2]) for r in have})
        ratios = [r[0] / r[1] for r in have]
        print(f"| {ty} | pp{n} @ d{depth} | {ours:.2f} | {theirs:.2f} ({'/'.join(fas)}) | "
              f"**{statistics.median(ratios):.2f}** ({min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
