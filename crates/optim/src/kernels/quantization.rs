//! bitsandbytes' dynamic 8-bit quantization: the 256-entry maps and block-wise quantize and
//! dequantize on host slices.
//!
//! The maps are built as `create_dynamic_map` builds them in Python (float32 `linspace` with
//! PyTorch's CPU formula, midpoints, decimal scaling, sort) so they equal bitsandbytes' tables bit
//! for bit. Two nearest-code searches exist because bitsandbytes has two: [`quantize_code`] is
//! `dQuantize` (used by `quantize_blockwise`), [`quantize_state_code`] is `quantize_2D` (used
//! inside the 8-bit optimizer kernels). They differ only at the ends of the table.
//! [`StateCodeTable`] finds `quantize_state_code`'s codes without the search, by one table
//! entry per bin of the float's bits (what the GPU kernel does, and the host 8-bit kernel through
//! a process-wide cache of tables). This module knows nothing about optimizers or tensors.

use std::sync::{Arc, Mutex, PoisonError};

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

/// Bins of [`StateCodeTable`] per sign: |x| under 2^-23, 24 binades of 128 bins each (exponent
/// and top seven mantissa bits), and |x| of 2 or more.
pub const CODE_BINS_PER_SIGN: usize = 1 + 24 * 128 + 1;

/// A bin entry's threshold field when the bin holds no code change.
const NO_STEP: u32 = 0x1_0000;

/// `quantize_state_code(map, signed, x)` as a lookup: one 32-bit entry per bin of `x`'s bits,
/// holding the code of the bin's smallest value and where in the bin the next code starts.
///
/// The binary search is a non-decreasing step function of `x` whose code changes are at least a
/// bin apart, so a bin holds at most one (checked when the table is built). Within a bin, sign,
/// exponent and top seven mantissa bits are fixed; the change is located by the low sixteen
/// mantissa bits (their complement for negative values, whose order is reversed). NaN (an
/// all-zero block's `0 * (1/0)`) gets the search's own code for NaN. The CUDA 8-bit kernel reads
/// these entries from shared memory: one load per code instead of a search.
#[derive(Debug, Clone, PartialEq)]
pub struct StateCodeTable {
    /// Per bin (positive bins, then negative ones): the code of its smallest value in bits
    /// 0..8, and in bits 8..25 the key (see [`code_key`]) from which values take the next code
    /// (`0x10000`: none).
    pub bins: Vec<u32>,
    /// The code of NaN.
    pub nan_code: u8,
}

/// The bin of `x` in a [`StateCodeTable`] (the GPU kernel computes the same from the bits).
#[inline]
pub fn code_bin(x: f32) -> usize {
    let bits = x.to_bits();
    let magnitude = (bits & 0x7fff_ffff).min(0x4000_0000);
    let bin = if magnitude < 0x3400_0000 {
        0
    } else {
        ((magnitude - 0x3400_0000) >> 16) as usize + 1
    };
    if bits >> 31 == 1 {
        CODE_BINS_PER_SIGN + bin
    } else {
        bin
    }
}

/// The position of `x` within its bin, increasing with `x`: the low sixteen mantissa bits, or
/// their complement for a negative `x`.
#[inline]
pub fn code_key(x: f32) -> u32 {
    let bits = x.to_bits();
    let low = bits & 0xffff;
    if bits >> 31 == 1 {
        0xffff - low
    } else {
        low
    }
}

impl StateCodeTable {
    /// The table of `quantize_state_code(map, signed, ·)`.
    ///
    /// # Panics
    /// If a bin holds more than one code change (not so for bitsandbytes' dynamic maps; a test
    /// builds both tables and checks them against the search).
    pub fn new(map: &QuantizationMap, signed: bool) -> StateCodeTable {
        match StateCodeTable::try_new(map, signed) {
            Ok(table) => table,
            Err(reason) => panic!("{reason}"),
        }
    }

    /// [`StateCodeTable::new`], or why this map has none (a bin with more than one code change).
    pub fn try_new(map: &QuantizationMap, signed: bool) -> Result<StateCodeTable, String> {
        let code = |x: f32| quantize_state_code(map, signed, x);
        let mut bins = vec![0u32; 2 * CODE_BINS_PER_SIGN];
        for bin in 0..CODE_BINS_PER_SIGN {
            // Magnitudes of the bin: [start, end) in bits.
            let start = match bin {
                0 => 0,
                _ => 0x3400_0000 + ((bin as u32 - 1) << 16),
            };
            let end = match bin {
                0 => 0x3400_0000,
                b if b == CODE_BINS_PER_SIGN - 1 => 0x7f80_0001,
                _ => start + (1 << 16),
            };
            for negative in [false, true] {
                // The value at key `key` of a regular bin (keys run over the low 16 bits).
                let at = |key: u32| {
                    if negative {
                        -f32::from_bits(start + (0xffff - key))
                    } else {
                        f32::from_bits(start + key)
                    }
                };
                let (lowest, highest) = if negative {
                    (-f32::from_bits(end - 1), -f32::from_bits(start))
                } else {
                    (f32::from_bits(start), f32::from_bits(end - 1))
                };
                let base = code(lowest);
                let changes = code(highest) - base;
                let step_key = match changes {
                    0 => NO_STEP,
                    1 if bin != 0 && bin != CODE_BINS_PER_SIGN - 1 => {
                        // The smallest key whose code passes the base.
                        let (mut lo, mut hi) = (0u32, 0xffffu32);
                        while lo < hi {
                            let mid = (lo + hi) / 2;
                            if code(at(mid)) > base {
                                hi = mid;
                            } else {
                                lo = mid + 1;
                            }
                        }
                        lo
                    }
                    _ => {
                        return Err(format!(
                            "bin {bin} (negative {negative}) holds {changes} code changes"
                        ))
                    }
                };
                let idx = if negative {
                    CODE_BINS_PER_SIGN + bin
                } else {
                    bin
                };
                bins[idx] = u32::from(base) | (step_key << 8);
            }
        }
        Ok(StateCodeTable {
            bins,
            nan_code: code(f32::NAN),
        })
    }

