//! Seeded, counter-based random numbers whose state can be saved and restored.
//!
//! Element `i` of a random draw is a pure function of `(seed, offset + i)` ([`uniform`]), so any
//! backend produces the same numbers in any order or thread split, and replaying a draw (for
//! activation checkpointing) only needs the [`GeneratorState`] from before it. A [`Generator`]
//! hands out offsets; it knows nothing about tensors or devices.

use parking_lot::Mutex;

/// A uniform number in `[0, 1)` with 24 random bits (exact in f32 and f64) for element
/// `counter` of the stream `seed`.
pub fn uniform(seed: u64, counter: u64) -> f64 {
    let mixed = mix(mix(seed ^ 0x9E37_79B9_7F4A_7C15).wrapping_add(counter));
    (mixed >> 40) as f64 / (1u64 << 24) as f64
}

/// The splitmix64 finaliser.
fn mix(value: u64) -> u64 {
    let mut z = value.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Everything that determines the next draws of a [`Generator`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GeneratorState {
    /// The stream.
    pub seed: u64,
    /// How many numbers were drawn so far.
    pub offset: u64,
}

/// A random stream shared by the ops that draw from it (dropout).
#[derive(Debug)]
pub struct Generator {
    state: Mutex<GeneratorState>,
}

impl Generator {
    /// A generator at the start of stream `seed`.
    pub fn new(seed: u64) -> Generator {
        Generator {
            state: Mutex::new(GeneratorState { seed, offset: 0 }),
        }
    }

    /// The state, to restore later with [`Generator::set_state`].
    pub fn state(&self) -> GeneratorState {
        *self.state.lock()
    }

    /// Restores a state from [`Generator::state`]: the next draws repeat those made after it.
    pub fn set_state(&self, state: GeneratorState) {
        *self.state.lock() = state;
    }

    /// Restarts at stream `seed`.
    pub fn manual_seed(&self, seed: u64) {
        self.set_state(GeneratorState { seed, offset: 0 });
    }

    /// Reserves `count` numbers; returns the seed and the offset of the first.
    pub fn advance(&self, count: u64) -> (u64, u64) {
        let mut state = self.state.lock();
        let res = (state.seed, state.offset);
        state.offset += count;
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restored_state_repeats_the_draws() {
        let generator = Generator::new(7);
        let saved = generator.state();
        let first = generator.advance(10);
        generator.set_state(saved);
        assert_eq!(generator.advance(10), first);
        assert_eq!(generator.advance(1), (7, 10));
        let draws: Vec<f64> = (0..1000).map(|i| uniform(7, i)).collect();
        assert!(draws.iter().all(|&u| (0.0..1.0).contains(&u)));
        let mean = draws.iter().sum::<f64>() / 1000.0;
        assert!((mean - 0.5).abs() < 0.05, "mean {mean}");
    }
}
