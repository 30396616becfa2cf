//! The CUDA side of the optimizers: the rules' kernels on device memory, gradient clipping's
//! reductions, and the raw-buffer layer for trainers that own their device buffers.
//!
//! Every rule has the implementations it has on the CPU, with the same float32 operations in the
//! same order (the `.cu` files in `kernels/` mirror `src/kernels/*.rs` with explicit rounding), so
//! the GPU and the CPU agree to the bit; SGD and Adam kernels come in f32, bf16 and f16 instances
//! (states of the parameter's dtype, the same roundings as the CPU's):
//! - fused: one pass per element, one launch for every parameter of a call;
//! - foreach: PyTorch's op-by-op passes, each launch one op over every tensor of a chunk, the
//!   temporaries in one scratch tensor of at most the chunk (16 MiB by default, small enough to
//!   stay in the H200's L2 between passes);
//! - single: the same passes one parameter at a time, with a temporary of that parameter;
//! - 8-bit Adam (fused only): bitsandbytes' blockwise kernel, and its 32-bit path for small
//!   tensors; 4-bit Adam (fused only): torchao's update, one CUDA block per block of 128, and its
//!   f32-state path.
//!
//! Each rule plugs in by implementing [`CudaKernels`](crate::rule::CudaKernels) for its state:
//! SGD and Adam through `multi_tensor.rs` (one generic driver; `sgd.rs` and `adam.rs` hold only
//! their kernel names, state addresses, pass ops and piece layouts), Adafactor and 8-bit Adam with
//! their own entries (`adafactor.rs` on the host's per-parameter schedule, `adam8bit.rs`,
//! `adam4bit.rs`, which shares 8-bit's state addresses), a
//! user's [`ElementwiseRule`](crate::ElementwiseRule) through `elementwise.rs` (its own PTX, one
//! fused launch). `clip.rs` launches the clipping kernels and `grad_scale.rs` a GradScaler's
//! overflow check (and unscale), both over a table of gradients (`grads.rs`). Every launch goes
//! through `launch.rs`: a launch reads a piece table (`table.rs`) — one entry per tensor or range
//! of one, with its addresses, length, step constants and first block — that `CudaDevice` copies
//! to a device buffer it keeps (with an asynchronous copy: no host synchronisation), beside the
//! lookup tables of the 8-bit codes and a GradScaler's per-parameter skip counters. State tensors
//! and scratch come from the parameters' backend, so `memory_allocated()` sees them.
//!
//! Imports point one way: `table.rs` and `launch.rs` at the bottom, the gradient tables and
//! their users above, then the rules' pieces (which import their front ends' states); this file
//! only declares and re-exports.
//!
//! [`CudaFusedAdam`] and [`CudaAdam8bit`] are the raw-buffer layer on the GPU: a trainer that owns
//! device memory hands them the buffers' addresses once and steps them.
//!
//! This module sits on headroom-ops-cuda's `CudaBackend` (context, stream, caching allocator,
//! kernel loading and launching); no cudarc type appears here.

mod adafactor;
mod adam;
mod adam4bit;
mod adam8bit;
pub(crate) mod clip;
mod elementwise;
pub(crate) mod grad_scale;
mod grads;
pub(crate) mod launch;
mod multi_tensor;
pub(crate) mod offload;
pub(crate) mod offload_stream;
mod replays;
mod sgd;
pub(crate) mod state_stream;
mod table;

pub use adafactor::{CudaAdafactor, DeviceAdafactorParam};
pub use adam::{CudaFusedAdam, DeviceAdamParam, FusedAdamMath};
pub use adam4bit::{fast_arithmetic_mismatches, CudaAdam4bit};
pub use adam8bit::{Adam8bitMath, CudaAdam8bit, DeviceAdam8bitParam};
pub use sgd::{CudaSgd, DeviceSgdParam};
