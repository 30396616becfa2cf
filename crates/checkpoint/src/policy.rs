//! What a checkpointed region keeps and what it recomputes, decided per saved tensor.
//!
//! Every tensor an op inside a region saves for backward arrives with its
//! [`SaveSite`] (op, role, shape, dtype, bytes, number); a [`SavePolicy`] answers [`Decision::Save`]
//! (keep it, as without checkpointing) or [`Decision::Recompute`] (drop it now, rebuild it by
//! running the region again in backward). [`RecomputeAll`] is PyTorch's `checkpoint`; [`SaveMatmuls`]
//! is the "save matrix products, recompute pointwise ops and norms" recipe; [`PolicyFn`] takes a
//! closure. The recomputation runs the region from its start up to the last save it must rebuild,
//! so keeping what late ops save shortens it. This module knows nothing about how a region runs.

use headroom_autograd_core::SaveSite;

/// What happens to one saved tensor of a checkpointed region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Decision {
    /// Keep it until backward, as without checkpointing.
    Save,
    /// Drop it now; rebuild it in backward by running the region again.
    Recompute,
}

/// Decides, per saved tensor, whether a checkpointed region keeps it or recomputes it.
pub trait SavePolicy: Send + Sync + std::fmt::Debug {
    /// The decision for the tensor `site` describes.
    fn decide(&self, site: &SaveSite) -> Decision;
}

/// Recompute everything the region saved; only its inputs stay (PyTorch's `checkpoint`).
#[derive(Debug, Clone, Copy, Default)]
pub struct RecomputeAll;

impl SavePolicy for RecomputeAll {
    fn decide(&self, _site: &SaveSite) -> Decision {
        Decision::Recompute
    }
}

/// Keep what matrix products and attention save (their operands; attention's output and
/// log-sum-exp), recompute what pointwise ops, norms, softmax and dropout save: the selective
/// recipe of torchtitan and Megatron (the products are the expensive part to recompute, the
/// rest is cheap and often large).
#[derive(Debug, Clone, Copy, Default)]
pub struct SaveMatmuls;

impl SavePolicy for SaveMatmuls {
    fn decide(&self, site: &SaveSite) -> Decision {
        match site.op {
            "matmul"
            | "linear"
            | "gelu_linear"
            | "gelu_tanh_linear"
            | "layer_norm_linear"
            | "scaled_dot_product_attention" => Decision::Save,
            _ => Decision::Recompute,
        }
    }
}

/// A policy from a closure over the [`SaveSite`].
pub struct PolicyFn<F>(pub F);

impl<F> std::fmt::Debug for PolicyFn<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PolicyFn")
    }
}

impl<F: Fn(&SaveSite) -> Decision + Send + Sync> SavePolicy for PolicyFn<F> {
    fn decide(&self, site: &SaveSite) -> Decision {
        (self.0)(site)
    }
}
