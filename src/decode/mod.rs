//! ReFusion's "plan and infill" slot decoding, step for step as the reference
//! `generate_refusion` (model card), with its two known bugs fixed (see the README):
//! - when an EOS is verified during parallel infilling, pending slots are removed from the EOS
//!   slot's own index onward (the reference removes from the *row* index, dropping un-generated
//!   slots between them);
//! - the answer stops at the first EOS by position ([`DecodeResult::answer`]); the raw tokens,
//!   as the reference returns them, are kept in [`DecodeResult::tokens`].
//!
//! The decoder sees the model only through [`Forward`] and the [`KvCache`] operations.

mod noise;
mod params;

use std::sync::atomic::{AtomicBool, Ordering};

pub use noise::Noise;
pub use params::DecodeParams;

use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::model::{Batch, Forward, Logits, LogitsFor};

/// What happened, for streaming and `--visual`.
#[derive(Debug, Clone)]
pub enum Event<'a> {
    /// The planning forward drafted these slots (start positions) with these tokens.
    Planned {
        slot_starts: &'a [u32],
        slot_size: usize,
        tokens: &'a [u32],
    },
    /// Rows being infilled: slot start positions and their current tokens and tags.
    Infill {
        slot_starts: &'a [u32],
        tokens: &'a [Vec<u32>],
        tags: &'a [Vec<bool>],
    },
    /// Tokens committed at these positions (appended to the output in this order).
    Committed {
        positions: &'a [u32],
        tokens: &'a [u32],
    },
}

#[derive(Debug, Clone)]
pub struct DecodeResult {
    /// Generated ids after the prompt in position order, as the reference returns them: before
    /// EOS truncation, so they may hold the EOS and tokens at positions after it.
    pub tokens: Vec<u32>,
    /// Their positions.
    pub positions: Vec<u32>,
    /// The reference's tokens-per-forward (mean of per-iteration ratios).
    pub tpf: f64,
    /// Forward calls actually made (plan, verify, draft, ...).
    pub forward_calls: usize,
    /// Tokens fed through the model over all calls.
    pub forward_tokens: usize,
    /// Tokens fed by each call, in order (all rows together): what a cost curve t(n) turns
    /// into a time for another model size.
    pub forward_sizes: Vec<u32>,
    /// Index into `tokens` of the first EOS, if any.
    pub eos_index: Option<usize>,
}

impl DecodeResult {
    /// The answer: generated tokens up to (not including) the first EOS by position.
    pub fn answer(&self) -> &[u32] {
        &self.tokens[..self.eos_index.unwrap_or(self.tokens.len())]
    }
}

/// Index of the largest value (the first one on ties, as torch.argmax).
fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// softmax(v)[i] in f32, as torch computes it.
fn prob(v: &[f32], i: usize) -> f32 {
    let max = v.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let sum: f32 = v.iter().map(|&x| (x - max).exp()).sum();
    (v[i] - max).exp() / sum
}

struct State<'m, M: Forward + ?Sized> {
    model: &'m M,
    p: DecodeParams,
    /// Committed tokens and positions, in cache order (prompt first).
    cur_x: Vec<u32>,
    cur_pos: Vec<u32>,
    sum_tpf: f64,
    tpf_steps: usize,
    forward_calls: usize,
    forward_tokens: usize,
    forward_sizes: Vec<u32>,
}

impl<M: Forward + ?Sized> State<'_, M> {
    fn forward(&mut self, batch: &Batch, cache: &mut KvCache) -> Result<Logits> {
        self.forward_calls += 1;
        self.forward_tokens += batch.len();
        self.forward_sizes.push(batch.len() as u32);
        self.model.forward(batch, cache)
    }
}

