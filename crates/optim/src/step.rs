//! The step vocabulary: the words an optimizer step is made of, which every other module of the
//! crate speaks — how a rule's update runs ([`Implementation`]), which parameters a step updates
//! ([`ParamId`], [`StepParams`]), how their gradients are scaled ([`Scaling`],
//! [`DeviceGradScaling`]), and what a rule's kernels receive ([`StepItem`], [`RuleCall`]).
//!
//! It sits on autograd-core's tensors and the raw kernels' [`GradScaling`]; it knows no rule, no
//! device and no optimizer (those import it: it is the bottom of the tensor layer).

use std::num::NonZeroUsize;

use headroom_autograd_core::Tensor;

use crate::kernels::GradScaling;

/// Elements of temporaries the bounded foreach implementation holds at once by default:
/// 4 Mi f32 = 16 MiB. PyTorch's foreach holds one temporary of the size of all parameters
/// (4 GB for a 1e9-parameter model); 16 MiB keeps each op's pass long enough to stream at full
/// memory bandwidth while staying far below the 64 MB budget of issue 5.
pub const DEFAULT_FOREACH_CHUNK: usize = 1 << 22;

/// How a rule's update runs; results agree to the bit, memory and passes differ. A rule may
/// lack some (8-bit Adam's blockwise kernel is one pass: `Fused` only); asking for one it lacks
/// is an [`OptimError::Unsupported`](crate::OptimError::Unsupported).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Implementation {
    /// One parameter at a time, op by op (temporaries of one parameter).
    Single,
    /// Op by op across all parameters of a group, temporaries bounded by `chunk` elements.
    Foreach {
        /// Elements of temporaries held at once.
        chunk: NonZeroUsize,
    },
    /// Op by op across all parameters of a group at once, as PyTorch's foreach does: ~1×
    /// the parameters' size in temporaries.
    ForeachUnbounded,
    /// One pass per element, no temporaries; the only implementation that takes a gradient
    /// [`Scaling`].
    Fused,
}

impl Implementation {
    /// Foreach with the default bound ([`DEFAULT_FOREACH_CHUNK`] elements).
    pub const FOREACH: Implementation = Implementation::Foreach {
        chunk: NonZeroUsize::new(DEFAULT_FOREACH_CHUNK).expect("a non-zero constant"),
    };

    /// `Some(Some(chunk))` for bounded foreach, `Some(None)` for unbounded foreach, `None` for
    /// the single and fused forms.
    pub(crate) fn foreach_bound(self) -> Option<Option<usize>> {
        match self {
            Implementation::Foreach { chunk } => Some(Some(chunk.get())),
            Implementation::ForeachUnbounded => Some(None),
            Implementation::Single | Implementation::Fused => None,
        }
    }
}

