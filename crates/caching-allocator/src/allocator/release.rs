//! Releasing cached memory: `empty_cache`, the release steps of the out-of-memory ladder,
//! garbage collection, and a released private pool's free memory.
//!
//! `empty_cache` (and the last step of the ladder) waits for every pending free, frees each
//! classic segment with no live block and unmaps the free pages of expandable segments. With
//! `max_split_size` set, the ladder first frees cached oversize blocks of the stream until the
//! request is covered. Garbage collection frees the oldest cached large blocks once reserved
//! memory passes its threshold of the allowed memory, as PyTorch does. Reclaiming
//! (`reclaim_free_pages`, Headroom's) unmaps the whole free pages of expandable segments, the
//! largest runs first, until a given number of bytes is released; with `reclaim_settles` it
//! counts the pages it takes from the other pool than the request's as lent by that pool. None of
//! these steps frees or unmaps memory of a live private pool; `empty_cache` is refused while
//! requests are routed to one (a capture may be under way), when `malloc` skips the ladder's steps.
//! A released pool's free memory is returned at once, and its record forgotten once it holds no
//! block.
//!
//! It sits on the parent module's state, on `stream_events` (waiting for pending frees), on
//! `free` (recording deferred events) and on `expandable` (unmapping pages, giving back address
//! space). It must not know how blocks are found or split for a request.

use rustc_hash::FxHashSet;

use super::{pool_index, CachingAllocator, PrivatePoolId, SegmentKind, State};
use crate::error::{AllocError, PrivatePoolMisuse};
use crate::free_index::BlockId;
use crate::snapshot::TraceAction;
use crate::stats::PoolKind;
use crate::storage::{Storage, StreamId};

impl<S: Storage> CachingAllocator<S> {
    /// Returns all unused cached memory to the storage (`torch.cuda.empty_cache`): waits for
    /// pending frees, frees every segment with no live block and unmaps every free page of
    /// expandable segments, except the memory of live private pools. While requests are routed
    /// to a private pool (a capture may be under way) it is refused with
    /// [`AllocError::PrivatePool`].
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        let mut state = self.state.lock();
        if let Some((_, pool)) = state.routing {
            return Err(AllocError::PrivatePool {
                pool,
                misuse: PrivatePoolMisuse::BeingRouted,
            });
        }
        state.release_cached_blocks()
    }
}

impl<S: Storage> State<S> {
    /// `empty_cache`; never called while routing.
    pub(super) fn release_cached_blocks(&mut self) -> Result<(), AllocError> {
        self.insert_deferred_events()?;
        self.synchronize_and_free_events()?;
        for pool in [PoolKind::Large, PoolKind::Small] {
            let free: Vec<BlockId> = self.pools[pool_index(pool)]
                .free_blocks()
                .map(|(_, id)| id)
                .filter(|&id| !self.in_live_pool(self.block(id).stream))
                .collect();
            self.release_free_blocks(free)?;
        }
        self.release_empty_expandable_segments()?;
        self.forget_empty_dead_pools();
        Ok(())
    }

    /// Returns the free memory of released private pool `pool` to the storage; never called
    /// while routing.
    pub(super) fn release_dead_pool(&mut self, pool: PrivatePoolId) -> Result<(), AllocError> {
        let stream = pool.stream();
        let free: Vec<BlockId> = self
            .pools
            .iter()
            .filter_map(|kind| kind.streams.get(&stream))
            .flat_map(|stream_pool| stream_pool.free.iter().map(|(_, _, id)| id))
            .collect();
        self.release_free_blocks(free)?;
        self.release_empty_expandable_segments()?;
        self.forget_empty_dead_pools();
        Ok(())
    }

    /// Forgets the released private pools that hold no block any more, with their empty caches.
    fn forget_empty_dead_pools(&mut self) {
        if self.private_pools.values().all(|pool| pool.live) {
            return;
        }
        let holding: FxHashSet<StreamId> = self
            .blocks
            .iter()
            .filter(|b| b.size > 0 && PrivatePoolId::from_stream(b.stream).is_some())
            .map(|b| b.stream)
            .collect();
        let empty: Vec<PrivatePoolId> = self
            .private_pools
            .iter()
            .filter(|(id, pool)| !pool.live && !holding.contains(&id.stream()))
            .map(|(&id, _)| id)
            .collect();
        for id in empty {
            self.private_pools.remove(&id);
            for kind in &mut self.pools {
                kind.streams.remove(&id.stream());
            }
        }
    }

