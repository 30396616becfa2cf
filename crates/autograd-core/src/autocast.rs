//! The autocast scope: per op, which dtype its floating-point inputs are cast to.
//!
//! Mixed precision in PyTorch's style runs some ops in a low-precision dtype (matrix products,
//! attention), keeps others in f32 (softmax, norms, losses, `exp`/`log`), and gives others the
//! widest dtype of their inputs. Which op does what is a policy: this module owns the scope and
//! the mechanism, the [`AutocastPolicy`] trait says which op does what, and the lists themselves
//! (PyTorch's, pinned to one version) live in the amp crate, not here.
//!
//! A scope is thread-local and nests like the grad-mode guard: [`autocast`] enables a policy
//! until its guard drops, [`autocast_disabled`] turns autocast off inside an enabled scope, and
//! the engine runs every backward with autocast off (backward ops run in the dtypes forward
//! chose). Ops listed in [`AUTOCAST_OPS`] consult the scope where they start: when the policy
//! wants a different dtype for one of their floating-point inputs, they cast it (a recorded
//! `to_dtype`, so gradients flow back in the source dtype) and run on the cast inputs. f64
//! tensors are never cast, as in PyTorch.
//!
//! Casting a parameter (an f32 leaf that requires grad) to the low-precision dtype happens once
//! per scope: the cast copy is cached, keyed by the tensor and by grad mode (so a copy made under
//! `no_grad` never serves a forward that must record), and the cache is dropped when the
//! outermost enabled scope ends. [`autocast_stats`] counts casts, cache hits and the bytes the
//! cache holds. A policy can also name linears (by their weights) that run in fp8
//! with a recipe ([`AutocastPolicy::float8_linear`]): `Tensor::linear` then quantizes its
//! operands as they come (nothing is cast or cached for it) and returns the policy's dtype. This
//! module knows nothing about kernels or about any op list.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use crate::dtype::{DType, Device};
use crate::error::Result;
use crate::ops::Float8Linear;
use crate::tensor::Tensor;

/// What autocast does with an op's floating-point inputs (PyTorch's three lists, and the rest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CastPolicy {
    /// Leave the inputs as they are (ops on no list).
    Keep,
    /// Cast them to the policy's low-precision dtype (PyTorch's `lower_precision_fp` list).
    LowerPrecision,
    /// Cast them to f32 (the `fp32` list).
    Float32,
    /// Cast them to the widest dtype among them (the `promote` list).
    Promote,
}

/// Which op runs in which dtype under autocast. Implemented by the amp crate (PyTorch's lists as
/// data); autograd-core only asks.
pub trait AutocastPolicy: Send + Sync + std::fmt::Debug {
    /// The dtype of [`CastPolicy::LowerPrecision`] (f16 or bf16).
    fn lower_precision(&self) -> DType;
    /// What `op` (a name in [`AUTOCAST_OPS`]) does with floating-point inputs on `device`.
    fn cast_policy(&self, op: &'static str, device: Device) -> CastPolicy;
    /// How a `linear` with this `weight` runs in fp8, if it does
    /// ([`Tensor::linear_float8_with`] or [`Tensor::linear_float8_delayed`] on the operands as
    /// they come, no half-precision copy of them, the output in the dtype `cast_policy` gives a
    /// linear): fp8 training's list of linears, by their weights (amp's `Float8Policy`). None by
    /// default.
    fn float8_linear(&self, weight: &Tensor) -> Option<Float8Linear> {
        let _ = weight;
        None
    }
    /// Whether a later op that saves an fp8 linear's output (tensorwise scales) keeps a recipe
    /// instead of its bytes: backward makes the output again with one fp8 GEMM from the input
    /// codes the linear keeps anyway (attention's q, k and v, a GELU's or SwiGLU's
    /// pre-activation: a 16-bit activation less per save, for a GEMM more). True by default.
    fn float8_rebuilds_outputs(&self) -> bool {
        true
    }
}

/// An optional base policy, as a policy: the base's answers, or no casting and no fp8 when there
/// is none (bf16 its low-precision dtype). Policies that layer a change over whatever scope they
/// are entered in (amp's `Float8Policy`, checkpoint's `Float8Blocks`) delegate to it.
impl AutocastPolicy for Option<Arc<dyn AutocastPolicy>> {
    fn lower_precision(&self) -> DType {
        self.as_ref()
            .map_or(DType::BF16, |base| base.lower_precision())
    }

    fn cast_policy(&self, op: &'static str, device: Device) -> CastPolicy {
        self.as_ref()
            .map_or(CastPolicy::Keep, |base| base.cast_policy(op, device))
    }

