//! The device-stepping side of [`OffloadedAdam`](crate::OffloadedAdam)
//! ([`OffloadStepper::Device`](crate::OffloadStepper::Device)): each parameter's moments live in
//! pinned host memory and stream through the GPU, which steps them with the on-device fused
//! kernels (`Adam`'s for f32, `AdamStochastic`'s for bf16), so the result is the on-device
//! optimizer's bit for bit and the host does no arithmetic.
//!
//! A parameter's moments (`exp_avg`, `exp_avg_sq` and, with AMSGrad, `max_exp_avg_sq`, f32, one
//! pinned block) come in on one side stream into a fresh device tensor, the compute stream waits
//! for them and steps the bucket in place, and they go back on a second side stream, their
//! device memory freed once that copy is done. The copies in are prefetched in the order the
//! last step stepped its buckets, as far ahead as [`OffloadConfig::stream_bytes`] allows (the
//! moments the device holds coming in; as many may be going back): at the end of a step the next
//! step's first buckets start coming in, so the copies in overlap the forward as well as the
//! backward while the last copies out drain (the link is full duplex). With more than that on
//! their way back, the compute stream waits for the oldest bucket's copy (the host does not)
//! rather than the device filling with moments when the backward outruns the link. A
//! parameter's copy in waits for its last copy out.
//!
//! It sits on ops-cuda's streams, events, pinned buffers and in-flight copies and on the CUDA
//! entries of `Adam` and `AdamStochastic`; it knows no model and no hook.
//!
//! [`OffloadConfig::stream_bytes`]: crate::OffloadConfig::stream_bytes

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use headroom_autograd_core::{DType, Tensor};
use headroom_ops_cuda::{CudaBackend, CudaEvent, CudaStream, InFlight, PinnedBuffer};

use crate::adam::AdamState;
use crate::adam_stochastic::AdamStochasticConfig;
use crate::cuda::launch::CudaDevice;
use crate::error::OptimError;
use crate::kernels::AdamConfig;
use crate::offload_state::NAME;
use crate::rule::CudaKernels;
use crate::step::{Implementation, RuleCall, Scaling, StepItem};

/// A parameter's step count and moments (`exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`), as a
/// state dict holds them.
pub(crate) type StreamedState = (u64, Vec<Vec<f32>>);

/// One parameter's moments in pinned host memory.
struct StreamedSlot {
    /// `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq`) back to back; `None` before the first
    /// step.
    moments: Option<PinnedBuffer>,
    step: u64,
    /// Recorded after the last copy of the moments back to the host.
    returned: Option<CudaEvent>,
}

/// The parameters, their pinned moments, the streams and the copies under way.
pub(crate) struct StreamedOffload {
    backend: Arc<CudaBackend>,
    device: CudaDevice,
    to_device: CudaStream,
    to_host: CudaStream,
    params: Vec<Tensor>,
    slots: Vec<StreamedSlot>,
    amsgrad: bool,
    /// Bytes of moments the device may hold coming in, and as many going back.
    budget: u64,
    /// Bytes of the moments in `incoming` and `outgoing`.
    incoming_bytes: u64,
    outgoing_bytes: u64,
    /// The position in `last_order` of the next bucket to prefetch.
    cursor: usize,
    /// The buckets of the last step, in the order they were stepped.
    last_order: Vec<Vec<usize>>,
    /// The buckets stepped since the last [`StreamedOffload::finish`].
    this_order: Vec<Vec<usize>>,
    /// Moments on their way to the device, by parameter.
    incoming: HashMap<usize, InFlight>,
    /// Moments on their way back to the host, a bucket an entry (its copies and bytes), oldest
    /// first.
    outgoing: VecDeque<(Vec<InFlight>, u64)>,
}

impl StreamedOffload {
    /// The offload of `params` (contiguous, of one `CudaBackend`), holding at most `budget`
    /// bytes of moments coming in and as many going back, beyond the bucket being stepped.
    pub(crate) fn new(
        params: &[Tensor],
        amsgrad: bool,
        budget: u64,
    ) -> Result<StreamedOffload, OptimError> {
        let device = CudaDevice::of(NAME, &params[0], params.len())?;
        let backend = Arc::clone(device.backend());
        let slots = params
            .iter()
            .map(|_| StreamedSlot {
                moments: None,
                step: 0,
                returned: None,
            })
            .collect();
        Ok(StreamedOffload {
            to_device: backend.new_stream()?,
            to_host: backend.new_stream()?,
            backend,
            device,
            params: params.to_vec(),
            slots,
            amsgrad,
            budget,
            incoming_bytes: 0,
            outgoing_bytes: 0,
            cursor: 0,
            last_order: Vec::new(),
            this_order: Vec::new(),
            incoming: HashMap::new(),
            outgoing: VecDeque::new(),
        })
    }

