//! The 8-bit codec on host memory: blockwise absmax quantisation to signed bytes and back.
//!
//! The elements are cut into blocks of `block` consecutive elements (the last one may be
//! shorter). Each block keeps its absmax `a = max |x|` as an f32 and one signed byte per element,
//! `code = round_half_even((x / a) * 127)` in `-127..=127`; decoding gives `(code / 127) * a`. So
//! every element comes back within `a / 254` (plus f32 rounding: [`INT8_ERROR_BOUND`]) and the
//! block's largest magnitude comes back exactly. A block of zeros keeps `a = 0` and codes 0. A
//! block holding a NaN or an infinity keeps `a = NaN` and codes 0, so it decodes to NaN throughout:
//! a non-finite activation stays non-finite in backward, where an overflow check can see it.
//!
//! Every step is one IEEE-rounded f32 operation in a fixed order (widen, divide, multiply, round
//! to even; divide, multiply, narrow to nearest even with one canonical NaN), which the CUDA
//! kernels (`kernels/compress.cu`) repeat, so both devices give the same bits. f64, bf16 and f16
//! elements are read as f32 (f64 rounded to nearest) and written back rounded to nearest even.
//!
//! This module is plain arithmetic on slices (in parallel runs of whole blocks on rayon's pool);
//! it knows no tensor, device or autograd.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::CheckpointError;

/// The largest code magnitude: codes are `-127..=127` (symmetric; -128 is never written).
pub const INT8_LEVELS: f32 = 127.0;

/// The round trip's error bound, as a fraction of the block's absmax: half a code step
/// (`1 / 254`) plus the f32 rounding of the division, the product and the decode (a few units of
/// 2^-24, bounded here by 2^-20).
pub const INT8_ERROR_BOUND: f64 = 0.5 / 127.0 + 1.0 / (1u64 << 20) as f64;

/// Block sizes the 8-bit codec takes: powers of two from 32 (a warp) to 4096.
pub const INT8_BLOCK_RANGE: std::ops::RangeInclusive<usize> = 32..=4096;

/// Element types the host codec reads and writes.
pub trait CodecElement: Copy + Send + Sync {
    /// The element as f32 (exact for f32, bf16 and f16; rounded to nearest for f64).
    fn to_f32(self) -> f32;
    /// An f32 as the element (rounded to nearest even; NaN as one canonical NaN).
    fn from_f32(value: f32) -> Self;
}

impl CodecElement for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(value: f32) -> Self {
        value
    }
}

impl CodecElement for f64 {
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn from_f32(value: f32) -> Self {
        f64::from(value)
    }
}

impl CodecElement for bf16 {
    fn to_f32(self) -> f32 {
        self.to_f32()
    }
    fn from_f32(value: f32) -> Self {
        if value.is_nan() {
            bf16::from_bits(0x7fc0)
        } else {
            bf16::from_f32(value)
        }
    }
}

impl CodecElement for f16 {
    fn to_f32(self) -> f32 {
        self.to_f32()
    }
    fn from_f32(value: f32) -> Self {
        if value.is_nan() {
            f16::from_bits(0x7e00)
        } else {
            f16::from_f32(value)
        }
    }
}

/// Checks an 8-bit block size: a power of two in [`INT8_BLOCK_RANGE`].
pub(crate) fn check_block(op: &'static str, block: usize) -> Result<(), CheckpointError> {
    if !block.is_power_of_two() || !INT8_BLOCK_RANGE.contains(&block) {
        return Err(CheckpointError::InvalidArgument {
            op,
            reason: format!(
                "8-bit block size {block}: give a power of two from {} to {} (default {})",
                INT8_BLOCK_RANGE.start(),
                INT8_BLOCK_RANGE.end(),
                crate::compress::DEFAULT_BLOCK
            ),
        });
    }
    Ok(())
}

