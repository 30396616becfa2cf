//! [`CudaBackend`]: one CUDA device, its caching allocator and its kernels.
//!
//! The backend owns the device's primary context (through cudarc), a
//! `CachingAllocator<CudaStorage>` with Headroom's default settings (expandable segments) and the
//! kernel cache. Every launch goes to the context's default stream; host transfers of the trait
//! are synchronous (asynchronous copies through pinned memory are in `pinned.rs`, on the streams
//! of `stream.rs`). Driver failures become `TensorError::Device` naming the op.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::{result, CudaContext, CudaStream};
use headroom_autograd_core::{
    AttentionBackward, AttentionForward, Backend, BinaryOp, Buffer, CrossEntropyArgs, Device,
    LayerNormBackward, LayerNormForward, LinearForward, LinearWeightGrad, MaskedOp, ReduceOp,
    Result, TensorError, UnaryOp, View,
};
use headroom_caching_allocator::{
    AllocError, Allocation, AllocatorConfig, CachingAllocator, CudaStorage, MemoryStats,
    PinnedHostStorage, StreamId,
};
use parking_lot::Mutex;

use crate::attention;
use crate::elementwise;
use crate::error::CudaError;
use crate::index;
use crate::kernels::KernelCache;
use crate::linear;
use crate::matmul::{self, BlasState};
use crate::rows;

/// The CUDA backend of one device.
pub struct CudaBackend {
    pub(crate) ordinal: usize,
    pub(crate) context: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) kernels: KernelCache,
    allocator: CachingAllocator<CudaStorage>,
    free_errors: Mutex<(u64, Option<AllocError>)>,
    /// cuBLAS, created on the first matrix product.
    pub(crate) blas: Mutex<Option<BlasState>>,
    /// f32 matrix products may use TF32 tensor cores (off by default, as in PyTorch).
    allow_tf32: AtomicBool,
    /// Pinned host memory for asynchronous copies (`pinned.rs`). Dropped after `allocator`,
    /// whose storage owns the streams it records events on.
    pub(crate) pinned: CachingAllocator<PinnedHostStorage>,
    /// The deferred index-check slots, one error word per checked op (`index.rs`), while index
    /// checks are deferred.
    pub(crate) deferred_index_checks: Mutex<Option<Allocation>>,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if let Some(slots) = self.deferred_index_checks.get_mut().take() {
            self.free_quietly(slots);
        }
        if let Some(state) = self.blas.get_mut().take() {
            let _ = self.context.bind_to_thread();
            state.release(self);
        }
    }
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.ordinal)
            .field("allocator", &self.allocator)
            .finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// The backend of device `ordinal`, with Headroom's default allocator settings (from
    /// `HEADROOM_ALLOC_CONF` when set). An error, not a panic, when there is no driver or device.
    pub fn new(ordinal: usize) -> std::result::Result<Arc<CudaBackend>, CudaError> {
        let config = AllocatorConfig::from_env().map_err(|e| CudaError::NoDevice {
            ordinal,
            reason: e.to_string(),
        })?;
        CudaBackend::with_config(ordinal, config)
    }

    /// The backend of device `ordinal` with an explicit allocator configuration.
    pub fn with_config(
        ordinal: usize,
        config: AllocatorConfig,
    ) -> std::result::Result<Arc<CudaBackend>, CudaError> {
        let no_device = |reason: String| CudaError::NoDevice { ordinal, reason };
        // The storage checks for the driver first, so a machine without one gets an error here
        // before cudarc is asked for anything.
        let storage = CudaStorage::new(ordinal).map_err(|e| no_device(e.to_string()))?;
        let pinned = PinnedHostStorage::new(ordinal).map_err(|e| no_device(e.to_string()))?;
        let context = CudaContext::new(ordinal).map_err(|e| no_device(e.to_string()))?;
        let stream = context.default_stream();
        Ok(Arc::new(CudaBackend {
            ordinal,
            context,
            stream,
            kernels: KernelCache::default(),
            allocator: CachingAllocator::new(storage, config),
            free_errors: Mutex::new((0, None)),
            blas: Mutex::new(None),
            allow_tf32: AtomicBool::new(false),
            pinned: CachingAllocator::new(pinned, AllocatorConfig::pytorch_defaults()),
            deferred_index_checks: Mutex::new(None),
        }))
    }

    /// The allocator, for statistics, snapshots and `empty_cache`.
    pub fn allocator(&self) -> &CachingAllocator<CudaStorage> {
        &self.allocator
    }

    /// Lets f32 matrix products run on TF32 tensor cores (10-bit mantissa inputs, f32
    /// accumulation; about 1e-3 relative error), PyTorch's `torch.backends.cuda.matmul.allow_tf32`.
    /// Off by default: f32 products are computed in f32.
    pub fn set_allow_tf32(&self, allow: bool) {
        self.allow_tf32.store(allow, Ordering::Relaxed);
    }

    /// Whether f32 matrix products may use TF32 (see [`CudaBackend::set_allow_tf32`]).
    pub fn allow_tf32(&self) -> bool {
        self.allow_tf32.load(Ordering::Relaxed)
    }

    /// Waits until every launched kernel has finished; then returns the error of a deferred index
    /// check, if one is pending (see [`CudaBackend::set_deferred_index_checks`]).
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| device_error("synchronize", e))?;
        self.take_deferred_index_error()
    }

    /// The number of frees that failed since creation, and the first failure.
    pub fn free_errors(&self) -> (u64, Option<String>) {
        let errors = self.free_errors.lock();
        (errors.0, errors.1.as_ref().map(ToString::to_string))
    }

    /// Returns `allocation` to the allocator, recording a failure like [`Backend::free`].
    pub(crate) fn free_quietly(&self, allocation: Allocation) {
        if let Err(error) = self.allocator.free(allocation) {
            self.note_free_error(error);
        }
    }

    /// Counts a failed free (where `Drop` cannot return it); see [`CudaBackend::free_errors`].
    pub(crate) fn note_free_error(&self, error: AllocError) {
        let mut errors = self.free_errors.lock();
        errors.0 += 1;
        errors.1.get_or_insert(error);
    }

    pub(crate) fn bind(&self, op: &'static str) -> Result<()> {
        self.context
            .bind_to_thread()
            .map_err(|e| device_error(op, e))
    }
}

