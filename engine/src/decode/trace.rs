//! A decode drawn position by position: what each answer position holds as the decoder's
//! [`Event`]s arrive (masked, a template's given text, planned, drafted, verified, committed
//! or infilled). One source for the terminal's `--visual` canvas and the server's
//! `refusion.step` events, which the web page draws.

use super::{DecodeParams, Event};

/// What a position holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CellState {
    /// Not written yet.
    Masked,
    /// A template's known text (given, never decoded).
    Given,
    /// Drafted by a planning forward.
    Planned,
    /// A draft in a row being infilled, not verified yet.
    Drafted,
    /// A draft in a row being infilled that has been verified.
    Verified,
    /// Committed by a verified slot or left-to-right decoding.
    Committed,
    /// Committed by parallel infilling.
    Infilled,
}

impl CellState {
    /// Its name in the server's events (and the page's legend).
    pub fn name(self) -> &'static str {
        match self {
            CellState::Masked => "masked",
            CellState::Given => "given",
            CellState::Planned => "planned",
            CellState::Drafted => "drafted",
            CellState::Verified => "verified",
            CellState::Committed => "committed",
            CellState::Infilled => "infilled",
        }
    }

    /// Final: a committed token never changes again.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            CellState::Given | CellState::Committed | CellState::Infilled
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cell {
    pub state: CellState,
    /// The token it holds (none while masked).
    pub token: Option<u32>,
}

/// Every answer position's cell, and which changed since the last [`Trace::take_changes`].
pub struct Trace {
    /// The first answer position (the prompt's length).
    start: u32,
    cells: Vec<Cell>,
    changed: Vec<u32>,
    /// Marks `changed` entries already listed (no index twice per step).
    dirty: Vec<bool>,
    /// Where slots lie: `(first index, slots)` per run of slots of `slot_size` (none for
    /// left-to-right decoding).
    slot_size: u32,
    slot_runs: Vec<(u32, u32)>,
}

impl Trace {
    /// The answer's positions after a prompt of `prompt_len` tokens, masked, with a template's
    /// known text given.
    pub fn new(params: &DecodeParams, prompt_len: u32) -> Trace {
        let len = params.answer_len() as usize;
        let mut t = Trace {
            start: prompt_len,
            cells: vec![
                Cell {
                    state: CellState::Masked,
                    token: None,
                };
                len
            ],
            changed: Vec::new(),
            dirty: vec![false; len],
            slot_size: params.slot_size,
            slot_runs: Vec::new(),
        };
        let k = params.slot_size.max(1);
        let method = params.strategy.method();
        match &params.template {
            _ if !method.uses_slots() => t.slot_size = 0,
            Some(template) if method.fills_gaps() => t.lay_out(template),
            _ => t.slot_runs = vec![(0, len as u32 / k)],
        }
        t
    }

    /// Every cell masked but `template`'s known text, given (cells past its positions stay
    /// masked: a shorter layout than the first).
    fn lay_out(&mut self, template: &super::Template) {
        let k = self.slot_size.max(1);
        for i in 0..self.cells.len() {
            let masked = Cell {
                state: CellState::Masked,
                token: None,
            };
            if self.cells[i] != masked {
                self.cells[i] = masked;
                if !self.dirty[i] {
                    self.dirty[i] = true;
                    self.changed.push(i as u32);
                }
            }
        }
        let (tokens, positions) = template.known(self.start, k);
        for (p, tok) in positions.into_iter().zip(tokens) {
            self.set(p, CellState::Given, tok);
        }
        self.slot_runs = template.gaps(0, k);
    }

    /// The slot size (0: no slots) and the runs of slots, `(first index, slots)`.
    pub fn slots(&self) -> (u32, &[(u32, u32)]) {
        (self.slot_size, &self.slot_runs)
    }

    pub fn cells(&self) -> &[Cell] {
        &self.cells
    }

    /// Applies what the decoder reported.
    pub fn apply(&mut self, ev: &Event<'_>) {
        match *ev {
            Event::Planned {
                slot_starts,
                slot_size,
                tokens,
            } => {
                for (s, &start) in slot_starts.iter().enumerate() {
                    let slot = tokens.iter().skip(s * slot_size).take(slot_size);
                    for (j, &tok) in slot.enumerate() {
                        self.set(start + j as u32, CellState::Planned, tok);
                    }
                }
            }
            Event::Infill {
                slot_starts,
                tokens,
                tags,
            } => {
                for ((&start, row), row_tags) in slot_starts.iter().zip(tokens).zip(tags) {
                    for (j, (&tok, &verified)) in row.iter().zip(row_tags).enumerate() {
                        let state = if verified {
                            CellState::Verified
                        } else {
                            CellState::Drafted
                        };
                        self.set(start + j as u32, state, tok);
                    }
                }
            }
            Event::Resized { template } => self.lay_out(template),
            Event::Committed { positions, tokens } => {
                for (&p, &tok) in positions.iter().zip(tokens) {
                    // A token that was a row's draft was infilled; one from a plan (or from
                    // nothing: left-to-right decoding) was committed by verification.
                    let state = match self.cell(p).map(|c| c.state) {
                        Some(CellState::Drafted | CellState::Verified) => CellState::Infilled,
                        _ => CellState::Committed,
                    };
                    self.set(p, state, tok);
                }
            }
        }
    }