    /// Frees the classic segments of the unsplit blocks among `free` (free blocks) and unmaps
    /// the whole pages of those of expandable segments, after waiting for the device.
    fn release_free_blocks(&mut self, free: Vec<BlockId>) -> Result<(), AllocError> {
        let mut synchronized = false;
        for id in free {
            match self.block(id).segment {
                SegmentKind::Classic => {
                    if !self.block(id).is_split() {
                        self.release_block(id)?;
                    }
                }
                SegmentKind::Expandable(segment) => {
                    if !synchronized {
                        // Unmapping does not wait for queued work that may still use the pages.
                        self.storage.synchronize_device()?;
                        self.note_device_idle();
                        synchronized = true;
                    }
                    self.unmap_block(id, segment)?;
                }
            }
        }
        Ok(())
    }

    pub(super) fn release_block(&mut self, id: BlockId) -> Result<(), AllocError> {
        let b = self.block(id);
        let (address, size, pool, stream) = (b.address, b.size, b.pool, b.stream);
        self.storage.free_segment(address, size)?;
        self.remove_free(id);
        self.stats.segment.update(pool, -1);
        self.stats.reserved_bytes.update(pool, -(size as i64));
        self.stats.num_device_free += 1;
        if self.is_oversize(size) {
            self.stats.oversize_segments.update(-1);
        }
        self.record(TraceAction::SegmentFree, address, size, stream);
        self.drop_block(id);
        Ok(())
    }

    /// Frees cached oversize blocks of this stream until `size` bytes are released (PyTorch's
    /// `release_available_cached_blocks`, used when `max_split_size` is set).
    pub(super) fn release_available_cached_blocks(
        &mut self,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
    ) -> Result<bool, AllocError> {
        let Some(max_split) = self.config.max_split_size else {
            return Ok(false);
        };
        let key_size = size.max(max_split);
        let Some(stream_pool) = self.pools[pool_index(pool)].streams.get(&stream) else {
            return Ok(false);
        };
        let candidates: Vec<(u64, BlockId)> = stream_pool
            .free
            .iter()
            .map(|(block_size, _, id)| (block_size, id))
            .filter(|&(block_size, id)| block_size >= max_split && !self.block(id).is_split())
            .collect();
        if let Some(&(_, id)) = candidates
            .iter()
            .find(|&&(block_size, _)| block_size >= key_size)
        {
            self.release_block(id)?;
            return Ok(true);
        }
        // Free the largest ones until their total covers the request.
        let mut released = 0;
        for &(block_size, id) in candidates.iter().rev() {
            if released >= key_size {
                break;
            }
            self.release_block(id)?;
            released += block_size;
        }
        Ok(released >= key_size)
    }

    /// Bytes of whole pages in the available blocks of expandable segments (any pool, any
    /// stream, no live private pool) outside `keep`: what [`State::reclaim_free_pages`] could
    /// release.
    pub(super) fn reclaimable_bytes(&self, keep: &[BlockId]) -> u64 {
        self.reclaim_candidates(keep)
            .iter()
            .map(|&(bytes, _, _)| bytes)
            .sum()
    }

    /// The blocks whose whole pages a reclaim of `bytes` unmaps, as (whole-page bytes, block,
    /// segment): available blocks of expandable segments (any pool, any stream, no live private
    /// pool) outside `keep`, those with the most pages first (by address among equals, so that
    /// the choice is deterministic), until their pages cover `bytes`.
    pub(super) fn reclaim_selection(
        &self,
        bytes: u64,
        keep: &[BlockId],
    ) -> Vec<(u64, BlockId, u32)> {
        let mut candidates = self.reclaim_candidates(keep);
        candidates.sort_unstable_by_key(|&(pages, id, _)| {
            (std::cmp::Reverse(pages), self.block(id).address)
        });
        let mut released = 0;
        candidates
            .into_iter()
            .take_while(|&(pages, _, _)| {
                let more = released < bytes;
                released += pages;
                more
            })
            .collect()
    }

