//! The [`Module`] trait: named parameters in PyTorch's order, and the training flag.
//!
//! A module owns its parameters as [`Tensor`] handles (leaves that require grad) and its
//! sub-modules as fields. [`Module::visit_parameters`] walks them depth-first in the order
//! PyTorch's `named_parameters()` yields them — a module's own parameters first, in
//! registration order, then each child's under `child.` — so weight files, optimizers and
//! golden tests line up name for name. Everything else (`named_parameters`, counting) is
//! derived from that one walk. This module knows no layer and no file format.

use headroom_autograd_core::Tensor;

/// A layer or model with named parameters.
pub trait Module {
    /// Calls `visit(name, parameter)` for every parameter, names prefixed by `prefix`
    /// (`""` at the root), in PyTorch's `named_parameters()` order. A tied parameter is visited
    /// once, under its first name.
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor));

    /// Switches dropout (and anything else that behaves differently in training) on or off;
    /// PyTorch's `train()` / `eval()`. Modules start in training mode, as in PyTorch.
    fn set_training(&mut self, training: bool);

    /// Every parameter with its full name, in PyTorch's order.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut res = Vec::new();
        self.visit_parameters("", &mut |name, tensor| {
            res.push((name.to_owned(), tensor.clone()));
        });
        res
    }

    /// Every parameter's full name, in PyTorch's order (the names of
    /// [`Module::named_parameters`]).
    fn parameter_names(&self) -> Vec<String> {
        let mut res = Vec::new();
        self.visit_parameters("", &mut |name, _| res.push(name.to_owned()));
        res
    }

    /// Every parameter, in PyTorch's order.
    fn parameters(&self) -> Vec<Tensor> {
        let mut res = Vec::new();
        self.visit_parameters("", &mut |_, tensor| res.push(tensor.clone()));
        res
    }

    /// The number of scalar parameters.
    fn num_parameters(&self) -> usize {
        let mut res = 0;
        self.visit_parameters("", &mut |_, tensor| res += tensor.numel());
        res
    }

    /// Clears every parameter's `.grad` (PyTorch's `zero_grad(set_to_none)`).
    fn zero_grad(&self, set_to_none: bool) -> crate::Result<()> {
        let mut res = Ok(());
        self.visit_parameters("", &mut |_, tensor| {
            if res.is_ok() {
                res = tensor.zero_grad(set_to_none);
            }
        });
        Ok(res?)
    }
}

/// The full name of `name` inside the module at `prefix` (`prefix.name`, or `name` at the root).
pub fn child_name(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_owned()
    } else {
        format!("{prefix}.{name}")
    }
}
