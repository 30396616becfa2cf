//! CUDA graphs: a step's kernels captured once and replayed with one launch, PyTorch's
//! `torch.cuda.graph` over the backend's compute stream.
//!
//! [`CudaBackend::capture`] runs a closure with the compute stream in capture mode (relaxed:
//! allocating memory stays legal) and every device allocation of the compute stream routed to a
//! private pool of the caching allocator. The kernels, copies and memsets the closure queues are
//! recorded, not run; the [`CudaGraph`] it returns replays them on the same addresses, so the
//! pool's blocks stay reserved for the graph (no `empty_cache` or page reclaim touches them)
//! until the graph is dropped. Tensors the closure created keep their pool memory and hold the
//! replay's results: a step's loss and gradients are read from them after each replay, as from
//! PyTorch's static outputs, and new inputs are copied into the tensors the capture read.
//!
//! A replay runs none of the closure's host code, so a step that depends on the host cannot be
//! captured: a read of device memory (`to_vec`, `item`, `synchronize`), a write from host memory
//! (`Tensor::from_slice`, a foreach optimizer's per-step table), a dropout draw (its seed comes from the
//! host) or an asynchronous pinned copy. Each of these refuses inside a capture
//! ([`CaptureState::refuse`]): the op fails, the capture is abandoned, and [`CudaBackend::capture`]
//! returns [`CaptureError::NotCapturable`] with the first reason, never a graph that would
//! replay stale host values. The abandoned capture ran nothing on the device. [`GraphedStep`]
//! turns this into a training loop's policy: warm up, capture, replay while the inputs keep
//! their shapes, and run eagerly (with the reason) where capture is refused.
//!
//! A step may still depend on its replay: an optimizer's step number grows with every replay.
//! Inside a capture, [`CudaBackend::replay_link`] lends such an op a device `u32` that holds the
//! replay's index (0 for the first; the graph sets it before each launch) and a [`ReplayLink`]
//! that counts the replays on the host and lets the op mark the graph stale when a host value it
//! baked in changes (a new learning rate): a stale graph refuses to replay, naming the reason,
//! and [`GraphedStep`] captures the step again. [`CudaBackend::write_for_replays`] copies bytes
//! that stay the same for every replay (a launch table of device addresses and
//! hyperparameters) through pinned memory the graph keeps, as a copy node every replay runs.
//!
//! Index checks are deferred while capturing (a replayed kernel records a bad index in the
//! backend's slots, reported by the next synchronisation), and stay deferred afterwards.
//!
//! This module sits on the backend's state (`device.rs`: the compute stream, the allocator) and
//! cudarc's graph calls; the other modules only ask [`CaptureState::refuse`] before touching the
//! host. It knows nothing about autograd beyond the tensors [`GraphedStep`] compares.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::sys;
use headroom_autograd_core::{DType, Result, Tensor, TensorError};
use headroom_caching_allocator::{Allocation, PinnedHostStorage, PrivatePoolId, StreamId};
use parking_lot::Mutex;

use crate::device::CudaBackend;
use crate::error::device_error;

/// Whether the backend is capturing, the first reason its step cannot be captured, and what the
/// capture made that its graph must keep.
#[derive(Debug, Default)]
pub(crate) struct CaptureState {
    active: AtomicBool,
    refusal: Mutex<Option<String>>,
    holdings: Mutex<Holdings>,
}

/// What a capture made for its graph: the replay-index cell and its link, and the pinned bytes
/// its copy nodes read.
#[derive(Debug, Default)]
struct Holdings {
    /// Made before the capture begins (see [`CudaBackend::capture`]); `used` once an op asked
    /// for it, and only then set before each replay.
    replay_index: Option<(Allocation, ReplayLink)>,
    replay_index_used: bool,
    staged: Vec<Allocation>,
}

/// The host side of a captured graph's replays, shared by the graph and the ops that asked for
/// its replay index ([`CudaBackend::replay_link`]): how many replays were queued, and whether a
/// host value the capture baked in has changed since.
#[derive(Debug, Clone, Default)]
pub struct ReplayLink(Arc<LinkState>);

