//! The CUDA backend: autograd-core's [`Backend`](headroom_autograd_core::Backend) on an NVIDIA
//! GPU.
//!
//! [`CudaBackend`] takes every byte from a `CachingAllocator<CudaStorage>`, so
//! `memory_allocated()` is exact on the GPU as on the host, and launches kernels compiled from
//! `kernels/*.cu` to PTX by `cargo xtask build-kernels` (committed gzipped, embedded, inflated once,
//! loaded once per backend). Work runs in order on the device's default stream, which is the
//! allocator's `StreamId::DEFAULT`, so a freed block is never reused while a kernel may still
//! read it.
//!
//! Every primitive of the trait is implemented: strided copy and cast, fill, unary, binary and
//! masked elementwise ops, reductions over trailing dims, softmax and log-softmax, layer norm,
//! RMSNorm, SwiGLU and the rotary embedding (`kernels/llama.cu`),
//! batched GEMM through cuBLAS (its workspace from the caching allocator), linear layers through
//! cuBLASLt (bias added, and bias gradient reduced, in the GEMM's epilogue), the fp8 quantize
//! (`kernels/float8.cu`) and fp8 products through cuBLASLt's fp8 GEMMs, fused attention,
//! gather and scatter-add, fused cross-entropy and dropout (the same random stream as the CPU
//! backend), in f32, f64, f16 and bf16 (the last two computed in f32). Out-of-range indices are typed errors,
//! checked on the device: read back after each call by default, or deferred to the next
//! synchronisation (`CudaBackend::set_deferred_index_checks`, `examples/index_checks.rs`).
//!
//! Kernels run on one stream (`CudaBackend::compute_stream`); side streams
//! (`CudaBackend::new_stream`) carry asynchronous copies between device memory and pinned host
//! buffers (`PinnedBuffer`, from a caching allocator of page-locked memory), ordered with
//! `CudaEvent`s. Memory used by a copy in flight is never reused early (see `pinned.rs`).
//!
//! Everything CUDA is behind the `cuda` feature; without it [`CudaBackend::new`] returns an error,
//! and with it a machine without a driver gets an error too, never a panic. This crate sits on
//! autograd-core and the caching allocator; no cudarc type appears in its public API.
//!
//! # Example
//!
//! The GPU when the build has CUDA and a device answers, else the CPU backend: code written over
//! autograd-core's `BackendRef` runs unchanged on either, with the same results.
//!
//! ```
//! use headroom_autograd_core::{BackendRef, DType, Tensor};
//! use headroom_ops_cuda::{CudaBackend, CudaError};
//!
//! fn gpu_or_cpu() -> Result<BackendRef, CudaError> {
//!     #[cfg(not(feature = "cuda"))]
//!     assert_eq!(CudaBackend::new(0).unwrap_err(), CudaError::NotCompiled);
//!     #[cfg(feature = "cuda")]
//!     match CudaBackend::new(0) {
//!         Ok(cuda) => return Ok(cuda),
//!         // No driver or no GPU here; a malformed HEADROOM_ALLOC_CONF is an error to fix.
//!         Err(CudaError::NoDevice { .. }) => {}
//!         Err(other) => return Err(other),
//!     }
//!     Ok(headroom_ops_cpu::CpuBackend::new_ref())
//! }
//!
//! let backend = gpu_or_cpu()?;
//! let x = Tensor::from_slice(&backend, &[1.0f32, 2.0, 3.0], &[3])?;
//! x.requires_grad_(true)?;
//! x.mul(&x)?.sum_all()?.backward()?;
//! assert_eq!(x.grad().unwrap().to_vec::<f32>()?, [2.0, 4.0, 6.0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;

// The ground floor: the device's state and what every kernel family uses. It imports no family.
#[cfg(feature = "cuda")]
mod blas;
#[cfg(feature = "cuda")]
mod blas_lt;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod graph;
#[cfg(feature = "cuda")]
mod kernels;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod operands;
#[cfg(feature = "cuda")]
mod profile;
#[cfg(feature = "cuda")]
mod scratch;
#[cfg(feature = "cuda")]
mod small_copies;
#[cfg(feature = "cuda")]
mod stream;

// The families: each sits on the ground floor and imports no other family.
#[cfg(feature = "cuda")]
mod attention;
#[cfg(feature = "cuda")]
mod elementwise;
#[cfg(feature = "cuda")]
mod float8;
#[cfg(feature = "cuda")]
mod index;
#[cfg(feature = "cuda")]
mod linear;
#[cfg(feature = "cuda")]
mod llama;
#[cfg(feature = "cuda")]
mod matmul;
#[cfg(feature = "cuda")]
mod pinned;
#[cfg(feature = "cuda")]
mod rows;

// The top floor: `impl Backend for CudaBackend`, dispatching to the families.
#[cfg(feature = "cuda")]
mod backend;

pub use error::CudaError;

#[cfg(feature = "cuda")]
pub use device::{CudaBackend, CudaBackendOptions};
#[cfg(feature = "cuda")]
pub use graph::{CaptureError, CudaGraph, GraphedStep, ReplayIndex, ReplayLink, StepRun};
#[cfg(feature = "cuda")]
pub use index::{ForeignLogitTile, ForeignTileGradient, ForeignTileStats};
#[cfg(feature = "cuda")]
pub use kernels::ptx_text;
#[cfg(feature = "cuda")]
pub use launch::{CudaKernel, KernelArg};
#[cfg(feature = "cuda")]
pub use pinned::{InFlight, PinnedBuffer};
#[cfg(feature = "cuda")]
pub use profile::OpTiming;
#[cfg(feature = "cuda")]
pub use small_copies::SmallCopies;
#[cfg(feature = "cuda")]
pub use stream::{CudaEvent, CudaStream};

/// Without the `cuda` feature: a backend that cannot be created.
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
pub struct CudaBackend {
    _never: std::convert::Infallible,
}

#[cfg(not(feature = "cuda"))]
impl CudaBackend {
    /// Always fails: this build has no CUDA support (enable the `cuda` feature).
    pub fn new(ordinal: usize) -> Result<std::sync::Arc<CudaBackend>, CudaError> {
        let _ = ordinal;
        Err(CudaError::NotCompiled)
    }
}
