//! fp8 training's policy (issue 37): the linears it lists, by their weights, run
//! autograd-core's `linear_float8_with` under one `Float8Recipe` (E4M3 forward; tensorwise
//! scales with E5M2 output gradients by default, or rowwise power-of-two scales with E4M3 ones;
//! current scales, or delayed ones from a `Float8History` per linear; the input saved as one
//! byte an element) on their operands as they come — an f32
//! weight is quantized from itself, with no bf16 copy in autocast's cache — and return the base
//! policy's dtype; every other op runs as the base policy says (an [`AmpPolicy`](crate::AmpPolicy) for bf16 autocast around them, or none). torchao's
//! `convert_to_float8_training(model, module_filter_fn=...)` picks modules; here the filter
//! takes parameter names, so no module is swapped and the weights stay the optimizer's.
//!
//! It sits on autograd-core's autocast seam (`AutocastPolicy::float8_linear`) and knows no
//! kernel.

use std::fmt;
use std::sync::Arc;

use headroom_autograd_core::{
    autocast, AutocastGuard, AutocastPolicy, CastPolicy, DType, Device, Float8History,
    Float8Linear, Float8Recipe, Tensor,
};

use crate::error::AmpError;

/// Whether `view` is `base.t()`: the same buffer, offset and elements, dims swapped.
fn is_transpose_of(view: &Tensor, base: &Tensor) -> bool {
    let (shape, strides) = (base.shape(), base.strides());
    base.ndim() == 2
        && Arc::ptr_eq(view.buffer(), base.buffer())
        && view.layout().offset() == base.layout().offset()
        && view.shape() == [shape[1], shape[0]]
        && view.strides() == [strides[1], strides[0]]
}

/// Runs the listed linears in fp8 under a base autocast policy (see the module docs).
///
/// ```
/// use headroom_amp::{AmpPolicy, Float8Policy};
/// use headroom_autograd_core::{DType, Tensor};
/// use headroom_ops_cpu::CpuBackend;
///
/// let cpu = CpuBackend::new_ref();
/// let w1 = Tensor::full(&cpu, &[8, 8], 0.125, DType::F32)?;
/// let w2 = Tensor::full(&cpu, &[8, 8], 0.125, DType::F32)?;
/// let params = [("fc1.weight".to_string(), w1.clone()), ("head.weight".to_string(), w2.clone())];
/// // Every linear but the head in fp8, the rest of the model in bf16 autocast.
/// let policy = Float8Policy::new(Some(AmpPolicy::torch_cuda(DType::BF16)?))
///     .with_linears(params.iter().map(|(n, t)| (n.as_str(), t)), |name| !name.starts_with("head"));
/// assert_eq!(policy.linears(), 1);
/// let x = Tensor::ones(&cpu, &[4, 8], DType::F32)?;
/// let y = {
///     let _fp8 = policy.enter();
///     x.linear(&w1, None)?.linear(&w2, None)? // fc1 in fp8, head in bf16
/// };
/// assert_eq!(y.dtype(), DType::BF16);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Float8Policy {
    base: Option<Arc<dyn AutocastPolicy>>,
    /// Each listed weight, with its amax history under delayed scaling.
    linears: Vec<(Tensor, Option<Arc<Float8History>>)>,
    recipe: Float8Recipe,
    /// The history length of delayed scaling, when on.
    delayed: Option<usize>,
    /// Whether saved outputs of the listed linears are rebuilt in backward.
    rebuilds_outputs: bool,
}

impl Float8Policy {
    /// No fp8 linears yet, every op as `base` says (or as it is, without one).
    pub fn new(base: Option<impl AutocastPolicy + 'static>) -> Float8Policy {
        Float8Policy {
            base: base.map(|policy| Arc::new(policy) as Arc<dyn AutocastPolicy>),
            linears: Vec::new(),
            recipe: Float8Recipe::TENSORWISE,
            delayed: None,
            rebuilds_outputs: true,
        }
    }

    /// Scales every listed linear (listed before or after) by the last `history` amaxes of each
    /// of its tensors instead of their current amax: tensorwise, E5M2 gradients, one
    /// [`Float8History`] per linear (see there). `history` 0 is an error.
    pub fn with_delayed_scaling(mut self, history: usize) -> Result<Float8Policy, AmpError> {
        Float8History::new(history)?;
        self.delayed = Some(history);
        for (_, slot) in &mut self.linears {
            *slot = Some(Float8History::new(history)?);
        }
        Ok(self)
    }

    /// The amax history of a listed linear's weight under delayed scaling.
    pub fn history(&self, weight: &Tensor) -> Option<Arc<Float8History>> {
        self.listed(weight).and_then(|(_, history)| history.clone())
    }