    fn cell(&self, pos: u32) -> Option<&Cell> {
        let i = pos.checked_sub(self.start)? as usize;
        self.cells.get(i)
    }

    /// Writes a cell unless it is final (positions outside the answer are ignored).
    fn set(&mut self, pos: u32, state: CellState, token: u32) {
        let Some(i) = pos.checked_sub(self.start).map(|i| i as usize) else {
            return;
        };
        let Some(c) = self.cells.get_mut(i) else {
            return;
        };
        if c.state.is_final() {
            return;
        }
        let new = Cell {
            state,
            token: Some(token),
        };
        if *c != new {
            *c = new;
            if !self.dirty[i] {
                self.dirty[i] = true;
                self.changed.push(i as u32);
            }
        }
    }

    /// The answer's end: cells that were never committed (drafts past the EOS, rows cut) are
    /// masked again, so the last picture holds only the answer.
    pub fn settle(&mut self) {
        for i in 0..self.cells.len() {
            let c = &mut self.cells[i];
            if c.state.is_final() || c.state == CellState::Masked {
                continue;
            }
            *c = Cell {
                state: CellState::Masked,
                token: None,
            };
            if !self.dirty[i] {
                self.dirty[i] = true;
                self.changed.push(i as u32);
            }
        }
    }

    /// The cells changed since the last call (index into the answer, cell), in index order.
    pub fn take_changes(&mut self) -> Vec<(u32, Cell)> {
        let mut changed = std::mem::take(&mut self.changed);
        changed.sort_unstable();
        changed
            .into_iter()
            .map(|i| {
                self.dirty[i as usize] = false;
                (i, self.cells[i as usize])
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::DecodeParams;
    use refusion_gguf::DecodingDefaults;

    fn params(gen: u32, k: u32) -> DecodeParams {
        let d = DecodingDefaults {
            gen_length: gen,
            slot_size: k,
            serial_blocks: 1,
            slot_threshold: 0.9,
            token_threshold: 0.9,
        };
        DecodeParams::new(d, 2, 3)
    }

    #[test]
    fn plan_infill_and_commit_give_each_state() {
        let mut t = Trace::new(&params(8, 4), 10);
        assert_eq!(t.cells().len(), 8);
        t.apply(&Event::Planned {
            slot_starts: &[10, 14],
            slot_size: 4,
            tokens: &[1, 2, 3, 4, 5, 6, 7, 8],
        });
        assert_eq!(t.take_changes().len(), 8);
        // The first slot is verified and committed; the second is infilled.
        t.apply(&Event::Committed {
            positions: &[10, 11, 12, 13],
            tokens: &[1, 2, 3, 4],
        });
        t.apply(&Event::Infill {
            slot_starts: &[14],
            tokens: &[vec![5, 9, 7, 8]],
            tags: &[vec![true, false, true, false]],
        });
        let step = t.take_changes();
        let states: Vec<&str> = step.iter().map(|(_, c)| c.state.name()).collect();
        assert_eq!(
            states,
            [
                "committed",
                "committed",
                "committed",
                "committed",
                "verified",
                "drafted",
                "verified",
                "drafted"
            ]
        );
        t.apply(&Event::Committed {
            positions: &[14, 15, 16, 17],
            tokens: &[5, 6, 7, 8],
        });
        assert!(t
            .cells()
            .iter()
            .skip(4)
            .all(|c| c.state == CellState::Infilled));
        assert_eq!(t.take_changes().len(), 4);
        // Final cells never change again, and outside positions are ignored.
        t.apply(&Event::Planned {
            slot_starts: &[10, 30],
            slot_size: 4,
            tokens: &[0; 8],
        });
        assert!(t.take_changes().is_empty());
        assert_eq!(t.cells()[0].token, Some(1));
    }

    #[test]
    fn settling_masks_what_was_never_committed() {
        let mut t = Trace::new(&params(8, 4), 0);
        t.apply(&Event::Planned {
            slot_starts: &[0, 4],
            slot_size: 4,
            tokens: &[1, 2, 3, 4, 5, 6, 7, 8],
        });
        t.apply(&Event::Committed {
            positions: &[0, 1, 2, 3],
            tokens: &[1, 2, 3, 4],
        });
        t.take_changes();
        t.settle();
        let changed = t.take_changes();
        assert_eq!(changed.len(), 4);
        assert!(changed
            .iter()
            .all(|(i, c)| *i >= 4 && c.state == CellState::Masked && c.token.is_none()));
        assert_eq!(t.cells()[0].state, CellState::Committed);
    }
}
