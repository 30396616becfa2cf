//! The host driver every rule's host entry runs: what is the same for every rule — element-type
//! dispatch, the scratch of the single and foreach forms, chunking, which form each parameter
//! takes — written once, with each rule supplying only its pieces.
//!
//! A rule's host pieces are [`HostKernels`] for each element type it takes: a parameter's
//! buffers (slices of its tensors), its single and fused kernels, and its foreach kernel if it
//! has one. Its [`UpdateRule::host_step`] is [`host_step_floats`] (f32, bf16 and f16 parameters)
//! or [`host_step`] of its one element type.
//!
//! [`single_or_fused`] is the per-parameter schedule shared by both devices for rules without a
//! foreach kernel (Adafactor, whose update needs whole-tensor norms). Nothing here knows an
//! algorithm or a device API.

use headroom_autograd_core::{DType, Element, Tensor};

use crate::error::OptimError;
use crate::host::{foreach_scratch, host_slice_mut, scratch};
use crate::kernels::{bf16, f16, GradScaling, ParamElement};
use crate::rule::UpdateRule;
use crate::step::{Implementation, RuleCall, StepItem};

/// How one parameter's kernel call runs.
#[derive(Debug)]
pub(crate) enum Form<'s, T> {
    /// The single form, its temporaries in this scratch (at least the rule's `scratch_len`).
    Single(&'s mut [T]),
    /// The fused form, with in-kernel unscale and skip.
    Fused(GradScaling),
}

/// A rule's host kernels for parameters of element type `T`: which slices of a parameter, its
/// gradient and its state go to which `kernels` function.
pub(crate) trait HostKernels<T: ParamElement + Element>: UpdateRule {
    /// One parameter's buffers as the kernels take them, with what they need of its step number.
    type Buffers<'a>;
    /// Whether the rule has a foreach kernel; without one, foreach runs each parameter through
    /// the single or the fused form ([`single_or_fused`]).
    const FOREACH_KERNEL: bool;

    /// The buffers of `item`.
    ///
    /// # Safety
    /// The item's parameter and gradient are checked CPU tensors of `T` (contiguous, disjoint),
    /// its state tensors are this crate's for this parameter, and nothing else reads or writes
    /// them while the buffers live.
    unsafe fn buffers<'a>(item: &'a StepItem<'_, Self::State>) -> Self::Buffers<'a>;

    /// Scratch elements the single form needs for `param`: by default one temporary of its
    /// size (SGD's and Adam's, `kernels::adam_scratch_len`).
    fn scratch_len(param: &Tensor) -> usize {
        param.numel()
    }

    /// One parameter's update in `form`.
    fn run(&self, bufs: Self::Buffers<'_>, form: Form<'_, T>) -> Result<(), OptimError>;

    /// The foreach kernel over parameters that share one scratch.
    fn foreach(&self, bufs: Vec<Self::Buffers<'_>>, scratch: &mut [T]) -> Result<(), OptimError> {
        let _ = (bufs, scratch);
        Err(OptimError::Unsupported {
            optimizer: Self::NAME,
            reason: "no foreach kernel".into(),
        })
    }
}

/// The parameter dtypes of [`host_step_floats`]: a rule's [`UpdateRule::DTYPES`] when it takes
/// them all.
pub(crate) const FLOATS: &[DType] = &[DType::F32, DType::BF16, DType::F16];

/// The host entry of a rule of f32, bf16 and f16 parameters: [`host_step`] for the items' type.
pub(crate) fn host_step_floats<R>(
    rule: &R,
    call: RuleCall<'_, '_, R::State>,
) -> Result<(), OptimError>
where
    R: HostKernels<f32> + HostKernels<bf16> + HostKernels<f16>,
{
    match call.items.first().map(|it| it.param.dtype()) {
        Some(DType::BF16) => host_step::<bf16, R>(rule, call),
        Some(DType::F16) => host_step::<f16, R>(rule, call),
        _ => host_step::<f32, R>(rule, call),
    }
}

