//! Headroom: the facade crate.
//!
//! Headroom is a kit of small crates that let a training loop fit in less GPU memory and run at
//! least as fast as PyTorch. Each crate stands alone (`headroom-caching-allocator`, ...); this
//! package only re-exports them under one name and hosts the workspace's examples and benches.
//! It holds no logic of its own and must never grow any: a technique lives in its crate.

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
