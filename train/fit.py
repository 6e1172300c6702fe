#!/usr/bin/env python3
"""The reference of fitted gaps (a gap is a maximum: the fill takes the length its text needs),
and its golden cases.

    .venv/bin/python train/fit.py models/refusion-tiny tests/fixtures/goldens_fit.json

Written from docs/infill.md ("A gap is a maximum") over train/infill.py's `generate_infill`
(which decodes a template whose gaps have fixed sizes, exactly as the runtime's `{{gap:=N}}`):

1. Token healing: a fitted gap takes from the span after it its first tokens (the word the span
   starts in, or its first token; the span keeps one), from the span before it its last (the
   word the span ends in, or its last token; a span between two fitted gaps keeps one), at most
   4 and no more than a token of the vocabulary can stand for (start with the text taken before
   a gap; end with the text taken after it). The gap grows by one token for each.
2. The probe: the template drafted at the gaps' maxima, one planning forward a block of 4 of
   the decode's serial blocks (`serial_num_blocks // 4`), each draft taken as it is (up to each
   gap's first EOS) and fed with the next block's forward; a healed gap start's draft is taken
   among the tokens that stand for the healed text. After each block, each fitted gap with a
   span after it is found: its draft (from its start to the first position not drafted, before
   any EOS) meets the span after it (`junction`, at least 2 of the span's tokens agreeing) or
   writes it again (`rewritten_at`) at L tokens; or it ended at an EOS; or it is full. Once all
   are (or the drafting is done), the probe ends.
3. The final decode: `generate_infill` with each fitted gap at L tokens (at least 1, rounded up
   to whole slots) when that is smaller than its size, and the healed starts restricted.
4. Stitching: a fitted gap's fill is cut where it meets the span after it with at least one
   token of the span written again, else where the healed text is written for the first of
   several times before the span (a slot's positions past the text filled with it), else at
   the length the probe found (where the fill's token there stands for the healed text), else
   where it meets the span with no token after, else where it writes the span again; a healed
   token the fill does not stand for is put back.

A template whose fitted gaps have no span after them has no probe.
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer
from transformers.models.qwen3 import modeling_qwen3

from goldens import SETTINGS, Counted, DiffusionCache
from infill import Noise, generate_infill, load, restrict

MOST_HEALED = 4
ANCHOR = 2
PROBE_BLOCKS = 4


def byte_decoder():
    """GPT-2's byte-level alphabet read back (printable bytes stand for themselves, the others
    for 256 + n in order)."""
    printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or b >= 174]
    out, n = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            n += 1
            out[chr(255 + n)] = b
    return out


def vocab_bytes(tok):
    """Every id's text as bytes; None for a special token."""
    dec = byte_decoder()
    added = {i: t for i, t in tok.added_tokens_decoder.items()}
    n = len(tok)
    out = []
    for i in range(n):
        if i in added:
            out.append(None if added[i].special else added[i].content.encode())
            continue
        s = tok.convert_ids_to_tokens(i)
        out.append(bytes(dec[c] if c in dec else 0 for c in s) if s is not None else b"")
    return out


def word_byte(b):
    return chr(b).isascii() and (chr(b).isalnum() or b == ord("_")) or b >= 0x80


def fitting(text, vocab, at_start_of_gap):
    """Tokens that can stand for healed text: starting with it (taken before a gap) or ending
    with it (taken after one)."""
    # A run of blanks before a gap also admits the run one space shorter (the pre-tokenizer's
    # `\s+(?!\S)` gives the last space to the word after it).
    blank = len(text) >= 2 and text.endswith(b" ") and all(c in b" \t" for c in text)
    shorter = text[:-1] if at_start_of_gap and blank else None
    ok = (lambda t: t.startswith(text) or t == shorter) if at_start_of_gap \
        else (lambda t: t.endswith(text))
    return [i for i, t in enumerate(vocab) if t and ok(t)]