/// The host entry of a rule for items of element type `T`: one scratch of the chunk (at most
/// all the items' elements) for a foreach kernel, else each parameter through the single form
/// (a scratch of its own) or the fused form.
pub(crate) fn host_step<T: ParamElement + Element, R: HostKernels<T>>(
    rule: &R,
    call: RuleCall<'_, '_, R::State>,
) -> Result<(), OptimError> {
    let (implementation, items, scaling) = (call.implementation, &*call.items, call.scaling.host());
    if let (Some(chunk), true) = (implementation.foreach_bound(), R::FOREACH_KERNEL) {
        let Some(tmp) = foreach_scratch(items.iter().map(|it| it.param), chunk)? else {
            return Ok(());
        };
        let bufs: Vec<R::Buffers<'_>> = items
            .iter()
            // SAFETY: the optimizer checked each item's parameter and gradient (CPU, of `T`,
            // contiguous, disjoint) and owns the state tensors; the step runs on this thread.
            .map(|it| unsafe { R::buffers(it) })
            .collect();
        // SAFETY: the scratch is a fresh tensor of this call, of `T` (the parameters' dtype).
        return rule.foreach(bufs, unsafe { host_slice_mut(&tmp) });
    }
    let lens: Vec<usize> = items.iter().map(|it| R::scratch_len(it.param)).collect();
    single_or_fused(
        implementation,
        &lens,
        // A rule whose single form needs no scratch (an element-wise rule) gets none.
        &mut |idx| {
            let len = lens[idx];
            (len > 0)
                .then(|| scratch(items[idx].param, len))
                .transpose()
        },
        &mut |idx, tmp| {
            let it = &items[idx];
            // SAFETY: as above, for this item alone.
            let bufs = unsafe { R::buffers(it) };
            let form = match tmp {
                // SAFETY: a fresh scratch tensor of this call, of `T`, used by this call only.
                Some(Some(tmp)) => Form::Single(unsafe { host_slice_mut(tmp) }),
                Some(None) => Form::Single(&mut []),
                None => Form::Fused(scaling),
            };
            rule.run(bufs, form)
        },
    )
}

/// Runs parameter `idx` of a [`single_or_fused`] schedule, with its temporary in the single
/// form, without one in the fused form.
pub(crate) type RunParam<'a, Tmp> = dyn FnMut(usize, Option<&Tmp>) -> Result<(), OptimError> + 'a;

/// The per-parameter schedule of `n = scratch_lens.len()` parameters: `run(idx, Some(tmp))`
/// runs parameter `idx` in the single form with a temporary `alloc(idx)` made, `run(idx, None)`
/// in the fused form.
/// - fused: every parameter fused;
/// - single: every parameter single, each temporary allocated just before its use;
/// - unbounded foreach: every temporary allocated before any is used (as a tensor list is),
///   each freed after its use;
/// - bounded foreach: single where the temporary (`scratch_lens[idx]` elements) fits the
///   chunk, else fused, so temporaries stay bounded.
pub(crate) fn single_or_fused<Tmp>(
    implementation: Implementation,
    scratch_lens: &[usize],
    alloc: &mut dyn FnMut(usize) -> Result<Tmp, OptimError>,
    run: &mut RunParam<'_, Tmp>,
) -> Result<(), OptimError> {
    let n = scratch_lens.len();
    match implementation {
        Implementation::Fused => (0..n).try_for_each(|idx| run(idx, None)),
        Implementation::Single => (0..n).try_for_each(|idx| run(idx, Some(&alloc(idx)?))),
        Implementation::ForeachUnbounded => {
            let temporaries = (0..n).map(&mut *alloc).collect::<Result<Vec<_>, _>>()?;
            for (idx, tmp) in temporaries.into_iter().enumerate() {
                run(idx, Some(&tmp))?;
            }
            Ok(())
        }
        Implementation::Foreach { chunk } => (0..n).try_for_each(|idx| {
            if scratch_lens[idx] <= chunk.get() {
                run(idx, Some(&alloc(idx)?))
            } else {
                run(idx, None)
            }
        }),
    }
}
