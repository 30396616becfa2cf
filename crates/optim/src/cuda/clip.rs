//! Gradient clipping on CUDA (`kernels/clip.cu`): `clip_grad_norm_` as three launches for any
//! number of gradients — partial reductions, the finishing kernel that leaves the total norm and
//! the clamped coefficient in device memory, the scaling that reads it — and `clip_grad_value_`
//! as one, per element type present. Nothing waits for the device, except the one read of the
//! total that `error_if_nonfinite` asks for (before any gradient changes).
//!
//! The gradients are pieces of one table (`grads.rs`: one run per element type, the blocks
//! numbered across the whole table), so the partials of every run land in one array that the
//! finishing kernel reads piece by piece. The clip's semantics and its checks are `clip/mod.rs`'s.

use headroom_autograd_core::{DType, Tensor};
use headroom_ops_cuda::KernelArg;

use super::grads::{grad_table, launch_runs, Run, THREADS};
use super::launch::{address, CudaDevice, Module};
use crate::clip::norm::{NormClip, NormType};
use crate::error::OptimError;

const PARTIALS_KERNELS: [&str; 3] = [
    "clip_partials_f32",
    "clip_partials_bf16",
    "clip_partials_f16",
];
const SCALE_KERNELS: [&str; 3] = ["clip_scale_f32", "clip_scale_bf16", "clip_scale_f16"];
const VALUE_KERNELS: [&str; 3] = ["clip_value_f32", "clip_value_bf16", "clip_value_f16"];

/// `clip_grad_norm_` of `grads` (checked by `clip/mod.rs`) on `device`.
pub(crate) fn clip_norm(
    device: &mut CudaDevice,
    grads: &[Tensor],
    clip: NormClip,
) -> Result<Tensor, OptimError> {
    let backend = grads[0].backend();
    let clip_table = grad_table(device, grads)?;
    let (n_pieces, n_blocks) = (clip_table.n_pieces, clip_table.n_blocks);
    let total = Tensor::empty(backend, &[1], DType::F32)?;
    // Partials, then the pieces' norms, then the coefficient (an f32 in the last slot).
    let scratch = Tensor::empty(backend, &[n_blocks as usize + n_pieces + 1], DType::F64)?;
    let partials = address(&scratch);
    let piece_norms = partials + n_blocks * 8;
    let coef = piece_norms + n_pieces as u64 * 8;
    let norm_type = KernelArg::I32(match clip.norm_type {
        NormType::L2 => 0,
        NormType::Inf => 1,
    });
    let base = device.write_table(clip_table.table.bytes())?;
    let partials_tail = |_: &Run| vec![norm_type, KernelArg::U64(partials)];
    // SAFETY: the partial kernels take a gradient table and these tail arguments; the table is
    // written at `base`, and the partials slice of the scratch holds one f64 per block.
    unsafe {
        launch_runs(
            device,
            &clip_table,
            base,
            (Module::Clip, PARTIALS_KERNELS),
            &partials_tail,
        )
    }?;
    let finish_args = [
        KernelArg::U64(base),
        KernelArg::U32(n_pieces as u32),
        KernelArg::U64(n_blocks),
        norm_type,
        KernelArg::F32(clip.max_norm),
        KernelArg::U64(partials),
        KernelArg::U64(piece_norms),
        KernelArg::U64(address(&total)),
        KernelArg::U64(coef),
    ];
    // SAFETY: `clip_finish` takes these parameters; the table is written at `base`, the partials
    // were written by the launches before it in stream order, and the scratch and total tensors
    // hold the slots it writes.
    unsafe { device.launch(Module::Clip, "clip_finish", 1, THREADS, &finish_args) }?;
    if clip.error_if_nonfinite {
        // The one host synchronisation: PyTorch reads the norm here too, before any gradient
        // changes.
        let total = total.to_vec::<f32>()?[0];
        if clip.rejects(total) {
            return Err(OptimError::NonFiniteNorm {
                norm_type: clip.norm_type,
                total,
            });
        }
    }
    let scale_tail = |_: &Run| vec![KernelArg::U64(coef)];
    // SAFETY: the scaling kernels take a gradient table and the coefficient's address, which
    // `clip_finish` wrote in the scratch (alive until after this launch is queued).
    unsafe {
        launch_runs(
            device,
            &clip_table,
            base,
            (Module::Clip, SCALE_KERNELS),
            &scale_tail,
        )
    }?;
    // The scratch is freed in stream order, after the launches that read it.
    drop(scratch);
    Ok(total)
}

/// `clip_grad_value_` of `grads` (checked by `clip/mod.rs`) on `device`.
pub(crate) fn clip_value(
    device: &mut CudaDevice,
    grads: &[Tensor],
    clip_value: f32,
) -> Result<(), OptimError> {
    let clip_table = grad_table(device, grads)?;
    let base = device.write_table(clip_table.table.bytes())?;
    // PyTorch rounds a clamp's scalar bounds to the tensor's type.
    let bounds = |run: &Run| {
        let bound = |value: f32| match run.dtype {
            DType::BF16 => half::bf16::from_f32(value).to_f32(),
            DType::F16 => half::f16::from_f32(value).to_f32(),
            _ => value,
        };
        vec![
            KernelArg::F32(bound(-clip_value)),
            KernelArg::F32(bound(clip_value)),
        ]
    };
    // SAFETY: the clamping kernels take a gradient table and the two bounds; the table is
    // written at `base`.
    unsafe {
        launch_runs(
            device,
            &clip_table,
            base,
            (Module::Clip, VALUE_KERNELS),
            &bounds,
        )
    }
}