def attaches(t, word):
    """A one-character token `t` before the word `word` goes with it, as Qwen's pre-tokenizer
    splits text (`[^\\r\\n\\p{L}\\p{N}]?\\p{L}+`): ` ` then `i` is healed as ` i`."""
    if len(t) != 1 or not word:
        return False
    c, w = t[0], word[0]
    letter = chr(w).isascii() and chr(w).isalpha() or w >= 0x80
    return not (chr(c).isascii() and chr(c).isalnum() or c in (13, 10) or c >= 0x80) and letter


def heal_len(ids, most, vocab, from_end):
    """How many tokens at a span's end (`from_end`) or start to heal."""
    at = (lambda j: ids[len(ids) - 1 - j]) if from_end else (lambda j: ids[j])
    most = min(most, MOST_HEALED, len(ids))
    n = 0
    while n < most:
        t = vocab[at(n)]
        if not t:
            break
        if n > 0:
            inner = vocab[at(n - 1)] or b""
            a, b = (t[-1:], inner[:1]) if from_end else (inner[-1:], t[:1])
            if not (a and b and word_byte(a[0]) and word_byte(b[0])):
                if from_end and attaches(t, inner):
                    n += 1
                break
        n += 1
    while n > 1:
        toks = [at(j) for j in range(n)]
        if from_end:
            toks.reverse()
        if fitting(b"".join(vocab[t] for t in toks), vocab, from_end):
            break
        n -= 1
    return n


def heal(template, vocab):
    """`template`: pieces {"known": ids}, {"gap": n} (exact) or {"fit": n}. Fitted gaps get
    "size", and "first"/"last": {"tokens", "bytes", "fits"}."""
    t = [dict(p) for p in template]
    for p in t:
        if "known" in p:
            p["known"] = list(p["known"])
        if "fit" in p:
            p["size"] = p["fit"]
    for i, p in enumerate(t):
        if "fit" not in p or i + 1 >= len(t) or "known" not in t[i + 1]:
            continue
        ids = t[i + 1]["known"]
        if len(ids) < 2:
            continue
        m = heal_len(ids, len(ids) - 1, vocab, False)
        if m:
            taken, t[i + 1]["known"] = ids[:m], ids[m:]
            text = b"".join(vocab[x] for x in taken)
            p["last"] = {"tokens": taken, "bytes": len(text), "fits": fitting(text, vocab, False)}
            p["fit"] += 1
            p["size"] = p["fit"]
    for i in range(len(t) - 1, 0, -1):
        p = t[i]
        if "fit" not in p or "known" not in t[i - 1]:
            continue
        ids = t[i - 1]["known"]
        keep = 1 if i >= 2 and "fit" in t[i - 2] else 0
        m = heal_len(ids, len(ids) - keep, vocab, True)
        if m:
            taken, t[i - 1]["known"] = ids[len(ids) - m:], ids[:len(ids) - m]
            text = b"".join(vocab[x] for x in taken)
            p["first"] = {"tokens": taken, "bytes": len(text), "fits": fitting(text, vocab, True)}
            p["fit"] += 1
            p["size"] = p["fit"]
    return [p for p in t if not ("known" in p and not p["known"])]


