//! The backward pass: runs the recorded graph from its roots down to the leaves.
//!
//! Nodes run once all their consumers have delivered gradients, later-created nodes first
//! (PyTorch's order), so activations are released in reverse order of creation. Right after a
//! node's backward returns, its backward closure — and with it the saved tensors — is dropped
//! (unless `retain_graph`), and the gradients it consumed are dropped too. A leaf's gradient is
//! final once every edge into it has delivered: then its gradient hooks run, the gradient is
//! accumulated into `.grad` (stolen when nothing else holds it, added in place otherwise), and its
//! post-accumulate-grad hooks run. Everything runs with grad mode and autocast off. When the pass
//! is over, the callbacks queued during it run, then (for an outermost pass) the thread's
//! backward-end hooks, and the thread's save numbers (`crate::saved`) start again from 0. This
//! module sits on `crate::graph`, `crate::hooks` and the elementwise ops; it knows nothing about
//! kernels.

use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use crate::error::{Result, TensorError};
use crate::grad_mode::no_grad;
use crate::graph::{Edge, Node};
use crate::hooks::{is_backward_running, BackwardPass};
use crate::saved::reset_save_seq;
use crate::tensor::Tensor;

/// How a backward pass treats the graph.
#[derive(Debug, Clone, Copy)]
pub struct BackwardOptions {
    /// Keep the saved tensors so the graph can be differentiated again.
    pub retain_graph: bool,
}

impl Tensor {
    /// Backward from a one-element tensor with gradient 1, freeing the graph as it goes.
    pub fn backward(&self) -> Result<()> {
        self.backward_with(
            None,
            BackwardOptions {
                retain_graph: false,
            },
        )
    }

    /// Backward with an explicit output gradient (required unless this tensor has one element).
    pub fn backward_with(&self, gradient: Option<Tensor>, options: BackwardOptions) -> Result<()> {
        let gradient = match gradient {
            Some(gradient) => {
                if gradient.shape() != self.shape() {
                    return Err(TensorError::ShapeMismatch {
                        op: "backward",
                        lhs: self.shape().to_vec(),
                        rhs: gradient.shape().to_vec(),
                    });
                }
                gradient
            }
            None if self.numel() == 1 => Tensor::ones(self.backend(), self.shape(), self.dtype())?,
            None => {
                return Err(TensorError::Autograd {
                    op: "backward",
                    reason: format!(
                        "grad can be implicitly created only for one-element outputs, not {:?}",
                        self.shape()
                    ),
                })
            }
        };
        run_backward(vec![(self.clone(), gradient)], options.retain_graph)
    }
}

fn node_key(node: &Arc<Node>) -> usize {
    Arc::as_ptr(node) as usize
}

fn leaf_key(leaf: &Tensor) -> usize {
    Arc::as_ptr(&leaf.inner) as usize
}

/// Runs backward from `roots`, each with its output gradient, then the callbacks queued during
/// the pass and, for an outermost pass, the thread's backward-end hooks.
pub fn run_backward(roots: Vec<(Tensor, Tensor)>, retain_graph: bool) -> Result<()> {
    let _grad_mode = no_grad();
    let _autocast = crate::autocast::autocast_disabled();
    let pass = BackwardPass::start();
    let res = run_graph(roots, retain_graph).and_then(|()| pass.finish());
    if !is_backward_running() {
        reset_save_seq();
    }
    res
}

