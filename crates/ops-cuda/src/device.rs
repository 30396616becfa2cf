//! [`CudaBackend`]: the state of one CUDA device, which every kernel family reads.
//!
//! The backend owns the device's primary context (through cudarc), a
//! `CachingAllocator<CudaStorage>` with Headroom's default settings (expandable segments), the
//! kernel cache (`kernels.rs`), the BLAS libraries' state (`blas.rs`, created on the first
//! product), the pinned-host allocator of `pinned.rs`, the slots of deferred index checks
//! (`index.rs`) and the pinned memory small copies go through (`small_copies.rs`). Every launch goes to the compute stream: a blocking stream the device
//! allocator's storage creates as its `StreamId::DEFAULT` (ordered with the legacy default
//! stream both ways, and capturable into a CUDA graph, `graph.rs`). This module holds the state
//! and its accessors: creating the backend, binding its context, returning memory, the TF32
//! switch; the `Backend` trait is `backend.rs`, and each family adds its own methods in its file
//! (`synchronize` is `index.rs`'s, since it is where deferred index checks report).
//!
//! This module is ground floor: it sits on the caching allocator, cudarc, `kernels.rs`,
//! `blas.rs`, `profile.rs` and `small_copies.rs`, and knows no kernel family.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use headroom_autograd_core::Result;
use headroom_caching_allocator::{
    AllocError, Allocation, AllocatorConfig, CachingAllocator, CudaStorage, CudaStorageOptions,
    PinnedHostOptions, PinnedHostStorage, StreamId,
};
use parking_lot::{MappedMutexGuard, Mutex, MutexGuard};

use crate::blas::BlasState;
use crate::error::{device_error, CudaError};
use crate::graph::CaptureState;
use crate::kernels::KernelCache;
use crate::profile::{OpProfiler, OpTiming};
use crate::small_copies::{SmallCopies, SmallCopyMemory};