/// Checks that codes and absmax have the lengths `n` elements in blocks of `block` need.
fn check_lengths(
    op: &'static str,
    n: usize,
    block: usize,
    codes: usize,
    absmax: usize,
) -> Result<(), CheckpointError> {
    check_block(op, block)?;
    if codes != n || absmax != n.div_ceil(block) {
        return Err(CheckpointError::InvalidArgument {
            op,
            reason: format!(
                "{n} elements in blocks of {block} need {n} codes and {} absmax values, got {codes} \
                 and {absmax}",
                n.div_ceil(block)
            ),
        });
    }
    Ok(())
}

/// Blocks per parallel task of the public entry points.
const BLOCKS_PER_TASK: usize = 64;

/// Quantises `x` blockwise: one absmax per `block` elements into `absmax`, one code per element
/// into `codes` (see the module docs for the formula), in parallel runs of whole blocks on
/// rayon's pool (each block's bits do not depend on the others').
pub fn quantize_int8_blockwise<T: CodecElement>(
    x: &[T],
    block: usize,
    codes: &mut [i8],
    absmax: &mut [f32],
) -> Result<(), CheckpointError> {
    check_lengths(
        "quantize_int8_blockwise",
        x.len(),
        block,
        codes.len(),
        absmax.len(),
    )?;
    let task = block * BLOCKS_PER_TASK;
    x.par_chunks(task)
        .zip(codes.par_chunks_mut(task))
        .zip(absmax.par_chunks_mut(BLOCKS_PER_TASK))
        .for_each(|((x, codes), absmax)| quantize_blocks(x, block, codes, absmax));
    Ok(())
}

/// Decodes what [`quantize_int8_blockwise`] wrote: `out[i] = (codes[i] / 127) * absmax[i / block]`,
/// in parallel runs of whole blocks.
pub fn dequantize_int8_blockwise<T: CodecElement>(
    codes: &[i8],
    absmax: &[f32],
    block: usize,
    out: &mut [T],
) -> Result<(), CheckpointError> {
    check_lengths(
        "dequantize_int8_blockwise",
        out.len(),
        block,
        codes.len(),
        absmax.len(),
    )?;
    let task = block * BLOCKS_PER_TASK;
    out.par_chunks_mut(task)
        .zip(codes.par_chunks(task))
        .zip(absmax.par_chunks(BLOCKS_PER_TASK))
        .for_each(|((out, codes), absmax)| dequantize_blocks(codes, absmax, block, out));
    Ok(())
}

/// [`quantize_int8_blockwise`] on lengths already checked, serially.
fn quantize_blocks<T: CodecElement>(x: &[T], block: usize, codes: &mut [i8], absmax: &mut [f32]) {
    for ((x, codes), absmax) in x
        .chunks(block)
        .zip(codes.chunks_mut(block))
        .zip(absmax.iter_mut())
    {
        *absmax = quantize_block(x, codes);
    }
}

/// [`dequantize_int8_blockwise`] on lengths already checked, serially.
fn dequantize_blocks<T: CodecElement>(codes: &[i8], absmax: &[f32], block: usize, out: &mut [T]) {
    for ((out, codes), &absmax) in out
        .chunks_mut(block)
        .zip(codes.chunks(block))
        .zip(absmax.iter())
    {
        dequantize_block(codes, absmax, out);
    }
}

/// One block: writes its codes and returns its absmax (NaN when it holds a non-finite value).
fn quantize_block<T: CodecElement>(x: &[T], codes: &mut [i8]) -> f32 {
    let mut absmax = 0.0f32;
    let mut finite = true;
    for v in x {
        let v = v.to_f32();
        finite &= v.is_finite();
        absmax = absmax.max(v.abs());
    }
    if !finite || absmax == 0.0 {
        codes.fill(0);
        return if finite { 0.0 } else { f32::NAN };
    }
    for (code, v) in codes.iter_mut().zip(x) {
        // |x / absmax| <= 1, so the rounded product lies in -127..=127.
        *code = ((v.to_f32() / absmax) * INT8_LEVELS).round_ties_even() as i8;
    }
    absmax
}

/// One block decoded into `out`.
fn dequantize_block<T: CodecElement>(codes: &[i8], absmax: f32, out: &mut [T]) {
    for (out, &code) in out.iter_mut().zip(codes) {
        *out = T::from_f32((f32::from(code) / INT8_LEVELS) * absmax);
    }
}