    fn moment_count(&self) -> usize {
        if self.amsgrad {
            3
        } else {
            2
        }
    }

    /// Steps `grads` (slot index and gradient, ascending slots) on the compute stream: their
    /// moments come in (prefetched, or fetched now), the fused kernel updates parameters and
    /// moments in place, and the moments go back to the host. Returns without waiting.
    pub(crate) fn submit(
        &mut self,
        grads: Vec<(usize, Tensor)>,
        adam: &AdamConfig,
        seed: u64,
    ) -> Result<(), OptimError> {
        self.release_returned()?;
        if grads.is_empty() {
            return Ok(());
        }
        let mut moments = Vec::with_capacity(grads.len());
        let mut bucket_bytes = 0;
        for (index, _) in &grads {
            let arriving = match self.incoming.remove(index) {
                Some(arriving) => {
                    self.incoming_bytes -= self.moment_bytes(*index);
                    arriving
                }
                None => self.fetch(*index)?,
            };
            bucket_bytes += self.moment_bytes(*index);
            moments.push(arriving.finish()?);
        }
        for (index, _) in &grads {
            self.slots[*index].step += 1;
        }
        let n_moments = self.moment_count();
        let mut states = grads
            .iter()
            .zip(&moments)
            .map(|((index, _), block)| moment_views(block, self.params[*index].numel(), n_moments))
            .collect::<Result<Vec<AdamState>, OptimError>>()?;
        for dtype in [DType::F32, DType::BF16] {
            let mut items: Vec<StepItem<'_, AdamState>> = grads
                .iter()
                .zip(states.iter_mut())
                .filter(|((index, _), _)| self.params[*index].dtype() == dtype)
                .map(|((index, grad), state)| StepItem {
                    step: self.slots[*index].step,
                    slot: *index,
                    param: &self.params[*index],
                    grad: grad.clone(),
                    state,
                })
                .collect();
            if items.is_empty() {
                continue;
            }
            let call = RuleCall {
                implementation: Implementation::Fused,
                items: &mut items,
                scaling: Scaling::None,
            };
            match dtype {
                DType::BF16 => AdamStochasticConfig::new(adam.clone(), seed)
                    .cuda_step(&mut self.device, call)?,
                _ => adam.cuda_step(&mut self.device, call)?,
            }
        }
        drop(states);
        let mut leaving = Vec::with_capacity(moments.len());
        for ((index, _), block) in grads.iter().zip(moments) {
            let slot = &mut self.slots[*index];
            let pinned = slot
                .moments
                .as_mut()
                .expect("a fetched parameter has its pinned moments");
            let copy = self
                .backend
                .copy_from_tensor_in_flight(block, pinned, 0, &self.to_host)?;
            slot.returned = Some(self.to_host.record_event()?);
            leaving.push(copy);
        }
        self.outgoing.push_back((leaving, bucket_bytes));
        self.outgoing_bytes += bucket_bytes;
        // With more than the budget on its way back, the oldest copies are handed back to the
        // compute stream (dropping an `InFlight` makes it wait for the copy, then frees the
        // moments in stream order): the device waits for the link, the host never does, so the
        // host keeps queuing backward's work while the copies run.
        while self.outgoing_bytes > self.budget && self.outgoing.len() > 1 {
            if let Some((_, bytes)) = self.outgoing.pop_front() {
                self.outgoing_bytes -= bytes;
            }
        }
        self.this_order
            .push(grads.iter().map(|(index, _)| *index).collect());
        self.cursor = self.cursor.max(self.this_order.len());
        self.prefetch()
    }

    /// Ends a step: the order of its buckets is the next step's prefetch order, and the next
    /// step's first buckets start coming in.
    pub(crate) fn finish(&mut self) -> Result<(), OptimError> {
        if !self.this_order.is_empty() {
            self.last_order = std::mem::take(&mut self.this_order);
            self.cursor = 0;
        }
        self.release_returned()?;
        self.prefetch()
    }

    /// Waits for every copy under way and drops the prefetched moments (the host state is then
    /// the truth, for a state dict or a load).
    pub(crate) fn settle(&mut self) -> Result<(), OptimError> {
        self.incoming.clear();
        self.outgoing.clear();
        (self.incoming_bytes, self.outgoing_bytes, self.cursor) = (0, 0, self.last_order.len());
        self.to_host.synchronize()?;
        self.to_device.synchronize()?;
        Ok(())
    }

    /// Bytes of pinned host memory the moments hold.
    pub(crate) fn state_bytes(&self) -> u64 {
        self.slots
            .iter()
            .filter_map(|slot| slot.moments.as_ref())
            .map(|block| block.len() as u64)
            .sum()
    }

    /// How many steps parameter `index` has taken.
    pub(crate) fn step(&self, index: usize) -> u64 {
        self.slots[index].step
    }