    /// Unmaps the whole pages of the blocks of `selection` ([`State::reclaim_selection`]).
    /// Returns the bytes released. Unmapping does not wait for queued work that may still use
    /// the pages: the caller has waited for the device (`synchronize_device`), or every block
    /// of the selection was freed in a free epoch that has passed ([`super::free_epochs`]).
    ///
    /// This is how the default policy keeps reserved memory near the live bytes: `malloc` calls
    /// it when a request would raise reserved memory above the reclaim ceiling, so pages move
    /// out of the holes between live blocks to where the request needs them instead of being
    /// added.
    ///
    /// With `reclaim_settles`, the pages taken from the other pool than `pool` (the request's)
    /// are counted as lent by that pool (`reclaim_lent`): when it needs pages above the ceiling
    /// again, it gets that much ceiling back without a reclaim.
    pub(super) fn reclaim_free_pages(
        &mut self,
        selection: &[(u64, BlockId, u32)],
        pool: PoolKind,
    ) -> Result<u64, AllocError> {
        let mut released = 0;
        for &(pages, id, segment) in selection {
            let from = self.block(id).pool;
            self.unmap_block(id, segment)?;
            if self.config.reclaim_settles && from != pool {
                self.reclaim_lent[pool_index(from)] += pages;
            }
            released += pages;
        }
        Ok(released)
    }

    /// (whole-page bytes, block, segment) of every available block of an expandable segment
    /// outside `keep` and outside live private pools that holds a whole page.
    fn reclaim_candidates(&self, keep: &[BlockId]) -> Vec<(u64, BlockId, u32)> {
        let mut candidates = Vec::new();
        for pool in &self.pools {
            for (&stream, stream_pool) in &pool.streams {
                if self.in_live_pool(stream) {
                    continue;
                }
                for (_, _, id) in stream_pool.free.iter() {
                    if keep.contains(&id) || !self.block(id).is_available() {
                        continue;
                    }
                    if let Some((pages, segment)) = self.whole_pages(id) {
                        if pages > 0 {
                            candidates.push((pages, id, segment));
                        }
                    }
                }
            }
        }
        candidates
    }

    fn gc_threshold(&self) -> Option<(f64, u64)> {
        let threshold = self.config.garbage_collection_threshold?;
        Some((threshold, self.allowed_memory()?))
    }

    /// Frees old cached large blocks once reserved memory passes the GC threshold.
    pub(super) fn garbage_collect(&mut self) -> Result<(), AllocError> {
        let Some((threshold, allowed)) = self.gc_threshold() else {
            return Ok(());
        };
        let gc_limit = (threshold * allowed as f64) as u64;
        let reserved = self.stats.reserved_bytes.all.current as u64;
        if reserved <= gc_limit {
            return Ok(());
        }
        let target = reserved - gc_limit;
        let n_searches = self.pools[pool_index(PoolKind::Large)].n_searches;
        let mut freeable: Vec<(u64, BlockId)> = self.pools[pool_index(PoolKind::Large)]
            .free_blocks()
            .map(|(_, id)| id)
            .filter(|&id| {
                let b = self.block(id);
                !b.is_split() && b.segment == SegmentKind::Classic && !self.in_live_pool(b.stream)
            })
            .map(|id| (n_searches - self.block(id).gc_base, id))
            .collect();
        let mut reclaimed = 0;
        while reclaimed < target && !freeable.is_empty() {
            let mean_age =
                freeable.iter().map(|&(age, _)| age as f64).sum::<f64>() / freeable.len() as f64;
            let (old, young): (Vec<_>, Vec<_>) = freeable
                .into_iter()
                .partition(|&(age, _)| age as f64 >= mean_age);
            for (_, id) in old {
                reclaimed += self.block(id).size;
                self.release_block(id)?;
            }
            freeable = young;
        }
        Ok(())
    }
}
