//! Streams and events: `record_stream`, and the frees that wait for other streams' work.
//!
//! A block used by streams other than its own is freed only once an event recorded on each of
//! them has completed. The pending frees wait in one FIFO queue per stream; each allocation
//! completes those whose events have passed (none is queried while requests are routed to a
//! private pool), and the release steps wait for all of them.
//!
//! It sits on the parent module's state, on the storage's events and on `free`, which returns a
//! block to its pool once its last event has completed. It must not know how blocks are found,
//! split or released.

use std::collections::VecDeque;

use super::{device_stream_only, Allocation, CachingAllocator, State};
use crate::error::AllocError;
use crate::free_index::BlockId;
use crate::storage::{EventId, Storage, StreamId};

impl<S: Storage> CachingAllocator<S> {
    /// Marks `allocation` as used by `stream` as well as its own (`Tensor.record_stream`). A
    /// private pool's virtual stream is refused with [`AllocError::PrivatePool`].
    pub fn record_stream(
        &self,
        allocation: &Allocation,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        if allocation.allocator != self.id {
            return Err(AllocError::UnknownAddress {
                address: allocation.address,
            });
        }
        self.record_stream_address(allocation.address, stream)
    }

    /// [`CachingAllocator::record_stream`] for the allocation that starts at `address` (for
    /// callers that keep raw addresses).
    pub fn record_stream_address(&self, address: u64, stream: StreamId) -> Result<(), AllocError> {
        let mut state = self.state.lock();
        let id = *state
            .live
            .get(&address)
            .ok_or(AllocError::UnknownAddress { address })?;
        device_stream_only(stream)?;
        let own = state.device_stream(state.blocks[id as usize].stream);
        let block = &mut state.blocks[id as usize];
        if stream != own && !block.stream_uses.contains(&stream) {
            block.stream_uses.push(stream);
        }
        Ok(())
    }

    /// The stream the live allocation starting at `address` was allocated on (whose pool its
    /// block returns to, unless it was routed to a private pool).
    pub fn allocation_stream(&self, address: u64) -> Result<StreamId, AllocError> {
        let state = self.state.lock();
        let id = *state
            .live
            .get(&address)
            .ok_or(AllocError::UnknownAddress { address })?;
        Ok(state.device_stream(state.blocks[id as usize].stream))
    }
}

impl<S: Storage> State<S> {
    /// Completes the frees whose events have completed, stream by stream in FIFO order.
    pub(super) fn process_events(&mut self) -> Result<(), AllocError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let streams: Vec<StreamId> = self.pending.keys().copied().collect();
        for stream in streams {
            while let Some(&(event, id)) = self.pending.get(&stream).and_then(|q| q.front()) {
                if !self.storage.query_event(event)? {
                    break;
                }
                self.pending.get_mut(&stream).map(VecDeque::pop_front);
                self.complete_event(event, id)?;
            }
            if self.pending.get(&stream).is_some_and(VecDeque::is_empty) {
                self.pending.remove(&stream);
            }
        }
        Ok(())
    }

    pub(super) fn synchronize_and_free_events(&mut self) -> Result<(), AllocError> {
        self.stats.num_sync_all_streams += 1;
        let pending = std::mem::take(&mut self.pending);
        // Every event is completed even when one block's segment cannot be returned (caching
        // off): the first such error is reported once the queues are empty.
        let mut first_error = None;
        for (_, queue) in pending {
            for (event, id) in queue {
                self.storage.synchronize_event(event)?;
                if let Err(error) = self.complete_event(event, id) {
                    first_error.get_or_insert(error);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn complete_event(&mut self, event: EventId, id: BlockId) -> Result<(), AllocError> {
        self.storage.release_event(event);
        let b = self.block_mut(id);
        b.event_count -= 1;
        if b.event_count == 0 && b.stream_uses.is_empty() {
            return self.free_block(id);
        }
        Ok(())
    }
}
