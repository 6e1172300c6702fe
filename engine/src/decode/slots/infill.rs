//! Phase 3 of a step, parallel infilling (when verification accepts no whole slot): each
//! chosen slot is a row over the shared cache; each round drafts the rows' unverified tokens
//! (masked) and re-verifies them, keeping the leading verified tokens' entries, up to
//! `slot_size` rounds; then the verified tokens are committed in the reference's order.

use super::{logits_of, Phase, SlotDecoder};
use crate::decode::{argmax, logprob, prob, Event, TokenLogprob};
use crate::error::{Error, Result};
use crate::kv::SeqCache;
use crate::model::{Batch, LogitsRef};

/// Parallel infilling of the chosen slots, one row each.
pub(super) struct Infill {
    pub(super) chosen: Vec<usize>,
    /// The slots chosen at the start (all removed at the end, whatever EOS truncates).
    pub(super) to_remove: Vec<usize>,
    pub(super) counts_block: usize,
    pub(super) spec: Vec<Vec<u32>>,
    /// With logprobs: each row token's, from the forward that drafted or verified it.
    pub(super) lp: Vec<Vec<Option<TokenLogprob>>>,
    pub(super) tags: Vec<Vec<bool>>,
    pub(super) row_pos: Vec<Vec<u32>>,
    pub(super) row_slot_starts: Vec<u32>,
    /// Leading tokens of every row verified and kept in the cache.
    pub(super) a: usize,
    /// The current round (`0..slot_size`).
    pub(super) it: usize,
}