    fn float8_linear(&self, weight: &Tensor) -> Option<Float8Linear> {
        self.as_ref().and_then(|base| base.float8_linear(weight))
    }

    fn float8_rebuilds_outputs(&self) -> bool {
        self.as_ref()
            .is_none_or(|base| base.float8_rebuilds_outputs())
    }
}

/// Every op that consults the autocast scope, by the name a policy is asked with. A policy
/// should answer for each (amp's parity test checks its lists against PyTorch's for all of them).
pub const AUTOCAST_OPS: &[&str] = &[
    "matmul",
    "linear",
    "linear_gelu",
    "scaled_dot_product_attention",
    "patch_embedding",
    "softmax",
    "log_softmax",
    "layer_norm",
    "cross_entropy",
    "sum",
    "mean",
    "max",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "tanh",
    "relu",
    "gelu",
    "gelu_tanh",
    "pow",
    "pow_scalar",
    "add",
    "sub",
    "mul",
    "div",
    "cat",
    "embedding",
    "masked_fill",
    "dropout",
];

/// What the cast cache of the current autocast scope did and holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AutocastStats {
    /// Tensors cast since the outermost enabled scope began.
    pub casts: u64,
    /// Parameter casts answered from the cache instead.
    pub cache_hits: u64,
    /// Cast parameters the cache holds now.
    pub cached_tensors: usize,
    /// Bytes of those cast copies.
    pub cached_bytes: u64,
}

#[derive(Default)]
struct ScopeState {
    /// One entry per live guard, innermost last: the policy, or `None` where autocast is off.
    frames: Vec<Option<Arc<dyn AutocastPolicy>>>,
    /// Parameter casts of the outermost enabled scope, by (tensor, dtype, grad mode): the source
    /// (kept alive so its address is not reused) and the cast copy.
    cache: HashMap<(usize, DType, bool), (Tensor, Tensor)>,
    stats: AutocastStats,
}

impl ScopeState {
    fn current(&self) -> Option<Arc<dyn AutocastPolicy>> {
        self.frames.last().cloned().flatten()
    }
}

thread_local! {
    static SCOPE: RefCell<ScopeState> = RefCell::default();
}

/// Runs ops under `policy` on this thread until the guard is dropped. Scopes nest; the innermost
/// decides.
pub fn autocast(policy: Arc<dyn AutocastPolicy>) -> AutocastGuard {
    push(Some(policy))
}

/// Turns autocast off on this thread until the guard is dropped (PyTorch's
/// `autocast(enabled=False)` inside an enabled region).
pub fn autocast_disabled() -> AutocastGuard {
    push(None)
}

/// The policy in force on this thread, if autocast is on.
pub fn autocast_policy() -> Option<Arc<dyn AutocastPolicy>> {
    SCOPE.with(|scope| scope.borrow().current())
}

/// How the policy in force runs the `linear` of `weight` in fp8, if it does
/// ([`AutocastPolicy::float8_linear`]).
pub(crate) fn float8_linear(weight: &Tensor) -> Option<Float8Linear> {
    autocast_policy().and_then(|policy| policy.float8_linear(weight))
}

/// Whether the scope's policy has fp8 linears' saved outputs rebuilt (true outside a scope).
pub(crate) fn float8_rebuilds_outputs() -> bool {
    autocast_policy().is_none_or(|policy| policy.float8_rebuilds_outputs())
}

/// The cast counts and cache of the current outermost enabled scope (all zero outside one).
pub fn autocast_stats() -> AutocastStats {
    SCOPE.with(|scope| scope.borrow().stats)
}

fn push(frame: Option<Arc<dyn AutocastPolicy>>) -> AutocastGuard {
    let depth = SCOPE.with(|scope| {
        let mut scope = scope.borrow_mut();
        scope.frames.push(frame);
        scope.frames.len()
    });
    AutocastGuard {
        depth,
        _not_send: std::marker::PhantomData,
    }
}

/// Restores the autocast state that was in force before it was made, when dropped; dropping the
/// last enabled scope frees the cast cache.
#[derive(Debug)]
#[must_use = "autocast is restored as soon as the guard is dropped"]
pub struct AutocastGuard {
    depth: usize,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        // The cache's tensors are dropped after the borrow ends: freeing them calls into the
        // backend, which must not find this thread's scope borrowed.
        let released = SCOPE.with(|scope| {
            let mut scope = scope.borrow_mut();
            scope.frames.truncate(self.depth - 1);
            if scope.frames.iter().any(Option::is_some) {
                return None;
            }
            scope.stats = AutocastStats::default();
            Some(std::mem::take(&mut scope.cache))
        });
        drop(released);
    }
}

