//! The CUDA side of [`OffloadedAdam`](crate::OffloadedAdam): gradients out on one side stream,
//! a host thread that steps each bucket as its copy lands, parameters back on a second stream.
//!
//! A bucket ([`CudaOffload::submit`]) records an event on the compute stream (its gradients are
//! written and its parameters read by everything queued so far), makes the copy-out stream wait
//! for it, and queues its gradients into one pinned staging block (from the backend's pinned
//! pool, so under its budget; the gradients' device blocks are marked with the copy stream, so
//! freeing them right after the call is safe). The host thread takes buckets in order: reading
//! the block waits for its copy, the host kernels step each parameter and write its new value
//! over its gradient, and the block goes back to the parameters on the copy-in stream, ordered
//! after the same event — not after the backward work queued since, so the copy overlaps it.
//! [`CudaOffload::finish`] waits for the host thread and makes the compute stream wait for the
//! copy-in stream: the next forward reads the updated parameters.
//!
//! It sits on ops-cuda's streams, events and pinned buffers and on the front end's host slots
//! (`offload_state.rs`); it knows no rule beyond the slot's own update.

use std::ops::Range;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use headroom_autograd_core::Tensor;
use headroom_ops_cuda::{CudaBackend, CudaEvent, CudaStream, PinnedBuffer};
use parking_lot::Mutex;

use crate::error::OptimError;
use crate::kernels::AdamConfig;
use crate::offload_state::HostSlot;

/// Byte alignment of each gradient in a staging block (the host kernels read f32 and bf16
/// slices of it; the copy engines prefer aligned rows).
const STAGING_ALIGN: usize = 256;

/// The streams, the host thread and the buckets it has not finished.
pub(crate) struct CudaOffload {
    backend: Arc<CudaBackend>,
    to_host: CudaStream,
    to_device: CudaStream,
    jobs: Option<mpsc::Sender<Bucket>>,
    done: mpsc::Receiver<Result<(), OptimError>>,
    worker: Option<JoinHandle<()>>,
    /// Buckets sent whose result has not been received.
    queued: usize,
    /// At most this many buckets queued at once.
    limit: usize,
    /// The first error a bucket met since the last [`CudaOffload::finish`].
    first_error: Option<OptimError>,
}

/// One bucket for the host thread.
struct Bucket {
    slots: Arc<Vec<Mutex<HostSlot>>>,
    /// Slot index and byte range of each gradient in `staging`.
    entries: Vec<(usize, Range<usize>)>,
    staging: PinnedBuffer,
    /// Recorded on the compute stream at submission: the gradients were written and the
    /// parameters last read before it.
    ready: CudaEvent,
    adam: AdamConfig,
    seed: u64,
}

impl CudaOffload {
    /// The offload of parameters of `like`'s backend, with at most `limit` buckets queued.
    pub(crate) fn new(like: &Tensor, limit: usize) -> Result<CudaOffload, OptimError> {
        let backend = super::launch::cuda_backend_of("OffloadedAdam", like)?;
        let to_host = backend.new_stream()?;
        let to_device = backend.new_stream()?;
        let (jobs, inbox) = mpsc::channel::<Bucket>();
        let (results, done) = mpsc::channel();
        let (worker_backend, worker_stream) = (Arc::clone(&backend), to_device.clone());
        let worker = std::thread::Builder::new()
            .name("headroom-offload".into())
            .spawn(move || {
                for bucket in inbox {
                    let result = step_bucket(&worker_backend, &worker_stream, bucket);
                    if results.send(result).is_err() {
                        break;
                    }
                }
            })
            .map_err(|err| OptimError::InvalidArgument {
                op: "OffloadedAdam",
                reason: format!("could not start the host thread: {err}"),
            })?;
        Ok(CudaOffload {
            backend,
            to_host,
            to_device,
            jobs: Some(jobs),
            done,
            worker: Some(worker),
            queued: 0,
            limit,
            first_error: None,
        })
    }