impl SlotDecoder {
    pub(super) fn after_draft(
        &mut self,
        mut inf: Infill,
        dl: &LogitsRef<'_>,
        cache: &mut SeqCache<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()> {
        let width = self.k - inf.a;
        cache.truncate_rows(inf.a)?;
        for r in 0..inf.spec.len() {
            for j in inf.a..self.k {
                if !inf.tags[r][j] {
                    let b = r * width + (j - inf.a);
                    let row = logits_of(dl, &self.logit_row, b);
                    let tok = argmax(row);
                    inf.spec[r][j] = tok as u32;
                    if let Some(top) = self.p.logprobs {
                        inf.lp[r][j] = Some(logprob(row, tok, top as usize));
                    }
                }
            }
        }
        // The rows as this forward drafted them (their tags as before).
        emit_rows(&inf, on_event);
        self.phase = Phase::Recheck(inf);
        Ok(())
    }

    pub(super) fn after_recheck(
        &mut self,
        mut inf: Infill,
        vl: &LogitsRef<'_>,
        cache: &mut SeqCache<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()> {
        let (k, a) = (self.k, inf.a);
        let width = k - a;
        let n_rows = inf.spec.len();
        for r in 0..n_rows {
            let mut ok = true;
            let old = inf.tags[r].clone();
            for j in a..k {
                let local = j - a;
                // A token whose predecessor was verified is accepted (at least one per row),
                // as drafted; another is scored by the logits of token j-1.
                let pass = local == 0 || old[j - 1] || {
                    let row = logits_of(vl, &self.logit_row, r * width + local - 1);
                    let tok = inf.spec[r][j] as usize;
                    if let Some(top) = self.p.logprobs {
                        inf.lp[r][j] = Some(logprob(row, tok, top as usize));
                    }
                    prob(row, tok) > self.p.token_threshold
                };
                ok &= pass;
                inf.tags[r][j] = ok;
            }
        }
        self.cut_after_eos(&mut inf, cache)?;
        let m = inf
            .tags
            .iter()
            .map(|row| row[inf.a..].iter().filter(|&&t| t).count())
            .min()
            .unwrap_or(0);
        if m > 0 {
            if inf.tags.iter().any(|row| row.iter().any(|&t| !t)) {
                inf.a += m - 1;
            } else {
                inf.a += m;
            }
            cache.truncate_rows(inf.a)?;
        }
        inf.it += 1;
        self.next_round(inf, cache, on_event)
    }

    /// EOS among the newly verified tokens: the first row holding one in each run is kept
    /// whole (its tags all set), the run's rows after it are dropped. With one run (plain
    /// generation) that is the reference's "keep rows up to the first such row".
    fn cut_after_eos(&self, inf: &mut Infill, cache: &mut SeqCache<'_>) -> Result<()> {
        let (a, k, eos) = (inf.a, self.k, self.p.eos_id);
        let mut eos_rows: Vec<usize> = Vec::new();
        let mut keep = vec![true; inf.spec.len()];
        for (r, kept) in keep.iter_mut().enumerate() {
            let start = inf.row_slot_starts[r];
            if eos_rows
                .iter()
                .any(|&e| self.layout.same_run(inf.row_slot_starts[e], start))
            {
                *kept = false;
            } else if (a..k).any(|j| inf.tags[r][j] && inf.spec[r][j] == eos) {
                eos_rows.push(r);
                inf.tags[r].iter_mut().for_each(|t| *t = true);
            }
        }
        if keep.iter().all(|&x| x) {
            return Ok(());
        }
        retain_by(&mut inf.spec, &keep);
        retain_by(&mut inf.lp, &keep);
        retain_by(&mut inf.tags, &keep);
        retain_by(&mut inf.row_pos, &keep);
        retain_by(&mut inf.chosen, &keep);
        retain_by(&mut inf.row_slot_starts, &keep);
        cache.select_rows(&keep)
    }

    /// Another infill round, or (all rows verified, or `slot_size` rounds done) the end of the
    /// step: a feed thus always ends mid-step or at a step boundary, never past one.
    pub(super) fn next_round(
        &mut self,
        inf: Infill,
        cache: &mut SeqCache<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()> {
        if inf.it >= self.k || inf.tags.iter().all(|r| r.iter().all(|&t| t)) {
            return self.finish_infill(inf, cache, on_event);
        }
        // The rows as this forward verified them.
        emit_rows(&inf, on_event);
        self.phase = Phase::Draft(inf);
        Ok(())
    }

    /// The end of infilling: TPF, every row's KV committed in slot order (cut after the first
    /// EOS), and the slots removed.
    pub(super) fn finish_infill(
        &mut self,
        inf: Infill,
        cache: &mut SeqCache<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()> {
        let (k, eos, n_slots) = (self.k, self.p.eos_id, self.slots.len());
        // The reference's loop variable: the last round entered (it stops at slot_size - 1).
        let loop_iter = inf.it.min(k - 1);
        self.sum_tpf += (k * inf.counts_block) as f64 / (loop_iter * 2 + 2) as f64;
        self.tpf_steps += 1;
        if inf.a != k {
            return Err(Error::internal(format!(
                "infilling ended with {} of {k} tokens verified",
                inf.a
            )));
        }
        // Every row's tokens, each cut after its own EOS (with one run: the reference's cut
        // after the first EOS of the rows flattened, since rows after it were dropped).
        let mut entries = Vec::new();
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut lps = Vec::new();
        let mut eos_rows = Vec::new();
        for (r, row) in inf.spec.iter().enumerate() {
            for (j, &t) in row.iter().enumerate() {
                entries.push((r, j));
                tokens.push(t);
                lps.push(inf.lp.get(r).and_then(|l| l.get(j)).cloned().flatten());
                positions.push(inf.row_pos[r][j]);
                if t == eos {
                    eos_rows.push((r, inf.row_pos[r][j]));
                    break;
                }
            }
        }
        cache.commit(&entries)?;
        self.keep_logprobs(&positions, lps);
        self.cur_x.extend_from_slice(&tokens);
        self.cur_pos.extend_from_slice(&positions);
        on_event(Event::Committed {
            positions: &positions,
            tokens: &tokens,
        });
        let mut to_remove = inf.to_remove.clone();
        for &(_, pos) in &eos_rows {
            // Its run's slots after the EOS go (the fix of the reference's bug: from the EOS
            // slot's own index, where the reference removes from the row index, dropping
            // pending slots that were never generated).
            self.layout.end_at(pos);
        }
        if let (true, Some(&(r, _))) = (self.p.reference_eos_bug, eos_rows.first()) {
            to_remove.extend(r..n_slots);
        }
        self.end_step(to_remove);
        Ok(())
    }
}

/// An infill round's forward over the rows' unsettled tokens: the draft (`mask` given: the
/// unverified tokens masked; its KV is dropped again) or the re-verification with the new
/// tokens.
/// The rows being infilled, for `--visual` and the server's steps.
fn emit_rows(inf: &Infill, on_event: &mut dyn FnMut(Event<'_>)) {
    on_event(Event::Infill {
        slot_starts: &inf.row_slot_starts,
        tokens: &inf.spec,
        tags: &inf.tags,
    });
}

pub(super) fn build_rows(b: &mut Batch, inf: &Infill, k: usize, mask: Option<u32>) {
    b.clear();
    for r in 0..inf.spec.len() {
        for j in inf.a..k {
            let t = match mask {
                Some(m) if !inf.tags[r][j] => m,
                _ => inf.spec[r][j],
            };
            b.push(t, inf.row_pos[r][j], r as u32);
        }
    }
}

/// Keeps the items whose `keep` is set.
fn retain_by<T>(v: &mut Vec<T>, keep: &[bool]) {
    let mut i = 0;
    v.retain(|_| {
        i += 1;
        keep.get(i - 1).copied().unwrap_or(true)
    });
}
