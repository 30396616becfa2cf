//! A rule of your own: [`ElementwiseRule`], an update in which each element of a parameter
//! depends only on the same element of its gradient and of its state tensors (SGD with sign
//! updates, Lion, RMSprop, Adam without AMSGrad). You write the update of one element, in f32;
//! the crate's drivers run it as a [`GroupOptimizer`](crate::GroupOptimizer) over parameter
//! groups, with every [`Implementation`](crate::Implementation), state dicts and schedulers.
//!
//! What the drivers do with it, on the host:
//! - parameters of f32, bf16 or f16 (a group may mix them), their gradients and state tensors of
//!   the parameter's dtype, zero before the first step; each element loaded to f32 exactly and
//!   each result stored rounded to nearest-even once
//!   ([`ParamElement`](crate::kernels::ParamElement));
//! - the fused form unscales each gradient element by a host-valued [`Scaling`](crate::Scaling)
//!   (`g / scale`, in f32) before the update, in blocks on rayon's threads;
//! - single and foreach run the same update parameter by parameter: an element-wise update has
//!   no ops to split, so it needs no temporaries, and every form gives the same bits.
//!
//! On a CUDA device the rule runs a kernel you bring ([`ElementwiseRule::cuda_kernel`]): PTX,
//! launched once per call over a table of [`ElementPiece`]s (its layout is documented there),
//! whatever the implementation. Without one, a CUDA step is an
//! [`OptimError::Unsupported`]. A GradScaler's device tensors are not read (the constants are
//! computed on the host from its step numbers): the optimizer refuses a
//! [`Scaling::Device`](crate::Scaling::Device) on CUDA for such a rule.
//!
//! It sits on the rule traits (`rule.rs`) and the host driver (`driver.rs`); the CUDA entry is
//! `cuda/elementwise.rs`.

use headroom_autograd_core::{Element, Tensor};
use rayon::prelude::*;

use crate::driver::{host_step_floats, Form, HostKernels, FLOATS};
use crate::error::OptimError;
use crate::host::{host_slice, host_slice_mut, zeros_like};
use crate::kernels::{ParamElement, PARALLEL_CHUNK};
use crate::rule::{SavedTensors, UpdateRule};
use crate::step::{NamedTensors, RuleCall, StepItem};

/// The most state tensors an [`ElementwiseRule`] keeps per parameter.
pub const MAX_ELEMENT_STATES: usize = 4;

/// The f32 constants an [`ElementPiece`] carries to a CUDA kernel.
pub const KERNEL_CONSTS: usize = 8;

