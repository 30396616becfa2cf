//! Adafactor on CUDA.

use super::CudaDevice;
use crate::adafactor::AdafactorState;
use crate::device::StepScaling;
use crate::error::OptimError;
use crate::kernels::AdafactorConfig;
use crate::optimizer::{Implementation, StepItem};

pub(crate) fn step(
    _device: &mut CudaDevice,
    _cfg: &AdafactorConfig,
    _implementation: Implementation,
    _items: &mut [StepItem<'_, AdafactorState>],
    _scaling: StepScaling<'_>,
) -> Result<(), OptimError> {
    Err(OptimError::Unsupported {
        optimizer: "Adafactor",
        reason: "not on CUDA yet".into(),
    })
}
