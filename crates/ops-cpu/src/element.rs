//! Element types as the kernels see them: storage types, their compute types, and dispatch.
//!
//! [`Float`] is a storage type of a floating-point dtype with the type it is computed in
//! (f32 for f32, f16 and bf16; f64 for f64); [`Real`] is the math a compute type offers.
//! [`Scalar`] covers all eight dtypes for copies, casts and fills, going through f64.
//! The `dispatch_float!` and `dispatch_any!` macros turn a run-time [`DType`] into a type.
//! Nothing here knows about layouts or threads.

use half::{bf16, f16};
use headroom_autograd_core::DType;

/// Math on a compute type (f32 or f64).
pub(crate) trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    fn from_f64(value: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn tanh(self) -> Self;
    fn erf(self) -> Self;
    fn powf(self, exponent: Self) -> Self;
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    fn from_f64(value: f64) -> Self {
        value as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn exp(self) -> Self {
        f32::exp(self)
    }
    fn ln(self) -> Self {
        f32::ln(self)
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn tanh(self) -> Self {
        f32::tanh(self)
    }
    fn erf(self) -> Self {
        libm::erff(self)
    }
    fn powf(self, exponent: Self) -> Self {
        f32::powf(self, exponent)
    }
}

impl Real for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    fn from_f64(value: f64) -> Self {
        value
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn ln(self) -> Self {
        f64::ln(self)
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn tanh(self) -> Self {
        f64::tanh(self)
    }
    fn erf(self) -> Self {
        libm::erf(self)
    }
    fn powf(self, exponent: Self) -> Self {
        f64::powf(self, exponent)
    }
}

/// A floating-point storage type and the type it is computed in.
pub(crate) trait Float: Copy + Send + Sync + 'static {
    type C: Real;
    fn load(self) -> Self::C;
    fn store(value: Self::C) -> Self;
}

impl Float for f32 {
    type C = f32;
    fn load(self) -> f32 {
        self
    }
    fn store(value: f32) -> Self {
        value
    }
}

impl Float for f64 {
    type C = f64;
    fn load(self) -> f64 {
        self
    }
    fn store(value: f64) -> Self {
        value
    }
}

impl Float for f16 {
    type C = f32;
    fn load(self) -> f32 {
        self.to_f32()
    }
    fn store(value: f32) -> Self {
        f16::from_f32(value)
    }
}

impl Float for bf16 {
    type C = f32;
    fn load(self) -> f32 {
        self.to_f32()
    }
    fn store(value: f32) -> Self {
        bf16::from_f32(value)
    }
}

/// One byte per element, read as 0 or 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct BoolByte(pub(crate) u8);

/// Any storage type, converted through f64 (exact for every dtype but large i64).
pub(crate) trait Scalar: Copy + Send + Sync + 'static {
    fn to_f64(self) -> f64;
    fn from_f64(value: f64) -> Self;
}

macro_rules! scalar_as {
    ($($ty:ty),*) => {$(
        impl Scalar for $ty {
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn from_f64(value: f64) -> Self {
                value as $ty
            }
        }
    )*};
}
scalar_as!(f32, f64, i64, i32, u8);

/// `value` rounded to f32 toward zero with the lowest mantissa bit set when inexact (round to
/// odd), so that rounding the result to nearest-even in a float of 13 or more fewer mantissa bits
/// (bf16, f16) gives `value` rounded to nearest-even directly. half's `from_f64` drops the f64's
/// low 32 mantissa bits before rounding (bf16 always, f16 without the F16C path), which turns an
/// f32 whose bits past bf16's are `0x8001..=0x8007` into a tie and rounds it down.
fn round_to_odd_f32(value: f64) -> f32 {
    let nearest = value as f32;
    if !value.is_finite() || f64::from(nearest) == value {
        return nearest;
    }
    let toward_zero = if f64::from(nearest).abs() > value.abs() {
        f32::from_bits(nearest.to_bits() - 1)
    } else {
        nearest
    };
    f32::from_bits(toward_zero.to_bits() | 1)
}

impl Scalar for f16 {
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn from_f64(value: f64) -> Self {
        f16::from_f32(round_to_odd_f32(value))
    }
}

impl Scalar for bf16 {
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn from_f64(value: f64) -> Self {
        bf16::from_f32(round_to_odd_f32(value))
    }
}

/// The 8-bit floats round to nearest-even from the f64 itself and saturate at their largest
/// finite value (float8's `from_f64`, cuda_fp8.hpp's conversion with `__NV_SATFINITE`).
impl Scalar for float8::F8E4M3 {
    fn to_f64(self) -> f64 {
        float8::F8E4M3::to_f64(&self)
    }
    fn from_f64(value: f64) -> Self {
        float8::F8E4M3::from_f64(value)
    }
}
impl Scalar for float8::F8E5M2 {
    fn to_f64(self) -> f64 {
        float8::F8E5M2::to_f64(&self)
    }
    fn from_f64(value: f64) -> Self {
        float8::F8E5M2::from_f64(value)
    }
}

impl Scalar for BoolByte {
    fn to_f64(self) -> f64 {
        f64::from(u8::from(self.0 != 0))
    }
    fn from_f64(value: f64) -> Self {
        BoolByte(u8::from(value != 0.0))
    }
}

/// Runs `$body` with `$T` bound to the storage type of a floating-point `$dtype`; other dtypes
/// return `UnsupportedDtype` for `$op`.
macro_rules! dispatch_float {
    ($dtype:expr, $op:expr, $T:ident => $body:expr) => {
        match $dtype {
            headroom_autograd_core::DType::F32 => {
                type $T = f32;
                $body
            }
            headroom_autograd_core::DType::F64 => {
                type $T = f64;
                $body
            }
            headroom_autograd_core::DType::F16 => {
                type $T = half::f16;
                $body
            }
            headroom_autograd_core::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            dtype => {
                return Err(headroom_autograd_core::TensorError::UnsupportedDtype { op: $op, dtype })
            }
        }
    };
}

/// Runs `$body` with `$T` bound to the storage type of any `$dtype`.
macro_rules! dispatch_any {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            headroom_autograd_core::DType::F32 => {
                type $T = f32;
                $body
            }
            headroom_autograd_core::DType::F64 => {
                type $T = f64;
                $body
            }
            headroom_autograd_core::DType::F16 => {
                type $T = half::f16;
                $body
            }
            headroom_autograd_core::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            headroom_autograd_core::DType::I64 => {
                type $T = i64;
                $body
            }
            headroom_autograd_core::DType::I32 => {
                type $T = i32;
                $body
            }
            headroom_autograd_core::DType::U8 => {
                type $T = u8;
                $body
            }
            headroom_autograd_core::DType::Bool => {
                type $T = $crate::element::BoolByte;
                $body
            }
            headroom_autograd_core::DType::F8E4M3 => {
                type $T = float8::F8E4M3;
                $body
            }
            headroom_autograd_core::DType::F8E5M2 => {
                type $T = float8::F8E5M2;
                $body
            }
        }
    };
}