/// How [`CudaBackend::with_options`] sets a backend up.
#[derive(Debug, Clone, Default)]
pub struct CudaBackendOptions {
    /// The device allocator's configuration (`HEADROOM_ALLOC_CONF`'s settings).
    pub allocator: AllocatorConfig,
    /// Bytes of pinned host memory the backend may hold at most, shared by everything that
    /// keeps data in host memory through it (activation offload's pools, pinned buffers): past
    /// it an allocation fails with an out-of-memory error that names the budget
    /// ([`headroom_caching_allocator::AllocError::OutOfMemory`], storage `pinned`), without
    /// asking the driver. `None`: the host's limit (page-locked memory cannot be swapped out, so
    /// a budget keeps a training run from starving the host).
    pub pinned_budget: Option<u64>,
}

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
    /// The op profile's spans while one runs (`profile.rs`).
    pub(crate) profiler: OpProfiler,
    /// Whether a CUDA graph capture runs, and why its step cannot be captured (`graph.rs`).
    pub(crate) capture: CaptureState,
    /// The device's compute capability, (major, minor), read once.
    compute_capability: (i32, i32),
    /// Attention forwards and backwards run on the Hopper wgmma kernels (`attention/wgmma.rs`).
    pub(crate) wgmma_forwards: AtomicU64,
    pub(crate) wgmma_backwards: AtomicU64,
    /// Attention forwards on the warp-specialised Hopper kernel (`attention/warp_specialized.rs`).
    pub(crate) ws_forwards: AtomicU64,
    /// Attention backwards whose dK/dV ran on the warp-specialised kernel.
    pub(crate) ws_backwards: AtomicU64,
    /// Rowwise fp8 products scaled after a unit-scaled product (`linear.rs`).
    pub(crate) float8_scaled_after: AtomicU64,
    /// How a few bytes are copied between host and device memory (`small_copies.rs`).
    pub(crate) small_copies: Mutex<SmallCopies>,
    /// The pinned memory small copies go through, allocated on the first (`small_copies.rs`).
    pub(crate) small_copy_memory: Mutex<Option<SmallCopyMemory>>,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if let Some(slots) = self.deferred_index_checks.get_mut().take() {
            self.free_quietly(slots);
        }
        if let Some(state) = self.blas.get_mut().take() {
            let _ = self.context.bind_to_thread();
            state.release(&self.allocator);
        }
        if let Some(memory) = self.small_copy_memory.get_mut().take() {
            let _ = self.context.bind_to_thread();
            memory.free();
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
    /// `HEADROOM_ALLOC_CONF` when set). An error, not a panic, when there is no driver or device
    /// ([`CudaError::NoDevice`]) or the variable is malformed ([`CudaError::Config`]).
    pub fn new(ordinal: usize) -> std::result::Result<Arc<CudaBackend>, CudaError> {
        let config = AllocatorConfig::from_env().map_err(|e| CudaError::Config {
            reason: e.to_string(),
        })?;
        CudaBackend::with_config(ordinal, config)
    }

    /// The backend of device `ordinal` with an explicit allocator configuration.
    pub fn with_config(
        ordinal: usize,
        config: AllocatorConfig,
    ) -> std::result::Result<Arc<CudaBackend>, CudaError> {
        let options = CudaBackendOptions {
            allocator: config,
            ..CudaBackendOptions::default()
        };
        CudaBackend::with_options(ordinal, options)
    }

    /// The backend of device `ordinal` with `options`: the device allocator's configuration and
    /// the byte budget of its pinned host memory.
    pub fn with_options(
        ordinal: usize,
        options: CudaBackendOptions,
    ) -> std::result::Result<Arc<CudaBackend>, CudaError> {
        let CudaBackendOptions {
            allocator: config,
            pinned_budget,
        } = options;
        let no_device = |reason: String| CudaError::NoDevice { ordinal, reason };
        // The storage checks for the driver first, so a machine without one gets an error here
        // before cudarc is asked for anything.
        let storage_options = CudaStorageOptions {
            own_default_stream: true,
            ..CudaStorageOptions::default()
        };
        let storage = CudaStorage::with_options(ordinal, storage_options)
            .map_err(|e| no_device(e.to_string()))?;
        let compute_stream = storage
            .raw_stream(StreamId::DEFAULT)
            .ok_or_else(|| no_device("the storage has no default stream".into()))?;
        let pinned_options = PinnedHostOptions {
            memory_limit: pinned_budget,
        };
        let pinned = PinnedHostStorage::with_options(ordinal, pinned_options)
            .map_err(|e| no_device(e.to_string()))?;
        let context = CudaContext::new(ordinal).map_err(|e| no_device(e.to_string()))?;
        // SAFETY: the stream belongs to the device's primary context (the storage's), and the
        // storage, which destroys it, lives in the backend's allocator, which outlives every user
        // of the wrapper (the backend's fields and the cuBLAS state released in `Drop`).
        let stream = unsafe { context.wrap_borrowed_stream(compute_stream.cast()) };
        let compute_capability = context
            .compute_capability()
            .map_err(|e| no_device(e.to_string()))?;
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
            profiler: OpProfiler::default(),
            capture: CaptureState::default(),
            compute_capability,
            wgmma_forwards: AtomicU64::new(0),
            wgmma_backwards: AtomicU64::new(0),
            ws_forwards: AtomicU64::new(0),
            ws_backwards: AtomicU64::new(0),
            float8_scaled_after: AtomicU64::new(0),
            small_copies: Mutex::new(SmallCopies::default()),
            small_copy_memory: Mutex::new(None),
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

    /// The device's compute capability, (major, minor): (9, 0) on an H100 or H200.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// The number of frees that failed since creation, and the first failure.
    pub fn free_errors(&self) -> (u64, Option<String>) {
        let errors = self.free_errors.lock();
        (errors.0, errors.1.as_ref().map(ToString::to_string))
    }

    /// Returns `allocation` to the allocator, recording a failure like
    /// [`Backend::free`](headroom_autograd_core::Backend::free).
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

    /// Makes the backend's context current on this thread (before any driver call), naming `op`
    /// in the error.
    pub(crate) fn bind(&self, op: &'static str) -> Result<()> {
        self.context
            .bind_to_thread()
            .map_err(|e| device_error(op, e))
    }

    /// Starts recording the device time of every primitive (dropping a profile not finished);
    /// see `profile.rs`.
    pub fn start_op_profile(&self) -> Result<()> {
        self.capture
            .refuse("start_op_profile", "times ops with events the host reads")?;
        self.bind("op_profile")?;
        self.profiler.start();
        Ok(())
    }

    /// Stops recording, waits for the device and returns each primitive's time since
    /// [`CudaBackend::start_op_profile`], in launch order.
    pub fn finish_op_profile(&self) -> Result<Vec<OpTiming>> {
        self.bind("op_profile")?;
        self.profiler.finish()
    }

    /// The cuBLAS state, created on first use (handle on the default stream, workspace from the
    /// caching allocator).
    pub(crate) fn blas_state(&self) -> Result<MappedMutexGuard<'_, BlasState>> {
        self.bind("matmul")?;
        let mut guard = self.blas.lock();
        if guard.is_none() {
            *guard = Some(BlasState::create(&self.stream, &self.allocator)?);
        }
        Ok(MutexGuard::map(guard, |state| {
            state.as_mut().expect("created above")
        }))
    }
}