/// Device scratch from the backend's caching allocator (at least 8 bytes), returned when
/// dropped: in stream order, so kernels queued on the default stream that use it run before any
/// later reuse; a failed free is recorded like [`Backend::free`]'s.
pub(crate) struct Scratch<'a> {
    backend: &'a CudaBackend,
    allocation: Option<Allocation>,
}

impl<'a> Scratch<'a> {
    pub(crate) fn new(backend: &'a CudaBackend, bytes: u64) -> Result<Scratch<'a>> {
        let allocation = backend
            .allocator
            .allocate(bytes.max(8), StreamId::DEFAULT)?;
        Ok(Scratch {
            backend,
            allocation: Some(allocation),
        })
    }

    /// The device address of the scratch memory.
    pub(crate) fn address(&self) -> u64 {
        self.allocation.as_ref().map_or(0, Allocation::address)
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        if let Some(allocation) = self.allocation.take() {
            self.backend.free_quietly(allocation);
        }
    }
}

/// A driver error as the core's error type.
pub(crate) fn device_error(op: &'static str, error: impl std::fmt::Display) -> TensorError {
    TensorError::Device {
        op,
        reason: error.to_string(),
    }
}

impl Backend for CudaBackend {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }

    fn allocate(&self, bytes: u64) -> Result<Allocation> {
        let stream = crate::stream::allocation_stream(self);
        let allocation = self.allocator.allocate(bytes, stream)?;
        if stream != StreamId::DEFAULT {
            // A side stream's block (`allocate_on_stream`) is used by kernels too: its reuse waits
            // for the compute stream's work queued before its free.
            if let Err(error) = self.allocator.record_stream(&allocation, StreamId::DEFAULT) {
                self.free(allocation);
                return Err(error.into());
            }
        }
        Ok(allocation)
    }

    fn free(&self, allocation: Allocation) {
        self.free_quietly(allocation);
    }

    fn memory_stats(&self) -> MemoryStats {
        self.allocator.memory_stats()
    }

