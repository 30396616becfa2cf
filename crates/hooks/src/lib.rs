//! The optimizer step fused into backward, for Headroom: gradients never pile up.
//!
//! [`InBackward`] takes any optim [`Optimizer`](headroom_optim::Optimizer) — fused Adam, AdamW
//! or SGD, 8-bit Adam, Adafactor, in any implementation — and steps its parameters from
//! post-accumulate-grad hooks as their gradients become final, in buckets of
//! [`InBackwardConfig::bucket_bytes`] (one multi-tensor launch each), freeing each gradient right
//! after its update. PyTorch's tutorial version (one `Adam(foreach=False)` per parameter) does
//! the same with one optimizer call per parameter; this is a bucketed, fused one, and it has none
//! of the walls that version hits:
//! - one LR scheduler drives the whole model, advanced once per optimizer step
//!   ([`InBackward::set_lr_scheduler`]);
//! - gradient accumulation over `k` micro-batches ([`InBackwardConfig::accumulation`]) equals
//!   the plain loop's;
//! - global gradient-norm clipping, exact (a measuring pass first) or with the previous step's
//!   norm ([`ClipMode`]);
//! - fp16 loss scaling with no partial updates ([`InBackward::backward_scaled`]);
//! - typed errors for a parameter registered twice or not requiring grad, and for stepping the
//!   optimizer by hand ([`HooksError`]); a parameter with no gradient in a step is not updated
//!   and is counted ([`InBackwardStats`]).
//!
//! It sits on autograd-core's hooks and backward-end callbacks and on optim's `Optimizer` trait;
//! it knows no rule, no kernel and no device.

mod error;
mod in_backward;
mod norm;
mod registry;

pub use error::HooksError;
pub use in_backward::{
    ClipMode, Clipping, InBackward, InBackwardConfig, InBackwardStats, DEFAULT_BUCKET_BYTES,
};
