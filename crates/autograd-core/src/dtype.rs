//! Element types and devices as run-time values.
//!
//! Mixed precision needs the dtype of a tensor to be data, not a type parameter, so [`DType`] is
//! an enum that every op and backend primitive dispatches on. [`Device`] says where a tensor's
//! storage lives; it is a plain value and knows nothing about how a device is driven.
//!
//! The two 8-bit floats are storage formats (fp8 training keeps a linear's saved input and its
//! weight's per-use copy in them, with a scale beside): they cast to and from the other dtypes,
//! copy and fill, and carry no gradients. Casts into them round to nearest-even and saturate at
//! the format's largest finite value (what torchao's `to_fp8_saturated` and cuBLAS's
//! `__nv_cvt_*_to_fp8(…, __NV_SATFINITE, …)` give); NaN stays NaN.

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary64.
    F64,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 64-bit integer (indices, targets).
    I64,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned byte.
    U8,
    /// Boolean, one byte per element (masks).
    Bool,
    /// OCP 8-bit float E4M3 (PyTorch's `float8_e4m3fn`: no infinities, largest finite 448).
    F8E4M3,
    /// OCP 8-bit float E5M2 (PyTorch's `float8_e5m2`: IEEE-like, largest finite 57344).
    F8E5M2,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 | DType::Bool | DType::F8E4M3 | DType::F8E5M2 => 1,
        }
    }

    /// Whether values of this dtype can carry gradients.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// Whether this is one of the 8-bit float storage formats.
    pub fn is_float8(self) -> bool {
        matches!(self, DType::F8E4M3 | DType::F8E5M2)
    }

    /// The largest finite value of a float dtype (f64 for f64; `None` for integers and `Bool`):
    /// the `max` of PyTorch's `torch.finfo`, which fp8 scales are taken against.
    pub fn max_finite(self) -> Option<f64> {
        Some(match self {
            DType::F64 => f64::MAX,
            DType::F32 => f32::MAX as f64,
            DType::F16 => half::f16::MAX.to_f64(),
            DType::BF16 => half::bf16::MAX.to_f64(),
            // Written out: float8 0.7's `MAX` constants are one code short (416 and 49152).
            DType::F8E4M3 => 448.0,
            DType::F8E5M2 => 57344.0,
            DType::I64 | DType::I32 | DType::U8 | DType::Bool => return None,
        })
    }
}

/// Where a tensor's storage lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// A CUDA device, by ordinal.
    Cuda(usize),
}

/// The dtype statistics (mean, rstd, log-sum-exp) are kept in for inputs of `dtype`: f64 for
/// f64, f32 for everything else.
pub(crate) fn stats_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}
