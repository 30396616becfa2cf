//! Freeing: a block given back by its client, merged with its free neighbours.
//!
//! A block that no other stream used returns to its stream's pool at once, merged with free
//! neighbours of the same mapped state, and the statistics of active and split blocks follow.
//! A block that other streams used (`record_stream`) records an event on each of them and waits
//! in the pending queues instead; `stream_events` completes the free once they have all passed.
//! While requests are routed to a private pool (a capture may be under way) no event is
//! recorded: such a block waits, unavailable, until an allocation, `empty_cache` or another such
//! free after the routing records its events (PyTorch defers them until the capture ends too).
//!
//! It sits on the arena and pools of the parent module and on the storage's events. It must not
//! know when events complete, nor anything of segments beyond the links of their blocks.

use smallvec::SmallVec;

use super::{Allocation, Block, CachingAllocator, SegmentKind, State, NIL};
use crate::error::AllocError;
use crate::free_index::BlockId;
use crate::snapshot::TraceAction;
use crate::storage::Storage;

impl<S: Storage> CachingAllocator<S> {
    /// Frees an allocation. If other streams used it ([`CachingAllocator::record_stream`]), the
    /// block is reused only once their work recorded so far has completed.
    /// An allocation of another allocator is an [`AllocError::UnknownAddress`].
    pub fn free(&self, allocation: Allocation) -> Result<(), AllocError> {
        if allocation.allocator != self.id {
            return Err(AllocError::UnknownAddress {
                address: allocation.address,
            });
        }
        // SAFETY: the `Allocation` was handed out by this allocator and is consumed here, so
        // its owner gave it up and no other `Allocation` names the block.
        unsafe { self.free_address(allocation.address) }
    }

    /// Frees the allocation that starts at `address` (for callers that keep raw addresses).
    ///
    /// # Safety
    /// Nothing may read or write the allocation's memory any more, and its [`Allocation`] must
    /// never be freed (forget it): the block goes back to the cache and the next request may get
    /// it, so a tensor still using it would share its memory with another.
    pub unsafe fn free_address(&self, address: u64) -> Result<(), AllocError> {
        let mut state = self.state.lock();
        let id = state
            .live
            .remove(&address)
            .ok_or(AllocError::UnknownAddress { address })?;
        state.free(id)
    }
}

impl<S: Storage> State<S> {
    fn free(&mut self, id: BlockId) -> Result<(), AllocError> {
        let b = self.block_mut(id);
        b.allocated = false;
        let (pool, size, requested, address, stream) =
            (b.pool, b.size, b.requested, b.address, b.stream);
        self.stats.allocation.update(pool, -1);
        self.stats.allocated_bytes.update(pool, -(size as i64));
        if self.is_oversize(size) {
            self.stats.oversize_allocations.update(-1);
        }
        self.record(TraceAction::FreeRequested, address, requested, stream);

        if self.block(id).stream_uses.is_empty() {
            return self.free_block(id);
        }
        self.deferred.push(id);
        self.insert_deferred_events()
    }

    /// Records, for each deferred block, an event on every other stream that used it, and
    /// queues its free behind them. Not while routing: the blocks stay deferred. A block whose
    /// event cannot be recorded stays deferred with the streams not recorded yet.
    pub(super) fn insert_deferred_events(&mut self) -> Result<(), AllocError> {
        if self.routing.is_some() {
            return Ok(());
        }
        while let Some(&id) = self.deferred.last() {
            while let Some(&used_stream) = self.block(id).stream_uses.last() {
                let event = self.storage.record_event(used_stream)?;
                let b = self.block_mut(id);
                b.stream_uses.pop();
                b.event_count += 1;
                self.pending
                    .entry(used_stream)
                    .or_default()
                    .push_back((event, id));
            }
            self.deferred.pop();
        }
        Ok(())
    }

    /// Returns a block whose client and streams are done with it to its pool, merging it with
    /// free neighbours. With `caching:False` its segment then goes back to the storage, unless a
    /// private pool holds it or requests are being routed (a capture may be under way; it waits
    /// in the cache for the next `empty_cache`).
    pub(super) fn free_block(&mut self, id: BlockId) -> Result<(), AllocError> {
        let b = self.block(id);
        let (pool, original_size, requested, address, stream) =
            (b.pool, b.size, b.requested, b.address, b.stream);
        self.record(TraceAction::FreeCompleted, address, requested, stream);

        let mut net_blocks = 0i64;
        let mut net_bytes = 0i64;
        for neighbour in [self.block(id).prev, self.block(id).next] {
            let subsumed = self.try_merge(id, neighbour);
            if subsumed > 0 {
                net_blocks -= 1;
                net_bytes -= subsumed as i64;
            }
        }
        self.block_mut(id).freed_in = self.epochs.current();
        self.insert_free(id);
        self.count_free_in_epoch();
        let b = self.block(id);
        if b.segment == SegmentKind::Classic {
            if b.is_split() {
                net_blocks += 1;
                net_bytes += b.size as i64;
            }
            self.stats.inactive_split.update(pool, net_blocks);
            self.stats.inactive_split_bytes.update(pool, net_bytes);
        }
        self.stats.active.update(pool, -1);
        self.stats
            .active_bytes
            .update(pool, -(original_size as i64));
        self.stats.requested_bytes.update(pool, -(requested as i64));
        let b = self.block(id);
        if !self.config.caching
            && self.routing.is_none()
            && b.segment == SegmentKind::Classic
            && !b.is_split()
            && !self.in_live_pool(b.stream)
        {
            self.release_block(id)?;
        }
        Ok(())
    }

    /// Merges `source` into `target` if `source` is a free neighbour in the same mapped state;
    /// returns the bytes taken over. `target` must be out of the free sets.
    pub(super) fn try_merge(&mut self, target: BlockId, source: BlockId) -> u64 {
        if source == NIL {
            return 0;
        }
        let src = self.block(source);
        if !src.is_available() || src.mapped != self.block(target).mapped {
            return 0;
        }
        if src.mapped {
            self.remove_free(source);
        } else {
            self.remove_unmapped(source);
        }
        let src = self.block(source);
        let src = Block {
            frames: None,
            stream_uses: SmallVec::new(),
            ..*src
        };
        if self.block(target).prev == source {
            let t = self.block_mut(target);
            t.address = src.address;
            t.prev = src.prev;
            if src.prev != NIL {
                self.block_mut(src.prev).next = target;
            }
        } else {
            let t = self.block_mut(target);
            t.next = src.next;
            if src.next != NIL {
                self.block_mut(src.next).prev = target;
            }
        }
        let t = self.block_mut(target);
        t.size += src.size;
        t.freed_in = t.freed_in.max(src.freed_in);
        self.drop_block(source);
        src.size
    }
}