#[derive(Debug, Default)]
struct LinkState {
    replays: AtomicU64,
    stale: Mutex<Option<String>>,
    dropped: AtomicBool,
}

impl ReplayLink {
    /// Replays queued so far (the first replay runs with index 0, and counts 1 once queued).
    pub fn replays(&self) -> u64 {
        self.0.replays.load(Ordering::Acquire)
    }

    /// Marks the graph stale: its next replay fails with `reason` (and [`GraphedStep`] captures
    /// the step again) instead of running with the old value. The first reason is kept.
    pub fn invalidate(&self, reason: impl Into<String>) {
        self.0.stale.lock().get_or_insert_with(|| reason.into());
    }

    /// Whether `other` links to the same graph.
    pub fn same_graph(&self, other: &ReplayLink) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Whether the graph is dropped (or its capture abandoned): no replay will come.
    pub fn is_finished(&self) -> bool {
        self.0.dropped.load(Ordering::Acquire)
    }

    fn stale_reason(&self) -> Option<String> {
        self.0.stale.lock().clone()
    }

    fn finish(&self) {
        self.0.dropped.store(true, Ordering::Release);
    }
}

/// The replay index a captured op reads: a device `u32` the graph sets to the replay's index
/// before each launch, and the link to the graph's replays.
#[derive(Debug, Clone)]
pub struct ReplayIndex {
    /// Device address of the `u32` cell.
    pub address: u64,
    /// The graph's replay count and staleness.
    pub link: ReplayLink,
}

impl CaptureState {
    /// `Ok` outside a capture. Inside one, `op` needs the host (`what` says how): the reason is
    /// recorded for [`CudaBackend::capture`] and `op` fails, abandoning the capture.
    pub(crate) fn refuse(&self, op: &'static str, what: &str) -> Result<()> {
        if !self.active.load(Ordering::Acquire) {
            return Ok(());
        }
        let reason = format!("`{op}` {what}");
        self.refusal.lock().get_or_insert_with(|| reason.clone());
        Err(TensorError::Device {
            op,
            reason: format!("{reason}, which a CUDA graph cannot replay"),
        })
    }

    /// Whether a capture is running.
    pub(crate) fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    fn begin(&self, replay_cell: Allocation) {
        *self.refusal.lock() = None;
        *self.holdings.lock() = Holdings {
            replay_index: Some((replay_cell, ReplayLink::default())),
            ..Holdings::default()
        };
        self.active.store(true, Ordering::Release);
    }

    fn end(&self) -> (Option<String>, Holdings) {
        self.active.store(false, Ordering::Release);
        (
            self.refusal.lock().take(),
            std::mem::take(&mut *self.holdings.lock()),
        )
    }
}

impl Holdings {
    /// Frees what the graph kept, once nothing on the device uses it (the caller waited).
    fn release(self, backend: &CudaBackend) {
        if let Some((cell, link)) = self.replay_index {
            link.finish();
            backend.free_quietly(cell);
        }
        for staged in self.staged {
            if let Err(error) = backend.pinned.free(staged) {
                backend.note_free_error(error);
            }
        }
    }
}

/// Why [`CudaBackend::capture`] returned no graph.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The step needs the host inside the captured region, or the driver rejected the capture.
    /// Nothing the step queued ran; run it eagerly instead (as [`GraphedStep`] does).
    #[error("the step cannot be captured into a CUDA graph: {reason}")]
    NotCapturable {
        /// What in the step needs the host (the first such op), or the driver's complaint.
        reason: String,
    },
    /// The step failed for a reason of its own (a shape error, out of memory), or the backend
    /// could not prepare the capture.
    #[error(transparent)]
    Step(#[from] TensorError),
}

