//! What a checkpointed region keeps and what it recomputes, decided per saved tensor.
//!
//! Every tensor an op inside a region saves for backward arrives with its
//! [`SaveSite`] (op, role, shape, dtype, bytes, number); a [`SavePolicy`] answers [`Decision::Save`]
//! (keep it, as without checkpointing) or [`Decision::Recompute`] (drop it now, rebuild it by
//! running the region again in backward). [`RecomputeAll`] is PyTorch's `checkpoint`; [`SaveMatmuls`]
//! is the "save matrix products, recompute pointwise ops and norms" recipe; [`RecomputeBefore`]
//! recomputes a block's early part and keeps its late part; [`PolicyFn`] takes a closure. The
//! recomputation runs the region from its start up to the last save it must rebuild, so keeping
//! what late ops save shortens it. This module knows nothing about how a region runs.

use headroom_autograd_core::{SaveRole, SaveSite};

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

    /// The decision for `site` where the region made the saves `earlier` before it (each's op and
    /// role, in order, read as the region holds them): for a policy that decides by position
    /// inside the region. By default [`SavePolicy::decide`].
    fn decide_in_region(
        &self,
        site: &SaveSite,
        earlier: &mut dyn Iterator<Item = (&'static str, SaveRole)>,
    ) -> Decision {
        let _ = earlier;
        self.decide(site)
    }
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

/// Recompute what the region saves before the `instance`-th call (from 0) of `op`, keep what
/// that call and everything after it save: the early part of a block is recomputed, the late
/// part kept, and the recomputation stops where the kept part begins (it runs up to the last
/// save it must rebuild). `RecomputeBefore::mlp()` splits a pre-norm block where its MLP
/// begins (ViT's and GPT-2's second `layer_norm_linear`): the attention half is recomputed (its
/// norm, q/k/v product and attention; not the output projection, whose saves come before its
/// product), the MLP's saves are kept. A call is counted at its first save (`Input(0)`); a
/// region with fewer calls recomputes everything, as [`RecomputeAll`]. Without the region's
/// earlier saves ([`SavePolicy::decide`]) it recomputes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecomputeBefore {
    /// The op whose call starts the kept part.
    pub op: &'static str,
    /// Which of its calls (from 0).
    pub instance: usize,
}

impl RecomputeBefore {
    /// Before the second `layer_norm_linear` of the region: a pre-norm block's attention half
    /// recomputed, its MLP's saves kept.
    pub fn mlp() -> RecomputeBefore {
        RecomputeBefore {
            op: "layer_norm_linear",
            instance: 1,
        }
    }

    /// Whether a save of `op` in `role` starts a call of the op.
    fn starts_call(&self, op: &str, role: SaveRole) -> bool {
        op == self.op && role == SaveRole::Input(0)
    }
}

impl SavePolicy for RecomputeBefore {
    fn decide(&self, _site: &SaveSite) -> Decision {
        Decision::Recompute
    }

    fn decide_in_region(
        &self,
        site: &SaveSite,
        earlier: &mut dyn Iterator<Item = (&'static str, SaveRole)>,
    ) -> Decision {
        let calls = earlier
            .chain(std::iter::once((site.op, site.role)))
            .filter(|&(op, role)| self.starts_call(op, role))
            .count();
        if calls > self.instance {
            Decision::Save
        } else {
            Decision::Recompute
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
