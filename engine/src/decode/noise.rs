//! The reference's sampling noise for planning drafts at temperature > 0:
//! `argmax(exp(logits) / (-ln u)^T)` in float64, `u` uniform, here from a seeded generator.

/// xoshiro256** seeded through splitmix64: small, fast, and reproducible from `--seed`.
pub struct Noise {
    s: [u64; 4],
}

impl Noise {
    pub fn new(seed: u64) -> Noise {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Noise {
            s: [next(), next(), next(), next()],
        }
    }

    fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in (0, 1): never 0, so `-ln u` is finite.
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Draws and drops `n` uniforms: what [`Self::sample`] over `n` logits takes from the
    /// stream (a draft skipped keeps every later draw where it was).
    pub fn skip(&mut self, n: usize) {
        for _ in 0..n {
            self.next_u64();
        }
    }

    /// The index maximising `exp(l) / (-ln u)^T` over `logits`.
    pub fn sample(&mut self, logits: &[f32], temperature: f64) -> usize {
        let mut best = 0;
        let mut best_v = f64::NEG_INFINITY;
        for (i, &l) in logits.iter().enumerate() {
            let g = (-self.uniform().ln()).powf(temperature);
            let v = (l as f64).exp() / g;
            if v > best_v {
                best_v = v;
                best = i;
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_and_roughly_softmax_distributed() {
        let logits = [0.0f32, (2.0f32).ln(), 0.0];
        let mut n = Noise::new(7);
        let mut counts = [0usize; 3];
        for _ in 0..20000 {
            counts[n.sample(&logits, 1.0)] += 1;
        }
        // At T = 1 this is exact sampling from softmax: 1/4, 1/2, 1/4.
        assert!(
            (counts[1] as f64 / 20000.0 - 0.5).abs() < 0.02,
            "{counts:?}"
        );
        let a: Vec<usize> = (0..5).map(|_| Noise::new(3).sample(&logits, 0.7)).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]), "same seed, same draw");
        // A skipped draw leaves the stream where sampling would have.
        let (mut drawn, mut skipped) = (Noise::new(5), Noise::new(5));
        drawn.sample(&logits, 0.7);
        skipped.skip(logits.len());
        assert_eq!(drawn.uniform(), skipped.uniform());
    }
}
