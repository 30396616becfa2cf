//! Seeded, counter-based random numbers whose state can be saved and restored.
//!
//! Element `i` of a random draw is a pure function of `(seed, offset + i)` ([`uniform`]), so any
//! backend produces the same numbers in any order or thread split, and replaying a draw only
//! needs the `(seed, offset)` it was given. A [`Generator`] hands out offsets; it knows nothing
//! about tensors or devices.
//!
//! Activation checkpointing runs a region twice and needs the same dropout masks both times,
//! without knowing which generators the region uses. So the draws of this thread can be
//! recorded ([`record_draws`]: every `(seed, offset, count)` any generator hands out while the
//! recording is open) and replayed ([`replay_draws`]: each draw is answered from the recording,
//! in order, and the live generators do not move, as PyTorch's `fork_rng` leaves them). Scopes
//! nest: a draw is answered by the innermost replay and recorded by every open recording.

use std::cell::RefCell;
use std::collections::VecDeque;

use parking_lot::Mutex;

/// A uniform number in `[0, 1)` with 24 random bits (exact in f32 and f64) for element
/// `counter` of the stream `seed`.
pub fn uniform(seed: u64, counter: u64) -> f64 {
    let mixed = mix(mix(seed ^ 0x9E37_79B9_7F4A_7C15).wrapping_add(counter));
    (mixed >> 40) as f64 / (1u64 << 24) as f64
}

/// A distribution to fill a tensor from ([`RandomDraw`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Distribution {
    /// Uniform on `[low, high)`: `low + (high - low) · u`.
    Uniform {
        /// Lower bound.
        low: f64,
        /// Upper bound.
        high: f64,
    },
    /// Normal by Box–Muller's cosine branch: `mean + std · sqrt(-2 ln(1 - u₁)) · cos(2π u₂)`,
    /// two uniforms an element.
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
}

impl Distribution {
    /// The uniforms one element consumes (the generator's counters it advances by an element).
    pub fn counters_per_element(&self) -> u64 {
        match self {
            Distribution::Uniform { .. } => 1,
            Distribution::Normal { .. } => 2,
        }
    }
}

/// What [`Backend::random`](crate::Backend::random) writes: element `i` (row-major) is
/// [`RandomDraw::value`]`(i)`, computed in f64 and rounded to the tensor's dtype to nearest
/// (bf16 and f16 directly from the f64, with no double rounding through f32).
///
/// The value is a pure function of `(seed, offset, i)`, so a tensor is the same however a
/// backend splits its elements. Uniform draws are the same bits on every backend (their
/// arithmetic is IEEE's basic operations); normal draws take `ln` and `cos` from the backend's
/// math library (the host's libm, CUDA's within 1 and 2 ulp of f64), so an element may differ
/// in its last bit between backends when the f64 value lies within an ulp of a rounding
/// boundary of the dtype (about one f32 element in 2^29; bf16 and f16 practically never), and
/// an f64 tensor's normal draws differ in their last bits wherever the libraries do (0.4% of a
/// million draws on an H200).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomDraw {
    /// The distribution.
    pub distribution: Distribution,
    /// The generator's seed.
    pub seed: u64,
    /// The counter of element 0's first uniform.
    pub offset: u64,
}

impl RandomDraw {
    /// Element `index`'s value, in the order of operations the backends' kernels follow.
    pub fn value(&self, index: u64) -> f64 {
        match self.distribution {
            Distribution::Uniform { low, high } => {
                low + (high - low) * uniform(self.seed, self.offset + index)
            }
            Distribution::Normal { mean, std } => {
                // 1 - u keeps the logarithm's argument in (0, 1].
                let u1 = 1.0 - uniform(self.seed, self.offset + 2 * index);
                let u2 = uniform(self.seed, self.offset + 2 * index + 1);
                let radius = (-2.0 * u1.ln()).sqrt();
                mean + std * radius * (std::f64::consts::TAU * u2).cos()
            }
        }
    }
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

    /// Reserves `count` numbers; returns the seed and the offset of the first. Inside a
    /// [`replay_draws`] scope the answer is the recorded draw and this generator does not move.
    pub fn advance(&self, count: u64) -> (u64, u64) {
        let draw = replayed(count).unwrap_or_else(|| {
            let mut state = self.state.lock();
            let draw = Draw {
                seed: state.seed,
                offset: state.offset,
                count,
            };
            state.offset += count;
            draw
        });
        record(draw);
        (draw.seed, draw.offset)
    }
}

/// One draw: `count` numbers of stream `seed` from `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Draw {
    seed: u64,
    offset: u64,
    count: u64,
}

/// The draws made on one thread while a [`record_draws`] scope was open, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordedDraws {
    draws: Vec<Draw>,
}

impl RecordedDraws {
    /// How many draws were recorded.
    pub fn len(&self) -> usize {
        self.draws.len()
    }

    /// Whether nothing was drawn.
    pub fn is_empty(&self) -> bool {
        self.draws.is_empty()
    }
}

