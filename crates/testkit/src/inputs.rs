//! Deterministic test inputs: one xorshift64 stream and the shapes of values tests draw from it.
//!
//! Every function here is a pure function of its seed, so a failing test reproduces bit for bit
//! on any machine. [`Xorshift::new`] spreads a small seed over the state (nearby seeds give
//! unrelated streams); [`Xorshift::from_state`] starts from a state exactly, for tests whose data
//! was drawn from a hand-picked state and whose tolerances were measured on that data.

/// The golden-ratio multiplier that spreads a seed over the 64 bits of the state.
const SEED_SPREAD: u64 = 0x9e37_79b9_7f4a_7c15;

/// Marsaglia's xorshift64 (shifts 13, 7, 17): fast, full period over the non-zero states, and
/// good enough for test data (not for statistics).
#[derive(Debug, Clone)]
pub struct Xorshift {
    state: u64,
}

impl Xorshift {
    /// The stream of `seed`: the seed times the golden-ratio multiplier, made odd (never zero).
    pub fn new(seed: u64) -> Xorshift {
        Xorshift::from_state(seed.wrapping_mul(SEED_SPREAD) | 1)
    }

    /// The stream that starts from `state` exactly. Panics on 0, which xorshift never leaves.
    pub fn from_state(state: u64) -> Xorshift {
        assert_ne!(state, 0, "a xorshift stream cannot start from 0");
        Xorshift { state }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        self.state
    }

    /// A float in [-1, 1) from the top 24 bits, a multiple of 2⁻²³ (exact in f32).
    pub fn next_signed_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// A float in [0, 1) from the top 53 bits (exact in f64).
    pub fn next_unit_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A float in [low, high): `low + (high - low) · u` with `u` from [`Xorshift::next_unit_f64`].
    pub fn next_f64_in(&mut self, low: f64, high: f64) -> f64 {
        low + (high - low) * self.next_unit_f64()
    }

    /// An integer in [0, bound), for labels and token ids (`bound` > 0; the modulo's bias is
    /// irrelevant for test data).
    pub fn next_below(&mut self, bound: u64) -> u64 {
        assert!(bound > 0, "an empty range");
        self.next_u64() % bound
    }
}

/// `n` floats in [-1, 1) from [`Xorshift::new(seed)`](Xorshift::new).
pub fn uniform_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut random = Xorshift::new(seed);
    (0..n).map(|_| random.next_signed_f32()).collect()
}

/// `n` floats in [-width/2, width/2) from [`Xorshift::new(seed)`](Xorshift::new):
/// [`uniform_f32`]'s values scaled by `width / 2` (the optimizer tests' parameters and gradients).
pub fn centered_f32(n: usize, width: f32, seed: u64) -> Vec<f32> {
    let mut random = Xorshift::new(seed);
    (0..n)
        .map(|_| random.next_signed_f32() * 0.5 * width)
        .collect()
}

/// `n` floats in [low, high) from [`Xorshift::new(seed)`](Xorshift::new).
pub fn uniform_f64(n: usize, low: f64, high: f64, seed: u64) -> Vec<f64> {
    let mut random = Xorshift::new(seed);
    (0..n).map(|_| random.next_f64_in(low, high)).collect()
}

/// `len` bytes that differ from position to position (period 256 · 256 before the high byte of
/// the position changes them again) and from seed to seed: data for copy round trips, where
/// any misplaced byte must show.
pub fn pattern_bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The streams tests were written against, pinned (Rust prints the shortest decimal that
    /// reads back to the same float, so these literals are exact): moving a test onto this
    /// module must not change its data.
    #[test]
    fn the_streams_are_the_ones_the_tests_were_written_against() {
        // `seed * 0x9e3779b97f4a7c15 | 1`, top 24 bits: the CUDA kernel benches' `random_f32`.
        assert_eq!(
            uniform_f32(5, 7),
            [0.92381155, 0.8500644, -0.0050849915, 0.12775624, -0.2921536]
        );
        // The state as given, top 53 bits: the parity tests' `Random(state).next(lo, hi)`.
        let mut random = Xorshift::from_state(0x9e37_79b9_7f4a_7c15);
        let drawn: Vec<f64> = (0..3).map(|_| random.next_f64_in(-3.0, 3.0)).collect();
        assert_eq!(
            drawn,
            [
                2.1587647246848993,
                -0.6341919698619796,
                -0.11647275570304938
            ]
        );
        assert_eq!(
            uniform_f64(3, 0.5, 2.0, 9),
            [0.8281780839923587, 0.5386067139928704, 0.8081666669521138]
        );
    }

    #[test]
    fn values_stay_in_their_ranges() {
        assert!(uniform_f32(10_000, 3)
            .iter()
            .all(|v| (-1.0..1.0).contains(v)));
        assert!(uniform_f64(10_000, 0.5, 2.0, 3)
            .iter()
            .all(|v| (0.5..2.0).contains(v)));
        let mut random = Xorshift::new(1);
        assert!((0..1000).all(|_| random.next_below(10) < 10));
        assert_ne!(uniform_f32(8, 1), uniform_f32(8, 2));
    }

    #[test]
    fn patterns_differ_by_position_and_seed() {
        let a = pattern_bytes(1 << 17, 3);
        assert_ne!(a, pattern_bytes(1 << 17, 4));
        assert_ne!(a[..256], a[256..512]);
        assert_eq!(pattern_bytes(10, 0)[..3], [0, 31, 62]);
    }
}
