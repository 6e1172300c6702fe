#!/usr/bin/env python3
"""Golden cases on the trained tiny ReFusion: the reference decoder's exact output at f32.

    .venv/bin/python train/goldens.py models/refusion-tiny tests/fixtures/goldens_tiny.json

The decoder is the model card's `generate_refusion`, read at run time from the card
(../shared/reference/ReFusion-model-card.md, or --card) and executed as it is, with one documented
change: its EOS-index bug in the parallel-infill branch is fixed (the pending slots are deleted from
the EOS row's own slot index, `topk_indices_relative[row]`; refusion-facts.md, known bug 1), as in
the public goldens. The model is transformers' stock `Qwen3ForCausalLM` in float32 with eager
attention; the card's cache methods (`full_update`, `batch_select_minibatch`) are added to
transformers' `DynamicCache` here. Each case runs again in float64: a case whose tokens or TPF
change is a near-tie and is left out (the count is printed and recorded).

Prompts: held-out questions of every kind through the chat template. Settings: the model card's
`main()`, `generate_refusion`'s own defaults, and the paper's per-benchmark settings (eval.sh).
"""

import argparse
import json
import os
import sys

import torch
import transformers
from transformers import AutoTokenizer, Qwen3ForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3 import modeling_qwen3

HERE = os.path.dirname(os.path.abspath(__file__))
CARD = os.path.join(HERE, "..", "..", "shared", "reference", "ReFusion-model-card.md")

# name: (gen_length, slot_size, serial_num_blocks, slot_threshold, token_threshold)
SETTINGS = {
    "card": (512, 4, 32, 0.6, 0.3),
    "defaults": (128, 8, 2, 0.9, 0.9),
    "gsm8k": (512, 32, 4, 0.9, 0.4),
    "humaneval": (512, 32, 4, 0.9, 0.4),
    "mbpp": (512, 32, 4, 0.9, 0.3),
    "math": (512, 32, 8, 0.8, 0.6),
    "mmlu_pro": (512, 16, 4, 0.9, 0.4),
    "arc_c": (512, 8, 64, 0.8, 0.1),
    "gpqa": (512, 8, 32, 0.8, 0.2),
}
BUGGY = "indices_after_eos = list(range(first_eos_block_idx, cur_gen_blocks_x.shape[1]))"
FIXED = ("indices_after_eos = list(range(topk_indices_relative[first_eos_block_idx].item(), "
         "cur_gen_blocks_x.shape[1]))")


class DiffusionCache(DynamicCache):
    """transformers' cache plus the two methods the card's decoder calls."""

    def full_update(self, new_kv, cache_kwargs=None):
        for i, (k, v) in enumerate(new_kv):
            self.key_cache[i] = torch.cat([self.key_cache[i], k], dim=-2)
            self.value_cache[i] = torch.cat([self.value_cache[i], v], dim=-2)

    def batch_select_minibatch(self, n):
        for i in range(len(self.key_cache)):
            self.key_cache[i] = self.key_cache[i][:n, ...]
            self.value_cache[i] = self.value_cache[i][:n, ...]


def load_reference(card):
    text = open(card).read()
    start, end = text.index("def add_gumbel_noise"), text.index("\ndef main():")
    code = text[start:end]
    if code.count(BUGGY) != 1:
        sys.exit(f"{card}: the EOS-index line to fix was not found once")
    code = code.replace(BUGGY, FIXED)
    scope = {"torch": torch, "F": torch.nn.functional, "np": None}
    exec("import torch\nimport torch.nn.functional as F\n" + code, scope)
    return scope["generate_refusion"]


class Counted(torch.nn.Module):
    """Counts the decoder's forward calls."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.calls = model, 0

    @property
    def device(self):
        return self.inner.device

    def forward(self, **kw):
        self.calls += 1
        return self.inner(**kw)


def run(gen, model, tok, ids, s, mask_id):
    counted = Counted(model)
    out, tpf = gen(counted, tok, torch.tensor([ids]), gen_length=s[0], temperature=0.0,
                   mask_id=mask_id, slot_size=s[1], serial_num_blocks=s[2],
                   slot_threshold=s[3], token_threshold=s[4])
    return out[0, len(ids):].tolist(), float(tpf), counted.calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--card", default=CARD)
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names")
    a = ap.parse_args()
    torch.set_num_threads(2)
    modeling_qwen3.DynamicCache = DiffusionCache  # the cache Qwen3Model creates on the first call
    gen = load_reference(a.card)
    tok = AutoTokenizer.from_pretrained(a.model)
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    mask_id, eos_id = cfg["mask_token_id"], cfg["eos_token_id"]
    assert tok.eos_token_id == eos_id
    models = {}
    for dt in (torch.float32, torch.float64):
        models[dt] = Qwen3ForCausalLM.from_pretrained(
            a.model, torch_dtype=dt, attn_implementation="eager").eval()
    held = json.load(open(os.path.join(a.model, "heldout.json")))
    by_kind = {}
    for h in held:
        by_kind.setdefault(h["kind"], []).append(h)
    prompts = [h for hs in by_kind.values() for h in hs[: a.per_kind]]
    cases, dropped = [], []
    for name in a.settings.split(","):
        s = SETTINGS[name]
        for h in prompts:
            text = tok.apply_chat_template([{"role": "user", "content": h["question"]}],
                                           add_generation_prompt=True, tokenize=False,
                                           enable_thinking=True)
            ids = tok(text)["input_ids"]
            toks, tpf, calls = run(gen, models[torch.float32], tok, ids, s, mask_id)
            toks64, tpf64, _ = run(gen, models[torch.float64], tok, ids, s, mask_id)
            cid = f"tiny-{len(cases) + len(dropped):03d}"
            if toks != toks64 or abs(tpf - tpf64) > 1e-9:
                dropped.append(cid)
                continue
            cases.append({
                "id": cid, "set": name, "model": "refusion-tiny", "kind": h["kind"],
                "question": h["question"], "prompt_ids": ids, "gen_length": s[0],
                "slot_size": s[1], "serial_num_blocks": s[2], "slot_threshold": s[3],
                "token_threshold": s[4], "temperature": 0.0, "mask_id": mask_id,
                "eos_id": eos_id, "tokens": toks, "tpf": tpf, "n_forward": calls,
                "text": tok.decode(toks, skip_special_tokens=False),
            })
            print(f"{cid} {name:9} {h['kind']:5} tpf {tpf:.3f} calls {calls:3} "
                  f"{tok.decode(toks, skip_special_tokens=True)[:60]!r}", flush=True)
    doc = {
        "format": "refusion-goldens-v1",
        "description": "generate_refusion (model card, EOS-index fix) on the trained tiny ReFusion, "
                       "float32, eager attention; cases that change in float64 are left out",
        "fix_eos_index": True,
        "generator": {"torch": torch.__version__, "transformers": transformers.__version__,
                      "dropped_near_ties": dropped},
        "settings": {k: dict(zip(["gen_length", "slot_size", "serial_num_blocks",
                                  "slot_threshold", "token_threshold"], v))
                     for k, v in SETTINGS.items()},
        "cases": cases,
    }
    json.dump(doc, open(a.out, "w"), indent=1)
    print(f"{len(cases)} cases written to {a.out}, {len(dropped)} near-ties left out")


if __name__ == "__main__":
    main()