    /// Queues one bucket: `grads` (slot index and gradient, ascending slots) go out to the host,
    /// which steps them with `adam` (bf16 rounding seeded by `seed`) and sends the parameters
    /// back. Returns without waiting
    /// for the host, unless `limit` buckets are queued already (then for the oldest).
    pub(crate) fn submit(
        &mut self,
        slots: &Arc<Vec<Mutex<HostSlot>>>,
        grads: Vec<(usize, Tensor)>,
        adam: &AdamConfig,
        seed: u64,
    ) -> Result<(), OptimError> {
        if grads.is_empty() {
            return Ok(());
        }
        // A parameter whose host copy must be read (its first step, or a change made through a
        // tensor op) is read once what is queued has landed.
        if grads
            .iter()
            .any(|(index, _)| slots[*index].lock().needs_read())
        {
            self.finish()?;
            for (index, _) in &grads {
                slots[*index].lock().sync_from_device(adam.amsgrad)?;
            }
        }
        let mut entries = Vec::with_capacity(grads.len());
        let mut total = 0usize;
        for (index, grad) in &grads {
            let start = total.next_multiple_of(STAGING_ALIGN);
            total = start + grad.numel() * grad.dtype().size_in_bytes();
            entries.push((*index, start..total));
        }
        let compute = self.backend.compute_stream();
        let ready = compute.record_event()?;
        self.to_host.wait_event(&ready)?;
        let mut staging = self.backend.pinned_host(total)?;
        for ((_, range), (_, grad)) in entries.iter().zip(&grads) {
            self.backend
                .copy_from_tensor_async(grad, &mut staging, range.start, &self.to_host)?;
        }
        while self.queued >= self.limit {
            self.receive_one();
        }
        let bucket = Bucket {
            slots: Arc::clone(slots),
            entries,
            staging,
            ready,
            adam: adam.clone(),
            seed,
        };
        let jobs = self
            .jobs
            .as_ref()
            .expect("the channel lives as long as self");
        jobs.send(bucket).map_err(|_| OptimError::InvalidArgument {
            op: "OffloadedAdam",
            reason: "the host thread stopped (a previous step panicked)".into(),
        })?;
        self.queued += 1;
        Ok(())
    }

    /// Waits for one queued bucket and keeps its error.
    fn receive_one(&mut self) {
        let result = self.done.recv().unwrap_or_else(|_| {
            Err(OptimError::InvalidArgument {
                op: "OffloadedAdam",
                reason: "the host thread stopped (a previous step panicked)".into(),
            })
        });
        self.queued -= 1;
        if let Err(err) = result {
            self.first_error.get_or_insert(err);
        }
    }

    /// Waits for every queued bucket, orders the compute stream after their copies back, and
    /// returns the first error any of them met.
    pub(crate) fn finish(&mut self) -> Result<(), OptimError> {
        while self.queued > 0 {
            self.receive_one();
        }
        self.backend.compute_stream().wait_stream(&self.to_device)?;
        match self.first_error.take() {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }
}

impl Drop for CudaOffload {
    fn drop(&mut self) {
        while self.queued > 0 {
            self.receive_one();
        }
        self.jobs = None;
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// The host thread's work on one bucket: step each parameter over its staged gradient, then
/// queue the new values back into the parameters.
fn step_bucket(
    backend: &Arc<CudaBackend>,
    to_device: &CudaStream,
    bucket: Bucket,
) -> Result<(), OptimError> {
    let Bucket {
        slots,
        entries,
        mut staging,
        ready,
        adam,
        seed,
    } = bucket;
    {
        // Waits for the copy out.
        let bytes = staging.as_mut_slice::<u8>()?;
        for (index, range) in &entries {
            slots[*index]
                .lock()
                .update(&adam, seed, &mut bytes[range.clone()])?;
        }
    }
    for (index, range) in entries {
        let mut slot = slots[index].lock();
        let param = &slot.param;
        let offset = param.layout().offset() * param.dtype().size_in_bytes();
        backend.copy_to_device_after(&staging, range, param.buffer(), offset, to_device, &ready)?;
        slot.mark_synced();
    }
    Ok(())
}