    /// The entry of `weight`: the listed tensor itself, or its transpose as a view of the same
    /// memory (what a `Conv1D` passes to `linear`: GPT-2 stores its weights `[in, out]`).
    fn listed(&self, weight: &Tensor) -> Option<&(Tensor, Option<Arc<Float8History>>)> {
        self.linears
            .iter()
            .find(|(listed, _)| listed.same_tensor(weight) || is_transpose_of(weight, listed))
    }

    fn list(&mut self, weight: &Tensor) {
        let history = self
            .delayed
            .map(|len| Float8History::new(len).expect("checked by with_delayed_scaling"));
        self.linears.push((weight.clone(), history));
    }

    /// Whether a later op that saves a listed linear's output keeps a recipe instead of its
    /// bytes (default true, tensorwise scales): backward makes the output again with one fp8
    /// GEMM from the input codes the linear keeps for its weight gradient. On GPT-2 that drops
    /// attention's q, k and v and the MLP's pre-activation from what a block keeps, for two fp8
    /// GEMMs more in backward; false keeps them. The step's values and gradients are the same
    /// bits either way.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use headroom_amp::{AmpPolicy, Float8Policy};
    /// use headroom_autograd_core::{BackendRef, DType, Tensor};
    /// use headroom_ops_cpu::CpuBackend;
    ///
    /// let cpu = Arc::new(CpuBackend::default());
    /// let backend: BackendRef = cpu.clone();
    /// let w1 = Tensor::full(&backend, &[64, 16], 0.125, DType::F32)?;
    /// let w2 = Tensor::full(&backend, &[16, 64], 0.25, DType::F32)?;
    /// w1.requires_grad_(true)?;
    /// w2.requires_grad_(true)?;
    /// let x = Tensor::ones(&backend, &[32, 16], DType::F32)?;
    /// let mut kept = Vec::new();
    /// for rebuild in [false, true] {
    ///     let policy = Float8Policy::new(None::<AmpPolicy>)
    ///         .with_weight(&w1)
    ///         .with_weight(&w2)
    ///         .with_rebuilt_outputs(rebuild);
    ///     let before = cpu.allocator().memory_allocated();
    ///     let y = {
    ///         let _fp8 = policy.enter();
    ///         x.linear(&w1, None)?.gelu_tanh_linear(&w2, None)? // saves w1's output
    ///     };
    ///     kept.push(cpu.allocator().memory_allocated() - before);
    ///     y.sum_all()?.backward()?;
    /// }
    /// // Rebuilt, the [32, 64] f32 pre-activation is not kept.
    /// assert_eq!(kept[0] - kept[1], 32 * 64 * 4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_rebuilt_outputs(mut self, rebuild: bool) -> Float8Policy {
        self.rebuilds_outputs = rebuild;
        self
    }

    /// Runs the listed linears with `recipe` (default [`Float8Recipe::TENSORWISE`]; delayed
    /// scaling, when on, takes precedence).
    pub fn with_recipe(mut self, recipe: Float8Recipe) -> Float8Policy {
        self.recipe = recipe;
        self
    }

    /// The recipe the listed linears run with.
    pub fn recipe(&self) -> Float8Recipe {
        self.recipe
    }

    /// Lists the weights among `parameters` (name, tensor: a model's `named_parameters`) whose
    /// names end in `weight`, are two-dimensional, and pass `filter` (given the name).
    pub fn with_linears<'a>(
        mut self,
        parameters: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
        filter: impl Fn(&str) -> bool,
    ) -> Float8Policy {
        for (name, tensor) in parameters {
            if name.ends_with("weight") && tensor.ndim() == 2 && filter(name) {
                self.list(tensor);
            }
        }
        self
    }

    /// Lists one linear's weight.
    pub fn with_weight(mut self, weight: &Tensor) -> Float8Policy {
        self.list(weight);
        self
    }

    /// The linears listed.
    pub fn linears(&self) -> usize {
        self.linears.len()
    }

    /// Runs ops under this policy on this thread until the guard drops.
    pub fn enter(&self) -> AutocastGuard {
        autocast(Arc::new(self.clone()))
    }
}

impl fmt::Debug for Float8Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Float8Policy")
            .field("base", &self.base)
            .field("linears", &self.linears.len())
            .field("recipe", &self.recipe)
            .field("delayed", &self.delayed)
            .field("rebuilds_outputs", &self.rebuilds_outputs)
            .finish()
    }
}

impl AutocastPolicy for Float8Policy {
    fn lower_precision(&self) -> DType {
        self.base.lower_precision()
    }

    fn cast_policy(&self, op: &'static str, device: Device) -> CastPolicy {
        self.base.cast_policy(op, device)
    }

    fn float8_linear(&self, weight: &Tensor) -> Option<Float8Linear> {
        let (_, history) = self.listed(weight)?;
        Some(match history {
            Some(history) => Float8Linear::Delayed(Arc::clone(history)),
            None => Float8Linear::Current(self.recipe),
        })
    }

    fn float8_rebuilds_outputs(&self) -> bool {
        self.rebuilds_outputs
    }
}