/// An update rule defined by the update of one element: the per-element function on the host,
/// and optionally a CUDA kernel of the same update. Every implementor is an
/// [`UpdateRule`](crate::UpdateRule) (a blanket implementation), so
/// `GroupOptimizer::<MyRule>::new(groups, implementation)` is an optimizer of it.
///
/// SGD with sign updates, `p ← p − lr·sign(g)`, checked against a hand-written loop:
///
/// ```
/// use headroom_autograd_core::Tensor;
/// use headroom_ops_cpu::CpuBackend;
/// use headroom_optim::{
///     ElementwiseRule, GroupOptimizer, Implementation, Optimizer, OptimError, ParamGroup,
/// };
///
/// #[derive(Debug, Clone)]
/// struct SignSgd {
///     lr: f64,
/// }
///
/// impl ElementwiseRule for SignSgd {
///     const NAME: &'static str = "SignSgd";
///     const STATES: &'static [&'static str] = &[];
///     type Consts = f32;
///
///     fn lr(&self) -> f64 {
///         self.lr
///     }
///     fn set_lr(&mut self, lr: f64) {
///         self.lr = lr;
///     }
///     fn consts(&self, _step: u64) -> f32 {
///         self.lr as f32
///     }
///     fn update(lr: &f32, param: f32, grad: f32, _states: &mut [f32]) -> f32 {
///         if grad == 0.0 { param } else { param - lr * grad.signum() }
///     }
/// }
///
/// let cpu = CpuBackend::new_ref();
/// let values = [1.0f32, -2.0, 0.5];
/// let grads = [0.25f32, -3.0, 0.0];
/// for implementation in [Implementation::Fused, Implementation::FOREACH, Implementation::Single] {
///     let param = Tensor::from_slice(&cpu, &values, &[3])?;
///     param.set_grad(Some(Tensor::from_slice(&cpu, &grads, &[3])?))?;
///     let mut opt = GroupOptimizer::new(
///         vec![ParamGroup::new(vec![param.clone()], SignSgd { lr: 0.1 })],
///         implementation,
///     )?;
///     opt.step()?;
///     let by_hand: Vec<f32> = values
///         .iter()
///         .zip(&grads)
///         .map(|(&p, &g)| if g == 0.0 { p } else { p - 0.1f32 * g.signum() })
///         .collect();
///     assert_eq!(param.to_vec::<f32>()?, by_hand);
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// `examples/custom_rule` writes Lion (one state tensor) the same way and checks the fused and
/// foreach forms against a hand-written loop, bit for bit, in f32 and bf16.
pub trait ElementwiseRule: Clone + std::fmt::Debug + Send + Sync + 'static {
    /// Name used in errors and state dicts.
    const NAME: &'static str;
    /// The names of the state tensors each parameter keeps (at most [`MAX_ELEMENT_STATES`]),
    /// in the order [`ElementwiseRule::update`] gets their elements: each like the parameter
    /// (its shape and dtype), zero before the first step.
    const STATES: &'static [&'static str];
    /// What one parameter's update at one step needs besides its elements (learning rate, bias
    /// corrections, ...), computed once per parameter and step by [`ElementwiseRule::consts`].
    type Consts: Copy + Send + Sync;

    /// Checks the hyperparameters (nothing by default).
    fn validate(&self) -> Result<(), OptimError> {
        Ok(())
    }
    /// The learning rate.
    fn lr(&self) -> f64;
    /// Sets the learning rate (what schedulers call).
    fn set_lr(&mut self, lr: f64);
    /// The constants of step `step` (counted from 1) of a parameter.
    fn consts(&self, step: u64) -> Self::Consts;
    /// One element's update: the parameter's value and its gradient's (unscaled), both in f32,
    /// and the element's state values (one per [`ElementwiseRule::STATES`], in f32, updated in
    /// place); returns the parameter's new value.
    fn update(consts: &Self::Consts, param: f32, grad: f32, states: &mut [f32]) -> f32;

    /// The rule's CUDA kernel, if it has one (`None` by default: CUDA parameters are an
    /// [`OptimError::Unsupported`] at each step).
    fn cuda_kernel(&self) -> Option<ElementKernel> {
        None
    }
    /// The constants as the CUDA kernel reads them ([`ElementPiece`]'s `consts`); zeros by
    /// default.
    fn kernel_consts(consts: &Self::Consts) -> [f32; KERNEL_CONSTS] {
        let _ = consts;
        [0.0; KERNEL_CONSTS]
    }
}

/// The CUDA kernel of an [`ElementwiseRule`]: PTX text (built by you, e.g. `nvcc -ptx`) and the
/// names of its entry points.
///
/// Each launch updates every parameter of one call (one group, one dtype) in one go: the kernel
/// `kernels[0]` (f32 parameters), `kernels[1]` (bf16) or `kernels[2]` (f16) runs with `threads`
/// threads a block over a table of [`ElementPiece`]s, one per parameter, and takes
/// `(const ElementPiece* pieces, unsigned n_pieces, unsigned long long block_elems,
/// const float* grad_scale, const float* found_inf)`; the last two are always null (a device
/// scaling is refused). Block `b` works on the piece `i` with the largest `first_block <= b`
/// (pieces are sorted by it; a binary search finds it) and updates its elements
/// `[(b - first_block) * block_elems, min((b - first_block + 1) * block_elems, len))`;
/// `block_elems` is a multiple of `4 * threads` and at most `max_block_elems`. Each element
/// loads the parameter, gradient and states of the parameter's type, computes in f32 (dividing
/// the gradient by `grad_scale` when `flags & 1`), and stores each value rounded to
/// nearest-even once — as [`ElementwiseRule::update`] does on the host, so that the two agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElementKernel {
    /// A name for the PTX module, unique in the process (the backend keeps modules by name).
    pub module: &'static str,
    /// The PTX text.
    pub ptx: &'static str,
    /// The entry points for f32, bf16 and f16 parameters (an unused one may repeat another: the
    /// optimizer admits only the dtypes you step).
    pub kernels: [&'static str; 3],
    /// Threads a block.
    pub threads: u32,
    /// The most elements a block updates (a multiple of `4 * threads`).
    pub max_block_elems: u64,
}

