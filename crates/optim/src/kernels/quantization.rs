//! bitsandbytes' dynamic 8-bit quantization: the 256-entry maps and block-wise quantize and
//! dequantize on host slices.
//!
//! The maps are built as `create_dynamic_map` builds them in Python (float32 `linspace` with
//! PyTorch's CPU formula, midpoints, decimal scaling, sort) so they equal bitsandbytes' tables bit
//! for bit. Two nearest-code searches exist because bitsandbytes has two: [`quantize_code`] is
//! `dQuantize` (used by `quantize_blockwise`), [`quantize_state_code`] is `quantize_2D` (used
//! inside the 8-bit optimizer kernels). They differ only at the ends of the table. This module
//! knows nothing about optimizers or tensors.

use crate::error::OptimError;

/// Number of entries in a quantization map.
pub const MAP_LEN: usize = 256;

/// A sorted table of 256 float32 values in [-1, 1]; a code is an index into it.
pub type QuantizationMap = [f32; MAP_LEN];

/// `torch.linspace(start, end, steps, dtype=float32)` as PyTorch's kernel computes it: the
/// first half counts up from `start`, the second half down from `end`, each value one fused
/// multiply-add (the compiled kernel contracts `start + step * idx`; without the fusion 42 of
/// the 256 signed entries come out one ulp off).
fn linspace_f32(start: f32, end: f32, steps: usize) -> Vec<f32> {
    let step = (end - start) / (steps - 1) as f32;
    let halfway = steps / 2;
    (0..steps)
        .map(|idx| {
            if idx < halfway {
                step.mul_add(idx as f32, start)
            } else {
                (-step).mul_add((steps - idx - 1) as f32, end)
            }
        })
        .collect()
}

/// bitsandbytes' `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`.
///
/// `signed` gives the map of the first Adam state (and of `quantize_blockwise`), unsigned the
/// map of the second state, whose sign bit becomes one more fraction bit.
pub fn dynamic_map(signed: bool) -> QuantizationMap {
    const MAX_EXPONENT_BITS: i32 = 7;
    const NON_SIGN_BITS: i32 = 7;
    let mut data: Vec<f64> = Vec::with_capacity(MAP_LEN);
    for i in 0..MAX_EXPONENT_BITS {
        let fraction_items = if signed {
            (1usize << (i + NON_SIGN_BITS - MAX_EXPONENT_BITS)) + 1
        } else {
            (1usize << (i + NON_SIGN_BITS - MAX_EXPONENT_BITS + 1)) + 1
        };
        let boundaries = linspace_f32(0.1, 1.0, fraction_items);
        // Python: `10 ** (-(max_exponent_bits - 1) + i)`, a double, applied to a float32
        // tensor, so the scale is rounded to float32 first.
        let scale = 10f64.powi(-(MAX_EXPONENT_BITS - 1) + i) as f32;
        for pair in boundaries.windows(2) {
            let mean = (pair[0] + pair[1]) / 2.0;
            data.push(f64::from(scale * mean));
        }
        if signed {
            for pair in boundaries.windows(2) {
                let mean = (pair[0] + pair[1]) / 2.0;
                data.push(f64::from(-scale * mean));
            }
        }
    }
    data.push(0.0);
    data.push(1.0);
    debug_assert_eq!(data.len(), MAP_LEN);
    data.sort_by(f64::total_cmp);
    let mut res = [0f32; MAP_LEN];
    for (dst, src) in res.iter_mut().zip(&data) {
        *dst = *src as f32;
    }
    res
}

/// The code of `x` (already divided by its block's absmax) in `map`: bitsandbytes' `dQuantize`,
/// a 7-step binary search from index 127, then the nearer of the two neighbours by midpoint.
#[inline]
pub fn quantize_code(map: &QuantizationMap, x: f32) -> u8 {
    let mut pivot = 127usize;
    let mut upper_pivot = 255usize;
    let mut lower_pivot = 0usize;
    let mut lower = -1.0f32;
    let mut upper = 1.0f32;
    let mut val = map[pivot];
    let mut step = 64usize;
    while step > 0 {
        if x > val {
            lower_pivot = pivot;
            lower = val;
            pivot += step;
        } else {
            upper_pivot = pivot;
            upper = val;
            pivot -= step;
        }
        val = map[pivot];
        step >>= 1;
    }
    if upper_pivot == 255 {
        upper = map[upper_pivot];
    }
    if lower_pivot == 0 {
        lower = map[lower_pivot];
    }
    nearest(x, val, pivot, lower, lower_pivot, upper, upper_pivot)
}

