//! A tiny, version-stable random generator (SplitMix64). Shuffles, crops and the
//! synthetic generator use it so that a seed means the same thing across builds
//! and crate upgrades (a resumed run must see the same samples).

/// SplitMix64: 64-bit state, full period, good enough for shuffles and crops.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64 { state: seed }
    }

    /// A generator from several words (seed, epoch, index, ...), mixed.
    pub fn from_parts(parts: &[u64]) -> SplitMix64 {
        let mut mix = SplitMix64::new(SEED_BASE);
        for &p in parts {
            mix.state ^= p;
            mix.next_u64();
        }
        mix
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, n)` (`n > 0`), without modulo bias worth noting for n < 2^32.
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() >> 32) * n) >> 32
    }

    /// Uniform in `[0, 1)`.
    pub fn unit_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// A fair coin.
    pub fn coin(&mut self) -> bool {
        self.next_u64() >> 63 == 1
    }
}

/// Starting state of [`SplitMix64::from_parts`].
const SEED_BASE: u64 = 0x5EED_0F5B_1CE0_0001;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_in_range() {
        let a: Vec<u64> = (0..5)
            .scan(SplitMix64::new(3), |r, _| Some(r.next_u64()))
            .collect();
        let b: Vec<u64> = (0..5)
            .scan(SplitMix64::new(3), |r, _| Some(r.next_u64()))
            .collect();
        assert_eq!(a, b);
        let mut r = SplitMix64::from_parts(&[1, 2, 3]);
        assert_ne!(r.next_u64(), SplitMix64::from_parts(&[1, 2, 4]).next_u64());
        let mut counts = [0u32; 7];
        for _ in 0..7000 {
            counts[r.below(7) as usize] += 1;
            let u = r.unit_f32();
            assert!((0.0..1.0).contains(&u));
        }
        assert!(counts.iter().all(|&c| c > 800), "{counts:?}");
    }
}
