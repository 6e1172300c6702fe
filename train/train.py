#!/usr/bin/env python3
"""Trains the tiny ReFusion that `refusion demo` ships, on the CPU, seeded and reproducible.

    python3 -m venv .venv && .venv/bin/pip install -r train/requirements.txt
    .venv/bin/python train/train.py --steps 3400 --minutes 60 --out /tmp/stage1   # 33 min, 2 cores
    .venv/bin/python train/train.py --init /tmp/stage1 --dialogues --steps 900 --bucket 8 \
        --lr 6e-4 --minutes 50 --out models/refusion-tiny               # the second stage, 22 min

1. The corpus (train/corpus.py): chat questions with worked answers, generated offline.
2. A byte-level BPE tokenizer trained on it, in Qwen3's format (the Qwen2 split pattern, NFC,
   byte-level), with Qwen3's special tokens, `<|mask|>`, and the ReFusion chat template.
3. A Qwen3-architecture model trained with ReFusion's objective (train/model.py).
4. A Hugging Face folder: config.json (with `mask_token_id`), model.safetensors (bf16),
   tokenizer.json, tokenizer_config.json, generation_config.json, heldout.json, train_log.json.

The second stage (`--init` a first stage's folder, `--dialogues`) keeps its tokenizer and goes on
training its weights on a mix: half the four kinds alone, the rest conversations of 2-4
questions, tool calls (and answers after a tool's result) and JSON answers (corpus.dialogue).
Those prompts are rendered by the model's own chat template in Jinja2, as the runtime renders
them (tools in the system turn, earlier turns, `<tool_response>`), and written with
heldout_chats.json, the chats held out for benches/chat_quality.py.
"""

import argparse
import json
import os
import random
import sys
import time

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
from model import Qwen3, cosine_lr, refusion_batch, refusion_loss  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TEMPLATE_FROM = os.path.join(ROOT, "tests/fixtures/tokenizers/refusion/tokenizer_config.json")
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3's specials that the chat template and the decoder use, then ReFusion's mask.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]
# The second stage's added (non-special) tokens: the fixed phrases of the chat template's tool
# prompt and of tool calls, results and JSON answers. The first stage's BPE never saw them, so a
# tool prompt would be ~650 tokens of single letters; as tokens of their own it is ~145, which
# keeps the second stage's steps short. They take the ids the vocabulary's padding left free.
PHRASES = [
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\n</tool_call>",
    '{"type": "function", "function": {"name": "', '", "description": "',
    '", "parameters": {"type": "object", "properties": {', '{"type": "integer"}',
    '{"type": "string"}', '}, "required": [', "<tool_call>\n", "\n</tool_call>",
    "<tool_response>\n", "\n</tool_response>", '{"name": "', '", "arguments": {', '{"answer": ',
    '{"city": "', '"degrees": ', '"sky": "',
]


def config(vocab):
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": vocab, "tie_word_embeddings": False, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "initializer_range": 0.02,
        "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 6,
        "rope_scaling": None, "torch_dtype": "bfloat16", "use_cache": True,
    }


def chat_prompt(tok, question):
    """The ReFusion template's rendering of one user turn with the generation prompt."""
    return tok.encode(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n").ids


def chat_renderer(tok_config):
    """The chat template's prompt for (messages, tools), with the generation prompt: Jinja2 set up
    as transformers sets it up, with a `tojson` that writes what Python's json.dumps writes (the
    runtime's template filter writes the same, engine/src/chat/template.rs)."""
    import jinja2
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent)
    template = env.from_string(tok_config["chat_template"])
    return lambda messages, tools: template.render(messages=messages, tools=tools,
                                                   add_generation_prompt=True)