/// The code of `x` in `map` as the 8-bit optimizer kernels find it: bitsandbytes' `quantize_2D`,
/// whose outer bounds stay at -1 (signed) or 0 (unsigned) and 1.
#[inline]
pub fn quantize_state_code(map: &QuantizationMap, signed: bool, x: f32) -> u8 {
    let mut pivot = 127usize;
    let mut upper_pivot = 255usize;
    let mut lower_pivot = 0usize;
    let mut lower = if signed { -1.0f32 } else { 0.0 };
    let mut upper = 1.0f32;
    let mut val = map[pivot];
    let mut step = 64usize;
    while step > 0 {
        if x > val {
            lower_pivot = pivot;
            lower = val;
            pivot += step;
        } else {
            upper_pivot = pivot;
            upper = val;
            pivot -= step;
        }
        val = map[pivot];
        step >>= 1;
    }
    nearest(x, val, pivot, lower, lower_pivot, upper, upper_pivot)
}

#[inline]
fn nearest(
    x: f32,
    val: f32,
    pivot: usize,
    lower: f32,
    lower_pivot: usize,
    upper: f32,
    upper_pivot: usize,
) -> u8 {
    let res = if x > val {
        let midpoint = (upper + val) * 0.5;
        if x > midpoint {
            upper_pivot
        } else {
            pivot
        }
    } else {
        let midpoint = (lower + val) * 0.5;
        if x < midpoint {
            lower_pivot
        } else {
            pivot
        }
    };
    res as u8
}

fn check_blocks(
    op: &'static str,
    n: usize,
    block_size: usize,
    codes: usize,
    absmax: usize,
) -> Result<(), OptimError> {
    if block_size == 0 {
        return Err(OptimError::InvalidArgument {
            op,
            reason: "block size 0".into(),
        });
    }
    let n_blocks = n.div_ceil(block_size);
    if codes != n || absmax != n_blocks {
        return Err(OptimError::LengthMismatch {
            op,
            expected: n,
            got: codes,
            detail: format!("{absmax} absmax entries for {n_blocks} blocks of {block_size}"),
        });
    }
    Ok(())
}

/// Block-wise quantization as `bitsandbytes.functional.quantize_blockwise` does it: per block of
/// `block_size` elements, `absmax = max |x|` and each code is the nearest entry of `map` to
/// `x * (1 / absmax)`.
pub fn quantize_blockwise(
    map: &QuantizationMap,
    input: &[f32],
    block_size: usize,
    codes: &mut [u8],
    absmax: &mut [f32],
) -> Result<(), OptimError> {
    check_blocks(
        "quantize_blockwise",
        input.len(),
        block_size,
        codes.len(),
        absmax.len(),
    )?;
    for ((block, block_codes), block_absmax) in input
        .chunks(block_size)
        .zip(codes.chunks_mut(block_size))
        .zip(absmax.iter_mut())
    {
        let max = block.iter().fold(f32::MIN, |acc, x| acc.max(x.abs()));
        *block_absmax = max;
        let inv = 1.0 / max;
        for (code, &x) in block_codes.iter_mut().zip(block) {
            *code = quantize_code(map, x * inv);
        }
    }
    Ok(())
}

/// The inverse of [`quantize_blockwise`]: `out = map[code] * absmax` of the block.
pub fn dequantize_blockwise(
    map: &QuantizationMap,
    codes: &[u8],
    absmax: &[f32],
    block_size: usize,
    out: &mut [f32],
) -> Result<(), OptimError> {
    check_blocks(
        "dequantize_blockwise",
        out.len(),
        block_size,
        codes.len(),
        absmax.len(),
    )?;
    for ((block_out, block_codes), &scale) in out
        .chunks_mut(block_size)
        .zip(codes.chunks(block_size))
        .zip(absmax)
    {
        for (dst, &code) in block_out.iter_mut().zip(block_codes) {
            *dst = map[usize::from(code)] * scale;
        }
    }
    Ok(())
}
