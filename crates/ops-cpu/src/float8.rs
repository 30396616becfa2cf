//! The fp8 quantize on the host ([`Float8Quantize`]): one read of the input for each row's amax,
//! the scales from those (or the delayed ones given), and a second read that writes the codes,
//! with no widened copy of the input. Rows are spread over rayon when the tensor is large.
//!
//! It sits on the element types and host pointers; it knows no recipe (which tensor is scaled
//! along which axis is autograd-core's) and no GEMM (`matmul.rs` multiplies the codes).

use headroom_autograd_core::{
    float8_quantize_dims, DType, Float8Granularity, Float8Quantize, Result, View,
};
use rayon::prelude::*;

use crate::element::{dispatch_float, Scalar};
use crate::strided::HostPtr;

/// The smallest amax a scale is taken against (torchao's `EPS`).
const AMAX_FLOOR: f64 = 1e-12;

/// Tensors with at least this many elements quantize their rows in parallel.
const PARALLEL_ELEMENTS: usize = 1 << 16;

/// A `[len]` view (stride 0 allowed) of an f32 vector, read element by element.
#[derive(Clone, Copy)]
struct Vector {
    ptr: HostPtr<f32>,
    offset: usize,
    stride: usize,
}

impl Vector {
    fn new(view: &View<'_>) -> Vector {
        Vector {
            ptr: HostPtr::new(view),
            offset: view.layout.offset(),
            stride: view.layout.strides()[0],
        }
    }

    fn get(self, index: usize) -> f32 {
        self.ptr.read(self.offset + index * self.stride)
    }
}

/// The largest of some amaxes, NaN if any is.
fn combined(amaxes: &[f64]) -> f64 {
    if amaxes.iter().any(|amax| amax.is_nan()) {
        f64::NAN
    } else {
        amaxes.iter().copied().fold(0.0, f64::max)
    }
}

/// `max_finite / max(amax, floor)` in f64, rounded to f32, then down to a power of two if asked
/// (clearing the mantissa of a positive normal f32 is `2^floor(log2 scale)`); NaN stays NaN.
fn scale_from(amax: f64, max_finite: f64, power_of_two: bool) -> f32 {
    if amax.is_nan() {
        return f32::NAN;
    }
    let scale = (max_finite / amax.max(AMAX_FLOOR)) as f32;
    if power_of_two && scale.is_normal() {
        f32::from_bits(scale.to_bits() & 0xff80_0000)
    } else {
        scale
    }
}

pub(crate) fn quantize_float8(args: Float8Quantize<'_>) -> Result<()> {
    let (rows, cols) = float8_quantize_dims(&args)?;
    if args.codes.dtype == DType::F8E4M3 {
        dispatch_float!(args.x.dtype, "quantize_float8", T => {
            quantize_typed::<T, float8::F8E4M3>(&args, rows, cols)
        });
    } else {
        dispatch_float!(args.x.dtype, "quantize_float8", T => {
            quantize_typed::<T, float8::F8E5M2>(&args, rows, cols)
        });
    }
    Ok(())
}

