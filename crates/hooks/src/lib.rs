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
//!
//! Fused AdamW stepped inside backward trains to the plain loop's parameters, bit for bit, and no
//! gradient outlives its bucket:
//!
//! ```
//! use headroom_autograd_core::{DType, Tensor};
//! use headroom_hooks::{InBackward, InBackwardConfig};
//! use headroom_optim::{Adam, AdamConfig, Implementation, Optimizer, ParamGroup};
//!
//! let cpu = headroom_ops_cpu::CpuBackend::new_ref();
//! let model = || -> Result<Vec<Tensor>, headroom_autograd_core::TensorError> {
//!     let w1 = Tensor::from_f64s(&cpu, &[0.1, -0.2, 0.3, 0.4, -0.5, 0.6], &[3, 2], DType::F32)?;
//!     let w2 = Tensor::from_f64s(&cpu, &[0.7, -0.8, 0.9], &[1, 3], DType::F32)?;
//!     w1.requires_grad_(true)?;
//!     w2.requires_grad_(true)?;
//!     Ok(vec![w1, w2])
//! };
//! let x = Tensor::from_f64s(&cpu, &[1.0, 2.0, -1.0, 0.5], &[2, 2], DType::F32)?;
//! let loss = |w: &[Tensor]| x.linear(&w[0], None)?.tanh()?.linear(&w[1], None)?.sum_all();
//! let adamw = |w: &[Tensor]| {
//!     let groups = vec![ParamGroup::new(w.to_vec(), AdamConfig::adamw())];
//!     Adam::new(groups, Implementation::Fused)
//! };
//!
//! // The plain loop: backward, then the step, with every gradient alive at once.
//! let plain = model()?;
//! let mut optimizer = adamw(&plain)?;
//! for _ in 0..3 {
//!     loss(&plain)?.backward()?;
//!     optimizer.step()?;
//!     optimizer.zero_grad(true)?;
//! }
//!
//! // In backward: each bucket is stepped the moment its gradients are final, then freed
//! // (`bucket_bytes: 0` makes every parameter a bucket of its own).
//! let stepped = model()?;
//! let config = InBackwardConfig { bucket_bytes: 0, ..InBackwardConfig::default() };
//! let in_backward = InBackward::new(Box::new(adamw(&stepped)?), config)?;
//! for _ in 0..3 {
//!     in_backward.backward(&loss(&stepped)?)?;
//!     assert!(stepped.iter().all(|w| w.grad().is_none()));
//! }
//!
//! for (a, b) in plain.iter().zip(&stepped) {
//!     assert_eq!(a.to_vec::<f32>()?, b.to_vec::<f32>()?);
//! }
//! assert_eq!((in_backward.stats().steps, in_backward.stats().buckets), (3, 6));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;
mod in_backward;
mod norm;
mod registry;

pub use error::HooksError;
pub use in_backward::{
    ClipMode, Clipping, InBackward, InBackwardConfig, InBackwardStats, DEFAULT_BUCKET_BYTES,
};