/// The pass itself: every node and leaf reachable from `roots`.
fn run_graph(roots: Vec<(Tensor, Tensor)>, retain_graph: bool) -> Result<()> {
    let mut node_grads: HashMap<usize, Vec<Option<Tensor>>> = HashMap::new();
    let mut leaf_grads: HashMap<usize, Tensor> = HashMap::new();
    let mut nodes: HashMap<usize, Arc<Node>> = HashMap::new();
    let mut leaves: HashMap<usize, Tensor> = HashMap::new();
    let mut root_nodes = Vec::new();
    for (root, gradient) in roots {
        if !root.requires_grad() {
            return Err(TensorError::Autograd {
                op: "backward",
                reason: "the tensor does not require grad and has no grad_fn".into(),
            });
        }
        match root.grad_fn() {
            Some((node, output_nr)) => {
                let slots = node_grads
                    .entry(node_key(&node))
                    .or_insert_with(|| vec![None; node.n_outputs()]);
                slots[output_nr] = Some(accumulate(slots[output_nr].take(), gradient)?);
                nodes.insert(node_key(&node), Arc::clone(&node));
                root_nodes.push(node);
            }
            None => {
                let key = leaf_key(&root);
                let previous = leaf_grads.remove(&key);
                leaf_grads.insert(key, accumulate(previous, gradient)?);
                leaves.insert(key, root);
            }
        }
    }

    // Count, for every node and leaf reachable from the roots, the edges that feed it.
    let mut node_deps: HashMap<usize, usize> = HashMap::new();
    let mut leaf_deps: HashMap<usize, usize> = HashMap::new();
    let mut stack: Vec<Arc<Node>> = root_nodes.clone();
    let mut visited: std::collections::HashSet<usize> = root_nodes.iter().map(node_key).collect();
    while let Some(node) = stack.pop() {
        for edge in node.next().iter().flatten() {
            match edge {
                Edge::Node { node: child, .. } => {
                    let key = node_key(child);
                    *node_deps.entry(key).or_insert(0) += 1;
                    if visited.insert(key) {
                        nodes.insert(key, Arc::clone(child));
                        stack.push(Arc::clone(child));
                    }
                }
                Edge::Leaf(leaf) => {
                    let key = leaf_key(leaf);
                    *leaf_deps.entry(key).or_insert(0) += 1;
                    leaves.entry(key).or_insert_with(|| leaf.clone());
                }
            }
        }
    }

    let mut ready: BinaryHeap<(u64, usize)> = BinaryHeap::new();
    for node in &root_nodes {
        let key = node_key(node);
        if node_deps.get(&key).copied().unwrap_or(0) == 0 && !ready.iter().any(|&(_, k)| k == key) {
            ready.push((node.seq(), key));
        }
    }
    let root_leaves: Vec<usize> = leaf_grads.keys().copied().collect();
    for key in root_leaves {
        if leaf_deps.get(&key).copied().unwrap_or(0) == 0 {
            finish_leaf(&leaves[&key], leaf_grads.remove(&key))?;
        }
    }

    while let Some((_, key)) = ready.pop() {
        let node = Arc::clone(&nodes[&key]);
        let mut grads = node_grads
            .remove(&key)
            .unwrap_or_else(|| vec![None; node.n_outputs()]);
        for (output_nr, hook) in node.pre_hooks() {
            if let Some(grad) = &grads[output_nr] {
                if let Some(replacement) = hook(grad)? {
                    grads[output_nr] = Some(replacement);
                }
            }
        }
        let input_grads = run_node(&node, &grads, retain_graph)?;
        drop(grads);
        for (input_idx, (edge, grad)) in node.next().iter().zip(input_grads).enumerate() {
            let Some(edge) = edge else { continue };
            if let Some(grad) = &grad {
                let expected = &node.input_shapes()[input_idx];
                if grad.shape() != expected.as_slice() {
                    return Err(TensorError::ShapeMismatch {
                        op: node.name(),
                        lhs: expected.to_vec(),
                        rhs: grad.shape().to_vec(),
                    });
                }
            }
            match edge {
                Edge::Node {
                    node: child,
                    output_nr,
                } => {
                    let child_key = node_key(child);
                    if let Some(grad) = grad {
                        let slots = node_grads
                            .entry(child_key)
                            .or_insert_with(|| vec![None; child.n_outputs()]);
                        slots[*output_nr] = Some(accumulate(slots[*output_nr].take(), grad)?);
                    }
                    let deps = node_deps.get_mut(&child_key).expect("counted above");
                    *deps -= 1;
                    if *deps == 0 {
                        ready.push((child.seq(), child_key));
                    }
                }
                Edge::Leaf(leaf) => {
                    let leaf_idx = leaf_key(leaf);
                    if let Some(grad) = grad {
                        let previous = leaf_grads.remove(&leaf_idx);
                        leaf_grads.insert(leaf_idx, accumulate(previous, grad)?);
                    }
                    let deps = leaf_deps.get_mut(&leaf_idx).expect("counted above");
                    *deps -= 1;
                    if *deps == 0 {
                        finish_leaf(leaf, leaf_grads.remove(&leaf_idx))?;
                    }
                }
            }
        }
    }
    Ok(())
}