/// Generates after `prompt`. The cache must be empty, or hold a prefix of `prompt` as its
/// shared entries (the rest of the prompt is fed with the first planning forward).
pub fn generate<M: Forward + ?Sized>(
    model: &M,
    cache: &mut KvCache,
    prompt: &[u32],
    params: &DecodeParams,
    on_event: &mut dyn FnMut(Event<'_>),
) -> Result<DecodeResult> {
    generate_cancellable(
        model,
        cache,
        prompt,
        params,
        &AtomicBool::new(false),
        on_event,
    )
}

/// [`generate`], stopping with [`Error::Cancelled`] between steps once `cancel` is set (a
/// client went away, Ctrl-C). The cache then holds the prompt and whatever was committed.
pub fn generate_cancellable<M: Forward + ?Sized>(
    model: &M,
    cache: &mut KvCache,
    prompt: &[u32],
    params: &DecodeParams,
    cancel: &AtomicBool,
    on_event: &mut dyn FnMut(Event<'_>),
) -> Result<DecodeResult> {
    params.validate()?;
    if prompt.is_empty() {
        return Err(Error::msg("the prompt is empty"));
    }
    if let Some(i) = prompt.iter().position(|&t| t == params.mask_id) {
        return Err(Error::msg(format!(
            "the prompt contains the mask token ({}) at index {i}; ReFusion does not infill user masks",
            params.mask_id
        )));
    }
    let vocab = model.config().vocab;
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::msg(format!(
            "prompt token {bad} is outside the vocabulary ({vocab})"
        )));
    }
    let cached = cache.shared_len();
    if cached > prompt.len() {
        return Err(Error::msg(
            "the KV cache holds more entries than the prompt",
        ));
    }
    cache.clear_rows();

    let k = params.slot_size as usize;
    let prompt_len = prompt.len();
    let gen_len = params.padded_gen_length() as usize;
    let block_len = gen_len / params.serial_blocks as usize;
    let needed = prompt_len + gen_len;
    let capacity = cache.shape().capacity;
    if needed + block_len > capacity {
        return Err(Error::msg(format!(
            "prompt ({prompt_len} tokens) + gen length ({gen_len}) + one serial block of scratch ({block_len}) = {} exceeds the context of {capacity} entries",
            needed + block_len
        )));
    }

    let mut noise = Noise::new(params.seed);
    let mut st = State {
        model,
        p: params.clone(),
        cur_x: prompt[..cached].to_vec(),
        cur_pos: (0..cached as u32).collect(),
        sum_tpf: 0.0,
        tpf_steps: 0,
        forward_calls: 0,
        forward_tokens: 0,
        forward_sizes: Vec::new(),
    };
    let mut pending_prompt: Vec<u32> = prompt[cached..].to_vec();
    let mut eos_flag = false;

    for sb in 0..params.serial_blocks as usize {
        // Remaining slots of this block, by start position, in position order.
        let block_start = prompt_len + sb * block_len;
        let mut slots: Vec<u32> = (0..block_len / k)
            .map(|s| (block_start + s * k) as u32)
            .collect();
        while !slots.is_empty() {
            if cancel.load(Ordering::Relaxed) {
                cache.clear_rows();
                return Err(Error::Cancelled);
            }
            let removed = step(
                &mut st,
                cache,
                &mut slots,
                &mut pending_prompt,
                &mut noise,
                on_event,
                &mut eos_flag,
            )?;
            let mut keep = vec![true; slots.len()];
            for i in removed {
                keep[i] = false;
            }
            let mut it = keep.iter();
            slots.retain(|_| *it.next().unwrap_or(&true));
        }
        if eos_flag {
            break;
        }
    }

    // Output: committed tokens sorted by position, prompt removed.
    let mut order: Vec<usize> = (0..st.cur_x.len()).collect();
    order.sort_by_key(|&i| st.cur_pos[i]);
    let tokens: Vec<u32> = order
        .iter()
        .skip(prompt_len)
        .map(|&i| st.cur_x[i])
        .collect();
    let positions: Vec<u32> = order
        .iter()
        .skip(prompt_len)
        .map(|&i| st.cur_pos[i])
        .collect();
    let eos_index = tokens.iter().position(|&t| t == params.eos_id);
    let tpf = if st.tpf_steps > 0 {
        st.sum_tpf / st.tpf_steps as f64
    } else {
        0.0
    };
    Ok(DecodeResult {
        tokens,
        positions,
        tpf,
        forward_calls: st.forward_calls,
        forward_tokens: st.forward_tokens,
        forward_sizes: std::mem::take(&mut st.forward_sizes),
        eos_index,
    })
}