/// The layout of one table entry an [`ElementKernel`] reads: 120 bytes, little-endian, as this
/// C struct (its first four fields are `PieceHead` of `kernels/optim.cuh`, the header of the
/// crate's own kernels, whose `find_piece` does the binary search):
///
/// ```c
/// struct ElementPiece {
///     unsigned long long len;          // elements of the parameter
///     unsigned long long first_block;  // its first block in the launch
///     unsigned long long skipped;      // always 0 (no device skip counter)
///     unsigned long long step;         // the step number (from 1) the consts are of
///     unsigned long long param, grad;  // device addresses, of the parameter's type
///     unsigned long long states[4];    // the state tensors in `STATES` order, 0 past them
///     float consts[8];                 // `ElementwiseRule::kernel_consts` of this step
///     float grad_scale;                // a host-valued scale, 1 without one
///     unsigned flags;                  // 1: divide each gradient element by `grad_scale`
/// };
/// ```
///
/// The Rust type exists for its documentation and its size; the table is written field by
/// field.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct ElementPiece {
    /// Elements of the parameter.
    pub len: u64,
    /// Its first block in the launch.
    pub first_block: u64,
    /// Always 0: no device skip counter.
    pub skipped: u64,
    /// The step number (from 1) the constants are of.
    pub step: u64,
    /// The parameter's device address.
    pub param: u64,
    /// The gradient's device address.
    pub grad: u64,
    /// The state tensors' device addresses, in [`ElementwiseRule::STATES`] order, 0 past them.
    pub states: [u64; MAX_ELEMENT_STATES],
    /// [`ElementwiseRule::kernel_consts`] of this step.
    pub consts: [f32; KERNEL_CONSTS],
    /// A host-valued gradient scale, 1 without one.
    pub grad_scale: f32,
    /// 1: divide each gradient element by `grad_scale`.
    pub flags: u32,
}

/// An [`ElementwiseRule`]'s state of one parameter: its tensors in
/// [`ElementwiseRule::STATES`] order.
#[derive(Debug)]
pub struct ElementwiseState {
    tensors: Vec<Tensor>,
}

impl ElementwiseState {
    /// The state tensors, in [`ElementwiseRule::STATES`] order.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }
}

impl<E: ElementwiseRule> UpdateRule for E {
    type State = ElementwiseState;
    const NAME: &'static str = E::NAME;
    const DTYPES: &'static [headroom_autograd_core::DType] = FLOATS;

    fn validate(&self) -> Result<(), OptimError> {
        if E::STATES.len() > MAX_ELEMENT_STATES {
            return Err(OptimError::InvalidArgument {
                op: E::NAME,
                reason: format!(
                    "{} state tensors, at most {MAX_ELEMENT_STATES}",
                    E::STATES.len()
                ),
            });
        }
        ElementwiseRule::validate(self)
    }

    fn lr(&self) -> f64 {
        ElementwiseRule::lr(self)
    }

    fn set_lr(&mut self, lr: f64) {
        ElementwiseRule::set_lr(self, lr);
    }

    fn init_state(&self, param: &Tensor) -> Result<ElementwiseState, OptimError> {
        let tensors = E::STATES.iter().map(|_| zeros_like(param));
        Ok(ElementwiseState {
            tensors: tensors.collect::<Result<_, _>>()?,
        })
    }

