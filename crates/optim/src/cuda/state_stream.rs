//! Optimizer state kept in pinned host memory between steps and streamed through the GPU: the
//! copies, their streams and their order, for any state made of named dense tensors. It serves
//! [`OffloadedAdam`](crate::OffloadedAdam)'s device stepper (`offload_stream.rs`: f32 moments)
//! and [`StreamedOptimizer`](crate::StreamedOptimizer) (any rule's state, e.g. 4-bit codes and
//! their scales).
//!
//! A slot's state is a list of pieces (name, dtype, shape) laid back to back in one pinned
//! block, its layout fixed at the slot's first copy out. A bucket's states come in on one side
//! stream, each piece into a fresh device tensor ([`StateStream::arrive`]); the caller steps them
//! on the compute stream and hands them back ([`StateStream::depart`]), and they go out on a
//! second side stream, their device memory freed once that copy is done. The copies in are
//! prefetched in the order the last step stepped its buckets, as far ahead as the budget allows
//! (the bytes the device holds coming in; as many may be going back): at the end of a step
//! ([`StateStream::finish`]) the next step's first buckets start coming in, so the copies in
//! overlap the forward as well as the backward while the last copies out drain (the link is full
//! duplex). With more than the budget on its way back, the compute stream waits for the oldest
//! bucket's copy (the host does not) rather than the device filling with state when the backward
//! outruns the link. A slot's copy in waits for its last copy out.
//!
//! It sits on ops-cuda's streams, events, pinned buffers and in-flight copies; it knows no rule,
//! no model and no hook.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_ops_cuda::{CudaBackend, CudaEvent, CudaStream, InFlight, PinnedBuffer};

use super::launch::cuda_backend_of;
use crate::error::OptimError;
use crate::optimizer::StateBytes;

/// One tensor of a slot's state: its name, dtype, shape and byte offset in the pinned block.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Piece {
    pub(crate) name: &'static str,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    offset: usize,
}

impl Piece {
    fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size_in_bytes()
    }
}

