//! A GradScaler's overflow check on CUDA (`kernels/grad_scale.cu`): PyTorch's
//! `_amp_foreach_non_finite_check_and_unscale_` as one launch per element type present, for any
//! number of gradients, over a gradient table (`grads.rs`). The flag is set in device memory and
//! never read here: no host synchronisation. The semantics and the checks are `grad_scale.rs`'s.

use headroom_autograd_core::Tensor;
use headroom_ops_cuda::KernelArg;

use super::grads::{grad_table, launch_runs, Run};
use super::launch::{address, CudaDevice, Module};
use crate::error::OptimError;

const CHECK_KERNELS: [&str; 3] = [
    "non_finite_check_f32",
    "non_finite_check_bf16",
    "non_finite_check_f16",
];

/// Sets `found_inf` to 1 where any element of `grads` is NaN or infinite, and with `inv_scale`
/// multiplies every element by it, in one pass (checked by `grad_scale.rs`: contiguous f32, bf16
/// and f16 gradients, one-element f32 flag and scale, all of `device`).
pub(crate) fn non_finite_check(
    device: &mut CudaDevice,
    grads: &[Tensor],
    found_inf: &Tensor,
    inv_scale: Option<&Tensor>,
) -> Result<(), OptimError> {
    let table = grad_table(device, grads)?;
    let base = device.write_table(table.table.bytes())?;
    let tail = |_: &Run| {
        vec![
            KernelArg::U64(address(found_inf)),
            KernelArg::U64(inv_scale.map_or(0, address)),
        ]
    };
    // SAFETY: the check kernels take a gradient table, the flag's address and the scale's (0:
    // none); the table is written at `base`, its gradients are live tensors of this backend, and
    // the flag and scale are live one-element f32 tensors of it.
    unsafe {
        launch_runs(
            device,
            &table,
            base,
            (Module::GradScale, CHECK_KERNELS),
            &tail,
        )
    }
}