/// One iteration of the reference's `while` loop over the remaining slots of a block.
/// Returns the indices (into `slots`) to remove.
#[allow(clippy::too_many_arguments)]
fn step<M: Forward + ?Sized>(
    st: &mut State<'_, M>,
    cache: &mut KvCache,
    slots: &mut [u32],
    pending_prompt: &mut Vec<u32>,
    noise: &mut Noise,
    on_event: &mut dyn FnMut(Event<'_>),
    eos_flag: &mut bool,
) -> Result<Vec<usize>> {
    let p = st.p.clone();
    let k = p.slot_size as usize;
    let n_slots = slots.len();
    let mask = p.mask_id;
    let eos = p.eos_id;

    // 1. Planning forward over the remaining masks (with the rest of the prompt, first time).
    let mut batch = Batch::default();
    let n_prompt = pending_prompt.len();
    let first_prompt_pos = st.cur_x.len() as u32;
    for (i, &t) in pending_prompt.iter().enumerate() {
        batch.tokens.push(t);
        batch.positions.push(first_prompt_pos + i as u32);
    }
    for &s in slots.iter() {
        for j in 0..k as u32 {
            batch.tokens.push(mask);
            batch.positions.push(s + j);
        }
    }
    batch.rows = vec![0; batch.tokens.len()];
    batch.logits_for = LogitsFor::Indices((n_prompt..batch.tokens.len()).collect());
    let logits = st.forward(&batch, cache)?;
    if n_prompt > 0 {
        // The prompt's KV stays; the masks' is dropped.
        cache.truncate_rows(n_prompt);
        cache.commit_row(0)?;
        st.cur_x.append(pending_prompt);
        st.cur_pos
            .extend((0..n_prompt as u32).map(|i| first_prompt_pos + i));
    } else {
        cache.clear_rows();
    }
    let n_gen = n_slots * k;
    let mut x0 = Vec::with_capacity(n_gen);
    let mut x0_p = Vec::with_capacity(n_gen);
    for j in 0..n_gen {
        let row = logits.row(j);
        let tok = if p.temperature > 0.0 {
            noise.sample(row, p.temperature)
        } else {
            argmax(row)
        };
        x0.push(tok as u32);
        x0_p.push(prob(row, tok));
    }
    on_event(Event::Planned {
        slot_starts: slots,
        slot_size: k,
        tokens: &x0,
    });

    // Slot confidence: the first token's probability. Chosen: above the threshold, else the best.
    let conf: Vec<f32> = (0..n_slots).map(|s| x0_p[s * k]).collect();
    let mut chosen: Vec<usize> = (0..n_slots)
        .filter(|&s| conf[s] > p.slot_threshold)
        .collect();
    let counts_block = chosen.len().max(1);
    if chosen.is_empty() {
        chosen.push(argmax(&conf));
    }

    // 2. Global verification: the chosen slots concatenated, in position order.
    let mut batch = Batch::default();
    for &s in &chosen {
        for j in 0..k {
            batch.tokens.push(x0[s * k + j]);
            batch.positions.push(slots[s] + j as u32);
        }
    }
    batch.rows = vec![0; batch.tokens.len()];
    let ver = st.forward(&batch, cache)?;
    // Token i of a slot (i >= 1) takes its autoregressive probability (shifted logits);
    // token 0 keeps the planning probability and is always accepted.
    let mut tags: Vec<Vec<bool>> = Vec::with_capacity(chosen.len());
    let mut flat_mask = Vec::with_capacity(chosen.len() * k);
    for (c, &s) in chosen.iter().enumerate() {
        let mut row = Vec::with_capacity(k);
        let mut ok = true;
        for j in 0..k {
            let flat = c * k + j;
            let pass = if j == 0 {
                true
            } else {
                prob(ver.row(flat - 1), x0[s * k + j] as usize) > p.token_threshold
            };
            flat_mask.push(pass);
            ok &= pass;
            row.push(ok);
        }
        tags.push(row);
    }
    let prefix_len = flat_mask.iter().take_while(|&&b| b).count();
    let flat_tokens: Vec<u32> = batch.tokens.clone();

    let mut to_remove: Vec<usize> = Vec::new();
    // remain: (relative slot index, tokens of it kept)
    let mut remain: Vec<(usize, usize)> = Vec::new();
    if let Some(first_eos) = flat_tokens[..prefix_len].iter().position(|&t| t == eos) {
        let eos_slot_pos = first_eos / k + 1;
        let eos_token_pos = first_eos % k;
        let eos_slot = chosen[eos_slot_pos - 1];
        for (i, &s) in chosen[..eos_slot_pos].iter().enumerate() {
            remain.push((
                s,
                if i + 1 == eos_slot_pos {
                    eos_token_pos + 1
                } else {
                    k
                },
            ));
        }
        *eos_flag = true;
        to_remove.extend(eos_slot..n_slots);
    } else if prefix_len / k > 0 {
        let m = prefix_len / k;
        for &s in &chosen[..m] {
            remain.push((s, k));
        }
    }
    if !remain.is_empty() {
        to_remove.extend(remain.iter().map(|&(s, _)| s));
        let mut positions = Vec::new();
        let mut tokens = Vec::new();
        for &(s, len) in &remain {
            for j in 0..len {
                tokens.push(x0[s * k + j]);
                positions.push(slots[s] + j as u32);
            }
        }
        // Their KV from the verification forward: the leading entries of row 0.
        cache.truncate_rows(tokens.len());
        cache.commit_row(0)?;
        st.cur_x.extend_from_slice(&tokens);
        st.cur_pos.extend_from_slice(&positions);
        on_event(Event::Committed {
            positions: &positions,
            tokens: &tokens,
        });
        st.sum_tpf += (k * remain.len()) as f64 / 2.0;
        st.tpf_steps += 1;
        to_remove.sort_unstable();
        to_remove.dedup();
        return Ok(to_remove);
    }
    cache.clear_rows();

    // 3. Parallel infilling: one row per chosen slot over the shared cache.
    let mut to_remove: Vec<usize> = chosen.clone();
    let mut spec: Vec<Vec<u32>> = chosen
        .iter()
        .map(|&s| x0[s * k..(s + 1) * k].to_vec())
        .collect();
    let mut row_pos: Vec<Vec<u32>> = chosen
        .iter()
        .map(|&s| (0..k as u32).map(|j| slots[s] + j).collect())
        .collect();
    let mut row_slot_starts: Vec<u32> = chosen.iter().map(|&s| slots[s]).collect();
    let mut a = 0usize;
    let mut first_eos_row: Option<usize> = None;
    let mut loop_iter = 0usize;
    for it in 0..k {
        loop_iter = it;
        if tags.iter().all(|r| r.iter().all(|&t| t)) {
            break;
        }
        on_event(Event::Infill {
            slot_starts: &row_slot_starts,
            tokens: &spec,
            tags: &tags,
        });
        let n_rows = spec.len();
        let width = k - a;
        // Draft: unverified tokens masked; the draft's KV is dropped again.
        let mut draft = Batch::default();
        for r in 0..n_rows {
            for j in a..k {
                draft
                    .tokens
                    .push(if tags[r][j] { spec[r][j] } else { mask });
                draft.positions.push(row_pos[r][j]);
                draft.rows.push(r as u32);
            }
        }
        let dl = st.forward(&draft, cache)?;
        cache.truncate_rows(a);
        for r in 0..n_rows {
            for j in a..k {
                if !tags[r][j] {
                    spec[r][j] = argmax(dl.row(r * width + (j - a))) as u32;
                }
            }
        }
        // Verify the rows with their new tokens.
        let mut verify = Batch::default();
        for r in 0..n_rows {
            for j in a..k {
                verify.tokens.push(spec[r][j]);
                verify.positions.push(row_pos[r][j]);
                verify.rows.push(r as u32);
            }
        }
        let vl = st.forward(&verify, cache)?;
        for r in 0..n_rows {
            let mut ok = true;
            let old = tags[r].clone();
            for j in a..k {
                let local = j - a;
                // Token j is scored by the logit of token j-1 (token a by its own).
                let src = r * width + local.saturating_sub(1);
                let mut pass = prob(vl.row(src), spec[r][j] as usize) > p.token_threshold;
                // A token whose predecessor was verified is accepted (at least one per row).
                if local == 0 || old[j - 1] {
                    pass = true;
                }
                ok &= pass;
                tags[r][j] = ok;
            }
        }
        // EOS among the newly verified tokens: keep rows up to the first such row.
        if let Some(r) = (0..n_rows).find(|&r| (a..k).any(|j| tags[r][j] && spec[r][j] == eos)) {
            first_eos_row = Some(r);
            spec.truncate(r + 1);
            tags.truncate(r + 1);
            tags[r].iter_mut().for_each(|t| *t = true);
            row_pos.truncate(r + 1);
            chosen.truncate(r + 1);
            row_slot_starts.truncate(r + 1);
            cache.retain_rows(r + 1);
        }
        let m = tags
            .iter()
            .map(|row| row[a..].iter().filter(|&&t| t).count())
            .min()
            .unwrap_or(0);
        if m > 0 {
            if tags.iter().any(|row| row.iter().any(|&t| !t)) {
                a += m - 1;
            } else {
                a += m;
            }
            cache.truncate_rows(a);
        }
    }
    st.sum_tpf += (k * counts_block) as f64 / (loop_iter * 2 + 2) as f64;
    st.tpf_steps += 1;
    if a != k {
        return Err(Error::msg(format!(
            "internal error: infilling ended with {a} of {k} tokens verified"
        )));
    }

    // Commit every row's KV in slot order, cut after the first EOS.
    let mut entries = Vec::new();
    let mut tokens = Vec::new();
    let mut positions = Vec::new();
    'rows: for (r, row) in spec.iter().enumerate() {
        for (j, &t) in row.iter().enumerate() {
            entries.push((r, j));
            tokens.push(t);
            positions.push(row_pos[r][j]);
            if t == eos {
                break 'rows;
            }
        }
    }
    cache.commit(&entries)?;
    st.cur_x.extend_from_slice(&tokens);
    st.cur_pos.extend_from_slice(&positions);
    on_event(Event::Committed {
        positions: &positions,
        tokens: &tokens,
    });

    if let Some(r) = first_eos_row {
        // The fix of the reference's bug: remove from the EOS slot's own index, not from the
        // row index (which would drop pending slots that were never generated).
        let from = if p.reference_eos_bug { r } else { chosen[r] };
        to_remove.extend(from..n_slots);
        *eos_flag = true;
    }
    to_remove.sort_unstable();
    to_remove.dedup();
    Ok(to_remove)
}
