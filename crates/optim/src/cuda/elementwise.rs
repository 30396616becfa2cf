//! The CUDA entry of every [`ElementwiseRule`]: one launch of the rule's own kernel
//! ([`ElementwiseRule::cuda_kernel`]) over a table of [`ElementPiece`]s, one per parameter of the
//! call, whatever the implementation (an element-wise update has one form). The pieces carry the
//! constants the host computes for each parameter's step ([`ElementwiseRule::kernel_consts`]),
//! so a GradScaler's device tensors are not read (the rule says so, and the optimizer refuses
//! them); a host-valued scale travels in the piece.
//!
//! It sits on the launch layer (`launch.rs`, `table.rs`) and the rule's front end
//! (`elementwise.rs`); the kernel is the user's.

use super::launch::{address, geometry, instance, CudaDevice, Module};
use super::table::{flags, PieceHead, Table};
use crate::elementwise::{
    ElementPiece, ElementwiseRule, ElementwiseState, KERNEL_CONSTS, MAX_ELEMENT_STATES,
};
use crate::error::OptimError;
use crate::rule::CudaKernels;
use crate::step::RuleCall;

/// Bytes of an [`ElementPiece`].
const PIECE_SIZE: usize = 120;
const _: () = assert!(std::mem::size_of::<ElementPiece>() == PIECE_SIZE);

impl<E: ElementwiseRule> CudaKernels<ElementwiseState> for E {
    const READS_DEVICE_SCALING: bool = false;

    fn cuda_step(
        &self,
        device: &mut CudaDevice,
        call: RuleCall<'_, '_, ElementwiseState>,
    ) -> Result<(), OptimError> {
        let RuleCall { items, scaling, .. } = call;
        let Some(first) = items.first() else {
            return Ok(());
        };
        let Some(kernel) = self.cuda_kernel() else {
            return Err(OptimError::Unsupported {
                optimizer: E::NAME,
                reason: "no CUDA kernel (ElementwiseRule::cuda_kernel)".into(),
            });
        };
        let round = 4 * u64::from(kernel.threads);
        if kernel.threads == 0 || kernel.max_block_elems % round != 0 {
            return Err(OptimError::InvalidArgument {
                op: E::NAME,
                reason: format!(
                    "an ElementKernel's max_block_elems ({}) is a non-zero multiple of 4 × its \
                     threads ({})",
                    kernel.max_block_elems, kernel.threads
                ),
            });
        }
        let name = instance(first.param.dtype(), kernel.kernels);
        let module = Module::User {
            name: kernel.module,
            ptx: kernel.ptx,
        };
        let geometry = geometry(items);
        let grad_scale = scaling.host().grad_scale;
        let pieces: Vec<(u64, u64, [u64; MAX_ELEMENT_STATES], [f32; KERNEL_CONSTS])> = items
            .iter()
            .map(|it| {
                let mut states = [0; MAX_ELEMENT_STATES];
                for (slot, tensor) in states.iter_mut().zip(it.state.tensors()) {
                    *slot = address(tensor);
                }
                let consts = E::kernel_consts(&self.consts(it.step));
                (address(it.param), address(&it.grad), states, consts)
            })
            .collect();
        device.run_fused(
            (module, name),
            &geometry,
            (kernel.max_block_elems, kernel.threads),
            (scaling, false),
            &mut |table, idx, head| write_piece(table, head, pieces[idx], grad_scale),
        )
    }
}

/// Writes an [`ElementPiece`], field by field in its order.
fn write_piece(
    table: &mut Table,
    head: PieceHead,
    (param, grad, states, consts): (u64, u64, [u64; MAX_ELEMENT_STATES], [f32; KERNEL_CONSTS]),
    grad_scale: Option<f32>,
) {
    table.entry(head).u64(param).u64(grad);
    for state in states {
        table.u64(state);
    }
    for value in consts {
        table.f32(value);
    }
    table
        .f32(grad_scale.unwrap_or(1.0))
        .u32(flags::when(grad_scale.is_some(), flags::HOST_SCALED))
        .end(PIECE_SIZE);
}