/// A parameter's state tensors by name (`exp_avg`, `momentum_buffer`, `state1`, ...).
pub type NamedTensors = Vec<(&'static str, Tensor)>;

/// A parameter's handle in one optimizer, resolved once (with
/// [`Optimizer::param_id`](crate::Optimizer::param_id) or
/// [`Optimizer::params`](crate::Optimizer::params)): its index in the optimizer's parameter
/// table, in registration order. Stepping by handle costs the parameter's own work, never a
/// search among all parameters.
///
/// ```
/// use headroom_autograd_core::{DType, Tensor};
/// use headroom_ops_cpu::CpuBackend;
/// use headroom_optim::{
///     Implementation, Optimizer, ParamGroup, Scaling, Sgd, SgdConfig, StepParams,
/// };
///
/// let cpu = CpuBackend::new_ref();
/// let (a, b) = (
///     Tensor::from_slice(&cpu, &[1.0f32, 2.0], &[2])?,
///     Tensor::from_slice(&cpu, &[3.0f32], &[1])?,
/// );
/// let mut sgd = Sgd::new(
///     vec![ParamGroup::new(vec![a.clone(), b.clone()], SgdConfig::new(0.5))],
///     Implementation::Fused,
/// )?;
/// let id_b = sgd.param_id(&b)?; // One search, at registration.
/// assert_eq!(id_b.index(), 1);
/// a.set_grad(Some(Tensor::from_slice(&cpu, &[1.0f32, 1.0], &[2])?))?;
/// b.set_grad(Some(Tensor::from_slice(&cpu, &[1.0f32], &[1])?))?;
/// // Only `b` steps, although `a` has a gradient too.
/// sgd.step_with(StepParams::Only(&[id_b]), Scaling::None)?;
/// assert_eq!(b.to_vec::<f32>()?, [2.5]);
/// assert_eq!(a.to_vec::<f32>()?, [1.0, 2.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(pub(crate) usize);

impl ParamId {
    /// The parameter's position among all of the optimizer's parameters (groups in order, then
    /// parameters in their group's order).
    pub fn index(self) -> usize {
        self.0
    }
}

/// Which parameters a step updates (those of them that have a gradient).
///
/// ```
/// use headroom_autograd_core::Tensor;
/// use headroom_ops_cpu::CpuBackend;
/// use headroom_optim::{
///     Adam, AdamConfig, Implementation, Optimizer, ParamGroup, Scaling, StepParams,
/// };
///
/// let cpu = CpuBackend::new_ref();
/// let params: Vec<Tensor> = (0..4)
///     .map(|i| Tensor::from_slice(&cpu, &[i as f32; 8], &[8]))
///     .collect::<Result<_, _>>()?;
/// let mut adam = Adam::new(
///     vec![ParamGroup::new(params.clone(), AdamConfig::adamw())],
///     Implementation::Fused,
/// )?;
/// for param in &params {
///     param.set_grad(Some(Tensor::from_slice(&cpu, &[0.1f32; 8], &[8])?))?;
/// }
/// // A bucket of two parameters, in one call (as an optimizer-in-backward hook steps it).
/// let ids: Vec<_> = adam.params().into_iter().map(|(id, _)| id).collect();
/// adam.step_with(StepParams::Only(&ids[2..]), Scaling::None)?;
/// assert_eq!((adam.param_step(0, 1)?, adam.param_step(0, 2)?), (0, 1));
/// // Then everything else that has a gradient.
/// adam.step_with(StepParams::All, Scaling::None)?;
/// assert_eq!((adam.param_step(0, 1)?, adam.param_step(0, 2)?), (1, 2));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub enum StepParams<'a> {
    /// Every parameter of the optimizer.
    All,
    /// These parameters (each at most once), by handle.
    Only(&'a [ParamId]),
}

/// A GradScaler's scale and found-inf flag in device memory: f32 tensors of one element on the
/// parameters' device. The fused and 8-bit CUDA kernels read them, so a step needs no host
/// synchronisation; with the flag set nothing is written, and the device counts the skipped step
/// so the next bias corrections use the right step number. On the CPU the host kernels read the
/// two values in place (host memory: no transfer, nothing to wait for).
#[derive(Debug, Clone, Default)]
pub struct DeviceGradScaling {
    /// The loss scale the gradients carry.
    pub grad_scale: Option<Tensor>,
    /// Non-zero when some gradient overflowed this step.
    pub found_inf: Option<Tensor>,
}

/// How the gradients of a step are scaled (a GradScaler's loss scale and overflow flag).
/// Anything but `None` needs the [`Implementation::Fused`] form, whose kernels unscale each
/// gradient element in registers and skip on overflow.
#[derive(Debug, Clone, Copy)]
pub enum Scaling<'a> {
    /// The gradients are the true gradients.
    None,
    /// Values the host holds (any device): a set `found_inf` skips the step before any kernel
    /// runs ([`StepOutcome::Skipped`](crate::kernels::StepOutcome::Skipped)).
    Host(GradScaling),
    /// Tensors on the parameters' device: the CUDA kernels read them, so nothing waits for the
    /// device, and a skipped step is counted there and does not advance the step numbers; on the
    /// CPU the host kernels read the values in place (host memory) and a skip is as for `Host`.
    Device(&'a DeviceGradScaling),
}

impl Scaling<'_> {
    /// Whether gradients are scaled or a skip flag is given at all.
    pub(crate) fn is_scaled(&self) -> bool {
        match self {
            Scaling::None => false,
            Scaling::Host(scaling) => *scaling != GradScaling::NONE,
            Scaling::Device(scaling) => scaling.grad_scale.is_some() || scaling.found_inf.is_some(),
        }
    }

    /// The host values (`NONE` without scaling, and for device scaling, which only the CUDA
    /// kernels read).
    pub(crate) fn host(&self) -> GradScaling {
        match self {
            Scaling::Host(scaling) => *scaling,
            Scaling::None | Scaling::Device(_) => GradScaling::NONE,
        }
    }
}

/// A parameter handed to a rule's kernels: one entry of a step.
#[derive(Debug)]
pub struct StepItem<'a, S> {
    /// Step number (1-based) this update is, as the host counts it (steps the device skipped
    /// under a [`DeviceGradScaling`] are subtracted by the kernels).
    pub step: u64,
    /// The parameter's slot (its [`ParamId`] index, device skip counter and random stream).
    pub slot: usize,
    /// The parameter.
    pub param: &'a Tensor,
    /// Its gradient.
    pub grad: Tensor,
    /// Its state.
    pub state: &'a mut S,
}

/// One call of a rule's kernels: parameters of one group and one dtype with their gradients and
/// states, the implementation, and how the gradients are scaled (checked by the optimizer; a
/// host-valued skip never gets here).
#[derive(Debug)]
pub struct RuleCall<'c, 'a, S> {
    /// How the update runs.
    pub implementation: Implementation,
    /// The parameters, each at most once.
    pub items: &'c mut [StepItem<'a, S>],
    /// How the gradients are scaled.
    pub scaling: Scaling<'c>,
}