def layout(template, start, k):
    """The template as `generate_infill` takes it (spans, gap sizes), each gap's first position
    and the restricted starts."""
    ids_t, gaps, first, pos = [], [], {}, start
    for p in template:
        if "known" in p:
            ids_t.append(p["known"])
            pos += len(p["known"])
            continue
        n = p.get("size", p.get("gap"))
        ids_t.append(n)
        gaps.append(pos)
        if "first" in p:
            first[pos] = p["first"]["fits"]
        pos += -(-n // k) * k
    return ids_t, gaps, first


def junction(fill, span, last, min_agree):
    best = None
    for i in range(1 if last else 0, len(fill) + 1):
        if last and fill[i - 1] not in last["fits"]:
            continue
        tail = fill[i:]
        n = min(len(tail), len(span))
        if tail[:n] != span[:n] or n < max(min_agree, 0 if last else 1):
            continue
        if best is None or n >= best[0]:
            best = (n, i)
    return None if best is None else best[1]


def rewritten_at(fill, span):
    m = min(len(span), 3)
    if m < 2 or len(fill) < m:
        return None
    for i in range(1, len(fill) - m + 1):
        if fill[i:i + m] == span[:m]:
            return i
    return None


LOOSE_MIN = 4


def loosely_at(fill, span, last):
    """The span written again with a few tokens otherwise: the cut (its token before standing
    for `last`) whose tail agrees with the span's start at the most places, at least 3 in 4 of
    the min(tail, span) tokens compared and at least min(LOOSE_MIN, span) of them; the latest
    of the best."""
    least = min(LOOSE_MIN, len(span))
    best = None
    for i in range(1, len(fill) + 1):
        if last and fill[i - 1] not in last["fits"]:
            continue
        tail = fill[i:]
        n = min(len(tail), len(span))
        if n == 0 or n < least:
            continue
        agree = sum(a == b for a, b in zip(tail, span))
        if agree * 4 < n * 3:
            continue
        if best is None or agree >= best[0]:
            best = (agree, i)
    return None if best is None else best[1]


@torch.no_grad()
def probe(model, eos, prompt, template, s, mask_id, temperature, seed):
    """Drafts the template at its gaps' sizes, one forward a probe block; returns each fitted
    gap's length found (None: it keeps its size), the first forward's draft (a slot's start:
    its tokens and its first token's probability) and each gap's first position."""
    gen_length, k, serial, _, _ = s
    serial = max(1, serial // PROBE_BLOCKS)
    start = len(prompt)
    ids_t, gap_starts, first = layout(template, start, k)
    noise = Noise(seed)
    padded = gen_length + (k - gen_length % k) % k
    per_block = max(1, padded // serial // k)
    runs = [(g0, -(-n // k)) for g0, n in zip(gap_starts, [p for p in ids_t if isinstance(p, int)])]
    n_blocks = max(-(-n // per_block) for _, n in runs)
    eos_at = [None] * len(runs)
    pending_x = list(prompt)
    pending_p = list(range(start))
    pos = start
    for p in ids_t:
        if isinstance(p, int):
            pos += -(-p // k) * k
        else:
            pending_x += p
            pending_p += range(pos, pos + len(p))
            pos += len(p)
    drafted = {}
    past = None
    first_plan = None
    spans = []
    for i, p in enumerate(template):
        if "known" not in p:
            nxt = template[i + 1]["known"] if i + 1 < len(template) and "known" in template[i + 1] else []
            spans.append((p, nxt))

    def found():
        out = []
        for gi, (p, span) in enumerate(spans):
            if "fit" not in p:
                continue
            g0, slots = runs[gi]
            fill = []
            while g0 + len(fill) in drafted and len(fill) < slots * k:
                fill.append(drafted[g0 + len(fill)])
            e = fill.index(eos) if eos in fill else None
            fill = fill[:e] if e is not None else fill
            anchor = min(ANCHOR, len(span))
            met = junction(fill, span, p.get("last"), anchor) if anchor > 0 else None
            if met is None:
                met = rewritten_at(fill, span)
            if met is None:
                met = loosely_at(fill, span, p.get("last"))
            if met is not None:
                out.append(("length", met))
            elif e is not None or len(fill) >= slots * k:
                out.append(("keep", None))
            else:
                out.append(("open", None))
        return out

    for b in range(n_blocks):
        if all(e is not None for e in eos_at):
            break
        starts = []
        for r, (g0, n) in enumerate(runs):
            for sl in range(min(b * per_block, n), min((b + 1) * per_block, n)):
                st = g0 + sl * k
                if eos_at[r] is None or st <= eos_at[r]:
                    starts.append(st)
        if not starts:
            continue
        mask_pos = [st + j for st in starts for j in range(k)]
        x = torch.tensor([pending_x + [mask_id] * len(mask_pos)])
        pp = torch.tensor([pending_p + mask_pos])
        out = model(input_ids=x, position_ids=pp, past_key_values=past, use_cache=True)
        past = out.past_key_values
        fed = past[0][0].shape[-2] - len(mask_pos)
        past.crop(fed)
        logits = out.logits[:, -len(mask_pos):, :]
        logits = restrict(logits, torch.tensor([mask_pos]), first)
        if temperature > 0:
            rows = logits[0].to(torch.float64).tolist()
            x0 = [noise.sample(r, temperature) for r in rows]
        else:
            x0 = torch.argmax(logits, dim=-1)[0].tolist()
        if first_plan is None:
            probs = F.softmax(logits[0].to(torch.float32), dim=-1)
            first_plan = {st: (x0[si * k:(si + 1) * k], float(probs[si * k, x0[si * k]]))
                          for si, st in enumerate(starts)}
        pending_x, pending_p = [], []
        for si, st in enumerate(starts):
            r = next(i for i, (g0, n) in enumerate(runs) if g0 <= st < g0 + n * k)
            if eos_at[r] is not None and st > eos_at[r]:
                continue
            for j in range(k):
                tokn, q = x0[si * k + j], st + j
                pending_x.append(tokn)
                pending_p.append(q)
                drafted[q] = tokn
                if tokn == eos:
                    eos_at[r] = q if eos_at[r] is None else min(eos_at[r], q)
                    break
        f = found()
        if not any(state == "open" for state, _ in f):
            return [n for _, n in f], first_plan, gap_starts
    return [n for _, n in found()], first_plan, gap_starts


def stitch_fit(template, tokens, positions, start, k, eos):
    """The answer and each gap's fill (the runtime's `Filled::stitch`)."""
    answer, fills, pos = [], [], start
    for i, p in enumerate(template):
        if "known" in p:
            answer += p["known"]
            pos += len(p["known"])
            continue
        n = p.get("size", p.get("gap"))
        end = pos + -(-n // k) * k
        inside = [t for t, q in zip(tokens, positions) if pos <= q < end]
        e = inside.index(eos) if eos in inside else None
        raw = inside[:e] if e is not None else inside
        full = e is None and len(raw) >= n
        if "fit" not in p:
            answer += raw
            fills.append({"tokens": raw, "eos": e is not None, "truncated": e is None,
                          "skip": 0, "trim": 0})
            pos = end
            continue
        span = template[i + 1]["known"] if i + 1 < len(template) and "known" in template[i + 1] else None
        last = p.get("last")
        meets = junction(raw, span, last, 1) if span is not None else None
        n_found = p.get("found")
        if meets is None and span is not None and last:
            # The healed text written more than once before the span: the first time it is.
            for i in range(1, len(raw) + 1):
                if raw[i - 1] in last["fits"] and all(x in last["fits"] for x in raw[i:]):
                    meets = i
                    break
        if meets is None and span is not None and last and n_found is not None \
                and 1 <= n_found <= len(raw) and raw[n_found - 1] in last["fits"]:
            meets = n_found
        if meets is None and span is not None:
            meets = junction(raw, span, last, 0)
        again = rewritten_at(raw, span) if meets is None and span is not None else None
        loose = loosely_at(raw, span, last) if meets is None and again is None \
            and span is not None else None
        cut = meets if meets is not None else again if again is not None else loose
        fill = raw[:cut] if cut is not None else raw
        first, last = p.get("first"), p.get("last")
        skip = 0
        if first:
            if fill and fill[0] in first["fits"]:
                skip = first["bytes"]
            else:
                answer += first["tokens"]
        answer += fill
        lone = len(fill) == 1 and first is not None and first["tokens"] == fill
        trim = 0
        if last:
            if (meets is not None or loose is not None) and not lone:
                trim = last["bytes"]
            else:
                answer += last["tokens"]
        fills.append({"tokens": fill, "eos": e is not None,
                      "truncated": e is None and full and cut is None, "skip": skip, "trim": trim})
        pos = end
    return answer, fills


def generate_fit(model, eos, prompt, template, s, mask_id, temperature=0.0, seed=0):
    """A healed template decoded as the runtime does: the probe, then the final decode."""
    counted = Counted(model)
    k = s[1]
    t = [dict(p) for p in template]
    has_span = any("fit" in p and i + 1 < len(t) and "known" in t[i + 1] for i, p in enumerate(t))
    plan = None
    if has_span:
        lengths, drafted, probe_starts = probe(counted, eos, prompt, t, s, mask_id, temperature,
                                               seed)
        for p, n in zip([p for p in t if "fit" in p], lengths):
            if n is not None:
                p["found"] = n
                size = -(-max(n, 1) // k) * k
                if size < -(-p["size"] // k) * k:
                    p["size"] = size
        # The final decode's first plan is the probe's first draft, slot for slot (the same
        # offset in the same gap).
        plan = {}
        ids_t, final_starts, _ = layout(t, len(prompt), k)
        sizes = [n for n in ids_t if isinstance(n, int)]
        for g0, was, n in zip(final_starts, probe_starts, sizes):
            for o in range(0, -(-n // k) * k, k):
                if was + o in (drafted or {}):
                    plan[g0 + o] = drafted[was + o]
    ids_t, _, first = layout(t, len(prompt), k)
    x, p, tpf = generate_infill(counted, eos, torch.tensor([prompt]), ids_t, gen_length=s[0],
                                temperature=temperature, mask_id=mask_id, slot_size=k,
                                serial_num_blocks=s[2], slot_threshold=s[3], token_threshold=s[4],
                                seed=seed, first_tokens=first, plan=plan)
    n = len(prompt)
    toks, pos = x[0, n:].tolist(), p[0, n:].tolist()
    answer, fills = stitch_fit(t, toks, pos, n, k, eos)
    return {"tokens": toks, "positions": pos, "tpf": float(tpf), "n_forward": counted.calls,
            "answer": answer, "fills": fills}


def parse(text):
    """`{{gap}}` (None: the gen length), `{{gap:N}}` and `{{gap:=N}}` markers."""
    out, rest = [], text
    while "{{gap" in rest:
        at = rest.index("{{gap")
        if at:
            out.append(rest[:at])
        end = rest.index("}}", at)
        arg = rest[at + 5:end]
        out.append(("fit", None) if arg == "" else ("gap", int(arg[2:])) if arg.startswith(":=")
                   else ("fit", int(arg[1:])))
        rest = rest[end + 2:]
    if rest:
        out.append(rest)
    return out


def templates(h):
    """Text templates over a held-out answer: a cursor inside a line, a line hidden behind gaps
    of 1, 2 and 4 times its tokens and behind `{{gap}}`, the last line hidden, two gaps, and an
    exact gap."""
    lines = h["response"].split("\n")
    i = 1 if len(lines) > 2 else 0
    before = "".join(l + "\n" for l in lines[:i])
    after = "\n".join(lines[i + 1:])
    n = len(lines[i]) // 3 + 2
    mid = len(lines[i]) // 2
    cursor = before + lines[i][:mid] + "{{gap}}" + "\n" + after
    out = {"cursor": cursor, "gap_2x": f"{before}{{{{gap:{2 * n}}}}}{after}",
           "gap_default": f"{before}{{{{gap}}}}{after}",
           "last_line": "\n".join(lines[:-1]) + "\n{{gap}}",
           "exact": f"{before}{{{{gap:={n}}}}}{after}"}
    if len(lines) > 3:
        out["two_gaps"] = f"{lines[0]}\n{{{{gap:24}}}}{lines[2]}\n{{{{gap:32}}}}" + "\n".join(lines[4:])
    # The shape of a `suffix` request: one gap, then text (the answer's first line hidden, and
    # all but its last line).
    out["suffix_first"] = "{{gap}}" + "\n".join(lines[1:])
    out["suffix_last"] = "{{gap}}" + lines[-1]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tiny")
    ap.add_argument("out")
    a = ap.parse_args()
    torch.set_num_threads(2)
    modeling_qwen3.DynamicCache = DiffusionCache
    tok = AutoTokenizer.from_pretrained(a.tiny)
    vocab = vocab_bytes(tok)
    cfg = json.load(open(os.path.join(a.tiny, "config.json")))
    mask_id, eos = cfg["mask_token_id"], cfg["eos_token_id"]
    models = {dt: load(a.tiny, dt) for dt in (torch.float32, torch.float64)}
    held = json.load(open(os.path.join(a.tiny, "heldout.json")))
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]
    cases, dropped = [], []
    picks = []
    for kind in ("add", "story", "list", "code"):
        picks += [h for h in held if h["kind"] == kind][:2]
    for h in picks:
        text = tok.apply_chat_template([{"role": "user", "content": h["question"]}],
                                       add_generation_prompt=True, tokenize=False,
                                       enable_thinking=True)
        prompt = tok(text)["input_ids"]
        runs = [(name, ttext, setting, 0.0, 0) for name, ttext in templates(h).items()
                for setting in ("defaults", "card")]
        if h is picks[0]:
            runs += [("gap_2x", templates(h)["gap_2x"], "defaults", 0.7, seed) for seed in (1, 7)]
        for name, ttext, setting, temperature, seed in runs:
            if True:
                s = SETTINGS[setting]
                pieces = []
                for p in parse(ttext):
                    if isinstance(p, str):
                        ids = enc(p)
                        if ids:
                            pieces.append({"known": ids})
                    elif p[0] == "gap":
                        pieces.append({"gap": p[1]})
                    else:
                        pieces.append({"fit": s[0] if p[1] is None else p[1]})
                healed = heal(pieces, vocab)
                got = generate_fit(models[torch.float32], eos, prompt, healed, s, mask_id,
                                   temperature, seed)
                got64 = generate_fit(models[torch.float64], eos, prompt, healed, s, mask_id,
                                     temperature, seed)
                cid = f"fit-{len(cases) + len(dropped):03d}"
                if got["tokens"] != got64["tokens"] or got["n_forward"] != got64["n_forward"]:
                    dropped.append(cid)
                    continue
                fills = [dict(f, text=bytes(b for t in f["tokens"] for b in vocab[t] or b"")
                              [f["skip"]:(len(bytes(b for t in f["tokens"] for b in vocab[t] or b""))
                                          - f["trim"])].decode("utf-8", "replace"))
                         for f in got["fills"]]
                case = {"id": cid, "kind": h["kind"], "template_name": name, "set": setting,
                        "prompt_ids": prompt, "template_text": ttext,
                        "gen_length": s[0], "slot_size": s[1], "serial_num_blocks": s[2],
                        "slot_threshold": s[3], "token_threshold": s[4],
                        "temperature": temperature, "seed": seed, "eos_id": eos,
                        "mask_id": mask_id,
                        "text": tok.decode(got["answer"]), "truth": h["response"],
                        **{k: v for k, v in got.items() if k != "fills"}, "fills": fills}
                cases.append(case)
                print(f"{cid} {h['kind']:5} {name:12} {setting:8} calls {got['n_forward']:3} "
                      f"right {case['text'] == h['response']}", flush=True)
    import transformers
    doc = {"format": "refusion-fit-goldens-v1",
           "description": "train/fit.py: fitted gaps (token healing, the drafting probe, the "
                          "final decode at the length found, the fill cut where the span after "
                          "it comes again), float32, eager attention; cases that change in "
                          "float64 are left out",
           "generator": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "dropped_near_ties": dropped},
           "cases": cases}
    json.dump(doc, open(a.out, "w"), indent=1)
    print(f"{len(cases)} cases written to {a.out}, {len(dropped)} near-ties left out")


if __name__ == "__main__":
    main()
