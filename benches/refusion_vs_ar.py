#!/usr/bin/env python3
"""A whole answer: ReFusion's slot decoding (`refusion generate`) next to llama.cpp's
autoregressive decoding of the same GGUF file, and where ReFusion breaks even.

    python3 benches/refusion_vs_ar.py --refusion target/release/refusion -m bench-data/0.6b-q4_k_m.gguf

With random weights ReFusion's tokens per forward (TPF) is not the real model's, so besides both
tokens/s this prints the forward cost curve t(n)/t(1) from `refusion bench` and the TPF at which
ReFusion would match llama.cpp: (mean time of one ReFusion forward) / (llama.cpp's time per
token). The paper's settings and TPFs are in shared/reference/refusion-facts.md.
Not part of CI; needs llama-cpp-python.
"""
import argparse
import ctypes
import json
import subprocess
import time

import llama_cpp as L

_quiet = L.llama_log_callback(lambda level, text, user: None)


def llama_ar(path, prompt, n_gen, threads):
    L.llama_log_set(_quiet, ctypes.c_void_p(0))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx = len(prompt) + n_gen + 8
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_n_vocab(L.llama_model_get_vocab(model))

    def decode(tokens, start):
        b = L.llama_batch_init(len(tokens), 0, 1)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0] = t, start + i, 1, 0
            b.logits[i] = 1 if i == len(tokens) - 1 else 0
        b.n_tokens = len(tokens)
        assert L.llama_decode(ctx, b) == 0
        L.llama_batch_free(b)
        logits = L.llama_get_logits_ith(ctx, -1)
        return max(range(n_vocab), key=lambda j: logits[j])

    tok = decode(prompt, 0)
    t = time.perf_counter()
    for i in range(n_gen):
        tok = decode([tok], len(prompt) + i)
    dt = time.perf_counter() - t
    L.llama_free(ctx)
    L.llama_model_free(model)
    return n_gen / dt, dt / n_gen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--refusion", default="target/release/refusion")
    ap.add_argument("-m", required=True)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--slot-size", type=int, default=4)
    ap.add_argument("--serial-blocks", type=int, default=8)
    a = ap.parse_args()
    prompt = [(i * 7919 + 13) % 150000 for i in range(32)]

    ar_tps, ar_t1 = llama_ar(a.m, prompt, a.n, a.t)
    out = subprocess.run([a.refusion, "generate", "-m", a.m, "--prompt-ids", ",".join(map(str, prompt)), "-n", str(a.n),
                          "--slot-size", str(a.slot_size), "--serial-blocks", str(a.serial_blocks), "-t", str(a.t), "--json"],
                         check=True, capture_output=True, text=True)
    g = json.loads(out.stdout)
    gen_s = g["timings"]["generate_ms"] / 1e3
    rf_tps = len(g["tokens"]) / gen_s
    per_forward = gen_s / g["forward_calls"]
    bench = subprocess.run([a.refusion, "bench", "-m", a.m, "-p", "1,2,4,8,16,32,64,128", "-d", "64", "-r", "3",
                            "-t", str(a.t), "--json"], check=True, capture_output=True, text=True)
    curve = {j["n_tokens"]: j["ms_per_forward"] for j in map(json.loads, bench.stdout.splitlines())}
    print(f"model file: {a.m}, {a.n} new tokens, {a.t} threads")
    print(f"llama.cpp autoregressive: {ar_tps:.2f} tokens/s ({ar_t1 * 1e3:.2f} ms per token)")
    print(f"refusion slot decoding:   {rf_tps:.2f} tokens/s (TPF {g['tpf']:.3f}, {g['forward_calls']} forwards, "
          f"{g['forward_tokens'] / g['forward_calls']:.1f} tokens per forward, {per_forward * 1e3:.2f} ms per forward)")
    print(f"break-even TPF against llama.cpp: {per_forward / ar_t1:.2f}")
    print("refusion forward cost t(n)/t(1) over a 64-entry cache:")
    for n, ms in curve.items():
        print(f"  n={n:4d}: {ms:8.2f} ms  t(n)/t(1) = {ms / curve[1]:.2f}")


if __name__ == "__main__":
    main()
