#!/usr/bin/env python3
"""Reads a GGUF written by `refusion convert` with llama.cpp's own `gguf` package and checks
it against the Hugging Face checkpoint it came from.

    check_gguf.py FILE.gguf HF_DIR

Checks: the qwen3 keys llama.cpp needs and their values, the tokenizer arrays, tensor names
and shapes, f32 tensors bit-exact, and every other tensor within its type's error bound
after decoding with gguf-py's numpy dequantizers (an implementation independent of ours).
Prints "OK <n> tensors" and exits 0, or raises.
"""
import json
import os
import struct
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

# Relative RMSE bounds on the test weights (same table as tests/convert.rs).
BOUND = {
    T.F32: 0.0, T.F16: 1e-3, T.BF16: 5e-3, T.Q8_0: 0.01, T.Q6_K: 0.03, T.Q5_K: 0.07,
    T.Q5_0: 0.085, T.Q5_1: 0.085, T.Q4_K: 0.14, T.Q4_0: 0.17, T.Q4_1: 0.17, T.Q3_K: 0.3, T.Q2_K: 0.5,
}

LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    layer, suffix = hf[len("model.layers."):].split(".", 1)
    return f"blk.{layer}.{LAYER[suffix]}"


def read_safetensors(path):
    """Minimal safetensors reader (numpy only): name -> float32 array."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = data[a:b]
        if info["dtype"] == "F32":
            x = np.frombuffer(raw, dtype="<f4")
        elif info["dtype"] == "F16":
            x = np.frombuffer(raw, dtype="<f2").astype(np.float32)
        elif info["dtype"] == "BF16":
            x = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"unexpected dtype {info['dtype']}")
        out[name] = x.reshape(info["shape"])
    return out


def load_weights(hf_dir):
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    files = (sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index)
             else ["model.safetensors"])
    weights = {}
    for f in files:
        weights.update(read_safetensors(os.path.join(hf_dir, f)))
    return weights


def field(reader, key):
    f = reader.fields.get(key)
    assert f is not None, f"missing key {key}"
    return f


def scalar(reader, key):
    f = field(reader, key)
    v = f.parts[f.data[0]]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(v).decode()
    return v.tolist()[0]


def strings(reader, key):
    f = field(reader, key)
    return [bytes(f.parts[i]).decode() for i in f.data]


def main():
    path, hf_dir = sys.argv[1], sys.argv[2]
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    r = gguf.GGUFReader(path)

    assert scalar(r, "general.architecture") == "qwen3"
    expect = {
        "qwen3.block_count": cfg["num_hidden_layers"],
        "qwen3.context_length": cfg["max_position_embeddings"],
        "qwen3.embedding_length": cfg["hidden_size"],
        "qwen3.feed_forward_length": cfg["intermediate_size"],
        "qwen3.attention.head_count": cfg["num_attention_heads"],
        "qwen3.attention.head_count_kv": cfg["num_key_value_heads"],
        "qwen3.attention.key_length": cfg["head_dim"],
        "qwen3.attention.value_length": cfg["head_dim"],
        "general.quantization_version": 2,
        "tokenizer.ggml.mask_token_id": cfg["mask_token_id"],
    }
    for key, want in expect.items():
        got = scalar(r, key)
        assert got == want, f"{key}: {got} != {want}"
    assert np.isclose(scalar(r, "qwen3.rope.freq_base"), cfg["rope_theta"], rtol=1e-6)
    assert np.isclose(scalar(r, "qwen3.attention.layer_norm_rms_epsilon"), cfg["rms_norm_eps"], rtol=1e-5)
    assert scalar(r, "tokenizer.ggml.model") == "gpt2"
    assert scalar(r, "tokenizer.ggml.pre") == "qwen2"
    assert scalar(r, "tokenizer.ggml.add_bos_token") is False or scalar(r, "tokenizer.ggml.add_bos_token") == 0

    tokens = strings(r, "tokenizer.ggml.tokens")
    assert len(tokens) == cfg["vocab_size"], (len(tokens), cfg["vocab_size"])
    tok_path = os.path.join(hf_dir, "tokenizer.json")
    if os.path.exists(tok_path):
        tj = json.load(open(tok_path))
        for text, i in tj["model"]["vocab"].items():
            assert tokens[i] == text, (i, tokens[i], text)
        for a in tj["added_tokens"]:
            assert tokens[a["id"]] == a["content"]
        merges = strings(r, "tokenizer.ggml.merges")
        first = tj["model"]["merges"][0]
        assert merges[0] == (first if isinstance(first, str) else " ".join(first))
    types = field(r, "tokenizer.ggml.token_type")
    assert len(types.data) == cfg["vocab_size"]
    tmpl = json.load(open(os.path.join(hf_dir, "tokenizer_config.json"))).get("chat_template")
    if tmpl:
        assert scalar(r, "tokenizer.chat_template") == tmpl

    weights = load_weights(hf_dir)
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == len(weights), (sorted(tensors), sorted(weights))
    for hf, x in weights.items():
        t = tensors[gguf_name(hf)]
        assert list(t.shape) == list(reversed(x.shape)), (hf, t.shape, x.shape)
        y = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(x.shape)
        if t.tensor_type == T.F32:
            assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), f"{hf} not bit-exact"
        else:
            e = np.sqrt(np.sum((x - y) ** 2) / max(np.sum(x.astype(np.float64) ** 2), 1e-30))
            assert e <= BOUND[t.tensor_type], f"{hf}: {t.tensor_type.name} rel rmse {e}"
    print(f"OK {len(tensors)} tensors")


if __name__ == "__main__":
    main()
