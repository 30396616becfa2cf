//! Element types and devices as run-time values.
//!
//! Mixed precision needs the dtype of a tensor to be data, not a type parameter, so [`DType`] is
//! an enum that every op and backend primitive dispatches on. [`Device`] says where a tensor's
//! storage lives; it is a plain value and knows nothing about how a device is driven.

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
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 | DType::Bool => 1,
        }
    }

    /// Whether values of this dtype can carry gradients.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
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
