#!/usr/bin/env python3
"""Forward throughput of refusion next to llama.cpp's, on the same GGUF file, same threads,
same shapes: n new tokens (one sequence) over a cache already holding `prefix` entries,
median of several runs after a warm-up. Not part of CI.

    pip install llama-cpp-python     # builds llama.cpp from source once (10-20 minutes)
    python3 benches/vs_llama_cpp.py --refusion target/release/refusion -m bench-data/0.6b-q4_k_m.gguf

llama.cpp is driven through its C API (llama_decode on a batch, then llama_memory_seq_rm to
drop the new entries), refusion through `refusion bench --json`.
"""
import argparse
import ctypes
import json
import statistics
import subprocess
import time

import llama_cpp as L


_quiet = L.llama_log_callback(lambda level, text, user: None)


def llama_cpp_bench(path, sizes, prefix, reps, threads):
    L.llama_log_set(_quiet, ctypes.c_void_p(0))
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise SystemExit(f"llama.cpp could not load {path}")
    cp = L.llama_context_default_params()
    cp.n_ctx = prefix + max(sizes) + 16
    cp.n_batch = max(512, max(sizes))
    cp.n_ubatch = max(512, max(sizes))
    cp.n_threads = threads
    cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    vocab = L.llama_n_vocab(L.llama_model_get_vocab(model))

    def decode(tokens, start, want_last_logits=True):
        n = len(tokens)
        b = L.llama_batch_init(n, 0, 1)
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = start + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if (want_last_logits and i == n - 1) else 0
        b.n_tokens = n
        rc = L.llama_decode(ctx, b)
        L.llama_synchronize(ctx)
        L.llama_batch_free(b)
        if rc != 0:
            raise SystemExit(f"llama_decode failed ({rc})")

    if prefix:
        decode([(i * 7919 + 13) % vocab for i in range(prefix)], 0)
    out = {}
    for n in sizes:
        toks = [(i * 104729 + 7) % vocab for i in range(n)]
        times = []
        for rep in range(reps + 1):
            t = time.perf_counter()
            decode(toks, prefix)
            dt = time.perf_counter() - t
            L.llama_memory_seq_rm(mem, 0, prefix, -1)
            if rep:
                times.append(dt)
        out[n] = n / statistics.median(times)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return out


def refusion_bench(binary, path, sizes, prefix, reps, threads):
    cmd = [binary, "bench", "-m", path, "-p", ",".join(map(str, sizes)), "-d", str(prefix),
           "-r", str(reps), "-t", str(threads), "--json"]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
    return {r["n_tokens"]: r["tokens_per_s"] for r in rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--refusion", default="target/release/refusion")
    ap.add_argument("-m", "--model", required=True, action="append")
    ap.add_argument("-p", default="1,16,32,64")
    ap.add_argument("-d", "--prefix", type=int, default=256)
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("-t", type=int, default=2)
    a = ap.parse_args()
    sizes = [int(x) for x in a.p.split(",")]
    print(f"| model file | test | refusion t/s | llama.cpp t/s | ratio |")
    print(f"| --- | --- | ---: | ---: | ---: |")
    for path in a.model:
        ours = refusion_bench(a.refusion, path, sizes, a.prefix, a.r, a.t)
        theirs = llama_cpp_bench(path, sizes, a.prefix, a.r, a.t)
        for n in sizes:
            print(f"| {path.split('/')[-1]} | pp{n} @ d{a.prefix} | {ours[n]:.2f} | {theirs[n]:.2f} | {ours[n] / theirs[n]:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