thread_local! {
    static LAST_USE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the backward function running now on this thread is its node's last use (no
/// `retain_graph`): it may then release a saved tensor as soon as it has used it, before it
/// allocates the rest of its gradients.
pub(crate) fn is_last_use() -> bool {
    LAST_USE.with(std::cell::Cell::get)
}

/// Sets [`is_last_use`] for one backward function, restoring the outer value (a backward run
/// from inside another) when dropped.
struct LastUse(bool);

impl LastUse {
    fn set(last: bool) -> LastUse {
        LastUse(LAST_USE.with(|cell| cell.replace(last)))
    }
}

impl Drop for LastUse {
    fn drop(&mut self) {
        LAST_USE.with(|cell| cell.set(self.0));
    }
}

/// Calls a node's backward; without `retain_graph` the closure (and its saved tensors) is
/// dropped before this returns.
fn run_node(
    node: &Node,
    grads: &[Option<Tensor>],
    retain_graph: bool,
) -> Result<Vec<Option<Tensor>>> {
    let mut slot = node.backward_fn().lock();
    let n_inputs = node.next().len();
    if grads.iter().all(Option::is_none) {
        if !retain_graph {
            drop(slot.take());
        }
        return Ok(vec![None; n_inputs]);
    }
    let res = if retain_graph {
        let backward = slot
            .as_mut()
            .ok_or(TensorError::GraphFreed { op: node.name() })?;
        let _use = LastUse::set(false);
        backward(grads)?
    } else {
        let mut backward = slot
            .take()
            .ok_or(TensorError::GraphFreed { op: node.name() })?;
        drop(slot);
        let res = {
            let _use = LastUse::set(true);
            backward(grads)
        };
        drop(backward);
        res?
    };
    debug_assert_eq!(
        res.len(),
        n_inputs,
        "{} returned the wrong number of gradients",
        node.name()
    );
    Ok(res)
}

/// Sums two gradients for one slot, in place when the first is exclusively held.
fn accumulate(existing: Option<Tensor>, grad: Tensor) -> Result<Tensor> {
    match existing {
        None => Ok(grad),
        Some(existing) if existing.is_exclusive_dense() => {
            existing.add_assign_raw(&grad)?;
            Ok(existing)
        }
        Some(existing) => existing.add(&grad),
    }
}

/// A leaf's gradient is final: hooks, accumulation into `.grad`, post-accumulate hooks.
fn finish_leaf(leaf: &Tensor, grad: Option<Tensor>) -> Result<()> {
    let Some(mut grad) = grad else { return Ok(()) };
    let (grad_hooks, post_hooks) = {
        let meta = leaf.inner.meta.lock();
        (
            meta.grad_hooks.snapshot(),
            meta.post_accumulate_hooks.snapshot(),
        )
    };
    for hook in grad_hooks {
        if let Some(replacement) = hook(&grad)? {
            grad = replacement;
        }
    }
    let existing = leaf.grad();
    match existing {
        Some(existing) => existing.add_assign_raw(&grad)?,
        None => {
            let grad = if grad.is_exclusive_dense() && grad.dtype() == leaf.dtype() {
                grad
            } else {
                grad.to_dtype_contiguous_copy(leaf.dtype())?
            };
            leaf.inner.meta.lock().grad = Some(grad);
        }
    }
    for hook in post_hooks {
        hook(leaf)?;
    }
    Ok(())
}
