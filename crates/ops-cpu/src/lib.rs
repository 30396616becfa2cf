//! The CPU backend: every autograd-core primitive on host memory.
//!
//! [`CpuBackend`] implements [`Backend`] over a [`CachingAllocator`] of [`HostStorage`] (the
//! classic policy, since host memory cannot map pages), so `memory_allocated()` counts CPU
//! tensors exactly as it counts GPU ones. Kernels compute f32 and f64 natively and f16/bf16 in
//! f32; large elementwise walks, reductions, softmax, layer norm and cross-entropy spread over
//! rayon, and GEMM goes through the `gemm` crate on strided operands. It is the reference the
//! CUDA backend is checked against, and the default on machines without a GPU.
//!
//! This crate sits on autograd-core (the trait and views) and the caching allocator. It knows
//! nothing about the graph: it only fills output views.
//!
//! ```
//! use headroom_autograd_core::{DType, Tensor};
//!
//! let cpu = headroom_ops_cpu::CpuBackend::new_ref();
//! let x = Tensor::from_slice(&cpu, &[1.0f32, 2.0, 3.0], &[3])?;
//! x.requires_grad_(true)?;
//! x.mul(&x)?.sum_all()?.backward()?;
//! assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![2.0, 4.0, 6.0]);
//! # Ok::<(), headroom_autograd_core::TensorError>(())
//! ```

mod attention;
mod cross_entropy;
mod element;
mod elementwise;
mod index;
mod layer_norm;
mod matmul;
mod reduce;
mod softmax;
mod strided;

use std::sync::Arc;

use headroom_autograd_core::{
    AttentionBackward, AttentionForward, Backend, BackendRef, BinaryOp, Buffer, CrossEntropyArgs,
    Device, LayerNormBackward, LayerNormForward, MaskedOp, ReduceOp, Result, UnaryOp, View,
};
use headroom_caching_allocator::{
    AllocError, Allocation, AllocatorConfig, CachingAllocator, HostStorage, MemoryStats, StreamId,
};
use parking_lot::Mutex;

/// The CPU backend: host memory from a caching allocator, kernels on rayon's pool.
#[derive(Debug)]
pub struct CpuBackend {
    allocator: CachingAllocator<HostStorage>,
    free_errors: Mutex<FreeErrors>,
}

/// Frees that failed (they cannot be reported from `Drop`): the first error and a count.
#[derive(Debug, Default)]
struct FreeErrors {
    first: Option<AllocError>,
    count: u64,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new(CachingAllocator::new(
            HostStorage::new(),
            AllocatorConfig::default(),
        ))
    }
}

impl CpuBackend {
    /// A backend over `allocator`.
    pub fn new(allocator: CachingAllocator<HostStorage>) -> CpuBackend {
        CpuBackend {
            allocator,
            free_errors: Mutex::new(FreeErrors::default()),
        }
    }

    /// A fresh backend with its own allocator (default settings), as a shared handle.
    pub fn new_ref() -> BackendRef {
        Arc::new(CpuBackend::default())
    }

    /// The allocator, for statistics, snapshots and `empty_cache`.
    pub fn allocator(&self) -> &CachingAllocator<HostStorage> {
        &self.allocator
    }

    /// The number of frees that failed, and the first failure, since creation.
    pub fn free_errors(&self) -> (u64, Option<String>) {
        let errors = self.free_errors.lock();
        (errors.count, errors.first.as_ref().map(ToString::to_string))
    }
}