    /// Parameter `index`'s step count and moments by their state-dict names (after
    /// [`StreamedOffload::settle`]), once it has stepped.
    pub(crate) fn saved(&self, index: usize) -> Result<Option<StreamedState>, OptimError> {
        let slot = &self.slots[index];
        let Some(block) = &slot.moments else {
            return Ok(None);
        };
        let values = block.as_slice::<f32>()?;
        let n = self.params[index].numel();
        Ok(Some((
            slot.step,
            values.chunks_exact(n).map(<[f32]>::to_vec).collect(),
        )))
    }

    /// Replaces parameter `index`'s state (after [`StreamedOffload::settle`]): `moments` in the
    /// state-dict order, or `None` for none.
    pub(crate) fn restore(
        &mut self,
        index: usize,
        saved: Option<StreamedState>,
    ) -> Result<(), OptimError> {
        let Some((step, moments)) = saved else {
            self.slots[index].moments = None;
            self.slots[index].step = 0;
            return Ok(());
        };
        let n = self.params[index].numel();
        let block = self.pinned_moments(index)?;
        let values = block.as_mut_slice::<f32>()?;
        for (chunk, saved) in values.chunks_exact_mut(n).zip(moments) {
            chunk.copy_from_slice(&saved);
        }
        self.slots[index].step = step;
        Ok(())
    }

    /// Frees the device memory of moments whose copy back has completed (the host does not
    /// wait).
    fn release_returned(&mut self) -> Result<(), OptimError> {
        while let Some((oldest, bytes)) = self.outgoing.front() {
            for copy in oldest {
                if !copy.is_done()? {
                    return Ok(());
                }
            }
            self.outgoing_bytes -= bytes;
            self.outgoing.pop_front();
        }
        Ok(())
    }

    /// Fetches the last step's buckets from the cursor on while the moments coming in stay within
    /// the budget (the next bucket always, if nothing is coming in). The moments going back have
    /// a budget of their own: the copies in of the next forward must not wait for the last
    /// backward's copies out, which the link carries at the same time.
    fn prefetch(&mut self) -> Result<(), OptimError> {
        while let Some(bucket) = self.last_order.get(self.cursor) {
            let wanted: Vec<usize> = bucket
                .iter()
                .copied()
                .filter(|i| !self.incoming.contains_key(i) && self.slots[*i].moments.is_some())
                .collect();
            let bytes: u64 = wanted.iter().map(|&i| self.moment_bytes(i)).sum();
            if self.incoming_bytes + bytes > self.budget && !self.incoming.is_empty() {
                break;
            }
            for index in wanted {
                let arriving = self.fetch(index)?;
                self.incoming.insert(index, arriving);
                self.incoming_bytes += self.moment_bytes(index);
            }
            self.cursor += 1;
        }
        Ok(())
    }

    /// Bytes of parameter `index`'s moments.
    fn moment_bytes(&self, index: usize) -> u64 {
        (self.params[index].numel() * self.moment_count() * 4) as u64
    }

    /// Queues the copy of parameter `index`'s moments into a fresh device tensor, after their
    /// last copy back.
    fn fetch(&mut self, index: usize) -> Result<InFlight, OptimError> {
        let elements = self.params[index].numel() * self.moment_count();
        let backend = self.params[index].backend().clone();
        self.pinned_moments(index)?;
        if let Some(returned) = &self.slots[index].returned {
            self.to_device.wait_event(returned)?;
        }
        let block = Tensor::empty(&backend, &[elements], DType::F32)?;
        let pinned = self.slots[index]
            .moments
            .as_ref()
            .expect("allocated just above");
        Ok(self
            .backend
            .copy_to_tensor_in_flight(pinned, 0, block, &self.to_device)?)
    }

    /// Parameter `index`'s pinned moments, allocated (zeros) at first use.
    fn pinned_moments(&mut self, index: usize) -> Result<&mut PinnedBuffer, OptimError> {
        let bytes = self.params[index].numel() * self.moment_count() * 4;
        let slot = &mut self.slots[index];
        if slot.moments.is_none() {
            let mut block = self.backend.pinned_host(bytes)?;
            block.as_mut_slice::<u8>()?.fill(0);
            slot.moments = Some(block);
        }
        Ok(slot.moments.as_mut().expect("allocated just above"))
    }
}

/// The moment views of a device block of `n_moments` runs of `n` elements.
fn moment_views(block: &Tensor, n: usize, n_moments: usize) -> Result<AdamState, OptimError> {
    Ok(AdamState {
        exp_avg: block.narrow(0, 0, n)?,
        exp_avg_sq: block.narrow(0, n, n)?,
        max_exp_avg_sq: (n_moments == 3)
            .then(|| block.narrow(0, 2 * n, n))
            .transpose()?,
    })
}