/// A slot's state as device tensors, by name, in the layout's order.
pub(crate) type NamedState = Vec<(&'static str, Tensor)>;

/// One slot's state in pinned host memory.
#[derive(Default)]
struct StreamSlot {
    layout: Vec<Piece>,
    /// The pieces back to back; `None` before the first copy out.
    block: Option<PinnedBuffer>,
    /// Recorded after the last copy of the state back to the host.
    returned: Option<CudaEvent>,
}

/// The slots' pinned states, the side streams and the copies under way.
pub(crate) struct StateStream {
    backend: Arc<CudaBackend>,
    /// The same backend as autograd-core sees it, for the tensors the states arrive in.
    tensors: BackendRef,
    to_device: CudaStream,
    to_host: CudaStream,
    slots: Vec<StreamSlot>,
    /// Bytes of state the device may hold coming in, and as many going back.
    budget: u64,
    incoming_bytes: u64,
    outgoing_bytes: u64,
    /// The position in `last_order` of the next bucket to prefetch.
    cursor: usize,
    /// The buckets of the last step, in the order they were stepped.
    last_order: Vec<Vec<usize>>,
    /// The buckets stepped since the last [`StateStream::finish`].
    this_order: Vec<Vec<usize>>,
    /// States on their way to the device, by slot.
    incoming: HashMap<usize, Vec<InFlight>>,
    /// The copies out of the bucket being stepped, and their bytes.
    departing: (Vec<InFlight>, u64),
    /// States on their way back to the host, a bucket an entry, oldest first.
    outgoing: VecDeque<(Vec<InFlight>, u64)>,
}

impl StateStream {
    /// The stream of `slots` states on `param`'s backend (headroom-ops-cuda's, else a typed
    /// error naming `op`), holding at most `budget` bytes of state coming in and as many going
    /// back, beyond the bucket being stepped.
    pub(crate) fn new(
        op: &'static str,
        param: &Tensor,
        slots: usize,
        budget: u64,
    ) -> Result<StateStream, OptimError> {
        let tensors = param.backend().clone();
        let backend = cuda_backend_of(op, param)?;
        Ok(StateStream {
            tensors,
            to_device: backend.new_stream()?,
            to_host: backend.new_stream()?,
            backend,
            slots: (0..slots).map(|_| StreamSlot::default()).collect(),
            budget,
            incoming_bytes: 0,
            outgoing_bytes: 0,
            cursor: 0,
            last_order: Vec::new(),
            this_order: Vec::new(),
            incoming: HashMap::new(),
            departing: (Vec::new(), 0),
            outgoing: VecDeque::new(),
        })
    }

    /// Slot `index`'s state on the device (prefetched, or fetched now; the compute stream waits
    /// for the copies), or `None` before its first copy out. Frees the device memory of states
    /// whose copy back has completed first.
    pub(crate) fn arrive(&mut self, index: usize) -> Result<Option<NamedState>, OptimError> {
        self.release_returned()?;
        if self.slots[index].block.is_none() {
            return Ok(None);
        }
        let copies = match self.incoming.remove(&index) {
            Some(copies) => {
                self.incoming_bytes -= self.state_bytes_of(index);
                copies
            }
            None => self.fetch(index)?,
        };
        let names = self.slots[index].layout.iter().map(|piece| piece.name);
        let arrived = names
            .zip(copies)
            .map(|(name, copy)| Ok((name, copy.finish()?)))
            .collect::<Result<NamedState, OptimError>>()?;
        Ok(Some(arrived))
    }

    /// Allocates slot `index`'s pinned block for a state of `state`'s tensors (zeroed), unless it
    /// has one: a step calls it before it changes anything, so a pinned budget too small for the
    /// state is an error with the parameters untouched.
    pub(crate) fn reserve(&mut self, index: usize, state: &NamedState) -> Result<(), OptimError> {
        if self.slots[index].block.is_some() {
            return Ok(());
        }
        let (layout, bytes) = layout_of(
            state
                .iter()
                .map(|(name, tensor)| (*name, tensor.dtype(), tensor.shape().to_vec())),
        );
        let mut block = self.backend.pinned_host(bytes)?;
        block.as_mut_slice::<u8>()?.fill(0);
        self.slots[index] = StreamSlot {
            layout,
            block: Some(block),
            returned: None,
        };
        Ok(())
    }

    /// Queues the copy of slot `index`'s state (device tensors, on the compute stream's side of
    /// the step that updated them) back to its pinned block ([`StateStream::reserve`]d if it has
    /// none). A later state must have the first one's layout.
    pub(crate) fn depart(&mut self, index: usize, state: NamedState) -> Result<(), OptimError> {
        self.reserve(index, &state)?;
        let slot = &mut self.slots[index];
        let same_layout = slot.layout.len() == state.len()
            && slot
                .layout
                .iter()
                .zip(&state)
                .all(|(piece, (name, tensor))| {
                    piece.name == *name
                        && piece.dtype == tensor.dtype()
                        && piece.shape == tensor.shape()
                });
        if !same_layout {
            return Err(OptimError::InvalidArgument {
                op: "StateStream",
                reason: format!("slot {index}'s state changed its tensors between steps"),
            });
        }
        let block = slot.block.as_mut().expect("allocated above");
        for (piece, (_, tensor)) in slot.layout.iter().zip(state) {
            let copy = self.backend.copy_from_tensor_in_flight(
                tensor,
                block,
                piece.offset,
                &self.to_host,
            )?;
            self.departing.0.push(copy);
        }
        slot.returned = Some(self.to_host.record_event()?);
        self.departing.1 += block.len() as u64;
        Ok(())
    }

    /// Ends a bucket of slots (stepped, their states handed to [`StateStream::depart`]): its
    /// copies out join the ones under way, the oldest handed back to the compute stream while
    /// more than the budget is going back, and the next buckets start coming in.
    pub(crate) fn end_bucket(&mut self, bucket: Vec<usize>) -> Result<(), OptimError> {
        let (copies, bytes) = std::mem::take(&mut self.departing);
        if !copies.is_empty() {
            self.outgoing.push_back((copies, bytes));
            self.outgoing_bytes += bytes;
        }
        // Dropping an `InFlight` makes the compute stream wait for the copy, then frees the
        // state in stream order: the device waits for the link, the host never does, so the
        // host keeps queuing backward's work while the copies run.
        while self.outgoing_bytes > self.budget && self.outgoing.len() > 1 {
            if let Some((_, bytes)) = self.outgoing.pop_front() {
                self.outgoing_bytes -= bytes;
            }
        }
        if !bucket.is_empty() {
            self.this_order.push(bucket);
        }
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

    /// Waits for every copy under way and drops the prefetched states (the host blocks are then
    /// the truth, for a state dict or a load).
    pub(crate) fn settle(&mut self) -> Result<(), OptimError> {
        self.incoming.clear();
        self.outgoing.clear();
        self.departing = (Vec::new(), 0);
        (self.incoming_bytes, self.outgoing_bytes, self.cursor) = (0, 0, self.last_order.len());
        self.to_host.synchronize()?;
        self.to_device.synchronize()?;
        Ok(())
    }

    /// Bytes of pinned host memory the states hold.
    pub(crate) fn host_bytes(&self) -> u64 {
        self.slots
            .iter()
            .filter_map(|slot| slot.block.as_ref())
            .map(|block| block.len() as u64)
            .sum()
    }

    /// Slot `index`'s state tensors by name, their bytes in host memory (after
    /// [`StateStream::settle`]), or `None` before its first copy out.
    pub(crate) fn host_state(
        &self,
        index: usize,
    ) -> Result<Option<Vec<StateBytes<'_>>>, OptimError> {
        let slot = &self.slots[index];
        let Some(block) = &slot.block else {
            return Ok(None);
        };
        let bytes = block.as_slice::<u8>()?;
        Ok(Some(
            slot.layout
                .iter()
                .map(|piece| {
                    let range = piece.offset..piece.offset + piece.bytes();
                    let bytes = Cow::Borrowed(&bytes[range]);
                    (piece.name, piece.dtype, piece.shape.clone(), bytes)
                })
                .collect(),
        ))
    }

    /// Replaces slot `index`'s host state (after [`StateStream::settle`]) by `state` (tensors by
    /// name, as little-endian bytes), or forgets it for `None`.
    pub(crate) fn restore(
        &mut self,
        index: usize,
        state: Option<Vec<StateBytes<'_>>>,
    ) -> Result<(), OptimError> {
        self.slots[index] = StreamSlot::default();
        let Some(state) = state else {
            return Ok(());
        };
        let (layout, bytes) = layout_of(
            state
                .iter()
                .map(|(name, dtype, shape, _)| (*name, *dtype, shape.clone())),
        );
        let mut block = self.backend.pinned_host(bytes)?;
        let host = block.as_mut_slice::<u8>()?;
        for (piece, (name, _, _, bytes)) in layout.iter().zip(&state) {
            if bytes.len() != piece.bytes() {
                return Err(OptimError::StateDict(format!(
                    "{name} holds {} bytes, expected {} for {:?} {:?}",
                    bytes.len(),
                    piece.bytes(),
                    piece.dtype,
                    piece.shape
                )));
            }
            host[piece.offset..piece.offset + bytes.len()].copy_from_slice(bytes);
        }
        self.slots[index] = StreamSlot {
            layout,
            block: Some(block),
            returned: None,
        };
        Ok(())
    }

    /// Frees the device memory of states whose copy back has completed (the host does not
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

    /// Fetches the last step's buckets from the cursor on while the states coming in stay within
    /// the budget (the next bucket always, if nothing is coming in). The states going back have
    /// a budget of their own: the copies in of the next forward must not wait for the last
    /// backward's copies out, which the link carries at the same time.
    fn prefetch(&mut self) -> Result<(), OptimError> {
        while let Some(bucket) = self.last_order.get(self.cursor) {
            let wanted: Vec<usize> = bucket
                .iter()
                .copied()
                .filter(|i| !self.incoming.contains_key(i) && self.slots[*i].block.is_some())
                .collect();
            let bytes: u64 = wanted.iter().map(|&i| self.state_bytes_of(i)).sum();
            if self.incoming_bytes + bytes > self.budget && !self.incoming.is_empty() {
                break;
            }
            for index in wanted {
                let copies = self.fetch(index)?;
                self.incoming.insert(index, copies);
                self.incoming_bytes += self.state_bytes_of(index);
            }
            self.cursor += 1;
        }
        Ok(())
    }

    /// Whether slot `index` has its pinned block.
    pub(crate) fn has_host_state(&self, index: usize) -> bool {
        self.slots[index].block.is_some()
    }

    /// Bytes of slot `index`'s state (0 before its first copy out).
    pub(crate) fn state_bytes_of(&self, index: usize) -> u64 {
        self.slots[index]
            .block
            .as_ref()
            .map_or(0, |block| block.len() as u64)
    }

    /// Queues the copy of slot `index`'s pieces into fresh device tensors, after their last copy
    /// back.
    fn fetch(&mut self, index: usize) -> Result<Vec<InFlight>, OptimError> {
        let slot = &self.slots[index];
        let block = slot.block.as_ref().expect("fetched slots have a block");
        if let Some(returned) = &slot.returned {
            self.to_device.wait_event(returned)?;
        }
        slot.layout
            .iter()
            .map(|piece| {
                let tensor = Tensor::empty(&self.tensors, &piece.shape, piece.dtype)?;
                Ok(self.backend.copy_to_tensor_in_flight(
                    block,
                    piece.offset,
                    tensor,
                    &self.to_device,
                )?)
            })
            .collect()
    }
}

/// The pieces (name, dtype, shape) back to back, and their bytes.
fn layout_of(
    pieces: impl Iterator<Item = (&'static str, DType, Vec<usize>)>,
) -> (Vec<Piece>, usize) {
    let mut offset = 0;
    let layout = pieces
        .map(|(name, dtype, shape)| {
            let piece = Piece {
                name,
                dtype,
                shape,
                offset,
            };
            offset += piece.bytes();
            piece
        })
        .collect();
    (layout, offset)
}
