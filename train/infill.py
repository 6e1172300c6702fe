#!/usr/bin/env python3
"""The reference of any-order generation ("fill the gaps"), and its golden cases.

    .venv/bin/python train/infill.py models/refusion-tiny tests/fixtures/models \
        tests/fixtures/goldens_infill.json

`generate_infill` below is the model card's `generate_refusion`, copied, with the known spans of
an answer template committed at their positions before decoding and its gaps decoded as runs of
slots. Every change from the card is marked `# INFILL`; the card's EOS-index bug is fixed as in
train/goldens.py. The semantics are docs/infill.md's:

- the answer is laid out after the prompt: each known span at its positions, each gap rounded up
  to whole slots, slots aligned to the gap's start;
- the known spans join the prompt (cur_x) before the first forward, so they enter the KV cache
  as verified slots do, in answer order;
- each gap is cut into blocks of the card's block length (gen_length / serial_num_blocks, at
  least one slot) from its start; serial block b holds every gap's b-th block;
- an EOS ends its own gap (its later slots are dropped; other gaps go on): the card's global
  `eos_flag` becomes one end per gap;
- at a temperature, the planning noise is refusion's seeded generator (xoshiro256**), so a seed
  reproduces the runtime's draws.

With one gap and nothing known this is the card's decoder exactly (checked by `--self-check`).
"""

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, Qwen3ForCausalLM
from transformers.models.qwen3 import modeling_qwen3

from goldens import SETTINGS, Counted, DiffusionCache, load_reference

M64 = (1 << 64) - 1


class Noise:
    """refusion's planning noise (src/decode/noise.rs): xoshiro256** seeded by splitmix64."""

    def __init__(self, seed):
        x, s = seed, []
        for _ in range(4):
            x = (x + 0x9E3779B97F4A7C15) & M64
            z = x
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
            s.append(z ^ (z >> 31))
        self.s = s

    def next_u64(self):
        s = self.s
        rotl = lambda v, k: ((v << k) | (v >> (64 - k))) & M64
        r = (rotl((s[1] * 5) & M64, 7) * 9) & M64
        t = (s[1] << 17) & M64
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = rotl(s[3], 45)
        return r

    def sample(self, logits, temperature):
        best, best_v = 0, -math.inf
        for i, l in enumerate(logits):
            u = ((self.next_u64() >> 11) + 0.5) / float(1 << 53)
            v = math.exp(l) / ((-math.log(u)) ** temperature)
            if v > best_v:
                best, best_v = i, v
        return best


