//! Attention over a cache of another type than f32 (f16, bf16, the block types) on AVX2: the
//! rows a block of tokens sees are decoded a tile at a time ([`tile_rows`], in the L1/L2
//! caches) and go through the f32 cache's kernels, so the memory per thread is one tile
//! whatever the context, and each quantized row is read once per block.
//!
//! The floats are the portable loop's, to the bit: a row decodes to the same values either way,
//! each score is the same dot product ([`dots_avx2`]), and a weighted sum split at a tile's
//! edge continues its chains from the values stored there ([`weighted_sum_avx2_from`]), which
//! an f32 store and load keep exactly.

use super::*;

/// Most rows decoded at a time: 128 KiB of f32 at head size 256, in L2.
const TILE: usize = 128;

/// Rows decoded at a time for a block of `nq` queries. Few queries (one token's heads) do
/// little work per row, so a tile that stays in L1 is what counts: 16 rows made one token over
/// 4,096 f16 entries 1.3-1.6x faster than 64 (Zen 4, `bench -p 1 -d 4096`). Many queries reuse
/// each row, so a longer tile saves the weighted sums' restarts at its edges: 128 rows,
/// 2-8% over 64 at 16 and 128 tokens.
fn tile_rows(nq: usize) -> usize {
    if nq < 8 {
        16
    } else {
        TILE
    }
}

