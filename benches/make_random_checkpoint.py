#!/usr/bin/env python3
"""Writes a Hugging Face Qwen3 checkpoint with real-sized shapes and random bf16 weights, for
conversion and runtime benchmarks (the real ReFusion weights cannot be downloaded here).

    python3 benches/make_random_checkpoint.py --shape qwen3-1.7b bench-data/qwen3-1.7b

Shapes: qwen3-0.6b, qwen3-1.7b, qwen3-8b (ReFusion's: vocab 151671, untied). Weights are
Gaussian with std 0.02 (norms near 1), written in shards of about 2 GB with an index, the
tokenizer taken from tests/fixtures/tokenizers/refusion. Needs numpy.
"""
import argparse
import json
import os
import shutil
import struct

import numpy as np

SHAPES = {
    "qwen3-0.6b": dict(hidden=1024, layers=28, heads=16, kv=8, head_dim=128, ffn=3072, vocab=151936, tied=True),
    "qwen3-1.7b": dict(hidden=2048, layers=28, heads=16, kv=8, head_dim=128, ffn=6144, vocab=151936, tied=True),
    "qwen3-8b": dict(hidden=4096, layers=36, heads=32, kv=8, head_dim=128, ffn=12288, vocab=151671, tied=False),
}


def tensors(s):
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv"] * s["head_dim"]
    yield "model.embed_tokens.weight", (s["vocab"], h)
    for l in range(s["layers"]):
        p = f"model.layers.{l}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "self_attn.q_norm.weight", (s["head_dim"],)
        yield p + "self_attn.k_norm.weight", (s["head_dim"],)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (s["ffn"], h)
        yield p + "mlp.up_proj.weight", (s["ffn"], h)
        yield p + "mlp.down_proj.weight", (h, s["ffn"])
    yield "model.norm.weight", (h,)
    if not s["tied"]:
        yield "lm_head.weight", (s["vocab"], h)


def bf16_bytes(rng, shape):
    n = int(np.prod(shape))
    out = np.empty(n, dtype=np.uint16)
    step = 1 << 24
    for a in range(0, n, step):
        b = min(n, a + step)
        x = rng.standard_normal(b - a, dtype=np.float32) * 0.02 if len(shape) > 1 else \
            1.0 + 0.05 * rng.standard_normal(b - a, dtype=np.float32)
        out[a:b] = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncation is fine for noise
    return out.tobytes()


def write_shard(path, items):
    header, offset = {}, 0
    for name, shape, data in items:
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    hj = json.dumps(header).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for _, _, data in items:
            f.write(data)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("out")
    a = ap.parse_args()
    s = SHAPES[a.shape]
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    names = list(tensors(s))
    shards, cur, size = [], [], 0
    for name, shape in names:
        nbytes = int(np.prod(shape)) * 2
        if cur and size + nbytes > 2 << 30:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += nbytes
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_shard(os.path.join(a.out, fname), [(n, sh, bf16_bytes(rng, sh)) for n, sh in shard])
        for n, _ in shard:
            weight_map[n] = fname
        print(f"wrote {fname}", flush=True)
    json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(a.out, "model.safetensors.index.json"), "w"))
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": s["hidden"],
        "intermediate_size": s["ffn"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv"], "head_dim": s["head_dim"], "vocab_size": s["vocab"],
        "tie_word_embeddings": s["tied"], "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960, "bos_token_id": 151643, "eos_token_id": 151645,
        "mask_token_id": 151670, "rope_scaling": None, "torch_dtype": "bfloat16",
    }
    json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"), indent=2)
    tok = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "tokenizers", "refusion")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok, f), os.path.join(a.out, f))
    print(f"{a.shape}: {sum(int(np.prod(sh)) for _, sh in names) / 1e9:.3f} B parameters in {a.out}")


if __name__ == "__main__":
    main()