    /// The table of `map` (signed or not) for the host kernels, built at its first use and
    /// kept for the process (a few distinct maps; past 16 a table is built per call), or `None`
    /// for a map with no table, which the kernels then search.
    pub(crate) fn shared(map: &QuantizationMap, signed: bool) -> Option<Arc<StateCodeTable>> {
        type Entry = ([u32; MAP_LEN], bool, Option<Arc<StateCodeTable>>);
        static BUILT: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
        let key = map.map(f32::to_bits);
        let mut built = BUILT.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, _, table)) = built.iter().find(|(k, s, _)| *k == key && *s == signed) {
            return table.clone();
        }
        let table = StateCodeTable::try_new(map, signed).ok().map(Arc::new);
        if built.len() < 16 {
            built.push((key, signed, table.clone()));
        }
        table
    }

    /// The code of `x`: through `table` when there is one, else by the search.
    #[inline]
    pub(crate) fn code_or_search(
        table: Option<&StateCodeTable>,
        map: &QuantizationMap,
        signed: bool,
        x: f32,
    ) -> u8 {
        match table {
            Some(table) => table.code(x),
            None => quantize_state_code(map, signed, x),
        }
    }

    /// `quantize_state_code(map, signed, x)` through the table.
    #[inline]
    pub fn code(&self, x: f32) -> u8 {
        if x.is_nan() {
            return self.nan_code;
        }
        let entry = self.bins[code_bin(x)];
        let base = (entry & 0xff) as u8;
        base + u8::from(code_key(x) >= entry >> 8)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Floats in value order as integers (both zeros are 0), and back.
    fn ordered_key(x: f32) -> i64 {
        let bits = x.to_bits();
        let magnitude = i64::from(bits & 0x7fff_ffff);
        if bits >> 31 == 1 {
            -magnitude
        } else {
            magnitude
        }
    }

    fn from_ordered_key(key: i64) -> f32 {
        let magnitude = f32::from_bits(key.unsigned_abs() as u32);
        if key < 0 {
            -magnitude
        } else {
            magnitude
        }
    }

    /// The table gives the search's code for every float near a code change (±4096 ulps) or a
    /// bin edge (±64), for a stride through all floats in [-2, 2], for both zeros and NaN; the
    /// search is monotone there too. The signed map's negative entries are exactly its first
    /// 127 (what the CUDA kernel's sign guard relies on).
    #[test]
    fn code_table_equals_the_search() {
        for signed in [true, false] {
            let map = dynamic_map(signed);
            let table = StateCodeTable::new(&map, signed);
            let check = |key: i64| {
                let x = from_ordered_key(key);
                let want = quantize_state_code(&map, signed, x);
                assert_eq!(table.code(x), want, "signed {signed}, x {x:e}");
                let next = from_ordered_key(key + 1);
                assert!(
                    quantize_state_code(&map, signed, next) >= want,
                    "not monotone at {x:e}"
                );
            };
            let (lowest, highest) = (ordered_key(-2.0), ordered_key(2.0));
            // Code changes: where the search's code differs from the previous float's.
            let mut changes = Vec::new();
            let mut key = lowest;
            while key < highest {
                let step = 1 << 12;
                let (a, b) = (
                    from_ordered_key(key),
                    from_ordered_key((key + step).min(highest)),
                );
                if quantize_state_code(&map, signed, a) != quantize_state_code(&map, signed, b) {
                    changes.push(key + step / 2);
                }
                key += step;
            }
            assert!(changes.len() >= 200, "{} code changes found", changes.len());
            for key in changes {
                (key - 4096..key + 4096).for_each(check);
            }
            for bin in 0..=CODE_BINS_PER_SIGN as i64 {
                let edge = 0x3400_0000 + ((bin - 1).max(0) << 16);
                (edge - 64..edge + 64).for_each(check);
                (-edge - 64..-edge + 64).for_each(check);
            }
            (lowest..highest).step_by(4099).for_each(check);
            for x in [
                0.0f32,
                -0.0,
                1.0,
                -1.0,
                f32::MIN_POSITIVE,
                1.0 + f32::EPSILON,
            ] {
                assert_eq!(table.code(x), quantize_state_code(&map, signed, x), "{x:e}");
            }
            assert_eq!(
                table.code(f32::NAN),
                quantize_state_code(&map, signed, f32::NAN)
            );
        }
        let signed = dynamic_map(true);
        for (code, value) in signed.iter().enumerate() {
            assert_eq!(
                value.is_sign_negative(),
                code < 127,
                "entry {code}: {value}"
            );
        }
    }
}
