//! Headroom: the facade crate.
//!
//! Headroom is a kit of small crates that let a training loop fit in less GPU memory and run at
//! least as fast as PyTorch. Each crate stands alone (`headroom-caching-allocator`, ...); this
//! package only re-exports them under one name and hosts the workspace's examples and benches.
//! It holds no logic of its own and must never grow any: a technique lives in its crate.
//!
//! ```
//! use headroom::autograd_core::{DType, Tensor};
//! use headroom::hooks::{InBackward, InBackwardConfig};
//! use headroom::optim::{Adam, AdamConfig, Implementation, ParamGroup};
//!
//! let cpu = headroom::ops_cpu::CpuBackend::new_ref();
//! let w = Tensor::full(&cpu, &[4, 4], 0.1, DType::F32)?;
//! w.requires_grad_(true)?;
//! let groups = vec![ParamGroup::new(vec![w.clone()], AdamConfig::adamw())];
//! let adamw = Adam::new(groups, Implementation::Fused)?;
//! // Fused AdamW stepped inside backward: the gradient is freed as soon as it has been used.
//! let in_backward = InBackward::new(Box::new(adamw), InBackwardConfig::default())?;
//! let x = Tensor::ones(&cpu, &[2, 4], DType::F32)?;
//! in_backward.backward(&x.linear(&w, None)?.sum_all()?)?;
//! assert!(w.grad().is_none());
//! assert_eq!(in_backward.stats().steps, 1);
//! assert!(w.to_vec::<f32>()?.iter().all(|&v| v < 0.1)); // every gradient was positive
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub use headroom_amp as amp;
pub use headroom_autograd_core as autograd_core;
pub use headroom_caching_allocator as caching_allocator;
pub use headroom_checkpoint as checkpoint;
pub use headroom_distributed as distributed;
pub use headroom_hooks as hooks;
pub use headroom_nn as nn;
pub use headroom_ops_cpu as ops_cpu;
pub use headroom_ops_cuda as ops_cuda;
pub use headroom_optim as optim;

/// The workspace README's Rust blocks, compiled and run as doc tests so that the loop it shows
/// stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