/// A captured step: its kernels, replayed by [`CudaGraph::replay`], and the private pool that
/// holds every buffer they use. Dropping it waits for the device, then returns the pool.
pub struct CudaGraph {
    backend: Arc<CudaBackend>,
    graph: Option<cudarc::driver::CudaGraph>,
    pool: PrivatePoolId,
    holdings: Option<Holdings>,
}

impl std::fmt::Debug for CudaGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaGraph")
            .field("device", &self.backend.ordinal)
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl CudaGraph {
    /// Queues the captured step on the compute stream, after the work queued before (input
    /// copies) and before the work queued after (an optimizer step outside the graph).
    ///
    /// A graph whose captured ops depend on the replay gets its replay index set first; one an
    /// op marked stale ([`ReplayLink::invalidate`]) fails with the reason and runs nothing.
    pub fn replay(&self) -> Result<()> {
        self.backend.bind("replay")?;
        if let Some(reason) = self.stale_reason() {
            return Err(TensorError::Device {
                op: "replay",
                reason: format!("the captured step is stale: {reason}; capture it again"),
            });
        }
        let graph = self.graph.as_ref().expect("present until drop");
        let replay_index = self
            .holdings
            .as_ref()
            .filter(|h| h.replay_index_used)
            .and_then(|h| h.replay_index.as_ref());
        if let Some((cell, link)) = replay_index {
            let index = u32::try_from(link.replays()).map_err(|_| TensorError::Device {
                op: "replay",
                reason: "a graph replays at most 2^32 times".into(),
            })?;
            // SAFETY: the cell is the graph's live 4-byte allocation; the memset is ordered on
            // the compute stream before the launch that reads it and after the replays before.
            unsafe {
                sys::cuMemsetD32Async(cell.address(), index, 1, self.backend.stream.cu_stream())
            }
            .result()
            .map_err(|e| device_error("replay", e))?;
        }
        graph.launch().map_err(|e| device_error("replay", e))?;
        if let Some((_, link)) = replay_index {
            link.0.replays.fetch_add(1, Ordering::AcqRel);
        }
        Ok(())
    }

    /// Why the graph may not replay any more (an op's [`ReplayLink::invalidate`]), if it may not.
    pub fn stale_reason(&self) -> Option<String> {
        let holdings = self.holdings.as_ref()?;
        holdings.replay_index.as_ref()?.1.stale_reason()
    }

    /// The private pool of the graph's buffers, for
    /// [`CachingAllocator::private_pool_usage`](headroom_caching_allocator::CachingAllocator::private_pool_usage)
    /// and the snapshot's `segment_pool_id`.
    pub fn pool(&self) -> PrivatePoolId {
        self.pool
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // Replays in flight use the pool: wait for them before the exec goes and the pool's
        // blocks become ordinary cached memory.
        let synced = self.backend.stream.synchronize();
        drop(self.graph.take());
        match synced {
            Ok(()) => {
                if let Some(holdings) = self.holdings.take() {
                    holdings.release(&self.backend);
                }
                if let Err(error) = self.backend.allocator().release_private_pool(self.pool) {
                    self.backend.note_free_error(error);
                }
            }
            // A device that cannot synchronise may still run the graph: keep its pool.
            Err(error) => {
                self.backend
                    .note_free_error(headroom_caching_allocator::AllocError::Storage(
                        headroom_caching_allocator::StorageError::Device(error.to_string()),
                    ))
            }
        }
    }
}

/// The refusal of a step that queued nothing.
const EMPTY: &str = "the step queued no work on the device";

/// Whether `graph` has no node (an empty graph replays nothing; PyTorch warns of it).
fn is_empty(graph: &cudarc::driver::CudaGraph) -> bool {
    let mut nodes = 0usize;
    // SAFETY: the graph is live (owned by `graph`); a null node array asks for the count only.
    let counted =
        unsafe { sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut nodes) };
    counted.result().is_ok() && nodes == 0
}