def train_tokenizer(texts, vocab):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(SPECIALS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    # Added after training so they take the last ids, as in Qwen3 (think tags are not special).
    from tokenizers import AddedToken
    for s in SPECIALS:
        tok.add_tokens([AddedToken(s, special=s not in ("<think>", "</think>"), normalized=False)])
    return tok


def tokenizer_config(tok):
    src = json.load(open(TEMPLATE_FROM))
    added = {}
    for s in SPECIALS + [p for p in PHRASES if tok.token_to_id(p) is not None]:
        added[str(tok.token_to_id(s))] = {
            "content": s, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": s in SPECIALS and s not in ("<think>", "</think>")}
    return {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "bos_token": None, "chat_template": src["chat_template"], "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "mask_token": "<|mask|>",
        "model_max_length": 2048, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }


def load(folder):
    """A first stage's model folder: (model, tokenizer, config)."""
    from safetensors.torch import load_file
    cfg = json.load(open(os.path.join(folder, "config.json")))
    model = Qwen3(cfg)
    state = {k: v.float() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    model.load_state_dict(state)
    return model, Tokenizer.from_file(os.path.join(folder, "tokenizer.json")), cfg


def save(model, tok, cfg, out, held, log, chats=None):
    os.makedirs(out, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": [cfg["eos_token_id"], cfg["bos_token_id"]]}
    json.dump(gen, open(os.path.join(out, "generation_config.json"), "w"), indent=2)
    tok.save(os.path.join(out, "tokenizer.json"))
    json.dump(tokenizer_config(tok), open(os.path.join(out, "tokenizer_config.json"), "w"), indent=2)
    json.dump(held, open(os.path.join(out, "heldout.json"), "w"), indent=1)
    json.dump(log, open(os.path.join(out, "train_log.json"), "w"), indent=1)
    if chats is not None:
        json.dump(chats, open(os.path.join(out, "heldout_chats.json"), "w"), indent=1)


def samples_from(a, tok, src, held, chats):
    """Endless (prompt ids, answer ids) pairs: the four kinds (from `src`, the stream the
    tokenizer was trained on), or with --dialogues the mix."""
    eos = tok.token_to_id("<|im_end|>")
    if not a.dialogues:
        for _, q, resp, _ in src:
            yield chat_prompt(tok, q), tok.encode(resp).ids + [eos]
        return
    render = chat_renderer(tokenizer_config(tok))
    for _, _, messages, tools, resp, _ in corpus.stream_dialogues(a.seed + 1, held + chats):
        yield tok.encode(render(messages, tools)).ids, tok.encode(resp).ids + [eos]


def batches(src, size, bucket):
    """Batches of `size` samples of like length: `bucket` batches' worth are drawn, sorted by
    length and cut, so that little of a batch is padding (the order of batches is shuffled)."""
    if bucket <= 1:
        while True:
            yield [next(src) for _ in range(size)]
    while True:
        pool = sorted((next(src) for _ in range(size * bucket)), key=lambda s: len(s[0]) + len(s[1]))
        cut = [pool[k:k + size] for k in range(0, len(pool), size)]
        random.Random(len(pool[0][0])).shuffle(cut)
        yield from cut


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--out", default=os.path.join(ROOT, "models/refusion-tiny"))
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=42.0, help="stop early past this time")
    ap.add_argument("--init", help="a first stage's model folder: its tokenizer and weights")
    ap.add_argument("--dialogues", action="store_true",
                    help="train on conversations, tool calls and JSON answers besides the four kinds")
    ap.add_argument("--bucket", type=int, default=1, help="batches drawn at once and sorted by length")
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    r = random.Random(a.seed)

    held = corpus.split(a.seed)
    chats = corpus.split_dialogues(a.seed) if a.dialogues else None
    src = corpus.stream(a.seed, held)
    if a.init:
        model, tok, cfg = load(a.init)
        if a.dialogues:
            from tokenizers import AddedToken
            tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in PHRASES])
            if tok.get_vocab_size() > cfg["vocab_size"]:
                sys.exit(f"{tok.get_vocab_size()} tokens do not fit vocab_size {cfg['vocab_size']}")
        ids = {s: tok.token_to_id(s) for s in SPECIALS}
        print(f"from {a.init}: tokenizer {tok.get_vocab_size()} tokens; ids {ids}", flush=True)
    else:
        texts = []
        for _ in range(20000):
            _, q, resp, _ = next(src)
            texts.append(f"user\n{q}\nassistant\n{resp}\n")
        tok = train_tokenizer(texts, a.vocab)
        ids = {s: tok.token_to_id(s) for s in SPECIALS}
        vocab = tok.get_vocab_size()
        padded = -(-vocab // 256) * 256
        cfg = config(padded)
        cfg.update(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                   mask_token_id=ids["<|mask|>"], pad_token_id=ids["<|endoftext|>"])
        print(f"tokenizer: {vocab} tokens (vocab_size {padded}); ids {ids}", flush=True)
        model = Qwen3(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    flat = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": flat, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95))
    stream = batches(samples_from(a, tok, src, held, chats or []), a.batch, a.bucket)
    log, t0, seen = [], time.time(), 0
    for step in range(a.steps):
        batch = refusion_batch(next(stream), ids["<|mask|>"], ids["<|endoftext|>"], r)
        lr = cosine_lr(step, a.steps, a.lr, 100 if not a.init else 30)
        for g in opt.param_groups:
            g["lr"] = lr
        logits = model(batch[0], batch[1])
        loss, ar, mdm = refusion_loss(logits, *batch[2:])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seen += int(batch[0].numel())
        if step % 50 == 0 or step == a.steps - 1:
            el = time.time() - t0
            rec = {"step": step, "loss": round(loss.item(), 4), "ar": round(ar.item(), 4),
                   "mdm": round(mdm.item(), 4), "lr": round(lr, 6), "tokens": seen,
                   "seconds": round(el, 1)}
            log.append(rec)
            print(json.dumps(rec), flush=True)
            if el > a.minutes * 60:
                print(f"time limit reached at step {step}", flush=True)
                break
    stages = []
    if a.init and os.path.exists(os.path.join(a.init, "train_log.json")):
        first = json.load(open(os.path.join(a.init, "train_log.json")))
        stages = first.get("stages", [first])
    this = {"args": vars(a), "params": n_params, "steps": log, "torch": torch.__version__}
    save(model, tok, cfg, a.out, held, {"stages": stages + [this]} if stages else this, chats)
    print(f"wrote {a.out}", flush=True)


if __name__ == "__main__":
    main()
