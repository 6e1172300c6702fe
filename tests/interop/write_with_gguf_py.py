#!/usr/bin/env python3
"""Writes a Hugging Face Qwen3 checkpoint as a qwen3 GGUF with llama.cpp's own `gguf` library,
the way llama.cpp's convert_hf_to_gguf.py lays it out (keys, tensor names, f32 weights), so that
the runtime can be tested on a file it did not write.

    write_with_gguf_py.py HF_DIR OUT.gguf
"""
import json
import os
import struct
import sys

import numpy as np
import gguf

hf, out = sys.argv[1], sys.argv[2]
cfg = json.load(open(os.path.join(hf, "config.json")))
tok = json.load(open(os.path.join(hf, "tokenizer.json")))
tok_cfg = json.load(open(os.path.join(hf, "tokenizer_config.json")))

with open(os.path.join(hf, "model.safetensors"), "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
    data = f.read()
weights = {}
for name, info in header.items():
    if name == "__metadata__":
        continue
    a, b = info["data_offsets"]
    weights[name] = np.frombuffer(data[a:b], dtype="<f4").reshape(info["shape"])

w = gguf.GGUFWriter(out, "qwen3")
w.add_name(os.path.basename(hf.rstrip("/")))
w.add_block_count(cfg["num_hidden_layers"])
w.add_context_length(cfg["max_position_embeddings"])
w.add_embedding_length(cfg["hidden_size"])
w.add_feed_forward_length(cfg["intermediate_size"])
w.add_head_count(cfg["num_attention_heads"])
w.add_head_count_kv(cfg["num_key_value_heads"])
w.add_key_length(cfg["head_dim"])
w.add_value_length(cfg["head_dim"])
w.add_rope_freq_base(cfg["rope_theta"])
w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
w.add_file_type(0)
vocab = cfg["vocab_size"]
tokens, types = [f"[PAD{i}]" for i in range(vocab)], [gguf.TokenType.UNUSED] * vocab
for text, i in tok["model"]["vocab"].items():
    tokens[i], types[i] = text, gguf.TokenType.NORMAL
for a in tok["added_tokens"]:
    tokens[a["id"]] = a["content"]
    types[a["id"]] = gguf.TokenType.CONTROL if a["special"] else gguf.TokenType.USER_DEFINED
merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
w.add_tokenizer_model("gpt2")
w.add_tokenizer_pre("qwen2")
w.add_token_list(tokens)
w.add_token_types(types)
w.add_token_merges(merges)
w.add_eos_token_id(cfg["eos_token_id"])
w.add_bos_token_id(cfg["bos_token_id"])
w.add_add_bos_token(False)
w.add_uint32("tokenizer.ggml.mask_token_id", cfg["mask_token_id"])
w.add_chat_template(tok_cfg["chat_template"])

names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
for name, x in weights.items():
    if name == "model.embed_tokens.weight":
        g = "token_embd.weight"
    elif name == "model.norm.weight":
        g = "output_norm.weight"
    elif name == "lm_head.weight":
        g = "output.weight"
    else:
        layer, rest = name[len("model.layers."):].split(".", 1)
        g = f"blk.{layer}.{names[rest[:-len('.weight')]]}.weight"
    w.add_tensor(g, np.ascontiguousarray(x, dtype=np.float32))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