impl CudaBackend {
    /// Captures the kernels `step` queues on the compute stream into a [`CudaGraph`], with every
    /// allocation of the compute stream in the meantime taken from a new private pool; returns
    /// the graph and `step`'s value. Nothing `step` queues runs now: replay the graph to run it.
    ///
    /// Waits for the device first, and defers index checks
    /// ([`CudaBackend::set_deferred_index_checks`]) for good. Warm the step up eagerly before
    /// capturing it, as PyTorch asks, so that kernels, cuBLAS heuristics and the autograd
    /// engine's first-use work happen outside the capture. A step that needs the host inside
    /// (see the module documentation) returns [`CaptureError::NotCapturable`] naming the op; the
    /// tensors it created then hold no values, so a step run again eagerly must start from
    /// gradients set to none. While it captures, other threads must leave the backend alone:
    /// their kernels would join the graph, and the ops above refuse on any thread.
    pub fn capture<R>(
        self: &Arc<Self>,
        step: impl FnOnce() -> Result<R>,
    ) -> std::result::Result<(CudaGraph, R), CaptureError> {
        self.bind("capture")?;
        self.synchronize()?;
        self.set_deferred_index_checks(true)?;
        let allocator = self.allocator();
        // The replay-index cell comes from outside the graph's pool: a block of the pool may have
        // served a tensor earlier in the graph, whose kernels would overwrite the index that the
        // replay set before launching them.
        let replay_cell = allocator
            .allocate(4, StreamId::DEFAULT)
            .map_err(TensorError::from)?;
        let pool = allocator.create_private_pool();
        if let Err(error) = allocator.begin_allocate_to_pool(StreamId::DEFAULT, pool) {
            self.free_quietly(replay_cell);
            return Err(TensorError::from(error).into());
        }
        self.capture.begin(replay_cell);
        let began = self
            .stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED);
        let outcome = match began {
            Ok(()) => {
                let value = step();
                let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
                Ok((value, graph))
            }
            Err(error) => Err(error),
        };
        let (refusal, holdings) = self.capture.end();
        allocator.end_allocate_to_pool();
        let fail = |error: CaptureError, holdings: Holdings| {
            // Nothing ran; wait for the device anyway before the pool's blocks are returned.
            let _ = self.stream.synchronize();
            holdings.release(self);
            if let Err(release) = allocator.release_private_pool(pool) {
                self.note_free_error(release);
            }
            Err(error)
        };
        let not_capturable = |reason: String| CaptureError::NotCapturable { reason };
        match (outcome, refusal) {
            (Err(error), _) => fail(
                not_capturable(format!("beginning the capture: {error}")),
                holdings,
            ),
            (Ok(_), Some(reason)) => fail(not_capturable(reason), holdings),
            (Ok((Err(error), _)), None) => fail(CaptureError::Step(error), holdings),
            (Ok((Ok(_), Err(error))), None) => fail(
                not_capturable(format!("the driver rejected the captured work: {error}")),
                holdings,
            ),
            (Ok((Ok(_), Ok(None))), None) => fail(not_capturable(EMPTY.into()), holdings),
            (Ok((Ok(_), Ok(Some(graph)))), None) if is_empty(&graph) => {
                fail(not_capturable(EMPTY.into()), holdings)
            }
            (Ok((Ok(value), Ok(Some(graph)))), None) => Ok((
                CudaGraph {
                    backend: Arc::clone(self),
                    graph: Some(graph),
                    pool,
                    holdings: Some(holdings),
                },
                value,
            )),
        }
    }

    /// Whether a capture is running on this backend.
    pub fn is_capturing(&self) -> bool {
        self.capture.is_active()
    }

    /// Inside a capture, refuses it: `op` needs the host at every step (`what` says how), so the
    /// capture is abandoned and [`CudaBackend::capture`] returns
    /// [`CaptureError::NotCapturable`] with this reason; the error returned here is for `op` to
    /// pass on. `Ok` outside a capture. For ops of other crates (an optimizer whose launch table
    /// changes every step) that this crate's own refusals do not see.
    pub fn refuse_capture(&self, op: &'static str, what: &str) -> Result<()> {
        self.capture.refuse(op, what)
    }

    /// Inside a capture, the replay index of the graph being captured: a device `u32` that holds
    /// the index of each replay while it runs (0 for the first, set before each launch), and the
    /// link to the graph's replays. `None` outside a capture. Every call of one capture returns
    /// the same cell.
    pub fn replay_link(&self) -> Result<Option<ReplayIndex>> {
        if !self.capture.is_active() {
            return Ok(None);
        }
        let mut holdings = self.capture.holdings.lock();
        holdings.replay_index_used = true;
        let (cell, link) = holdings
            .replay_index
            .as_ref()
            .expect("made when the capture began");
        Ok(Some(ReplayIndex {
            address: cell.address(),
            link: link.clone(),
        }))
    }

    /// Copies `bytes` to device address `address` in stream order, as
    /// [`write_async`](CudaBackend::write_async) does; inside a capture the bytes go through
    /// pinned memory the graph keeps, and every replay copies them again. For bytes that are the
    /// same at every replay (a launch table of addresses and fixed hyperparameters); a value that
    /// changes per step must come from the device (see [`CudaBackend::replay_link`]).
    ///
    /// # Safety
    /// `address .. address + bytes.len()` must be live memory of this backend, and inside a
    /// capture stay so for the graph's life (an allocation of the capture's pool).
    pub unsafe fn write_for_replays(&self, address: u64, bytes: &[u8]) -> Result<()> {
        if !self.capture.is_active() || bytes.is_empty() {
            // SAFETY: forwarded from the caller.
            return unsafe { self.write_async(address, bytes) };
        }
        self.bind("write_for_replays")?;
        let staged = self
            .pinned
            .allocate(bytes.len() as u64, PinnedHostStorage::HOST_STREAM)?;
        // SAFETY: the pinned block is live, at least `bytes.len()` long and owned here; no copy
        // uses it yet.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), staged.address() as *mut u8, bytes.len())
        };
        // SAFETY: the destination is the caller's live range; the source is pinned memory the
        // graph keeps until it is dropped (after the device is done), so every replay's copy
        // node reads these bytes.
        let copied = unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                address,
                staged.address() as *const std::ffi::c_void,
                bytes.len(),
                self.stream.cu_stream(),
            )
        }
        .result()
        .map_err(|e| device_error("write_for_replays", e));
        self.capture.holdings.lock().staged.push(staged);
        copied
    }
}

