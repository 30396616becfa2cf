//! The CUDA driver of the rules whose kernels are a fused multi-tensor kernel and PyTorch's
//! foreach passes over piece tables (SGD and Adam): the kernel instance of the parameters'
//! dtype, the pieces' addresses, and the choice between one fused launch and the passes
//! (chunked foreach, or single: one parameter at a time), written once.
//!
//! A rule plugs in through [`PieceKernels`]: its kernel names, its state's addresses, its pass
//! ops and how it writes a piece (`cuda/sgd.rs`, `cuda/adam.rs`), whose `CudaKernels::cuda_step`
//! calls [`step`]. The launches themselves are [`CudaDevice`]'s (`run_fused`, `run_unfused`);
//! nothing here knows an algorithm.

use super::launch::{address, geometry, instance, CudaDevice, Module, PassOps};
use super::table::{PieceHead, Table};
use crate::error::OptimError;
use crate::rule::UpdateRule;
use crate::step::{Implementation, RuleCall};

/// The addresses of one piece (a parameter, or a range of one): parameter, gradient, up to
/// three state buffers and the temporary (0: none).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    pub(crate) param: u64,
    pub(crate) grad: u64,
    pub(crate) states: [u64; 3],
    pub(crate) tmp: u64,
}

impl Span {
    /// The span of the elements from `start` of a parameter whose buffers (of `elem`-byte
    /// elements) are `self`, with temporary `tmp`.
    fn at(self, start: usize, elem: u64, tmp: u64) -> Span {
        let offset = start as u64 * elem;
        let shift = |a: u64| if a == 0 { 0 } else { a + offset };
        Span {
            param: shift(self.param),
            grad: shift(self.grad),
            states: self.states.map(shift),
            tmp,
        }
    }
}

/// A rule's pieces for the multi-tensor driver.
pub(crate) trait PieceKernels: UpdateRule {
    /// The PTX module of the kernels.
    const MODULE: Module;
    /// The fused kernel's f32, bf16 and f16 instances.
    const FUSED_KERNELS: [&'static str; 3];
    /// The pass kernel's f32, bf16 and f16 instances.
    const PASS_KERNELS: [&'static str; 3];
    /// Elements and threads per block of the fused kernel.
    const FUSED_BLOCK: (u64, u32);
    /// Whether the fused kernel takes a CUDA graph's replay index after the found-inf flag and
    /// reads its step from it, so a step inside a capture replays right (else it refuses one).
    const REPLAYED: bool;

    /// The device addresses of a state's buffers (0: none).
    fn state_addresses(state: &Self::State) -> [u64; 3];
    /// The pass ops of a foreach or single step, in launch order.
    fn pass_ops(&self) -> PassOps;
    /// Writes the piece of `span` (a host-valued gradient scale when given).
    fn write_piece(&self, table: &mut Table, head: PieceHead, span: Span, grad_scale: Option<f32>);
}

/// The CUDA entry of a [`PieceKernels`] rule (its `CudaKernels::cuda_step`): one fused launch for
/// all of a call's parameters, or the passes.
pub(crate) fn step<R: PieceKernels>(
    rule: &R,
    device: &mut CudaDevice,
    call: RuleCall<'_, '_, R::State>,
) -> Result<(), OptimError> {
    let RuleCall {
        implementation,
        items,
        scaling,
    } = call;
    let Some(first) = items.first() else {
        return Ok(());
    };
    let like = first.param.clone();
    let dtype = like.dtype();
    let elem = dtype.size_in_bytes() as u64;
    let geometry = geometry(items);
    let spans: Vec<Span> = items
        .iter()
        .map(|it| Span {
            param: address(it.param),
            grad: address(&it.grad),
            states: R::state_addresses(it.state),
            tmp: 0,
        })
        .collect();
    if implementation == Implementation::Fused {
        let grad_scale = scaling.host().grad_scale;
        return device.run_fused(
            (R::MODULE, instance(dtype, R::FUSED_KERNELS)),
            &geometry,
            R::FUSED_BLOCK,
            (scaling, R::REPLAYED),
            &mut |table, idx, head| rule.write_piece(table, head, spans[idx], grad_scale),
        );
    }
    let lens: Vec<usize> = geometry.iter().map(|g| g.len).collect();
    device.run_unfused(
        (R::MODULE, instance(dtype, R::PASS_KERNELS)),
        &like,
        &lens,
        implementation.foreach_bound(),
        &rule.pass_ops(),
        &mut |table, idx, range, tmp, first_block| {
            let head = PieceHead {
                len: range.len() as u64,
                first_block,
                skipped: 0,
                step: geometry[idx].step,
            };
            let span = spans[idx].at(range.start, elem, tmp);
            rule.write_piece(table, head, span, None);
        },
    )
}