    fn write_host(&self, dst: &Buffer, byte_offset: usize, data: &[u8]) -> Result<()> {
        dst.check_range("write_host", byte_offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        self.bind("write_host")?;
        // SAFETY: the destination range lies inside the live device buffer (checked above);
        // `data` is a host slice of that length. The synchronous copy runs on the legacy default
        // stream, where every kernel runs, so it starts only after the kernels queued before it
        // (no explicit synchronisation needed).
        unsafe { result::memcpy_htod_sync(dst.address() + byte_offset as u64, data) }
            .map_err(|e| device_error("write_host", e))
    }

    fn read_host(&self, src: &Buffer, byte_offset: usize, out: &mut [u8]) -> Result<()> {
        src.check_range("read_host", byte_offset, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        self.bind("read_host")?;
        // SAFETY: the source range lies inside the live device buffer (checked above) and `out`
        // is exclusively borrowed. The synchronous copy runs on the legacy default stream after
        // the kernels queued before it, and returns once the data is on the host.
        unsafe { result::memcpy_dtoh_sync(out, src.address() + byte_offset as u64) }
            .map_err(|e| device_error("read_host", e))?;
        // The copy waited for the queued kernels: a deferred index check has its answer.
        self.take_deferred_index_error()
    }

    fn copy(&self, src: View<'_>, dst: View<'_>) -> Result<()> {
        elementwise::copy(self, src, dst)
    }

    fn fill(&self, dst: View<'_>, value: f64) -> Result<()> {
        elementwise::fill(self, dst, value)
    }

    fn unary(&self, op: UnaryOp, x: View<'_>, out: View<'_>) -> Result<()> {
        elementwise::unary(self, op, x, out)
    }

    fn binary(&self, op: BinaryOp, a: View<'_>, b: View<'_>, out: View<'_>) -> Result<()> {
        elementwise::binary(self, op, a, b, out)
    }

    fn masked(&self, op: MaskedOp, x: View<'_>, mask: View<'_>, out: View<'_>) -> Result<()> {
        elementwise::masked(self, op, x, mask, out)
    }

    fn reduce(&self, op: ReduceOp, x: View<'_>, n_reduced: usize, out: View<'_>) -> Result<()> {
        rows::reduce(self, op, x, n_reduced, out)
    }

    fn reduce_with_index(
        &self,
        op: ReduceOp,
        x: View<'_>,
        values: View<'_>,
        indices: View<'_>,
    ) -> Result<()> {
        rows::reduce_with_index(self, op, x, values, indices)
    }

    fn matmul(&self, a: View<'_>, b: View<'_>, out: View<'_>, accumulate: bool) -> Result<()> {
        matmul::matmul(self, a, b, out, accumulate)
    }

    fn linear(&self, args: LinearForward<'_>) -> Result<()> {
        linear::linear(self, args)
    }

    fn linear_weight_grad(&self, args: LinearWeightGrad<'_>) -> Result<()> {
        linear::linear_weight_grad(self, args)
    }

    fn softmax(&self, x: View<'_>, dim: usize, log: bool, out: View<'_>) -> Result<()> {
        rows::softmax(self, x, dim, log, out)
    }

    fn softmax_backward(
        &self,
        y: View<'_>,
        dy: View<'_>,
        dim: usize,
        log: bool,
        dx: View<'_>,
    ) -> Result<()> {
        rows::softmax_backward(self, y, dy, dim, log, dx)
    }

    fn layer_norm(&self, args: LayerNormForward<'_>) -> Result<()> {
        rows::layer_norm(self, args)
    }

    fn layer_norm_backward(&self, args: LayerNormBackward<'_>) -> Result<()> {
        rows::layer_norm_backward(self, args)
    }

    fn cross_entropy(
        &self,
        args: CrossEntropyArgs<'_>,
        loss: View<'_>,
        lse: View<'_>,
    ) -> Result<()> {
        index::cross_entropy(self, args, loss, lse)
    }

    fn cross_entropy_backward(
        &self,
        args: CrossEntropyArgs<'_>,
        lse: View<'_>,
        dloss: View<'_>,
        dlogits: View<'_>,
    ) -> Result<()> {
        index::cross_entropy_backward(self, args, lse, dloss, dlogits)
    }

    fn gather(&self, x: View<'_>, dim: usize, index: View<'_>, out: View<'_>) -> Result<()> {
        index::gather(self, x, dim, index, out)
    }

    fn scatter_add(&self, dst: View<'_>, dim: usize, index: View<'_>, src: View<'_>) -> Result<()> {
        index::scatter_add(self, dst, dim, index, src)
    }

    fn attention(&self, args: AttentionForward<'_>) -> Result<()> {
        attention::attention(self, args)
    }

    fn attention_backward(&self, args: AttentionBackward<'_>) -> Result<()> {
        attention::attention_backward(self, args)
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
        index::dropout(self, x, p, seed, offset, out, mask)
    }
}