/// How [`GraphedStep::run`] ran a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepRun {
    /// Eagerly: warming up, or capture is refused (see [`GraphedStep::eager_reason`]).
    Eager,
    /// Captured: this call ran the step once under capture, then replayed it once.
    Captured,
    /// Replayed: the captured graph ran; the step's host code did not.
    Replayed,
}

/// The identity of a step's inputs: a captured graph reads its inputs at their addresses, in
/// their layout.
#[derive(Debug, Clone, PartialEq, Eq)]
struct InputKey(Vec<InputIdentity>);

/// One input's address, shape, strides, offset and dtype.
#[derive(Debug, Clone, PartialEq, Eq)]
struct InputIdentity {
    address: u64,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
    dtype: DType,
}

impl InputKey {
    fn of(inputs: &[&Tensor]) -> InputKey {
        let entries = inputs
            .iter()
            .map(|t| InputIdentity {
                address: t.buffer().address(),
                shape: t.shape().to_vec(),
                strides: t.strides().to_vec(),
                offset: t.layout().offset(),
                dtype: t.dtype(),
            })
            .collect();
        InputKey(entries)
    }
}

enum Phase {
    Warming { done: usize },
    Captured(CudaGraph),
    Eager,
}

/// A training step run through CUDA graphs when it can be: `warmup` eager runs, a capture, then
/// replays while the step's inputs stay the same tensors with the same shapes. New inputs go in
/// by copying into those tensors before [`GraphedStep::run`]. A change of inputs drops the graph
/// and warms up again (the step is captured anew for the new shapes), as does a graph an op
/// marked stale (an optimizer whose learning rate changed); a refused capture runs the step
/// eagerly from then on, with the reason in [`GraphedStep::eager_reason`].
///
/// The step closure runs again after a refused capture, so it must not depend on what the
/// refused run left: start it by setting the gradients to none (`zero_grad(true)`), as PyTorch
/// captures `backward` into fresh gradients. The optimizer may step inside the closure when it
/// reads its step number from the replay (headroom-optim's fused Adam and AdamW, after backward
/// or inside it, with a device GradScaler): the whole step is then one graph. Otherwise step it
/// after [`GraphedStep::run`], on the gradients the capture created (each replay overwrites
/// them; do not set them to none between replays).
pub struct GraphedStep {
    backend: Arc<CudaBackend>,
    warmup: usize,
    key: Option<InputKey>,
    phase: Phase,
    reason: Option<String>,
}