/// The dtype PyTorch's `promote_types` gives two floating-point dtypes.
fn promote(a: DType, b: DType) -> DType {
    match (a, b) {
        _ if a == b => a,
        (DType::F64, _) | (_, DType::F64) => DType::F64,
        _ => DType::F32,
    }
}

/// Whether autocast may cast `tensor`: floating point, not f64.
fn eligible(tensor: &Tensor) -> bool {
    tensor.dtype().is_float() && tensor.dtype() != DType::F64
}

/// The dtype the autocast scope wants the floating-point inputs of `op` in, or `None` when
/// autocast is off or leaves them as they are.
pub(crate) fn autocast_target(op: &'static str, inputs: &[Option<&Tensor>]) -> Option<DType> {
    let policy = autocast_policy()?;
    let device = inputs.iter().flatten().next()?.device();
    Some(match policy.cast_policy(op, device) {
        CastPolicy::Keep => return None,
        CastPolicy::LowerPrecision => policy.lower_precision(),
        CastPolicy::Float32 => DType::F32,
        CastPolicy::Promote => {
            let mut dtypes = inputs.iter().flatten().filter(|t| eligible(t));
            let first = dtypes.next()?.dtype();
            dtypes.fold(first, |acc, t| promote(acc, t.dtype()))
        }
    })
}

/// The inputs of `op` cast as the autocast scope wants them (`None` entries are absent optional
/// inputs, and stay so), or `None` when autocast is off or no input changes: the op then runs on
/// its inputs as they are. Ops call it where they start and, when it answers, run again on the
/// cast inputs, which then need no cast.
pub(crate) fn autocast_inputs(
    op: &'static str,
    inputs: &[Option<&Tensor>],
) -> Result<Option<Vec<Option<Tensor>>>> {
    let (Some(policy), Some(target)) = (autocast_policy(), autocast_target(op, inputs)) else {
        return Ok(None);
    };
    let needs_cast = |t: &Tensor| eligible(t) && t.dtype() != target;
    if !inputs.iter().flatten().any(|t| needs_cast(t)) {
        return Ok(None);
    }
    let cast_one = |input: &Option<&Tensor>| -> Result<Option<Tensor>> {
        Ok(match input {
            Some(t) if needs_cast(t) => Some(cast(t, target, policy.lower_precision())?),
            Some(t) => Some((*t).clone()),
            None => None,
        })
    };
    Ok(Some(inputs.iter().map(cast_one).collect::<Result<_>>()?))
}

/// [`autocast_inputs`] for `N` inputs that are all given.
pub(crate) fn autocast_args<const N: usize>(
    op: &'static str,
    inputs: [&Tensor; N],
) -> Result<Option<[Tensor; N]>> {
    let Some(cast) = autocast_inputs(op, &inputs.map(Some))? else {
        return Ok(None);
    };
    let mut cast = cast.into_iter().flatten();
    Ok(Some(std::array::from_fn(|_| {
        cast.next().expect("every input was given")
    })))
}

/// `tensor` cast to `dtype`, from the scope's cache when it is a parameter cast to the
/// low-precision dtype.
fn cast(tensor: &Tensor, dtype: DType, lower_precision: DType) -> Result<Tensor> {
    let cacheable = dtype == lower_precision
        && tensor.dtype() == DType::F32
        && tensor.is_leaf()
        && tensor.requires_grad()
        && !tensor.is_view();
    if !cacheable {
        let res = tensor.to_dtype(dtype)?;
        SCOPE.with(|scope| scope.borrow_mut().stats.casts += 1);
        return Ok(res);
    }
    let key = (
        Arc::as_ptr(&tensor.inner) as usize,
        dtype,
        crate::grad_mode::is_grad_enabled(),
    );
    let hit = SCOPE.with(|scope| {
        let mut scope = scope.borrow_mut();
        let hit = scope.cache.get(&key).map(|(_, cast)| cast.clone());
        if hit.is_some() {
            scope.stats.cache_hits += 1;
        }
        hit
    });
    if let Some(hit) = hit {
        return Ok(hit);
    }
    let res = tensor.to_dtype(dtype)?;
    SCOPE.with(|scope| {
        let mut scope = scope.borrow_mut();
        scope.stats.casts += 1;
        scope.stats.cached_tensors += 1;
        scope.stats.cached_bytes += (res.numel() * dtype.size_in_bytes()) as u64;
        scope.cache.insert(key, (tensor.clone(), res.clone()));
    });
    Ok(res)
}