fn quantize_typed<T: Scalar, Q: Scalar>(args: &Float8Quantize<'_>, rows: usize, cols: usize) {
    let max_finite = args.codes.dtype.max_finite().unwrap_or(f64::from(f32::MAX));
    let x = HostPtr::<T>::new(&args.x);
    let (x_offset, x_strides) = (args.x.layout.offset(), args.x.layout.strides());
    let (row_stride, col_stride) = (x_strides[0], x_strides[1]);
    let premultiply = args.premultiply.as_ref().map(Vector::new);
    // The value the codes are taken from, and what its amax is taken over: f32(x) (times the
    // premultiplier, an f32 product), with x itself for the amax when nothing multiplies it.
    let value = |row: usize, col: usize| -> (f32, f64) {
        let raw = Scalar::to_f64(x.read(x_offset + row * row_stride + col * col_stride));
        match premultiply {
            Some(vector) => {
                let product = raw as f32 * vector.get(col);
                (product, f64::from(product))
            }
            None => (raw as f32, raw),
        }
    };
    let row_amax = |row: usize| -> f64 {
        let mut amax = 0.0f64;
        for col in 0..cols {
            let magnitude = value(row, col).1.abs();
            if magnitude.is_nan() {
                return f64::NAN;
            }
            amax = amax.max(magnitude);
        }
        amax
    };
    let parallel = rows * cols >= PARALLEL_ELEMENTS && rows > 1;
    let amaxes: Vec<f64> = if parallel {
        (0..rows).into_par_iter().map(row_amax).collect()
    } else {
        (0..rows).map(row_amax).collect()
    };
    // Each group's amax: the rows' own, or all of them for one scale.
    let group_amaxes: Vec<f64> = match args.granularity {
        Float8Granularity::Tensorwise => vec![combined(&amaxes)],
        Float8Granularity::Rowwise => amaxes,
    };
    if let Some(amax_out) = &args.amax {
        let (out, base) = HostPtr::<f32>::with_offset(amax_out);
        for (group, &amax) in group_amaxes.iter().enumerate() {
            out.write(base + group, amax as f32);
        }
    }
    let scales: Vec<f32> = match &args.delayed_scale {
        Some(given) => {
            let given = Vector::new(given);
            (0..group_amaxes.len())
                .map(|group| given.get(group))
                .collect()
        }
        None => group_amaxes
            .iter()
            .map(|&amax| scale_from(amax, max_finite, args.power_of_two))
            .collect(),
    };
    let (scale_out, scale_base) = HostPtr::<f32>::with_offset(&args.scale);
    for (index, &scale) in scales.iter().enumerate() {
        scale_out.write(scale_base + index, scale);
    }
    if let Some(inverse_out) = &args.inverse_scale {
        let (out, base) = HostPtr::<f32>::with_offset(inverse_out);
        for (index, &scale) in scales.iter().enumerate() {
            out.write(base + index, inverse_of(scale));
        }
    }
    let (codes, codes_base) = HostPtr::<Q>::with_offset(&args.codes);
    let write_row = |row: usize| {
        let scale = scales[if scales.len() == 1 { 0 } else { row }];
        for col in 0..cols {
            let code = Q::from_f64(f64::from(value(row, col).0 * scale));
            codes.write(codes_base + row * cols + col, code);
        }
    };
    if parallel {
        (0..rows).into_par_iter().for_each(write_row);
    } else {
        (0..rows).for_each(write_row);
    }
}

/// `1 / scale`, correctly rounded (an f32 division), the canonical NaN for a NaN scale (as the
/// GPU writes it, whatever the NaN's payload).
fn inverse_of(scale: f32) -> f32 {
    if scale.is_nan() {
        f32::from_bits(0x7fc0_0000)
    } else {
        1.0 / scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Power-of-two rounding is `2^floor(log2 scale)` (torchao's `exp2(floor(log2(s)))`), exact
    /// powers stay, and NaN (a NaN amax) stays NaN.
    #[test]
    fn power_of_two_scales_round_down() {
        assert_eq!(scale_from(3.5, 448.0, true), 128.0);
        assert_eq!(scale_from(3.0, 448.0, true), 128.0); // 149.33 -> 128
        assert_eq!(scale_from(0.75, 448.0, true), 512.0); // 597.33 -> 512
        assert_eq!(scale_from(3.0, 448.0, false), (448.0f64 / 3.0) as f32);
        assert_eq!(scale_from(0.0, 448.0, false), (448.0 / AMAX_FLOOR) as f32);
        assert!(scale_from(f64::NAN, 448.0, true).is_nan());
        for exponent in -100..40 {
            let amax = 448.0 * 2f64.powi(-exponent) * 0.999;
            let want = 2f32.powi(exponent);
            assert_eq!(scale_from(amax, 448.0, true), want, "2^{exponent}");
        }
    }
}