impl std::fmt::Debug for GraphedStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphedStep")
            .field("warmup", &self.warmup)
            .field("captured", &matches!(self.phase, Phase::Captured(_)))
            .field("eager_reason", &self.reason)
            .finish_non_exhaustive()
    }
}

impl GraphedStep {
    /// A step on `backend` captured after `warmup` eager runs (PyTorch warms up 3; at least 1, so
    /// that first-use work is outside the capture).
    pub fn new(backend: &Arc<CudaBackend>, warmup: usize) -> GraphedStep {
        GraphedStep {
            backend: Arc::clone(backend),
            warmup: warmup.max(1),
            key: None,
            phase: Phase::Warming { done: 0 },
            reason: None,
        }
    }

    /// Runs one step whose device inputs are `inputs`: eagerly while warming up or after a
    /// refused capture, captured and replayed once when warm, replayed afterwards.
    pub fn run(
        &mut self,
        inputs: &[&Tensor],
        step: &mut dyn FnMut() -> Result<()>,
    ) -> Result<StepRun> {
        let key = InputKey::of(inputs);
        if self.key.as_ref() != Some(&key) {
            if self.key.is_some() && !matches!(self.phase, Phase::Eager) {
                self.reason = Some("the step's inputs changed (new tensors or shapes)".into());
                self.phase = Phase::Warming { done: 0 };
            }
            self.key = Some(key);
        }
        if let Phase::Captured(graph) = &self.phase {
            if let Some(reason) = graph.stale_reason() {
                self.reason = Some(reason);
                self.phase = Phase::Warming { done: 0 };
            }
        }
        match &mut self.phase {
            Phase::Captured(graph) => {
                graph.replay()?;
                Ok(StepRun::Replayed)
            }
            Phase::Eager => {
                step()?;
                Ok(StepRun::Eager)
            }
            Phase::Warming { done } if *done < self.warmup => {
                *done += 1;
                step()?;
                Ok(StepRun::Eager)
            }
            Phase::Warming { .. } => match self.backend.capture(&mut *step) {
                Ok((graph, ())) => {
                    graph.replay()?;
                    self.phase = Phase::Captured(graph);
                    self.reason = None;
                    Ok(StepRun::Captured)
                }
                Err(CaptureError::NotCapturable { reason }) => {
                    self.reason = Some(reason);
                    self.phase = Phase::Eager;
                    step()?;
                    Ok(StepRun::Eager)
                }
                Err(CaptureError::Step(error)) => Err(error),
            },
        }
    }

    /// Why the last run was not replayed from a graph: the capture's refusal, or a change of
    /// inputs; `None` while warming up for the first time or once captured.
    pub fn eager_reason(&self) -> Option<&str> {
        self.reason.as_deref()
    }

    /// The captured graph, once there is one.
    pub fn graph(&self) -> Option<&CudaGraph> {
        match &self.phase {
            Phase::Captured(graph) => Some(graph),
            _ => None,
        }
    }
}