thread_local! {
    /// Scores, and one tile of decoded rows.
    static CODED: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// The local slots of a decoded tile.
const LOCAL: [usize; TILE] = {
    let mut s = [0usize; TILE];
    let mut i = 0;
    while i < TILE {
        s[i] = i;
        i += 1;
    }
    s
};

/// The next (up to) `rows` slots of `it`, into `tile`; how many.
fn next_tile(it: &mut impl Iterator<Item = usize>, tile: &mut [usize; TILE], rows: usize) -> usize {
    let mut n = 0;
    while n < rows {
        match it.next() {
            Some(s) => tile[n] = s,
            None => break,
        }
        n += 1;
    }
    n
}

impl Block<'_> {
    /// One token's heads' weighted sums over `slots` of `values` (`ps(h)` head `h`'s
    /// probabilities) into `out(h)`, continued from `out` when `from_out`: two heads at a time
    /// with AVX-512, else one at a time with AVX2.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA, and AVX-512F when `avx512`; each `out(h)` is this task's own
    /// `head_dim` values; each `ps(h)` has `slots.len()` values; the slots index `values`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn weighted<'p>(
        &self,
        avx512: bool,
        ps: impl Fn(usize) -> &'p [f32],
        slots: &[usize],
        values: &[f32],
        out: impl Fn(usize) -> &'p mut [f32],
        from_out: bool,
    ) {
        let (hd, group) = (self.head_dim, self.group);
        let mut h = 0;
        if avx512 {
            while h < group {
                let two = h + 2 <= group;
                // SAFETY: as said above (AVX-512F with `avx512`).
                unsafe {
                    if two {
                        let o = [out(h).as_mut_ptr(), out(h + 1).as_mut_ptr()];
                        avx512::weighted_sum_avx512_from::<2>(
                            [ps(h), ps(h + 1)],
                            slots,
                            values,
                            hd,
                            o,
                            from_out,
                        );
                    } else {
                        let o = [out(h).as_mut_ptr()];
                        avx512::weighted_sum_avx512_from::<1>(
                            [ps(h)],
                            slots,
                            values,
                            hd,
                            o,
                            from_out,
                        );
                    }
                }
                h += if two { 2 } else { 1 };
            }
            return;
        }
        for h in 0..group {
            // SAFETY: as said above.
            unsafe { weighted_sum_avx2_from(ps(h), slots, values, hd, out(h), from_out) };
        }
    }

    /// Rows `slots` of `view` decoded into `buf`, one after the other.
    fn decode(view: &HeadView<'_>, slots: &[usize], hd: usize, buf: &mut [f32]) {
        view.read_rows(slots, &mut buf[..slots.len() * hd]);
    }

    /// The block's scores, softmax, and weighted values, tile by tile (see the module).
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA; `out` points at the whole `[n, n_heads, head_dim]` output,
    /// and no other thread reads or writes this block's heads meanwhile; the block has at
    /// most [`MAX_QUERIES`] queries.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn run_coded_avx2(
        &self,
        keys: &HeadView<'_>,
        values: &HeadView<'_>,
        out: &SharedOut,
    ) {
        let (hd, group, stride) = (self.head_dim, self.group, self.stride);
        let avx512 = has_avx512() && held_back() == 0 && hd <= avx512::MAX_HEAD_DIM;
        let nt = self.toks.len();
        let (qs, nq) = self.queries();
        let qs = &qs[..nq];
        let shared: usize = self.prefix.iter().map(|s| s.len).sum();
        let prefix = || self.prefix.iter().flat_map(|s| s.start..s.start + s.len);
        CODED.with(|cell| {
            let mut cell = cell.borrow_mut();
            let (scores, buf) = &mut *cell;
            if scores.len() < nq * stride {
                scores.resize(nq * stride, 0.0);
            }
            let rows = tile_rows(nq);
            if buf.len() < rows * hd {
                buf.resize(rows * hd, 0.0);
            }
            let mut slots = [0usize; TILE];
            // Scores against the shared prefix, a tile of keys at a time.
            let (mut it, mut t0) = (prefix(), 0);
            loop {
                let n = next_tile(&mut it, &mut slots, rows);
                if n == 0 {
                    break;
                }
                Self::decode(keys, &slots[..n], hd, buf);
                // Sixteen queries side by side from eight on (a one-token forward's few heads
                // per KV head leave most lanes idle).
                // SAFETY: AVX2 and FMA (our caller), AVX-512F on an AVX-512 kernel path with
                // `hd <= MAX_HEAD_DIM`; the local slots index the tile's `n` rows; `t0 + n`
                // is within the prefix, inside each query's run.
                unsafe { self.prefix_scores(qs, buf, &LOCAL[..n], t0, scores, avx512 && nq >= 8) };
                t0 += n;
            }
            // Scores against each row's own entries, each read once for the tokens that see it.
            // SAFETY: AVX2 and FMA (our caller); every query has `hd` values.
            unsafe { self.row_scores_avx2(qs, keys, &mut buf[..hd], scores, shared) };
            for j in 0..nt {
                let n_keys = shared + self.vis(j).count;
                for h in 0..group {
                    softmax(&mut scores[(j * group + h) * stride..][..n_keys]);
                }
            }
            // SAFETY: head `h < group` of the block's token `j` lies inside `out` (our caller),
            // and the (token, head) slices belong to this task only.
            let o = |j: usize, h: usize| unsafe {
                let i = self.toks.start + j;
                std::slice::from_raw_parts_mut(
                    out.get().add((i * self.n_heads + self.g * group + h) * hd),
                    hd,
                )
            };
            // The values: the prefix a tile at a time for every query, then each row's entries
            // for its tokens, each sum continuing where the last tile left it.
            let (mut it, mut t0) = (prefix(), 0);
            loop {
                let n = next_tile(&mut it, &mut slots, rows);
                if n == 0 {
                    break;
                }
                Self::decode(values, &slots[..n], hd, buf);
                if !avx512 {
                    // Every query of the block over the tile, up to six sharing each read.
                    let ps = |qi: usize| &scores[qi * stride + t0..][..n];
                    let out = |qi: usize| o(qi / group, qi % group).as_mut_ptr();
                    // SAFETY: AVX2, FMA (our caller); `out(qi)` is this task's `hd` values of
                    // its query `qi`; `ps(qi)` has `n` values; the local slots index the tile.
                    unsafe { avx2::weighted_sums_all(nq, ps, &LOCAL[..n], buf, hd, out, t0 > 0) };
                } else {
                    for j in 0..nt {
                        let ps = |h: usize| &scores[(j * group + h) * stride + t0..][..n];
                        // SAFETY: AVX2, FMA (our caller) and AVX-512F (`avx512`); `o(j, h)`
                        // is this task's; `ps(h)` has `n` values; the local slots index the
                        // tile.
                        unsafe { self.weighted(avx512, ps, &LOCAL[..n], buf, |h| o(j, h), t0 > 0) };
                    }
                }
                t0 += n;
            }
            for (j, most) in self.rows() {
                let row = &self.vis(j).row_slots[..most];
                for (c, chunk) in row.chunks(rows).enumerate() {
                    let u0 = c * rows;
                    Self::decode(values, chunk, hd, buf);
                    for j2 in (j..nt).filter(|&j2| self.same_row(j, j2)) {
                        let sees = self.vis(j2).count.saturating_sub(u0).min(chunk.len());
                        if sees == 0 {
                            continue;
                        }
                        let ps =
                            |h: usize| &scores[(j2 * group + h) * stride + shared + u0..][..sees];
                        let from_out = shared + u0 > 0;
                        // SAFETY: as above, with `sees` values and rows.
                        unsafe {
                            self.weighted(avx512, ps, &LOCAL[..sees], buf, |h| o(j2, h), from_out)
                        };
                    }
                }
            }
        });
    }
}
