//! Allocation: PyTorch's `malloc`, from a request to the block handed out.
//!
//! A request is rounded (`AllocatorConfig::round_size`), routed to the small or the large pool,
//! and served best fit from the stream's free blocks. A miss climbs the out-of-memory ladder:
//! garbage collection, a new segment (or pages of an expandable segment), freeing cached
//! oversize blocks, and freeing the whole cache before searching the pool again; only then is
//! the request an [`AllocError::OutOfMemory`], with the figures of the failure. A block that is
//! found is split by PyTorch's rules, and the statistics count the allocation. With expandable
//! segments, best fit is PyTorch's (a block at a segment's end counts as what it could grow
//! to), and a request that maps pages above the reclaim ceiling first has free pages reclaimed
//! (`reclaim_free_pages`; how the ceiling settles, and a pool gets back the pages it lent to the
//! other one: `reclaim_settles`).
//!
//! While requests are routed to a private pool, the routed stream's requests are served from the
//! pool's blocks (its virtual stream), and since a stream capture may be under way nothing
//! waits for the device: no pending free is completed or deferred event recorded, and the
//! ladder takes no release step and reclaims no page. A request that neither a free block nor
//! new memory serves fails at once.
//!
//! It sits on the arena and pools of the parent module and calls the steps of `free` (recording
//! deferred events), `stream_events` (completing pending frees), `release` (the ladder's release
//! steps) and `expandable` (mapping pages). It must not know how those steps free or map memory,
//! nor how a storage obtains it.

use smallvec::SmallVec;

use super::{
    device_stream_only, pool_index, round_up, Allocation, Block, CachingAllocator, SegmentKind,
    State, NIL, SMALL_BUFFER,
};
use crate::error::{AllocError, OutOfMemoryReport};
use crate::free_index::{BlockId, FreeIndex};
use crate::snapshot::TraceAction;
use crate::stats::PoolKind;
use crate::storage::{Storage, StorageError, StreamId};

/// Requests up to this size go to the small pool.
const SMALL_SIZE: u64 = 1 << 20;
/// Requests below this size (and above [`SMALL_SIZE`]) get a whole large-buffer segment.
const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Large requests are rounded up to this for their segment.
const ROUND_LARGE: u64 = 2 << 20;
/// Requests this large fail at once, as in PyTorch.
const ONE_EXABYTE: u64 = 1 << 60;
/// With `reclaim_settles`, the reclaim ceiling is at least the live peak plus this fraction of
/// it (1/200: 0.5%), so that layouts drifting by less never wait for the device.
const RECLAIM_SLACK_DIVISOR: u64 = 200;
/// With `reclaim_settles`, a reclaim raises the ceiling by half its excess but by at least this
/// many of the large pool's pages (or the whole excess, when less): halving alone leaves a
/// step that lacks the same bytes each time lacking half as many the next time, and the time
/// after, without end.
const RECLAIM_MIN_RAISE_PAGES: u64 = 2;

impl<S: Storage> CachingAllocator<S> {
    /// Allocates `size` bytes for use on `stream`. A request of 0 bytes gets a 512-byte block.
    /// While `stream` is routed to a private pool
    /// ([`CachingAllocator::begin_allocate_to_pool`]), the block comes from the pool.
    ///
    /// On failure the cache is freed and the allocation retried (not while a routing is in
    /// force); only then is [`AllocError::OutOfMemory`] returned, with the figures of the
    /// failure. A private pool's virtual stream is refused with [`AllocError::PrivatePool`].
    pub fn allocate(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        let mut state = self.state.lock();
        let id = state.malloc(size, stream)?;
        let block = &state.blocks[id as usize];
        Ok(Allocation {
            address: block.address,
            size: block.size,
            requested: size,
            stream,
            allocator: self.id,
            host_memory: S::HOST_MEMORY,
        })
    }
}

impl<S: Storage> State<S> {
    fn round_size(&self, size: u64) -> u64 {
        self.config.round_size(size)
    }

