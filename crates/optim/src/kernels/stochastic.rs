//! Stochastic rounding of f32 to bf16 with a seeded, counter-based random stream that the CPU
//! and the CUDA kernels (`kernels/adam.cu`) compute alike, so both round every element the same
//! way.
//!
//! Rounding to nearest loses an update smaller than half a bf16 ulp of the parameter every time;
//! rounding up with probability equal to the discarded fraction keeps it on average (the rounded
//! value's expectation is the f32 value), which is what lets bf16 parameters train without an
//! f32 master copy. The 16 random bits of an element come from splitmix64 over a key (seed,
//! parameter index, step) and the element's index: no state, the same bits on any device and in
//! any order of evaluation, a different stream for every parameter and step.
//!
//! [`Bf16Rounding`] is the choice a rule over bf16 parameters offers (the 8-bit and 4-bit
//! rules); [`ParamRounding`] is that choice for one parameter at one step, which a raw kernel
//! takes.

use half::bf16;

use super::ParamElement;

/// How a rule that takes bf16 parameters without an f32 master copy stores an updated
/// parameter. f32 parameters are stored exactly either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Bf16Rounding {
    /// To nearest even: PyTorch's `copy_`, torchao's default (`bf16_stochastic_round=False`) and
    /// bitsandbytes' only choice. An update under half a bf16 ulp of its parameter is lost.
    #[default]
    Nearest,
    /// Stochastically (torchao's `bf16_stochastic_round=True`), with random bits seeded by
    /// `seed` ([`stochastic_key`] of the seed, the parameter's index in its optimizer and the
    /// step): reproducible, and the same bits on the CPU and CUDA.
    Stochastic {
        /// Seeds the random bits.
        seed: u64,
    },
}

/// The rounding of one parameter's update at one step: to nearest, or stochastic with the bits of
/// one stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamRounding {
    key: Option<u64>,
}

impl ParamRounding {
    /// To nearest even (the only rounding of f32 parameters, where it is exact).
    pub const NEAREST: ParamRounding = ParamRounding { key: None };

    /// Stochastic with the bits of stream `key` ([`stochastic_key`]); element `i` of the
    /// parameter rounds with [`stochastic_bits`]`(key, i)`.
    pub fn stochastic(key: u64) -> ParamRounding {
        ParamRounding { key: Some(key) }
    }

    /// `rounding` for the parameter at index `slot` of its optimizer at step `step`.
    pub fn of(rounding: Bf16Rounding, slot: usize, step: u64) -> ParamRounding {
        match rounding {
            Bf16Rounding::Nearest => ParamRounding::NEAREST,
            Bf16Rounding::Stochastic { seed } => {
                ParamRounding::stochastic(stochastic_key(seed, slot as u64, step))
            }
        }
    }

    /// The stream's key, when stochastic.
    pub fn key(self) -> Option<u64> {
        self.key
    }

    /// `value` stored as element `index` of a parameter of `T`.
    #[inline(always)]
    pub fn store<T: ParamElement>(self, value: f32, index: usize) -> T {
        match self.key {
            Some(key) => T::from_f32_stochastic(value, stochastic_bits(key, index as u64)),
            None => T::from_f32(value),
        }
    }
}

/// splitmix64's increment (the golden ratio's 64-bit fraction).
const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// splitmix64's output function.
#[inline(always)]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The key of the random stream of parameter `param_index` at step `step` (counted from 1)
/// under `seed`.
pub fn stochastic_key(seed: u64, param_index: u64, step: u64) -> u64 {
    mix64(seed ^ mix64((param_index << 32) ^ step))
}

/// The 16 random bits element `index` of the stream `key` rounds with (in the low bits): the
/// elements `4j..4j+3` share one splitmix64 output ([`stochastic_group`]`(key, j)`), element
/// `4j + k` taking its bits `63 - 16k` down to `48 - 16k`, so a kernel that rounds four
/// neighbours computes one hash for them (on the GPU the hash was a sixth of the bf16 Adam
/// step's instructions).
#[inline(always)]
pub fn stochastic_bits(key: u64, index: u64) -> u32 {
    stochastic_bits_of(stochastic_group(key, index / 4), (index % 4) as u32)
}

/// The 64 random bits of the elements `4 * group .. 4 * group + 4` of the stream `key`.
#[inline(always)]
pub fn stochastic_group(key: u64, group: u64) -> u64 {
    mix64(key.wrapping_add(group.wrapping_add(1).wrapping_mul(GOLDEN_GAMMA)))
}

/// The 16 bits of element `k` (0 to 3) of a group's bits ([`stochastic_group`]).
#[inline(always)]
pub fn stochastic_bits_of(group_bits: u64, k: u32) -> u32 {
    ((group_bits >> (48 - 16 * k)) & 0xffff) as u32
}

/// `value` rounded to bf16 up (in magnitude) with probability equal to the fraction of a bf16
/// ulp it drops, given 16 uniform random bits: the discarded low half of the f32 bits plus the
/// random bits carries into the kept half exactly that often. NaN and ±infinity round as to
/// nearest (one canonical NaN); a finite value may round up to infinity, as to nearest can.
#[inline(always)]
pub fn round_bf16_stochastic(value: f32, random: u32) -> bf16 {
    if !value.is_finite() {
        return <bf16 as ParamElement>::from_f32(value);
    }
    let bits = value.to_bits().wrapping_add(random & 0xffff) & 0xffff_0000;
    bf16::from_bits((bits >> 16) as u16)
}
