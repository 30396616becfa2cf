//! Mixed precision for Headroom: autocast with PyTorch's lists, a GradScaler that never waits
//! for the device, f32 master weights, apex's opt levels, and bf16 training without a master
//! copy.
//!
//! - **Autocast** ([`AmpPolicy`]): PyTorch 2.11's CUDA autocast lists as data
//!   ([`AutocastLists`]), applied through autograd-core's autocast seam, overridable per list or
//!   per op. Matrix products and attention run in f16 or bf16, softmax, norms, losses and
//!   `exp`/`log` in f32, mixed inputs in the widest dtype: the output dtype of every op Headroom
//!   has equals PyTorch's (`tests/autocast.rs` against PyTorch's own table). Each f32
//!   parameter is cast once per autocast region; the copies are freed when it ends
//!   (autograd-core's cast cache, whose bytes `autocast_stats` reports).
//! - **GradScaler** ([`GradScaler`]): PyTorch's semantics and state dict, a loss-scale provider
//!   (optim's `LossScaler`) rather than a wrapper: `scaler.step(&mut optimizer)` in the plain
//!   loop, or handed to hooks' `InBackward::backward_scaled` (and through it to a sharded
//!   optimizer), so fp16 works wherever an f32 step does. With an optimizer whose kernels take a
//!   device scale (fused SGD, Adam, AdamW, 8-bit Adam) a whole step — overflow check, unscale,
//!   step or skip, scale update — reads nothing back to the host. f16 and bf16 gradients are unscaled in f32 arithmetic
//!   (PyTorch refuses them), unscaling twice in a step is [`AmpError::AlreadyUnscaled`], and the
//!   step's [`SkipFlag`](headroom_optim::SkipFlag) tells an LR scheduler not to advance.
//! - **Master weights** ([`MasterWeights`]): apex O2's f32 copy of a half model, held by the
//!   optimizer, as a decorator; [`OptLevel`] O0–O3 with apex's meaning and [`AmpTraining`], the
//!   training step of a level.
//! - **fp8 linears** ([`Float8Policy`]): the linears it lists, by parameter name, run in fp8
//!   inside a base policy's autocast, under one autograd-core `Float8Recipe` (tensorwise with
//!   E5M2 gradients, or rowwise power-of-two scales) with current scales or delayed ones
//!   (`with_delayed_scaling`: an amax history per linear); each input is saved once, in one byte
//!   an element, and a linear behind GELU keeps only its pre-activation.
//! - **bf16 without a master copy**: [`AdamStochastic`](headroom_optim::AdamStochastic) (in
//!   optim, whose kernels it needs) rounds each bf16 update stochastically with f32 moments —
//!   12 bytes per parameter instead of O2's 16 — seeded and reproducible, the CPU and CUDA
//!   kernels equal to the bit.
//!
//! It sits on autograd-core (the autocast seam, tensor ops) and optim (the `Optimizer` trait,
//! device scaling, `SkipFlag`, the multi-tensor overflow check `non_finite_check_and_unscale_`);
//! it knows no kernel and no device. The
//! `cuda` feature only lets the tests run on ops-cuda's backend.
//!
//! ```
//! use headroom_amp::{AmpPolicy, GradScaler, GradScalerConfig};
//! use headroom_autograd_core::{autocast_stats, DType, Tensor};
//! use headroom_ops_cpu::CpuBackend;
//! use headroom_optim::{Adam, AdamConfig, Implementation, ParamGroup};
//!
//! let cpu = CpuBackend::new_ref();
//! let w = Tensor::full(&cpu, &[8, 8], 0.1, DType::F32)?;
//! w.requires_grad_(true)?;
//! let mut adam = Adam::new(vec![ParamGroup::new(vec![w.clone()], AdamConfig::adamw())], Implementation::Fused)?;
//! let mut scaler = GradScaler::new(GradScalerConfig::default())?;
//! let policy = AmpPolicy::torch_cuda(DType::BF16)?;
//! let x = Tensor::ones(&cpu, &[4, 8], DType::F32)?;
//!
//! let loss = {
//!     let _autocast = policy.enter();
//!     let h = x.linear(&w, None)?.linear(&w, None)?; // w cast to bf16 once, then cached
//!     assert_eq!(autocast_stats().cache_hits, 1);
//!     assert_eq!(autocast_stats().cached_bytes, 8 * 8 * 2);
//!     h.sum_all()? // f32: sum is on PyTorch's f32 list
//! };
//! assert_eq!(autocast_stats().cached_bytes, 0); // freed when the region ended
//! scaler.scale(&loss)?.backward()?;
//! let skipped = scaler.step(&mut adam)?;
//! scaler.update()?;
//! assert!(!skipped.read()?);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;
mod float8;
mod levels;
mod master;
mod policy;
mod scaler;
mod state;

pub use error::AmpError;
pub use float8::Float8Policy;
pub use levels::{AmpTraining, LossScale, OptLevel, OptLevelProperties};
pub use master::{MasterWeights, DEFAULT_MASTER_BUCKET_BYTES};
pub use policy::{torch_op_of, AmpPolicy, AutocastLists, TorchList, TorchOp};
pub use scaler::{GradScaler, GradScalerConfig, GradScalerState, MAX_GROWTH_INTERVAL};