pub(crate) use {dispatch_any, dispatch_float};

/// Whether `dtype` is stored in one byte read as a truth value (masks).
pub(crate) fn is_mask(dtype: DType) -> bool {
    matches!(dtype, DType::Bool | DType::U8)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Conversions to bf16 and f16 round to nearest-even from the value itself: an f32 just
    /// above a bf16 tie rounds up (half's `from_f64` made it a tie and rounded down), exact ties
    /// go to even, f64 values round once, and overflow, NaN and tiny values keep their meaning.
    #[test]
    fn narrow_floats_round_to_nearest_even_from_the_value() {
        let above_tie = f32::from_bits(0xbf6c_8007);
        assert_eq!(
            bf16::from_f64(f64::from(above_tie)).to_bits(),
            0xbf6c,
            "half's own"
        );
        assert_eq!(
            <bf16 as Scalar>::from_f64(f64::from(above_tie)).to_bits(),
            0xbf6d
        );
        assert_eq!(bf16::from_f32(above_tie).to_bits(), 0xbf6d);
        for bits in [
            0x3f80_8000u32,
            0x3f81_8000,
            0x3f80_7fff,
            0x3f80_8001,
            0xc2c8_8003,
        ] {
            let x = f32::from_bits(bits);
            assert_eq!(
                <bf16 as Scalar>::from_f64(f64::from(x)).to_bits(),
                bf16::from_f32(x).to_bits(),
                "{bits:#x}"
            );
            assert_eq!(
                <f16 as Scalar>::from_f64(f64::from(x)).to_bits(),
                f16::from_f32(x).to_bits(),
                "{bits:#x}"
            );
        }
        // An f64 a hair above a bf16 tie (below f32's resolution) rounds up, not to even.
        let tie = f64::from(f32::from_bits(0x3f80_8000));
        assert_eq!(<bf16 as Scalar>::from_f64(tie).to_bits(), 0x3f80);
        assert_eq!(<bf16 as Scalar>::from_f64(tie + 1e-12).to_bits(), 0x3f81);
        assert_eq!(<bf16 as Scalar>::from_f64(1e300).to_bits(), 0x7f80);
        assert!(<bf16 as Scalar>::from_f64(f64::NAN).is_nan());
        assert_eq!(<bf16 as Scalar>::from_f64(-1e-300).to_bits(), 0x8000);
    }

    /// Every code of both 8-bit floats reads back to itself through f64, but NaN (which stays
    /// NaN) and E5M2's infinities, which the saturating cast takes to the largest finite value.
    #[test]
    fn every_float8_code_round_trips() {
        for bits in 0..=u8::MAX {
            let e4m3 = float8::F8E4M3::from_bits(bits);
            let back = <float8::F8E4M3 as Scalar>::from_f64(Scalar::to_f64(e4m3));
            if bits & 0x7f == 0x7f {
                assert!(Scalar::to_f64(back).is_nan(), "e4m3 {bits:#x}");
            } else {
                assert_eq!(back.to_bits(), bits, "e4m3 {bits:#x}");
            }
            let e5m2 = float8::F8E5M2::from_bits(bits);
            let value = Scalar::to_f64(e5m2);
            let back = <float8::F8E5M2 as Scalar>::from_f64(value);
            if value.is_nan() {
                assert!(Scalar::to_f64(back).is_nan(), "e5m2 {bits:#x}");
            } else if value.is_infinite() {
                assert_eq!(
                    Scalar::to_f64(back),
                    57344.0f64.copysign(value),
                    "e5m2 {bits:#x}"
                );
            } else {
                assert_eq!(back.to_bits(), bits, "e5m2 {bits:#x}");
            }
        }
    }

    /// Casting a tensor into the 8-bit floats on the CPU backend: nearest-even ties, saturation
    /// at the largest finite value (torchao's `to_fp8_saturated`; PyTorch's plain `.to()` gives
    /// NaN there), subnormals down to the smallest and zero below half of it, signs and NaN
    /// kept; the codes widen to bf16 exactly; and they carry no gradient.
    #[test]
    fn tensors_cast_into_float8_round_to_nearest_even_and_saturate() {
        use headroom_autograd_core::Tensor;
        let cpu = crate::CpuBackend::new_ref();
        let sub = 2f64.powi(-9); // E4M3's smallest subnormal
        let cases: [(DType, &[(f64, f64)]); 2] = [
            (
                DType::F8E4M3,
                &[
                    (1.0625, 1.0),
                    (1.1875, 1.25),
                    (1.07, 1.125),
                    (448.0, 448.0),
                    (460.0, 448.0),
                    (1e6, 448.0),
                    (-1e6, -448.0),
                    (sub, sub),
                    (0.75 * sub, sub),
                    (0.5 * sub, 0.0),
                    (-3.0, -3.0),
                ],
            ),
            (
                DType::F8E5M2,
                &[
                    (1.125, 1.0),
                    (1.375, 1.5),
                    (57344.0, 57344.0),
                    (1e6, 57344.0),
                    (-1e9, -57344.0),
                    (2f64.powi(-16), 2f64.powi(-16)),
                    (2f64.powi(-18), 0.0),
                ],
            ),
        ];
        for (dtype, pairs) in cases {
            let inputs: Vec<f64> = pairs.iter().map(|&(x, _)| x).collect();
            let x = Tensor::from_f64s(&cpu, &inputs, &[inputs.len()], DType::F32).unwrap();
            let cast = x.to_dtype(dtype).unwrap();
            assert_eq!(cast.dtype(), dtype);
            let got = cast.to_vec_f64().unwrap();
            for (&(input, want), got) in pairs.iter().zip(got) {
                assert_eq!(got, want, "{dtype:?} of {input}");
            }
            assert_eq!(
                dtype.max_finite(),
                Some(pairs.iter().map(|p| p.1).fold(0.0, f64::max))
            );
            let special = Tensor::from_f64s(&cpu, &[f64::NAN, -0.0], &[2], DType::F32).unwrap();
            let special = special.to_dtype(dtype).unwrap().to_vec_f64().unwrap();
            assert!(special[0].is_nan(), "{dtype:?} keeps NaN");
            assert!(
                special[1] == 0.0 && special[1].is_sign_negative(),
                "{dtype:?} keeps -0"
            );
            // Every finite code widens to bf16 exactly.
            let codes: Vec<f64> = (0..=u8::MAX)
                .map(|bits| match dtype {
                    DType::F8E4M3 => float8::F8E4M3::from_bits(bits).to_f64(),
                    _ => float8::F8E5M2::from_bits(bits).to_f64(),
                })
                .filter(|v| v.is_finite())
                .collect();
            let narrow = Tensor::from_f64s(&cpu, &codes, &[codes.len()], dtype).unwrap();
            assert_eq!(
                narrow.to_dtype(DType::BF16).unwrap().to_vec_f64().unwrap(),
                codes
            );
            assert!(!dtype.is_float() && dtype.is_float8());
            assert!(
                narrow.requires_grad_(true).is_err(),
                "{dtype:?} carries no gradient"
            );
        }
    }
}