    fn allocation_size(&self, size: u64) -> u64 {
        if size <= SMALL_SIZE {
            SMALL_BUFFER
        } else if size < MIN_LARGE_ALLOC {
            self.config.large_segment_size
        } else {
            round_up(size, ROUND_LARGE)
        }
    }

    fn malloc(&mut self, requested: u64, stream: StreamId) -> Result<BlockId, AllocError> {
        device_stream_only(stream)?;
        if requested >= ONE_EXABYTE {
            return Err(self.out_of_memory(requested, requested));
        }
        // While routing, a capture may be under way: no event is recorded, queried or waited
        // for, and nothing is freed (PyTorch skips the same steps during a capture).
        let capturing = self.routing.is_some();
        if !capturing {
            self.insert_deferred_events()?;
            self.process_events()?;
        }
        let stream = self.cache_stream(stream);
        let size = self.round_size(requested);
        let pool = if size <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        };
        if !self.config.caching && !capturing {
            return self.malloc_uncached(requested, size, pool, stream);
        }
        let alloc_size = self.allocation_size(size);

        let mut found = self.get_free_block(pool, stream, size);
        if found.is_none() {
            if !capturing {
                self.garbage_collect()?;
            }
            found = self.alloc_block(pool, stream, size, alloc_size)?;
        }
        if found.is_none()
            && !capturing
            && self.config.max_split_size.is_some()
            && self.release_available_cached_blocks(pool, stream, size)?
        {
            found = self.alloc_block(pool, stream, size, alloc_size)?;
        }
        if found.is_none() && !capturing {
            self.release_cached_blocks()?;
            self.stats.num_alloc_retries += 1;
            // Completing pending frees may have put a fitting block back in the pool: look
            // there before asking the storage again (PyTorch does not; issue 189504).
            found = self.get_free_block(pool, stream, size);
            if found.is_none() {
                found = self.alloc_block(pool, stream, size, alloc_size)?;
            }
        }
        match found {
            Some(id) => Ok(self.alloc_found_block(id, requested, size, stream)),
            None => Err(self.out_of_memory(requested, alloc_size)),
        }
    }

    /// With `caching:False`: a segment of exactly the rounded request, never split and never
    /// reused (its free returns it, [`State::free_block`]). When the storage has no room, the
    /// blocks a private pool no longer holds are released and the request tried once more.
    fn malloc_uncached(
        &mut self,
        requested: u64,
        size: u64,
        pool: PoolKind,
        stream: StreamId,
    ) -> Result<BlockId, AllocError> {
        let mut found = self.alloc_block(pool, stream, size, size)?;
        if found.is_none() {
            self.release_cached_blocks()?;
            self.stats.num_alloc_retries += 1;
            found = self.alloc_block(pool, stream, size, size)?;
        }
        match found {
            Some(id) => Ok(self.alloc_found_block(id, requested, size, stream)),
            None => Err(self.out_of_memory(requested, size)),
        }
    }

    fn get_free_block(&mut self, pool: PoolKind, stream: StreamId, size: u64) -> Option<BlockId> {
        let max_split = self.config.max_split_size;
        let non_split_rounding = self.config.max_non_split_rounding;
        let pool_idx = pool_index(pool);
        self.pools[pool_idx].n_searches += 1;
        let stream_pool = self.pools[pool_idx].streams.get(&stream)?;
        let (found_size, address, id) = if self.expandable {
            self.best_expandable_fit(&stream_pool.free, size)?
        } else {
            stream_pool.free.first_at_least(size)?
        };
        if let Some(max_split) = max_split {
            // Do not hand an oversize block to a small request, nor a much larger oversize
            // block to an oversize request.
            if size < max_split && found_size >= max_split {
                return None;
            }
            if size >= max_split && found_size >= size + non_split_rounding {
                return None;
            }
        }
        self.pools[pool_idx]
            .stream(stream)
            .free
            .remove(found_size, address);
        Some(id)
    }

    /// PyTorch's best fit among blocks of expandable segments: a block followed by unmapped
    /// space counts as the size it could grow to, so from the smallest fitting block the search
    /// moves on while the next block's grown size is smaller. A request then does not take the
    /// free block at the end of a segment (which could grow for a larger one) when another fits.
    fn best_expandable_fit(&self, free: &FreeIndex, size: u64) -> Option<(u64, u64, BlockId)> {
        let expandable_size = |id: BlockId| {
            let block = self.block(id);
            let next = block.next;
            block.size
                + if next != NIL && !self.block(next).mapped {
                    self.block(next).size
                } else {
                    0
                }
        };
        let mut candidates = free.iter_at_least(size);
        let mut best = candidates.next()?;
        let mut best_size = expandable_size(best.2);
        for next in candidates {
            let next_size = expandable_size(next.2);
            if next_size >= best_size {
                break;
            }
            (best, best_size) = (next, next_size);
        }
        Some(best)
    }

    fn should_split(&self, id: BlockId, size: u64) -> bool {
        let block = self.block(id);
        let remaining = block.size - size;
        if block.pool == PoolKind::Small || block.segment != SegmentKind::Classic {
            remaining >= 512
        } else {
            !self.is_oversize(size) && remaining > SMALL_SIZE
        }
    }

    /// Obtains new memory for a request: a segment, or pages of an expandable segment. `None`
    /// when the storage is out of memory (or the memory fraction is exhausted).
    fn alloc_block(
        &mut self,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        alloc_size: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        if self.expandable {
            return self.alloc_expandable(pool, stream, size);
        }
        if let Some(allowed) = self.allowed_memory() {
            if self.stats.reserved_bytes.all.current as u64 + alloc_size > allowed {
                return Ok(None);
            }
        }
        let address = match self.storage.allocate_segment(alloc_size) {
            Ok(address) => address,
            Err(StorageError::OutOfMemory { .. }) => return Ok(None),
            Err(error) => return Err(error.into()),
        };
        let id = self.new_block(Block {
            address,
            size: alloc_size,
            requested: 0,
            stream,
            pool,
            segment: SegmentKind::Classic,
            prev: NIL,
            next: NIL,
            allocated: false,
            mapped: true,
            event_count: 0,
            stream_uses: SmallVec::new(),
            gc_base: 0,
            frames: None,
            freed_in: self.epochs.current(),
        });
        self.stats.segment.update(pool, 1);
        self.stats.reserved_bytes.update(pool, alloc_size as i64);
        self.stats.num_device_alloc += 1;
        if self.is_oversize(alloc_size) {
            self.stats.oversize_segments.update(1);
        }
        self.record(TraceAction::SegmentAlloc, address, alloc_size, stream);
        Ok(Some(id))
    }

    /// Pages for a request of an expandable segment: the run of available blocks it takes,
    /// with the pages it lacks mapped. With `reclaim_free_pages`, when mapping them would raise
    /// reserved memory above the reclaim ceiling, the device is waited for (completing pending
    /// frees too) and whole free pages elsewhere are unmapped first, as many as the excess; the
    /// run is then chosen again, since a hole may now hold the request lower down. Not while
    /// routing (a capture may be under way): the pages are mapped.
    ///
    /// With `reclaim_settles`, each reclaim also raises the ceiling by half its excess (at least
    /// [`RECLAIM_MIN_RAISE_PAGES`] pages): a loop whose steps keep moving pages between the same
    /// holes needs more pages than the ceiling for its layout, and after a few steps the ceiling
    /// holds it, so the loop stops waiting. And a pool whose free pages a reclaim gave to the
    /// other pool gets them back first: the ceiling rises by up to what it lent, with no wait
    /// (a loop whose forward fills the small pool and whose backward fills the large one would
    /// otherwise move pages from one to the other and back in every step). The ceiling only
    /// rises, so every reclaim makes the next one less likely.
    fn alloc_expandable(
        &mut self,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        let Some(mut run) = self.expandable_run(pool, stream, size)? else {
            return Ok(None);
        };
        if self.config.reclaim_free_pages && self.config.reclaim_settles {
            self.take_back_lent_pages(pool, &run, size);
        }
        if self.config.reclaim_free_pages
            && self.routing.is_none()
            && self.raises_reclaim_ceiling(&run, size)
            && self.reclaimable_bytes(&run) > 0
        {
            // The device is waited for only when it must be: when frees wait for other streams'
            // events (completing them can merge blocks and change the choice), or when a page
            // the reclaim takes belongs to a block freed in an epoch that has not passed
            // ([`super::free_epochs`]). Otherwise the same pages move at once.
            self.note_passed_marks();
            let mut waited = false;
            if self.pending.values().any(|queue| !queue.is_empty()) {
                self.wait_for_device()?;
                waited = true;
                // Completed frees may have merged blocks of the run with their neighbours.
                let Some(fresh) = self.expandable_run(pool, stream, size)? else {
                    return Ok(None);
                };
                run = fresh;
            }
            let to_map = self.bytes_to_map(&run, size);
            let reserved = self.stats.reserved_bytes.all.current as u64;
            let ceiling = self.reclaim_ceiling(size);
            if reserved + to_map > ceiling {
                let excess = reserved + to_map - ceiling;
                if self.config.reclaim_settles {
                    let min_raise = RECLAIM_MIN_RAISE_PAGES * self.config.expandable_page_size;
                    self.reclaim_allowance = ceiling + (excess / 2).max(min_raise.min(excess));
                }
                let selection = self.reclaim_selection(excess, &run);
                let ready = selection
                    .iter()
                    .all(|&(_, id, _)| self.epochs.has_passed(self.block(id).freed_in));
                if !waited && !ready {
                    self.wait_for_device()?;
                }
                self.reclaim_free_pages(&selection, pool)?;
                let Some(fresh) = self.expandable_run(pool, stream, size)? else {
                    return Ok(None);
                };
                run = fresh;
            }
        }
        self.map_block(&run, size)
    }

    /// Waits for every stream's work and completes every pending free: after it, every free
    /// page can be unmapped.
    fn wait_for_device(&mut self) -> Result<(), AllocError> {
        self.synchronize_and_free_events()?;
        self.storage.synchronize_device()?;
        self.note_device_idle();
        Ok(())
    }

    /// With `reclaim_settles`: when mapping the pages `run` lacks for `size` bytes would raise
    /// reserved memory above the reclaim ceiling and reclaims for the other pool took pages from
    /// `pool`, raises the allowance by as much of the excess as `pool` lent (and counts that
    /// much as given back).
    fn take_back_lent_pages(&mut self, pool: PoolKind, run: &[BlockId], size: u64) {
        let lent = self.reclaim_lent[pool_index(pool)];
        if lent == 0 {
            return;
        }
        let wanted = self.stats.reserved_bytes.all.current as u64 + self.bytes_to_map(run, size);
        let ceiling = self.reclaim_ceiling(size);
        let back = wanted.saturating_sub(ceiling).min(lent);
        if back > 0 {
            self.reclaim_lent[pool_index(pool)] -= back;
            self.reclaim_allowance = ceiling + back;
        }
    }

    /// Whether mapping the pages `run` lacks for `size` bytes raises reserved memory above the
    /// reclaim ceiling.
    fn raises_reclaim_ceiling(&self, run: &[BlockId], size: u64) -> bool {
        let reserved = self.stats.reserved_bytes.all.current as u64;
        reserved + self.bytes_to_map(run, size) > self.reclaim_ceiling(size)
    }

    /// Reserved bytes a request of `size` bytes may map up to without reclaiming: the most ever
    /// reserved and, with `reclaim_settles`, also the allowance earlier reclaims have raised and
    /// the live peak (this request included) plus 0.5%.
    fn reclaim_ceiling(&self, size: u64) -> u64 {
        let reserved = self.reserved_ceiling();
        if !self.config.reclaim_settles {
            return reserved;
        }
        let live = self
            .allocated_ceiling()
            .max(self.stats.allocated_bytes.all.current as u64 + size);
        reserved
            .max(self.reclaim_allowance)
            .max(live + live / RECLAIM_SLACK_DIVISOR)
    }

    /// The most bytes ever reserved at once: the statistics' peak, or what it was before a
    /// `reset_peak_stats`.
    pub(super) fn reserved_ceiling(&self) -> u64 {
        self.reserved_high_water
            .max(self.stats.reserved_bytes.all.peak as u64)
    }

    /// The most bytes ever allocated at once: the statistics' peak, or what it was before a
    /// `reset_peak_stats`.
    pub(super) fn allocated_ceiling(&self) -> u64 {
        self.allocated_high_water
            .max(self.stats.allocated_bytes.all.peak as u64)
    }

    fn alloc_found_block(
        &mut self,
        id: BlockId,
        requested: u64,
        size: u64,
        stream: StreamId,
    ) -> BlockId {
        let already_split = self.block(id).is_split();
        let classic = self.block(id).segment == SegmentKind::Classic;
        let pool = self.block(id).pool;
        if self.should_split(id, size) {
            let block = self.block(id);
            let next = block.next;
            let rest = block.piece(block.address + size, block.size - size, id, next);
            let remaining = self.new_block(rest);
            if next != NIL {
                self.block_mut(next).prev = remaining;
            }
            let b = self.block_mut(id);
            b.next = remaining;
            b.size = size;
            self.insert_free(remaining);
            if classic {
                if already_split {
                    self.stats.inactive_split_bytes.update(pool, -(size as i64));
                } else {
                    let remaining_size = self.block(remaining).size as i64;
                    self.stats.inactive_split.update(pool, 1);
                    self.stats.inactive_split_bytes.update(pool, remaining_size);
                }
            }
        } else if already_split && classic {
            let block_size = self.block(id).size as i64;
            self.stats.inactive_split.update(pool, -1);
            self.stats.inactive_split_bytes.update(pool, -block_size);
        }

        let frames = self.history.is_recording().then(|| self.context.frames());
        let b = self.block_mut(id);
        b.allocated = true;
        b.requested = requested;
        b.frames = frames;
        let (address, block_size) = (b.address, b.size);
        self.live.insert(address, id);

        self.stats.allocation.update(pool, 1);
        self.stats.allocated_bytes.update(pool, block_size as i64);
        self.stats.active.update(pool, 1);
        self.stats.active_bytes.update(pool, block_size as i64);
        self.stats.requested_bytes.update(pool, requested as i64);
        if self.is_oversize(block_size) {
            self.stats.oversize_allocations.update(1);
        }
        self.record(TraceAction::Alloc, address, requested, stream);
        id
    }

    fn out_of_memory(&mut self, requested: u64, attempted: u64) -> AllocError {
        let info = self.storage.memory_info();
        let allocated = self.stats.allocated_bytes.all.current as u64;
        let reserved = self.stats.reserved_bytes.all.current as u64;
        let reserved_unallocated = reserved.saturating_sub(allocated);
        let largest_free_block = self
            .pools
            .iter()
            .flat_map(|pool| pool.streams.values())
            .filter_map(|stream_pool| stream_pool.free.last().map(|(size, _, _)| size))
            .max()
            .unwrap_or(0);
        self.stats.num_ooms += 1;
        let stream = StreamId::DEFAULT;
        self.record(TraceAction::Oom, info.free, attempted, stream);
        AllocError::OutOfMemory(Box::new(OutOfMemoryReport {
            requested,
            attempted,
            capacity: info.total,
            free: info.free,
            allowed: self.allowed_memory(),
            allocated,
            reserved_unallocated,
            largest_free_block,
            suggest_expandable_segments: !self.expandable
                && self.storage.supports_expandable_segments()
                && reserved_unallocated >= requested,
            storage: self.storage.name(),
        }))
    }
}
