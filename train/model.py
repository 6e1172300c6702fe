"""A small Qwen3 in plain PyTorch, and ReFusion's training objective.

The forward is Qwen3's (RMSNorm, q/k RMSNorm before RoPE, GQA, SwiGLU, no biases), with the caller's
position ids and ordinary causal attention in storage order, so the saved weights load unchanged
into transformers' `Qwen3ForCausalLM` and into `refusion convert`.

`refusion_batch` lays out one training batch the way ReFusion's `forward_process` does (read at
github.com/ML-GSAI/ReFusion, `qwen3/modeling_qwen3_refusion.py`; written anew here): the answer is cut
into slots of a size drawn from {4, 8, 16, 32}; each slot is masked with probability
p = (1 - eps) t + eps, t ~ U(0, 1); the clean slots come first in a shuffled order, each labelled
with its own next tokens (the last token of a slot is not labelled), then the masked slots in order,
labelled with their own tokens; every token keeps its true position. `refusion_loss` is the hybrid
loss: mean cross-entropy over the clean labels plus the masked tokens' cross-entropy / p / answer
length, summed and divided by the batch size.
"""

import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE = -100
SLOT_SIZES = (4, 8, 16, 32)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


class Rope:
    """Rotary embedding by explicit position (rotate-half, over the whole head)."""

    def __init__(self, head_dim, theta):
        self.inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    def __call__(self, x, pos):
        ang = pos[:, None, :, None].float() * self.inv  # [B, 1, T, D/2]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, d = c["num_attention_heads"], c["head_dim"]
        kv = c["num_key_value_heads"]
        self.h, self.kv, self.d = h, kv, d
        self.q_proj = nn.Linear(c["hidden_size"], h * d, bias=False)
        self.k_proj = nn.Linear(c["hidden_size"], kv * d, bias=False)
        self.v_proj = nn.Linear(c["hidden_size"], kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, c["hidden_size"], bias=False)
        self.q_norm = RMSNorm(d, c["rms_norm_eps"])
        self.k_norm = RMSNorm(d, c["rms_norm_eps"])

    def forward(self, x, pos, rope):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.h, self.d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.d).transpose(1, 2)
        q, k = rope(q, pos), rope(k, pos)
        rep = self.h // self.kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.h * self.d))


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], c["hidden_size"], bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = Mlp(c)

    def forward(self, x, pos, rope):
        x = x + self.self_attn(self.input_layernorm(x), pos, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Qwen3(nn.Module):
    """Parameter names are transformers' (`model.layers.0.self_attn.q_proj.weight`, ...)."""

    def __init__(self, c):
        super().__init__()
        self.model = Body(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        self.rope = Rope(c["head_dim"], c["rope_theta"])
        std = c["initializer_range"]
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)

    def forward(self, ids, pos):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, pos, self.rope)
        return self.lm_head(self.model.norm(x))


def refusion_layout(prompt, answer, mask_id, r, eps=1e-3):
    """One sample's (tokens, positions, labels, masked flags, p_mask), ReFusion's layout."""
    k = r.choice(SLOT_SIZES)
    p_len = len(prompt)
    slots = [list(range(i, min(i + k, len(answer)))) for i in range(0, len(answer), k)]
    p = (1 - eps) * r.random() + eps
    masked = [r.random() < p for _ in slots]
    clean = [i for i, m in enumerate(masked) if not m]
    r.shuffle(clean)
    toks, pos, lab, msk = list(prompt), list(range(p_len)), [IGNORE] * p_len, [False] * p_len
    for i in clean:
        s = [answer[j] for j in slots[i]]
        toks += s
        lab += s[1:] + [IGNORE]
        msk += [False] * len(s)
        pos += [p_len + j for j in slots[i]]
    for i in (i for i, m in enumerate(masked) if m):
        s = [answer[j] for j in slots[i]]
        toks += [mask_id] * len(s)
        lab += s
        msk += [True] * len(s)
        pos += [p_len + j for j in slots[i]]
    return toks, pos, lab, msk, p


def refusion_batch(samples, mask_id, pad_id, r):
    """Pads the laid-out samples on the right (labels ignored there, positions continue)."""
    rows = [refusion_layout(p, a, mask_id, r) for p, a in samples]
    t = max(len(x[0]) for x in rows)
    ids, pos, lab, msk, pm, alen = [], [], [], [], [], []
    for (toks, ps, lb, mk, p), (_, a) in zip(rows, samples):
        n = t - len(toks)
        ids.append(toks + [pad_id] * n)
        pos.append(ps + list(range(len(toks), t)))
        lab.append(lb + [IGNORE] * n)
        msk.append(mk + [False] * n)
        pm.append(p)
        alen.append(len(a))
    return (torch.tensor(ids), torch.tensor(pos), torch.tensor(lab), torch.tensor(msk),
            torch.tensor(pm), torch.tensor(alen, dtype=torch.float32))


def refusion_loss(logits, lab, msk, pm, alen):
    """The hybrid autoregressive + masked-diffusion loss; also returns its two parts."""
    b, t, v = logits.shape
    flat, lab_f, msk_f = logits.reshape(-1, v), lab.reshape(-1), msk.reshape(-1)
    ar = ~msk_f & (lab_f != IGNORE)
    ar_loss = F.cross_entropy(flat[ar], lab_f[ar]) if ar.any() else flat.sum() * 0
    scale = (pm[:, None] * alen[:, None]).expand(b, t).reshape(-1)
    ce = F.cross_entropy(flat[msk_f], lab_f[msk_f], reduction="none")
    mdm_loss = (ce / scale[msk_f]).sum() / b
    return ar_loss + mdm_loss, ar_loss.detach(), mdm_loss.detach()


def cosine_lr(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


__all__ = ["Qwen3", "refusion_batch", "refusion_loss", "cosine_lr", "random"]