enum DrawScope {
    Record(Vec<Draw>),
    Replay {
        queue: VecDeque<Draw>,
        diverged: bool,
    },
}

thread_local! {
    static DRAW_SCOPES: RefCell<Vec<DrawScope>> = const { RefCell::new(Vec::new()) };
}

/// The innermost replay's next draw, if a replay is open; a draw of another size, or none left,
/// marks the replay as diverged and is answered by the live generator.
fn replayed(count: u64) -> Option<Draw> {
    DRAW_SCOPES.with(|scopes| {
        let mut scopes = scopes.borrow_mut();
        let (queue, diverged) = scopes.iter_mut().rev().find_map(|scope| match scope {
            DrawScope::Replay { queue, diverged } => Some((queue, diverged)),
            DrawScope::Record(_) => None,
        })?;
        match queue.pop_front() {
            Some(draw) if draw.count == count && !*diverged => Some(draw),
            _ => {
                *diverged = true;
                None
            }
        }
    })
}

fn record(draw: Draw) {
    DRAW_SCOPES.with(|scopes| {
        for scope in scopes.borrow_mut().iter_mut() {
            if let DrawScope::Record(draws) = scope {
                draws.push(draw);
            }
        }
    });
}

fn open(scope: DrawScope) -> usize {
    DRAW_SCOPES.with(|scopes| {
        let mut scopes = scopes.borrow_mut();
        scopes.push(scope);
        scopes.len()
    })
}

/// Closes the scope at `depth` (and any left open inside it), returning it.
fn close(depth: usize) -> Option<DrawScope> {
    DRAW_SCOPES.with(|scopes| {
        let mut scopes = scopes.borrow_mut();
        if scopes.len() < depth {
            return None;
        }
        scopes.truncate(depth);
        scopes.pop()
    })
}

/// Records every draw of this thread until [`DrawRecording::finish`] (dropping the guard
/// discards the recording).
pub fn record_draws() -> DrawRecording {
    DrawRecording {
        depth: open(DrawScope::Record(Vec::new())),
        _not_send: std::marker::PhantomData,
    }
}

/// An open [`record_draws`] scope.
#[derive(Debug)]
#[must_use = "the recording stops when the guard is dropped"]
pub struct DrawRecording {
    depth: usize,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl DrawRecording {
    /// Stops recording and returns the draws.
    pub fn finish(self) -> RecordedDraws {
        let draws = match close(self.depth) {
            Some(DrawScope::Record(draws)) => draws,
            _ => Vec::new(),
        };
        std::mem::forget(self);
        RecordedDraws { draws }
    }
}

impl Drop for DrawRecording {
    fn drop(&mut self) {
        close(self.depth);
    }
}

/// Answers this thread's draws from `draws`, in order, until [`DrawReplay::finish`]: the same
/// random numbers as when they were recorded, and no generator moves.
pub fn replay_draws(draws: &RecordedDraws) -> DrawReplay {
    let queue = draws.draws.iter().copied().collect();
    DrawReplay {
        depth: open(DrawScope::Replay {
            queue,
            diverged: false,
        }),
        _not_send: std::marker::PhantomData,
    }
}

/// An open [`replay_draws`] scope.
#[derive(Debug)]
#[must_use = "the replay stops when the guard is dropped"]
pub struct DrawReplay {
    depth: usize,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl DrawReplay {
    /// Stops replaying. `true` when every draw made was answered from the recording (draws left
    /// over are fine: a recompute may stop early); `false` when a draw asked for another number
    /// of elements, or more draws were made than recorded, so some numbers differ.
    pub fn finish(self) -> bool {
        let faithful = !matches!(
            close(self.depth),
            Some(DrawScope::Replay { diverged: true, .. })
        );
        std::mem::forget(self);
        faithful
    }
}

impl Drop for DrawReplay {
    fn drop(&mut self) {
        close(self.depth);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replayed_draws_repeat_the_recording_and_leave_generators_alone() {
        let (a, b) = (Generator::new(1), Generator::new(2));
        let recording = record_draws();
        let first = [a.advance(10), b.advance(3), a.advance(5)];
        let draws = recording.finish();
        assert_eq!(draws.len(), 3);
        let after = (a.state(), b.state());
        let replay = replay_draws(&draws);
        // Nested: a recording inside the replay sees the replayed draws.
        let inner = record_draws();
        let again = [a.advance(10), b.advance(3), a.advance(5)];
        assert_eq!(inner.finish(), draws);
        assert!(replay.finish());
        assert_eq!(again, first);
        assert_eq!((a.state(), b.state()), after);
        // A draw of another size, or one too many, is flagged.
        let replay = replay_draws(&draws);
        a.advance(11);
        assert!(!replay.finish());
        let replay = replay_draws(&RecordedDraws::default());
        a.advance(1);
        assert!(!replay.finish());
        // Diverged draws came from the live generator, which moved: 15 + 11 + 1.
        assert_eq!(a.state().offset, 27);
    }

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