    fn state_tensors(state: &ElementwiseState) -> NamedTensors {
        E::STATES
            .iter()
            .copied()
            .zip(state.tensors.iter().cloned())
            .collect()
    }

    fn state_from_tensors(&self, saved: &mut SavedTensors) -> Result<ElementwiseState, OptimError> {
        let tensors = E::STATES.iter().map(|name| saved.take_like(name));
        Ok(ElementwiseState {
            tensors: tensors.collect::<Result<_, _>>()?,
        })
    }

    fn host_step(&self, call: RuleCall<'_, '_, ElementwiseState>) -> Result<(), OptimError> {
        host_step_floats(self, call)
    }
}

/// One parameter's elements on the host: its step, parameter, gradient and states.
pub(crate) struct ElementSlices<'a, T> {
    step: u64,
    param: &'a mut [T],
    grad: &'a [T],
    states: Vec<&'a mut [T]>,
}

impl<E: ElementwiseRule, T: ParamElement + Element> HostKernels<T> for E {
    type Buffers<'a> = ElementSlices<'a, T>;
    /// Every form runs the one update, parameter by parameter.
    const FOREACH_KERNEL: bool = false;

    unsafe fn buffers<'a>(item: &'a StepItem<'_, ElementwiseState>) -> ElementSlices<'a, T> {
        // SAFETY: forwarded from the caller (the states are this rule's tensors, like the
        // parameter).
        unsafe {
            ElementSlices {
                step: item.step,
                param: host_slice_mut(item.param),
                grad: host_slice(&item.grad),
                states: item
                    .state
                    .tensors
                    .iter()
                    .map(|t| host_slice_mut(t))
                    .collect(),
            }
        }
    }

    /// No temporaries.
    fn scratch_len(_param: &Tensor) -> usize {
        0
    }

    fn run(&self, bufs: ElementSlices<'_, T>, form: Form<'_, T>) -> Result<(), OptimError> {
        let scale = match form {
            Form::Single(_) => None,
            Form::Fused(scaling) => scaling.grad_scale,
        };
        update_elements::<E, T>(&self.consts(bufs.step), bufs, scale);
        Ok(())
    }
}

/// `E::update` on every element of one parameter, each gradient element divided by `scale` when
/// given; on the calling thread for a small parameter, else in blocks on rayon's threads.
fn update_elements<E: ElementwiseRule, T: ParamElement>(
    consts: &E::Consts,
    bufs: ElementSlices<'_, T>,
    scale: Option<f32>,
) {
    let run = |block: ElementSlices<'_, T>| {
        let ElementSlices {
            param,
            grad,
            mut states,
            ..
        } = block;
        let mut values = [0.0f32; MAX_ELEMENT_STATES];
        let values = &mut values[..states.len()];
        for (i, (p, g)) in param.iter_mut().zip(grad).enumerate() {
            for (value, state) in values.iter_mut().zip(states.iter()) {
                *value = state[i].to_f32();
            }
            let g = match scale {
                Some(s) => g.to_f32() / s,
                None => g.to_f32(),
            };
            *p = T::from_f32(E::update(consts, p.to_f32(), g, values));
            for (value, state) in values.iter().zip(states.iter_mut()) {
                state[i] = T::from_f32(*value);
            }
        }
    };
    if bufs.param.len() < 2 * PARALLEL_CHUNK {
        run(bufs);
        return;
    }
    let ElementSlices {
        step,
        param,
        grad,
        mut states,
    } = bufs;
    let mut state_blocks: Vec<_> = states
        .iter_mut()
        .map(|s| s.chunks_mut(PARALLEL_CHUNK))
        .collect();
    let blocks: Vec<ElementSlices<'_, T>> = param
        .chunks_mut(PARALLEL_CHUNK)
        .zip(grad.chunks(PARALLEL_CHUNK))
        .map(|(param, grad)| ElementSlices {
            step,
            param,
            grad,
            states: state_blocks
                .iter_mut()
                .map(|blocks| blocks.next().expect("a state is as long as its parameter"))
                .collect(),
        })
        .collect();
    blocks.into_par_iter().for_each(run);
}
