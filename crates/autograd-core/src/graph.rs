//! The recorded graph: one [`Node`] per differentiable op call, with edges to its inputs.
//!
//! Ops call [`record`] after computing their outputs when [`needs_grad`] says so. A node owns
//! the op's backward closure (and through it the saved tensors), edges to the nodes or leaves
//! its inputs came from, and the gradient hooks registered on its outputs. A global sequence
//! number orders nodes by creation, which the engine uses to run later ops first. This module
//! knows nothing about how backward is scheduled (`crate::engine`) or about kernels.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::Result;
use crate::grad_mode::is_grad_enabled;
use crate::hooks::{GradHook, HookHandle, HookList};
use crate::layout::Dims;
use crate::tensor::Tensor;

/// A backward function: gradients of the outputs (`None` where no gradient arrived) in, one
/// gradient per input out (`None` for inputs that need none).
pub(crate) type BackwardFn =
    Box<dyn FnMut(&[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> + Send>;

/// Where an input's gradient goes.
pub(crate) enum Edge {
    /// Into output `output_nr` of another node.
    Node { node: Arc<Node>, output_nr: usize },
    /// Into a leaf's `.grad`.
    Leaf(Tensor),
}

/// One recorded op call.
pub(crate) struct Node {
    name: &'static str,
    seq: u64,
    n_outputs: usize,
    backward: Mutex<Option<BackwardFn>>,
    next: Vec<Option<Edge>>,
    input_shapes: Vec<Dims>,
    /// Gradient hooks on outputs, as (output_nr, hook).
    pre_hooks: Arc<HookList<(usize, GradHook)>>,
}

static NEXT_SEQ: AtomicU64 = AtomicU64::new(0);

impl Node {
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    pub(crate) fn n_outputs(&self) -> usize {
        self.n_outputs
    }

    pub(crate) fn next(&self) -> &[Option<Edge>] {
        &self.next
    }

    pub(crate) fn input_shapes(&self) -> &[Dims] {
        &self.input_shapes
    }

    pub(crate) fn backward_fn(&self) -> &Mutex<Option<BackwardFn>> {
        &self.backward
    }

    pub(crate) fn register_pre_hook(&self, output_nr: usize, hook: GradHook) -> HookHandle {
        HookList::push(&self.pre_hooks, (output_nr, hook))
    }

    pub(crate) fn pre_hooks(&self) -> Vec<(usize, GradHook)> {
        self.pre_hooks.snapshot()
    }
}

/// Whether an op on `inputs` must be recorded: grad mode is on and some input requires grad.
pub fn needs_grad(inputs: &[&Tensor]) -> bool {
    is_grad_enabled() && inputs.iter().any(|input| input.requires_grad())
}

/// Records an op: a node named `name` whose backward maps the gradients of `outputs` to those of
/// `inputs`, and makes it the `grad_fn` of each output.
pub(crate) fn record(
    name: &'static str,
    inputs: &[&Tensor],
    outputs: &[&Tensor],
    backward: impl FnMut(&[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> + Send + 'static,
) {
    let next = inputs
        .iter()
        .map(|input| {
            if !input.requires_grad() {
                None
            } else if let Some((node, output_nr)) = input.grad_fn() {
                Some(Edge::Node { node, output_nr })
            } else {
                Some(Edge::Leaf((*input).clone()))
            }
        })
        .collect();
    let node = Arc::new(Node {
        name,
        seq: NEXT_SEQ.fetch_add(1, Ordering::Relaxed),
        n_outputs: outputs.len(),
        backward: Mutex::new(Some(Box::new(backward))),
        next,
        input_shapes: inputs.iter().map(|input| input.shape().into()).collect(),
        pre_hooks: Arc::default(),
    });
    for (output_nr, output) in outputs.iter().enumerate() {
        output.set_grad_fn(Arc::clone(&node), output_nr);
    }
}
