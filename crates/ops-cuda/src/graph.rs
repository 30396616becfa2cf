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
//! (`Tensor::from_slice`, an optimizer's per-step table), a dropout draw (its seed comes from the
//! host) or an asynchronous pinned copy. Each of these refuses inside a capture
//! ([`CaptureState::refuse`]): the op fails, the capture is abandoned, and [`CudaBackend::capture`]
//! returns [`CaptureError::NotCapturable`] with the first reason, never a graph that would
//! replay stale host values. The abandoned capture ran nothing on the device. [`GraphedStep`]
//! turns this into a training loop's policy: warm up, capture, replay while the inputs keep
//! their shapes, and run eagerly (with the reason) where capture is refused.
//!
//! Index checks are deferred while capturing (a replayed kernel records a bad index in the
//! backend's slots, reported by the next synchronisation), and stay deferred afterwards.
//!
//! This module sits on the backend's state (`device.rs`: the compute stream, the allocator) and
//! cudarc's graph calls; the other modules only ask [`CaptureState::refuse`] before touching the
//! host. It knows nothing about autograd beyond the tensors [`GraphedStep`] compares.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::sys;
use headroom_autograd_core::{DType, Result, Tensor, TensorError};
use headroom_caching_allocator::{PrivatePoolId, StreamId};
use parking_lot::Mutex;

use crate::device::CudaBackend;
use crate::error::device_error;

/// Whether the backend is capturing, and the first reason its step cannot be captured.
#[derive(Debug, Default)]
pub(crate) struct CaptureState {
    active: AtomicBool,
    refusal: Mutex<Option<String>>,
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

    fn begin(&self) {
        *self.refusal.lock() = None;
        self.active.store(true, Ordering::Release);
    }

    fn end(&self) -> Option<String> {
        self.active.store(false, Ordering::Release);
        self.refusal.lock().take()
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
    pub fn replay(&self) -> Result<()> {
        self.backend.bind("replay")?;
        let graph = self.graph.as_ref().expect("present until drop");
        graph.launch().map_err(|e| device_error("replay", e))
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
        let pool = allocator.create_private_pool();
        allocator
            .begin_allocate_to_pool(StreamId::DEFAULT, pool)
            .map_err(TensorError::from)?;
        self.capture.begin();
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
        let refusal = self.capture.end();
        allocator.end_allocate_to_pool();
        let fail = |error: CaptureError| {
            // Nothing ran; wait for the device anyway before the pool's blocks are returned.
            let _ = self.stream.synchronize();
            if let Err(release) = allocator.release_private_pool(pool) {
                self.note_free_error(release);
            }
            Err(error)
        };
        let not_capturable = |reason: String| CaptureError::NotCapturable { reason };
        match (outcome, refusal) {
            (Err(error), _) => fail(not_capturable(format!("beginning the capture: {error}"))),
            (Ok(_), Some(reason)) => fail(not_capturable(reason)),
            (Ok((Err(error), _)), None) => fail(CaptureError::Step(error)),
            (Ok((Ok(_), Err(error))), None) => fail(not_capturable(format!(
                "the driver rejected the captured work: {error}"
            ))),
            (Ok((Ok(_), Ok(None))), None) => fail(not_capturable(EMPTY.into())),
            (Ok((Ok(_), Ok(Some(graph)))), None) if is_empty(&graph) => {
                fail(not_capturable(EMPTY.into()))
            }
            (Ok((Ok(value), Ok(Some(graph)))), None) => Ok((
                CudaGraph {
                    backend: Arc::clone(self),
                    graph: Some(graph),
                    pool,
                },
                value,
            )),
        }
    }

    /// Whether a capture is running on this backend.
    pub fn is_capturing(&self) -> bool {
        self.capture.is_active()
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
/// and warms up again (the step is captured anew for the new shapes); a refused capture runs the
/// step eagerly from then on, with the reason in [`GraphedStep::eager_reason`].
///
/// The step closure runs again after a refused capture, so it must not depend on what the
/// refused run left: start it by setting the gradients to none (`zero_grad(true)`), as PyTorch
/// captures `backward` into fresh gradients. After a capture, the gradients it created are the
/// ones each replay overwrites: step an optimizer outside the graph on them, and do not set them
/// to none between replays.
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