impl Backend for CpuBackend {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }

    fn allocate(&self, bytes: u64) -> Result<Allocation> {
        Ok(self.allocator.allocate(bytes, StreamId::DEFAULT)?)
    }

    fn free(&self, allocation: Allocation) {
        if let Err(error) = self.allocator.free(allocation) {
            let mut errors = self.free_errors.lock();
            errors.count += 1;
            errors.first.get_or_insert(error);
        }
    }

    fn memory_stats(&self) -> MemoryStats {
        self.allocator.memory_stats()
    }

    fn write_host(&self, dst: &Buffer, byte_offset: usize, data: &[u8]) -> Result<()> {
        dst.check_range("write_host", byte_offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: the range is inside the live host buffer (checked above) and `data` is a
        // separate host slice, so the regions do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                (dst.address() as *mut u8).add(byte_offset),
                data.len(),
            );
        }
        Ok(())
    }

    fn read_host(&self, src: &Buffer, byte_offset: usize, out: &mut [u8]) -> Result<()> {
        src.check_range("read_host", byte_offset, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: the range is inside the live host buffer (checked above) and `out` is a
        // separate, exclusively borrowed host slice.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (src.address() as *const u8).add(byte_offset),
                out.as_mut_ptr(),
                out.len(),
            );
        }
        Ok(())
    }

    fn copy(&self, src: View<'_>, dst: View<'_>) -> Result<()> {
        elementwise::copy(src, dst)
    }

    fn fill(&self, dst: View<'_>, value: f64) -> Result<()> {
        elementwise::fill(dst, value)
    }

    fn unary(&self, op: UnaryOp, x: View<'_>, out: View<'_>) -> Result<()> {
        elementwise::unary(op, x, out)
    }

    fn binary(&self, op: BinaryOp, a: View<'_>, b: View<'_>, out: View<'_>) -> Result<()> {
        elementwise::binary(op, a, b, out)
    }

    fn masked(&self, op: MaskedOp, x: View<'_>, mask: View<'_>, out: View<'_>) -> Result<()> {
        elementwise::masked(op, x, mask, out)
    }

    fn reduce(&self, op: ReduceOp, x: View<'_>, n_reduced: usize, out: View<'_>) -> Result<()> {
        reduce::reduce(op, x, n_reduced, out)
    }

    fn reduce_with_index(
        &self,
        op: ReduceOp,
        x: View<'_>,
        values: View<'_>,
        indices: View<'_>,
    ) -> Result<()> {
        reduce::reduce_with_index(op, x, values, indices)
    }

    fn matmul(&self, a: View<'_>, b: View<'_>, out: View<'_>, accumulate: bool) -> Result<()> {
        matmul::matmul(a, b, out, accumulate)
    }

    fn softmax(&self, x: View<'_>, dim: usize, log: bool, out: View<'_>) -> Result<()> {
        softmax::softmax(x, dim, log, out)
    }

    fn softmax_backward(
        &self,
        y: View<'_>,
        dy: View<'_>,
        dim: usize,
        log: bool,
        dx: View<'_>,
    ) -> Result<()> {
        softmax::softmax_backward(y, dy, dim, log, dx)
    }

    fn layer_norm(&self, args: LayerNormForward<'_>) -> Result<()> {
        layer_norm::layer_norm(args)
    }

    fn layer_norm_backward(&self, args: LayerNormBackward<'_>) -> Result<()> {
        layer_norm::layer_norm_backward(args)
    }

    fn cross_entropy(
        &self,
        args: CrossEntropyArgs<'_>,
        loss: View<'_>,
        lse: View<'_>,
    ) -> Result<()> {
        cross_entropy::cross_entropy(args, loss, lse)
    }

    fn cross_entropy_backward(
        &self,
        args: CrossEntropyArgs<'_>,
        lse: View<'_>,
        dloss: View<'_>,
        dlogits: View<'_>,
    ) -> Result<()> {
        cross_entropy::cross_entropy_backward(args, lse, dloss, dlogits)
    }

    fn gather(&self, x: View<'_>, dim: usize, index: View<'_>, out: View<'_>) -> Result<()> {
        index::gather(x, dim, index, out)
    }

    fn scatter_add(&self, dst: View<'_>, dim: usize, index: View<'_>, src: View<'_>) -> Result<()> {
        index::scatter_add(dst, dim, index, src)
    }

    fn attention(&self, args: AttentionForward<'_>) -> Result<()> {
        attention::attention(args)
    }

    fn attention_backward(&self, args: AttentionBackward<'_>) -> Result<()> {
        attention::attention_backward(args)
    }

    fn dropout(
        &self,
        x: View<'_>,
        p: f64,
        seed: u64,
        offset: u64,
        out: View<'_>,
        mask: View<'_>,
    ) -> Result<()> {
        elementwise::dropout(x, p, seed, offset, out, mask)
    }
}