@torch.no_grad()
def generate_infill(model, eos_token_id, prompt, template, gen_length=128, temperature=0.,
                    mask_id=151670, slot_size=8, serial_num_blocks=2, slot_threshold=0.9,
                    token_threshold=0.9, seed=0, first_tokens=None, plan=None):
    # INFILL: `template` is the answer in order: a list of ids (a known span) or an int (a gap
    # of at most that many tokens); the EOS id is given (the card reads the tokenizer's).
    # FIT (train/fit.py): `first_tokens` maps a position to the only tokens its planning
    # draft may take (token healing at a fitted gap's start).
    # FIT: `plan` maps a slot's start to (its tokens, its confidence): a probe's draft taken as
    # the first step's plan instead of a planning forward (the known spans are then fed with
    # that step's verification).
    first_tokens = first_tokens or {}
    sum_TPF = 0.0
    forward_count = 0

    batch_size = 1
    prompt_len = prompt.shape[1]
    device = model.device
    noise = Noise(seed)  # INFILL: the runtime's seeded noise instead of torch.rand_like

    # INFILL: lay the answer out: known spans at their positions, gaps as runs of slots.
    pos, known_x, known_pos, gaps = prompt_len, [], [], []
    for piece in template:
        if isinstance(piece, int):
            n_slots = -(-piece // slot_size)
            gaps.append((pos, n_slots))
            pos += n_slots * slot_size
        else:
            known_x += piece
            known_pos += range(pos, pos + len(piece))
            pos += len(piece)
    gap_eos = [None] * len(gaps)
    # INFILL: the card's block length (of the gen length, `{{gap}}`'s default) in slots, at
    # least one; every gap is cut into blocks of it from its start, and serial block b holds
    # every gap's b-th block.
    padded = gen_length + (slot_size - gen_length % slot_size) % slot_size
    per_block = max(1, padded // serial_num_blocks // slot_size)
    n_serial = max(-(-n // per_block) for _, n in gaps)

    def gap_of(p):
        for g, (g0, n) in enumerate(gaps):
            if g0 <= p < g0 + n * slot_size:
                return g
        return None

    def close(p):  # an EOS committed at p ends its gap
        g = gap_of(p)
        gap_eos[g] = p if gap_eos[g] is None else min(gap_eos[g], p)

    def past_eos(start):
        g = gap_of(start)
        return g is not None and gap_eos[g] is not None and start > gap_eos[g]

    prompt_pos_ids = torch.arange(prompt_len, dtype=torch.long, device=device).unsqueeze(0)
    cur_x = torch.cat((prompt, torch.tensor([known_x], dtype=torch.long)), dim=1)  # INFILL
    cur_pos = torch.cat((prompt_pos_ids, torch.tensor([known_pos], dtype=torch.long)), dim=1)

    cur_slot_size = slot_size

    past_key_values = None

    for serial_num_block in range(n_serial):  # INFILL: the gaps' blocks
        # INFILL: every gap ended at an EOS: done (the card's `if eos_flag: break`).
        if all(e is not None for e in gap_eos):
            break
        # INFILL: this block's slots: each gap's share, minus those past the gap's EOS.
        starts = []
        for g0, n in gaps:
            lo = min(serial_num_block * per_block, n)
            hi = min((serial_num_block + 1) * per_block, n)
            starts += [g0 + s * slot_size for s in range(lo, hi)
                       if not past_eos(g0 + s * slot_size)]
        if not starts:
            continue
        cur_gen_blocks_pos_ids = (torch.tensor(starts).unsqueeze(1)
                                  + torch.arange(slot_size).unsqueeze(0)).unsqueeze(0)
        cur_gen_blocks_x = torch.full_like(cur_gen_blocks_pos_ids, mask_id)

        # slot level generation
        while cur_gen_blocks_x.numel() > 0:
            cur_gen_blocks_x = cur_gen_blocks_x.reshape(batch_size, -1, cur_slot_size)
            cur_gen_blocks_pos_ids = cur_gen_blocks_pos_ids.reshape(batch_size, -1, cur_slot_size)

            flat_gen_blocks_x = cur_gen_blocks_x.view(batch_size, -1)
            flat_gen_blocks_pos_ids = cur_gen_blocks_pos_ids.view(batch_size, -1)

            prefix_block_tag = False

            slot_starts = cur_gen_blocks_pos_ids[0, :, 0].tolist()
            fed = 0
            if plan is not None and past_key_values is None and all(st in plan for st in slot_starts):
                # FIT: the probe's draft is this step's plan; no planning forward.
                x0_gen = torch.tensor([[t for st in slot_starts for t in plan[st][0]]])
                x0_p_softmax = torch.zeros(x0_gen.shape, dtype=torch.float64)
                for si, st in enumerate(slot_starts):
                    x0_p_softmax[0, si * cur_slot_size] = plan[st][1]
                fed = cur_x.shape[1]
                plan = None
            elif past_key_values is None:
                input_x = torch.cat((cur_x, flat_gen_blocks_x), dim=1)
                input_pos_ids = torch.cat((cur_pos, flat_gen_blocks_pos_ids), dim=1)
                outputs = model(input_ids=input_x, position_ids=input_pos_ids,
                                past_key_values=past_key_values, use_cache=True)
            else:
                outputs = model(input_ids=flat_gen_blocks_x, position_ids=flat_gen_blocks_pos_ids,
                                past_key_values=past_key_values, use_cache=True)

            if not fed:
                logits = outputs.logits
                gen_logits = logits[:, -flat_gen_blocks_x.shape[1]:, :]
                gen_logits = restrict(gen_logits, flat_gen_blocks_pos_ids, first_tokens)  # FIT

                past_key_values = outputs.past_key_values
                past_key_values.crop(cur_x.shape[1])
                assert cur_x.shape[-1] == past_key_values[0][0].shape[-2]

                if temperature > 0:  # INFILL: the runtime's noise, row by row
                    rows = gen_logits[0].to(torch.float64).tolist()
                    x0_gen = torch.tensor([[noise.sample(r, temperature) for r in rows]])
                else:
                    x0_gen = torch.argmax(gen_logits, dim=-1)

                p_softmax = F.softmax(gen_logits, dim=-1)
                x0_p_softmax = torch.gather(p_softmax, dim=-1, index=torch.unsqueeze(x0_gen, -1)).squeeze(-1)
            x0_gen_blocks = x0_gen.view(batch_size, -1, cur_slot_size)

            x0_p_softmax_blocks = x0_p_softmax.view(batch_size, -1, cur_slot_size)
            block_confidence_softmax = x0_p_softmax_blocks[:, :, 0]

            is_confident_block = block_confidence_softmax > slot_threshold
            counts_block = torch.sum(is_confident_block, dim=1).item()
            topk_indices_relative = is_confident_block[0].nonzero(as_tuple=True)[0]

            if counts_block <= 0:
                counts_block = 1
                _, topk_indices_relative = torch.topk(block_confidence_softmax.squeeze(0), k=1)

            topk_indices_relative, _ = torch.sort(topk_indices_relative)

            chosen_gen_blocks = x0_gen_blocks[0, topk_indices_relative, :]
            chosen_position_ids = cur_gen_blocks_pos_ids[0, topk_indices_relative, :]
            chosen_p_softmax_blocks = x0_p_softmax_blocks[0, topk_indices_relative, :]

            # Global Verification
            if fed:  # FIT: the known spans (and the prompt) fed in front of it
                outputs = model(input_ids=torch.cat((cur_x, chosen_gen_blocks.reshape(1, -1)), dim=1),
                                position_ids=torch.cat((cur_pos, chosen_position_ids.reshape(1, -1)), dim=1),
                                past_key_values=None, use_cache=True)
                AR_logits = outputs.logits[:, fed:]
            else:
                outputs = model(input_ids=chosen_gen_blocks.reshape(1, -1),
                                position_ids=chosen_position_ids.reshape(1, -1),
                                past_key_values=past_key_values, use_cache=True)
                AR_logits = outputs.logits
            AR_logits = torch.cat([AR_logits[:, :1], AR_logits[:, :-1]], dim=1)
            AR_p_softmax = F.softmax(AR_logits, dim=-1)
            AR_x0_p_softmax = torch.gather(AR_p_softmax, dim=-1, index=torch.unsqueeze(chosen_gen_blocks.reshape(1, -1), -1)).squeeze(-1)
            AR_x0_p_softmax_blocks = AR_x0_p_softmax.reshape(-1, cur_slot_size)
            chosen_p_softmax_blocks[:, 1:] = AR_x0_p_softmax_blocks[:, 1:]

            prob_mask = chosen_p_softmax_blocks > token_threshold
            prob_mask[:, 0] = 1
            tag_blocks = torch.cumprod(prob_mask.int(), dim=-1)

            tag_tokens = torch.cumprod(prob_mask.int().reshape(1, -1), dim=-1)
            prefix_len = torch.sum(tag_tokens, dim=-1)
            flat_chosen_gen_blocks = chosen_gen_blocks.reshape(1, -1)
            confident_prefix_tokens = flat_chosen_gen_blocks[:, :prefix_len]

            if prefix_len > 0:
                is_eos_in_prefix = (confident_prefix_tokens.squeeze(0) == eos_token_id)
                eos_found_flag = torch.any(is_eos_in_prefix)

                remain_indices = []
                indices_to_remove = set()

                if eos_found_flag:
                    first_eos_pos_tensor = torch.argmax(is_eos_in_prefix.int())

                    eos_block_pos = first_eos_pos_tensor // cur_slot_size + 1
                    eos_token_pos = first_eos_pos_tensor - (first_eos_pos_tensor // cur_slot_size) * cur_slot_size

                    eos_block = topk_indices_relative[eos_block_pos - 1].item()

                    remain_indices.extend(topk_indices_relative[:eos_block_pos].tolist())

                    topk_indices_relative = torch.tensor([], device=device)

                    # INFILL: the EOS ends its own gap (the card: `eos_flag = True` and every
                    # slot from the EOS slot on removed); the gap's later slots go below.
                    close(int(cur_gen_blocks_pos_ids[0, eos_block, 0]) + int(eos_token_pos))

                elif (prefix_len // cur_slot_size) > 0:
                    num_prefix_blocks = prefix_len // cur_slot_size
                    remain_indices.extend(topk_indices_relative[:num_prefix_blocks].tolist())

                    topk_indices_relative = topk_indices_relative[num_prefix_blocks:]
                    tag_blocks = tag_blocks[num_prefix_blocks:]

                if len(remain_indices) > 0:
                    indices_to_remove.update(remain_indices)

                    token_indices = []
                    for i_idx, b_idx in enumerate(remain_indices):
                        start_index = b_idx * cur_slot_size
                        current_block_len = cur_slot_size
                        if eos_found_flag and i_idx == len(remain_indices) - 1:
                            current_block_len = eos_token_pos + 1
                        end_index = start_index + current_block_len
                        block_range = torch.arange(start_index, end_index, dtype=torch.long, device=device)
                        token_indices.append(block_range)

                    full_token_indices = torch.cat(token_indices)

                    cur_x = torch.cat((cur_x, x0_gen[:, full_token_indices]), dim=1)
                    cur_pos = torch.cat((cur_pos, flat_gen_blocks_pos_ids[:, full_token_indices]), dim=1)

                    past_key_values = outputs.past_key_values
                    past_key_values.crop(cur_x.shape[1])
                    assert cur_x.shape[-1] == past_key_values[0][0].shape[-2]

                    prefix_block_tag = True

                    sum_TPF += cur_slot_size * len(remain_indices) / 2
                    forward_count += 1

            if prefix_block_tag == True:
                # INFILL: slots past their gap's EOS go too
                indices_to_remove.update(i for i in range(cur_gen_blocks_x.shape[1])
                                         if past_eos(int(cur_gen_blocks_pos_ids[0, i, 0])))
                keep_mask = torch.ones(cur_gen_blocks_x.shape[1], dtype=torch.bool, device=device)
                keep_mask[list(indices_to_remove)] = False
                cur_gen_blocks_x = cur_gen_blocks_x[:, keep_mask, :]
                cur_gen_blocks_pos_ids = cur_gen_blocks_pos_ids[:, keep_mask, :]
                continue

            elif prefix_block_tag == False:
                past_key_values = outputs.past_key_values
                past_key_values.crop(cur_x.shape[1])
                assert cur_x.shape[-1] == past_key_values[0][0].shape[-2]

            indices_to_remove = set(topk_indices_relative.tolist())

            current_speculative_blocks = chosen_gen_blocks.clone()
            accepted_prefix_len = 0
            eos_found_in_loop = False

            if past_key_values is not None and counts_block > 1:
                past_key_values.batch_repeat_interleave(counts_block)

            for loop_iter in range(cur_slot_size):
                if not torch.any(tag_blocks == 0):
                    break

                input_tokens = current_speculative_blocks[:, accepted_prefix_len:]
                input_pos = chosen_position_ids[:, accepted_prefix_len:]

                current_tags = tag_blocks[:, accepted_prefix_len:]
                masked_input_tokens = torch.where(current_tags.bool(), input_tokens, mask_id)

                draft_len = past_key_values[0][0].shape[2]
                draft_outputs = model(input_ids=masked_input_tokens, position_ids=input_pos,
                                      past_key_values=past_key_values, use_cache=False)
                past_key_values.crop(draft_len)
                draft_logits = draft_outputs.logits
                proposed_tokens = torch.argmax(draft_logits, dim=-1)

                input_tokens = torch.where(current_tags.bool(), input_tokens, proposed_tokens)
                current_speculative_blocks[:, accepted_prefix_len:] = input_tokens

                verify_outputs = model(input_ids=input_tokens, position_ids=input_pos,
                                       past_key_values=past_key_values, use_cache=True)
                verify_logits = verify_outputs.logits
                verify_logits = torch.cat([verify_logits[:, :1], verify_logits[:, :-1]], dim=1)

                verify_probs = F.softmax(verify_logits, dim=-1)
                gathered_probs = torch.gather(verify_probs, -1, input_tokens.unsqueeze(-1)).squeeze(-1)

                prob_mask = gathered_probs > token_threshold

                update_tag_blocks = F.pad(tag_blocks[:, accepted_prefix_len:], (1, 0), value=1)[:, :-1]
                prob_mask[update_tag_blocks == 1] = True

                new_tags = torch.cumprod(prob_mask.int(), dim=-1)
                tag_blocks[:, accepted_prefix_len:] = new_tags

                newly_verified_mask = (tag_blocks[:, accepted_prefix_len:] == 1)
                is_eos_in_new = (current_speculative_blocks[:, accepted_prefix_len:] == eos_token_id) & newly_verified_mask

                if torch.any(is_eos_in_new):
                    eos_found_in_loop = True
                    # INFILL: per gap, the first row holding a verified EOS is kept whole and the
                    # gap's rows after it are dropped (the card: every row after the first).
                    has_eos = torch.any(is_eos_in_new, dim=1).tolist()
                    keep, eos_rows = [], []
                    for r in range(len(has_eos)):
                        g = gap_of(int(chosen_position_ids[r, 0]))
                        if any(gap_of(int(chosen_position_ids[e, 0])) == g for e in eos_rows):
                            continue
                        keep.append(r)
                        if has_eos[r]:
                            eos_rows.append(r)
                    keep_t = torch.tensor(keep, dtype=torch.long)
                    for e in eos_rows:
                        tag_blocks[e] = 1
                    current_speculative_blocks = current_speculative_blocks[keep_t]
                    tag_blocks = tag_blocks[keep_t]
                    chosen_position_ids = chosen_position_ids[keep_t]
                    topk_indices_relative = topk_indices_relative[keep_t]
                    if verify_outputs.past_key_values is not None:
                        verify_outputs.past_key_values.batch_select_indices(keep_t)

                current_tags = tag_blocks[:, accepted_prefix_len:]
                len_per_block = torch.sum(current_tags, dim=1)
                newly_accepted_len = torch.min(len_per_block).item()
                if newly_accepted_len > 0:
                    if torch.any(tag_blocks == 0):
                        accepted_prefix_len = accepted_prefix_len + newly_accepted_len - 1
                    else:
                        accepted_prefix_len = accepted_prefix_len + newly_accepted_len
                    past_key_values = verify_outputs.past_key_values
                    if past_key_values is not None:
                        past_key_values.crop(cur_x.shape[1] + accepted_prefix_len)

            sum_TPF += (cur_slot_size * counts_block) / (loop_iter * 2 + 2)
            forward_count += 1

            ar_kv_cache = tuple((layer_past[0][:, :, -cur_slot_size:, :],
                                 layer_past[1][:, :, -cur_slot_size:, :])
                                for layer_past in past_key_values)

            past_key_values.crop(cur_x.shape[1])
            past_key_values.batch_select_indices(torch.tensor([0]).to(device))

            # INFILL: each row is cut after its own first EOS (the card cuts the rows flattened
            # after the first EOS: the same with one gap, whose rows after it were dropped).
            eos_mask = (current_speculative_blocks == eos_token_id).int()
            keep_mask = ((torch.cumsum(eos_mask, dim=-1) - eos_mask) == 0).flatten()
            kept_tokens = current_speculative_blocks.flatten()[keep_mask].reshape(batch_size, -1)
            kept_pos_ids = chosen_position_ids.flatten()[keep_mask].reshape(batch_size, -1)

            if kept_tokens.numel() > 0 and ar_kv_cache is not None:
                new_past = []
                for i, (key, val) in enumerate(ar_kv_cache):
                    num_heads, _, head_dim = key.shape[1], key.shape[2], key.shape[3]
                    flat_key = key.permute(1, 0, 2, 3).reshape(1, num_heads, -1, head_dim)
                    flat_val = val.permute(1, 0, 2, 3).reshape(1, num_heads, -1, head_dim)
                    new_past.append((flat_key[:, :, keep_mask, :], flat_val[:, :, keep_mask, :]))
                kept_kv = tuple(new_past)

            past_key_values.full_update(kept_kv)

            cur_x = torch.cat((cur_x, kept_tokens), dim=1)
            cur_pos = torch.cat((cur_pos, kept_pos_ids), dim=1)

            assert cur_x.shape[-1] == past_key_values[0][0].shape[-2]

            if eos_found_in_loop:
                # INFILL: each EOS ends its gap; the gaps' later slots go (the card, fixed:
                # every slot from the EOS row's own slot index on, and `eos_flag = True`).
                for r in range(current_speculative_blocks.shape[0]):
                    hits = (current_speculative_blocks[r] == eos_token_id).nonzero()
                    if len(hits) > 0:
                        close(int(chosen_position_ids[r, int(hits[0])]))
            indices_to_remove.update(i for i in range(cur_gen_blocks_x.shape[1])
                                     if past_eos(int(cur_gen_blocks_pos_ids[0, i, 0])))

            keep_mask = torch.ones(cur_gen_blocks_x.shape[1], dtype=torch.bool, device=device)
            keep_mask[list(indices_to_remove)] = False
            cur_gen_blocks_x = cur_gen_blocks_x[:, keep_mask, :]
            cur_gen_blocks_pos_ids = cur_gen_blocks_pos_ids[:, keep_mask, :]

    _, re_mask_indices = torch.sort(cur_pos, dim=-1)
    x = torch.gather(cur_x, dim=-1, index=re_mask_indices)
    p = torch.gather(cur_pos, dim=-1, index=re_mask_indices)

    TPF = sum_TPF / forward_count

    return x, p, TPF


def restrict(gen_logits, pos_ids, first_tokens):
    """FIT: the rows at a restricted position keep only their admitted tokens' logits (the
    others at minus infinity, so the softmax, the arg-max and the noise see only those)."""
    if not first_tokens:
        return gen_logits
    out = gen_logits.clone()
    for j, p in enumerate(pos_ids[0].tolist()):
        if p in first_tokens:
            keep = torch.full_like(out[0, j], float("-inf"))
            idx = torch.tensor(first_tokens[p], dtype=torch.long)
            keep[idx] = out[0, j, idx]
            out[0, j] = keep
    return out


def stitch(template, tokens, positions, start, slot_size, eos):
    """The answer and each gap's fill (up to its first EOS), as the runtime's `Filled`."""
    answer, fills, pos = [], [], start
    for piece in template:
        if isinstance(piece, int):
            end = pos + -(-piece // slot_size) * slot_size
            inside = [t for t, q in zip(tokens, positions) if pos <= q < end]
            cut = inside.index(eos) if eos in inside else len(inside)
            answer += inside[:cut]
            fills.append({"tokens": inside[:cut], "eos": cut < len(inside)})
            pos = end
        else:
            answer += piece
            pos += len(piece)
    return answer, fills


# name: (slot_size, serial_num_blocks, slot_threshold, token_threshold), from goldens.SETTINGS
INFILL_SETTINGS = ["defaults", "card", "gsm8k", "arc_c"]


def tiny_templates(h):
    """Text templates over a held-out answer: one gap in the middle (the second line), the
    last line given and the working asked for, a gap at the start, one at the end, two gaps,
    and a gap far longer than its fill."""
    lines = h["response"].split("\n")
    first, second, rest = lines[0] + "\n", lines[1] + "\n" if len(lines) > 2 else None, lines
    # None: `{{gap}}`, a gap of the gen length (the shape of a `suffix` request).
    out = {"end": [first, 48], "start": [None, "\n".join(lines[1:])],
           "last_line": [None, lines[-1]]}
    if second is not None:
        out["middle"] = [first, 24, "\n".join(lines[2:])]
        out["long_gap"] = [first, 64, "\n".join(lines[2:])]
        out["two_gaps"] = [first, 20, lines[2] + "\n", 40] if len(lines) > 3 else [first, 20, 40]
    return out


def random_templates(rng, hi):
    ids = lambda n: rng.integers(0, hi, n).tolist()
    return {"one_gap": [16], "middle": [ids(5), 12, ids(4)], "after_prompt_two_gaps": [8, ids(6), 10],
            "end": [ids(3), 20], "long_two_gaps": [ids(4), 24, ids(3), 6, ids(2)]}


def run_case(model, eos, prompt, template, s, mask_id, temperature=0.0, seed=0):
    counted = Counted(model)
    x, p, tpf = generate_infill(counted, eos, torch.tensor([prompt]), template,
                                gen_length=s[0], temperature=temperature, mask_id=mask_id, slot_size=s[1],
                                serial_num_blocks=s[2], slot_threshold=s[3],
                                token_threshold=s[4], seed=seed)
    n = len(prompt)
    return x[0, n:].tolist(), p[0, n:].tolist(), float(tpf), counted.calls


def self_check(gen_card, model, tok, prompts, mask_id, eos):
    """With one gap and nothing known, generate_infill is the card's decoder (EOS fix)."""
    for ids in prompts:
        for name in ["defaults", "card", "gsm8k"]:
            s = SETTINGS[name]
            out, want_tpf = gen_card(model, tok, torch.tensor([ids]), gen_length=s[0], temperature=0.0,
                                     mask_id=mask_id, slot_size=s[1], serial_num_blocks=s[2],
                                     slot_threshold=s[3], token_threshold=s[4])
            got, _, tpf, _ = run_case(model, eos, ids, [s[0]], s, mask_id)
            assert got == out[0, len(ids):].tolist() and abs(tpf - float(want_tpf)) < 1e-12, name
    print(f"self-check: one gap = the card's decoder on {len(prompts) * 3} runs")


def load(path, dtype):
    return Qwen3ForCausalLM.from_pretrained(path, torch_dtype=dtype,
                                            attn_implementation="eager").eval()


def main():
    import numpy as np

    ap = argparse.ArgumentParser()
    ap.add_argument("tiny")
    ap.add_argument("fixtures", help="folder of pub-a, pub-b, pub-c")
    ap.add_argument("out")
    a = ap.parse_args()
    torch.set_num_threads(2)
    modeling_qwen3.DynamicCache = DiffusionCache
    cases, dropped = [], []

    def add(model_name, models, eos, mask_id, prompt, name, template, setting, text=None,
            temperature=0.0, seed=0):
        s = SETTINGS[setting]
        ids_template = [s[0] if p is None else p for p in template]
        got = run_case(models[torch.float32], eos, prompt, ids_template, s, mask_id, temperature, seed)
        got64 = run_case(models[torch.float64], eos, prompt, ids_template, s, mask_id, temperature, seed)
        cid = f"infill-{len(cases) + len(dropped):03d}"
        if got[0] != got64[0] or abs(got[2] - got64[2]) > 1e-9:
            dropped.append(cid)
            return
        toks, pos, tpf, calls = got
        answer, fills = stitch(ids_template, toks, pos, len(prompt), s[1], eos)
        case = {"id": cid, "model": model_name, "template_name": name, "set": setting,
                "prompt_ids": prompt,
                "template": [{"gap": p} if isinstance(p, int) else {"known": p} for p in ids_template],
                "gen_length": s[0], "slot_size": s[1], "serial_num_blocks": s[2], "slot_threshold": s[3],
                "token_threshold": s[4], "temperature": temperature, "seed": seed,
                "mask_id": mask_id, "eos_id": eos, "tokens": toks, "positions": pos, "tpf": tpf,
                "n_forward": calls, "answer": answer, "fills": fills}
        if text is not None:
            case["template_text"] = text
        cases.append(case)
        print(f"{cid} {model_name:13} {name:22} {setting:8} tpf {tpf:.3f} calls {calls:3} "
              f"fills {[len(f['tokens']) for f in fills]}", flush=True)

    # The trained tiny ReFusion: held-out questions through the chat template.
    tok = AutoTokenizer.from_pretrained(a.tiny)
    cfg = json.load(open(os.path.join(a.tiny, "config.json")))
    mask_id, eos = cfg["mask_token_id"], cfg["eos_token_id"]
    models = {dt: load(a.tiny, dt) for dt in (torch.float32, torch.float64)}
    held = json.load(open(os.path.join(a.tiny, "heldout.json")))
    picks = [next(h for h in held if h["kind"] == k) for k in ("add", "story", "list", "code")]
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]
    prompts = []
    for h in picks:
        text = tok.apply_chat_template([{"role": "user", "content": h["question"]}],
                                       add_generation_prompt=True, tokenize=False,
                                       enable_thinking=True)
        prompts.append(tok(text)["input_ids"])
    self_check(load_reference(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                           "shared", "reference", "ReFusion-model-card.md")),
               models[torch.float32], tok, prompts[:2], mask_id, eos)
    for h, prompt in zip(picks, prompts):
        for name, t in tiny_templates(h).items():
            ids_t = [p if p is None or isinstance(p, int) else enc(p) for p in t]
            text = "".join("{{gap}}" if p is None else f"{{{{gap:{p}}}}}" if isinstance(p, int)
                           else p for p in t)
            for setting in ("defaults", "card"):
                add("refusion-tiny", models, eos, mask_id, prompt, name, ids_t, setting, text)
    h, prompt = picks[0], prompts[0]
    t = tiny_templates(h)["middle"]
    ids_t = [p if isinstance(p, int) else enc(p) for p in t]
    for seed in (1, 7):
        add("refusion-tiny", models, eos, mask_id, prompt, "middle", ids_t, "defaults",
            temperature=0.7, seed=seed)

    # The random fixtures: raw prompts, random spans (sharp logits: every branch fires).
    for name in ("pub-a", "pub-b", "pub-c"):
        path = os.path.join(a.fixtures, name)
        c = json.load(open(os.path.join(path, "config.json")))
        mask_id, eos = c["mask_token_id"], c["eos_token_id"]
        models = {dt: load(path, dt) for dt in (torch.float32, torch.float64)}
        rng = np.random.default_rng(len(cases))
        hi = mask_id - 6
        for pi in range(2):
            prompt = rng.integers(0, hi, int(rng.integers(4, 16))).tolist()
            for tname, t in random_templates(rng, hi).items():
                for setting in INFILL_SETTINGS:
                    add(name, models, eos, mask_id, prompt, tname, t, setting)
        prompt = rng.integers(0, hi, 6).tolist()
        add(name, models, eos, mask_id, prompt, "middle", [[1, 2, 3], 16, [4, 5]], "defaults",
            temperature=0.9, seed=3)

    import transformers
    doc = {
        "format": "refusion-infill-goldens-v1",
        "description": "train/infill.py's generate_infill (the model card's generate_refusion "
                       "with an answer template's known spans committed at their positions and "
                       "its gaps as runs of slots), float32, eager attention; cases that change "
                       "in float64 are left out",
        "generator": {"torch": torch.__version__, "transformers": transformers.__version__,
                      "dropped_near_ties": dropped},
        "cases": cases,
    }
    json.dump(doc, open(a.out, "w"), indent=1)
    print(f"{len(cases)} cases written to {a.out}, {len(dropped)} near-ties left out")


if __name__ == "__main__":
    main()
