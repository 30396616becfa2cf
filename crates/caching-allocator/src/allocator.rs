//! The caching policy: PyTorch's caching allocator over any [`Storage`].
//!
//! Requests are rounded to 512 bytes (or to power-of-two divisions), routed to the small pool
//! (≤ 1 MiB) or the large pool, and served best-fit by (stream, size, address) from freed blocks.
//! A miss obtains a new segment from the storage — 2 MiB for small requests, 20 MiB for requests
//! under 10 MiB, the request rounded to 2 MiB otherwise — or, with expandable segments, maps just
//! enough pages at the end of the stream's one growing segment. Blocks are split by PyTorch's
//! rules, merged with free neighbours on free, and a block used by other streams
//! (`record_stream`) is only reused after events recorded on those streams complete.
//!
//! The out-of-memory ladder is PyTorch's, with one fix: after pending frees are completed the pool
//! is searched again, so an allocation never fails while a fitting block sits in the cache
//! (pytorch/pytorch issue 189504).
//!
//! Everything lives in one [`parking_lot::Mutex`]: blocks in an arena indexed by [`BlockId`],
//! free blocks in ordered sets per pool. This module knows nothing about tensors and nothing about
//! how a storage obtains memory.

use std::collections::{BTreeMap, VecDeque};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::config::AllocatorConfig;
use crate::error::{AllocError, OutOfMemoryReport};
use crate::free_index::{BlockId, FreeIndex};
use crate::history::{ContextStack, History, HistoryOptions};
use crate::snapshot::{
    BlockSnapshot, BlockState, Frames, SegmentSnapshot, Snapshot, TraceAction, TraceEntry, Value,
};
use crate::stats::{FragmentationStats, MemoryStats, PoolKind, StatArray};
use crate::storage::{EventId, Storage, StorageError, StreamId};

/// Requests up to this size go to the small pool.
const SMALL_SIZE: u64 = 1 << 20;
/// Segment size of the small pool, and page size of its expandable segments.
const SMALL_BUFFER: u64 = 2 << 20;
/// Requests below this size (and above [`SMALL_SIZE`]) get a whole large-buffer segment.
const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Large requests are rounded up to this for their segment.
const ROUND_LARGE: u64 = 2 << 20;
/// Requests this large fail at once, as in PyTorch.
const ONE_EXABYTE: u64 = 1 << 60;

/// "No block" in the prev/next links.
const NIL: BlockId = u32::MAX;

/// A live allocation: the block handed out by [`CachingAllocator::allocate`]. Give it back with
/// [`CachingAllocator::free`]; it is not `Clone`, so it cannot be freed twice.
#[derive(Debug, PartialEq, Eq, Hash)]
#[must_use = "an allocation that is dropped without `free` stays allocated"]
pub struct Allocation {
    address: u64,
    size: u64,
    requested: u64,
    stream: StreamId,
}

impl Allocation {
    /// Start address (device pointer, host pointer or simulated address).
    pub fn address(&self) -> u64 {
        self.address
    }

    /// Bytes reserved for it: the request rounded up, or a whole block that was not split.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Bytes the caller asked for.
    pub fn requested(&self) -> u64 {
        self.requested
    }

    /// The stream it was allocated on.
    pub fn stream(&self) -> StreamId {
        self.stream
    }
}

/// The caching allocator: PyTorch's policy over a [`Storage`]. `Send + Sync` when the storage is
/// `Send`; every call takes one lock.
#[derive(Debug)]
pub struct CachingAllocator<S: Storage> {
    state: Mutex<State<S>>,
    config: AllocatorConfig,
}

/// Pops the context label pushed by [`CachingAllocator::push_context`] when dropped.
#[derive(Debug)]
#[must_use = "the label is popped as soon as the guard is dropped"]
pub struct ContextGuard<'a, S: Storage> {
    allocator: &'a CachingAllocator<S>,
}

impl<S: Storage> Drop for ContextGuard<'_, S> {
    fn drop(&mut self) {
        self.allocator.state.lock().context.pop();
    }
}

impl<S: Storage> CachingAllocator<S> {
    /// An allocator over `storage`. Expandable segments are used when `config` asks for them and
    /// the storage can map pages.
    pub fn new(storage: S, config: AllocatorConfig) -> Self {
        let expandable = config.expandable_segments && storage.supports_expandable_segments();
        let stats = MemoryStats {
            max_split_size: config.max_split_size.map_or(-1, |size| size as i64),
            ..MemoryStats::default()
        };
        let state = State {
            storage,
            config: config.clone(),
            expandable,
            blocks: Vec::new(),
            free_slots: Vec::new(),
            pools: [Pool::default(), Pool::default()],
            live: FxHashMap::default(),
            pending: BTreeMap::new(),
            expandable_segments: Vec::new(),
            stats,
            history: History::default(),
            context: ContextStack::default(),
        };
        CachingAllocator {
            state: Mutex::new(state),
            config,
        }
    }

    /// The settings in force.
    pub fn config(&self) -> &AllocatorConfig {
        &self.config
    }

    /// Whether this allocator grows expandable segments (asked for, and the storage can map).
    pub fn uses_expandable_segments(&self) -> bool {
        self.state.lock().expandable
    }

    /// Allocates `size` bytes for use on `stream`. A request of 0 bytes gets a 512-byte block.
    ///
    /// On failure the cache is freed and the allocation retried; only then is
    /// [`AllocError::OutOfMemory`] returned, with the figures of the failure.
    pub fn allocate(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        let mut state = self.state.lock();
        let id = state.malloc(size, stream)?;
        let block = &state.blocks[id as usize];
        Ok(Allocation {
            address: block.address,
            size: block.size,
            requested: size,
            stream,
        })
    }

    /// Frees an allocation. If other streams used it ([`CachingAllocator::record_stream`]), the
    /// block is reused only once their work recorded so far has completed.
    pub fn free(&self, allocation: Allocation) -> Result<(), AllocError> {
        self.free_address(allocation.address)
    }

    /// Frees the allocation that starts at `address` (for callers that keep raw addresses).
    pub fn free_address(&self, address: u64) -> Result<(), AllocError> {
        let mut state = self.state.lock();
        let id = state
            .live
            .remove(&address)
            .ok_or(AllocError::UnknownAddress { address })?;
        state.free(id)
    }

    /// Marks `allocation` as used by `stream` as well as its own (`Tensor.record_stream`).
    pub fn record_stream(
        &self,
        allocation: &Allocation,
        stream: StreamId,
    ) -> Result<(), AllocError> {
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
        let block = &mut state.blocks[id as usize];
        if stream != block.stream && !block.stream_uses.contains(&stream) {
            block.stream_uses.push(stream);
        }
        Ok(())
    }

    /// The stream the live allocation starting at `address` was allocated on (whose pool its
    /// block returns to).
    pub fn allocation_stream(&self, address: u64) -> Result<StreamId, AllocError> {
        let state = self.state.lock();
        let id = *state
            .live
            .get(&address)
            .ok_or(AllocError::UnknownAddress { address })?;
        Ok(state.blocks[id as usize].stream)
    }

    /// Returns all unused cached memory to the storage (`torch.cuda.empty_cache`): waits for
    /// pending frees, frees every segment with no live block and unmaps every free page of
    /// expandable segments.
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        self.state.lock().release_cached_blocks()
    }

    /// All statistics (`torch.cuda.memory_stats`).
    pub fn memory_stats(&self) -> MemoryStats {
        self.state.lock().stats.clone()
    }

    /// Bytes allocated now (`torch.cuda.memory_allocated`).
    pub fn memory_allocated(&self) -> u64 {
        self.state.lock().stats.allocated_bytes.all.current as u64
    }

    /// Bytes reserved now (`torch.cuda.memory_reserved`).
    pub fn memory_reserved(&self) -> u64 {
        self.state.lock().stats.reserved_bytes.all.current as u64
    }

    /// Peak of allocated bytes (`torch.cuda.max_memory_allocated`).
    pub fn max_memory_allocated(&self) -> u64 {
        self.state.lock().stats.allocated_bytes.all.peak as u64
    }

    /// Peak of reserved bytes (`torch.cuda.max_memory_reserved`).
    pub fn max_memory_reserved(&self) -> u64 {
        self.state.lock().stats.reserved_bytes.all.peak as u64
    }

    /// Sets every peak to its current value.
    pub fn reset_peak_stats(&self) {
        self.state.lock().stats.reset_peak();
    }

    /// Zeroes cumulative sums and counters.
    pub fn reset_accumulated_stats(&self) {
        self.state.lock().stats.reset_accumulated();
    }

    /// Figures PyTorch lacks: largest free block per pool, stranded free bytes, internal waste.
    pub fn fragmentation_stats(&self) -> FragmentationStats {
        self.state.lock().fragmentation_stats()
    }

    /// `torch.cuda.memory_summary()`'s table, followed by the fragmentation figures.
    pub fn memory_summary(&self, abbreviated: bool) -> String {
        let state = self.state.lock();
        crate::report::memory_summary(&state.stats, &state.fragmentation_stats(), 0, abbreviated)
    }

    /// Starts recording history with `options`, or stops and clears it with `None`
    /// (`torch.cuda.memory._record_memory_history`).
    pub fn record_history(&self, options: Option<HistoryOptions>) {
        let mut state = self.state.lock();
        state.history.options = options;
        if options.is_none() {
            state.history.entries.clear();
            state.history.overflowed = false;
        }
    }

    /// Pushes a context label (`forward`, `encoder.3`, ...) until the guard is dropped. While
    /// history is recorded, allocations carry the stack of labels as their frames. The stack
    /// belongs to the allocator, not to a thread.
    pub fn push_context(&self, label: &str) -> ContextGuard<'_, S> {
        self.state.lock().context.push(label.to_owned());
        ContextGuard { allocator: self }
    }

    /// The allocator's state in PyTorch's snapshot structure, with the recorded history.
    pub fn snapshot(&self) -> Snapshot {
        self.state.lock().snapshot()
    }

    /// Runs `f` on the storage, under the allocator's lock.
    pub fn with_storage<R>(&self, f: impl FnOnce(&mut S) -> R) -> R {
        f(&mut self.state.lock().storage)
    }

    /// Recomputes every statistic from the blocks and checks the block structure (links,
    /// contiguity, pool membership). For tests and debugging; costs a pass over all blocks.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.state.lock().check_invariants()
    }
}

/// Whether a block is part of a classic segment or of an expandable one (by index).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SegmentKind {
    Classic,
    Expandable(u32),
}

#[derive(Debug, Clone)]
struct Block {
    address: u64,
    size: u64,
    requested: u64,
    stream: StreamId,
    pool: PoolKind,
    segment: SegmentKind,
    prev: BlockId,
    next: BlockId,
    allocated: bool,
    mapped: bool,
    event_count: u32,
    stream_uses: SmallVec<[StreamId; 2]>,
    gc_base: u64,
    frames: Option<Frames>,
}

impl Block {
    /// A free, unused block of the same segment, stream and mapping at `[address, address + size)`.
    fn piece(&self, address: u64, size: u64, prev: BlockId, next: BlockId) -> Block {
        Block {
            address,
            size,
            requested: 0,
            stream: self.stream,
            pool: self.pool,
            segment: self.segment,
            prev,
            next,
            allocated: false,
            mapped: self.mapped,
            event_count: 0,
            stream_uses: SmallVec::new(),
            gc_base: self.gc_base,
            frames: None,
        }
    }

    fn is_split(&self) -> bool {
        self.prev != NIL || self.next != NIL
    }

    fn end(&self) -> u64 {
        self.address + self.size
    }

    /// Free for reuse or merging: not allocated, no pending events, no other stream using it.
    fn is_available(&self) -> bool {
        !self.allocated && self.event_count == 0 && self.stream_uses.is_empty()
    }

    fn state(&self) -> BlockState {
        if self.allocated {
            BlockState::ActiveAllocated
        } else if self.event_count > 0 {
            BlockState::ActivePendingFree
        } else {
            BlockState::Inactive
        }
    }
}

/// The cached blocks of one pool (small or large) for one stream.
#[derive(Debug, Default)]
struct StreamPool {
    /// Free mapped blocks by (size, address): with the stream chosen by the map that holds
    /// this pool, PyTorch's (stream, size, address) order.
    free: FreeIndex,
    /// Unmapped blocks of expandable segments by address.
    unmapped: BTreeMap<u64, BlockId>,
}

#[derive(Debug, Default)]
struct Pool {
    streams: FxHashMap<StreamId, StreamPool>,
    /// Searches so far; a free block's age is this minus its `gc_base`.
    n_searches: u64,
}

impl Pool {
    fn stream(&mut self, stream: StreamId) -> &mut StreamPool {
        self.streams.entry(stream).or_default()
    }

    fn free_blocks(&self) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        self.streams
            .values()
            .flat_map(|pool| pool.free.iter().map(|(size, _, id)| (size, id)))
    }
}

#[derive(Debug)]
struct ExpandableSegment {
    base: u64,
    reserved: u64,
    page: u64,
    stream: StreamId,
    pool: PoolKind,
    mapped: u64,
}

#[derive(Debug)]
struct State<S> {
    storage: S,
    config: AllocatorConfig,
    expandable: bool,
    blocks: Vec<Block>,
    free_slots: Vec<BlockId>,
    pools: [Pool; 2],
    live: FxHashMap<u64, BlockId>,
    pending: BTreeMap<StreamId, VecDeque<(EventId, BlockId)>>,
    expandable_segments: Vec<Option<ExpandableSegment>>,
    stats: MemoryStats,
    history: History,
    context: ContextStack,
}

fn pool_index(pool: PoolKind) -> usize {
    match pool {
        PoolKind::Small => 0,
        PoolKind::Large => 1,
    }
}

fn round_up(value: u64, multiple: u64) -> u64 {
    value.div_ceil(multiple) * multiple
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

impl<S: Storage> State<S> {
    // ----- arena -----

    fn new_block(&mut self, block: Block) -> BlockId {
        if let Some(id) = self.free_slots.pop() {
            self.blocks[id as usize] = block;
            id
        } else {
            self.blocks.push(block);
            (self.blocks.len() - 1) as BlockId
        }
    }

    fn drop_block(&mut self, id: BlockId) {
        let block = &mut self.blocks[id as usize];
        block.prev = NIL;
        block.next = NIL;
        block.size = 0;
        block.frames = None;
        self.free_slots.push(id);
    }

    fn block(&self, id: BlockId) -> &Block {
        &self.blocks[id as usize]
    }

    fn block_mut(&mut self, id: BlockId) -> &mut Block {
        &mut self.blocks[id as usize]
    }

    fn pool_mut(&mut self, pool: PoolKind) -> &mut Pool {
        &mut self.pools[pool_index(pool)]
    }

    fn insert_free(&mut self, id: BlockId) {
        let b = self.block(id);
        let (size, address, pool, stream) = (b.size, b.address, b.pool, b.stream);
        let pool = self.pool_mut(pool);
        let n_searches = pool.n_searches;
        pool.stream(stream).free.insert(size, address, id);
        self.block_mut(id).gc_base = n_searches;
    }

    fn remove_free(&mut self, id: BlockId) {
        let b = self.block(id);
        let (size, address, pool, stream) = (b.size, b.address, b.pool, b.stream);
        self.pool_mut(pool)
            .stream(stream)
            .free
            .remove(size, address);
    }

    fn insert_unmapped(&mut self, id: BlockId) {
        let b = self.block(id);
        let (address, pool, stream) = (b.address, b.pool, b.stream);
        self.pool_mut(pool)
            .stream(stream)
            .unmapped
            .insert(address, id);
    }

    fn remove_unmapped(&mut self, id: BlockId) {
        let b = self.block(id);
        let (address, pool, stream) = (b.address, b.pool, b.stream);
        self.pool_mut(pool).stream(stream).unmapped.remove(&address);
    }

    // ----- history -----

    fn record(&mut self, action: TraceAction, addr: u64, size: u64, stream: StreamId) {
        if !self.history.is_recording() {
            return;
        }
        let with_context = self.history.options.is_some_and(|o| o.record_context);
        let frames = if with_context {
            self.context.frames()
        } else {
            self.context.no_frames()
        };
        self.history.push(TraceEntry {
            action,
            addr,
            size,
            stream: stream.0,
            time_us: now_us(),
            frames,
        });
    }

    // ----- sizes -----

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

    fn is_oversize(&self, size: u64) -> bool {
        self.config.max_split_size.is_some_and(|max| size >= max)
    }

    fn allowed_memory(&self) -> Option<u64> {
        let fraction = self.config.per_process_memory_fraction?;
        Some((self.storage.memory_info().total as f64 * fraction) as u64)
    }

    // ----- malloc -----

    fn malloc(&mut self, requested: u64, stream: StreamId) -> Result<BlockId, AllocError> {
        if requested >= ONE_EXABYTE {
            return Err(self.out_of_memory(requested, requested));
        }
        self.process_events()?;
        let size = self.round_size(requested);
        let pool = if size <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        };
        let alloc_size = self.allocation_size(size);

        let mut found = self.get_free_block(pool, stream, size);
        if found.is_none() {
            self.garbage_collect()?;
            found = self.alloc_block(pool, stream, size, alloc_size)?;
        }
        if found.is_none()
            && self.config.max_split_size.is_some()
            && self.release_available_cached_blocks(pool, stream, size)?
        {
            found = self.alloc_block(pool, stream, size, alloc_size)?;
        }
        if found.is_none() {
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

    fn get_free_block(&mut self, pool: PoolKind, stream: StreamId, size: u64) -> Option<BlockId> {
        let max_split = self.config.max_split_size;
        let non_split_rounding = self.config.max_non_split_rounding;
        let pool = self.pool_mut(pool);
        pool.n_searches += 1;
        let stream_pool = pool.streams.get_mut(&stream)?;
        let (found_size, address, id) = stream_pool.free.first_at_least(size)?;
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
        stream_pool.free.remove(found_size, address);
        Some(id)
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
            return self.try_allocate_expandable(pool, stream, size);
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

    // ----- free -----

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

        let stream_uses = std::mem::take(&mut self.block_mut(id).stream_uses);
        if stream_uses.is_empty() {
            self.free_block(id);
            return Ok(());
        }
        for used_stream in stream_uses {
            let event = self.storage.record_event(used_stream)?;
            self.block_mut(id).event_count += 1;
            self.pending
                .entry(used_stream)
                .or_default()
                .push_back((event, id));
        }
        Ok(())
    }

    /// Returns a block whose client and streams are done with it to its pool, merging it with
    /// free neighbours.
    fn free_block(&mut self, id: BlockId) {
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
        self.insert_free(id);
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
    }

    /// Merges `source` into `target` if `source` is a free neighbour in the same mapped state;
    /// returns the bytes taken over. `target` must be out of the free sets.
    fn try_merge(&mut self, target: BlockId, source: BlockId) -> u64 {
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
        self.block_mut(target).size += src.size;
        self.drop_block(source);
        src.size
    }

    // ----- events -----

    /// Completes the frees whose events have completed, stream by stream in FIFO order.
    fn process_events(&mut self) -> Result<(), AllocError> {
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
                self.complete_event(event, id);
            }
            if self.pending.get(&stream).is_some_and(VecDeque::is_empty) {
                self.pending.remove(&stream);
            }
        }
        Ok(())
    }

    fn synchronize_and_free_events(&mut self) -> Result<(), AllocError> {
        self.stats.num_sync_all_streams += 1;
        let pending = std::mem::take(&mut self.pending);
        for (_, queue) in pending {
            for (event, id) in queue {
                self.storage.synchronize_event(event)?;
                self.complete_event(event, id);
            }
        }
        Ok(())
    }

    fn complete_event(&mut self, event: EventId, id: BlockId) {
        self.storage.release_event(event);
        let b = self.block_mut(id);
        b.event_count -= 1;
        if b.event_count == 0 {
            self.free_block(id);
        }
    }

    // ----- release -----

    fn release_cached_blocks(&mut self) -> Result<(), AllocError> {
        self.synchronize_and_free_events()?;
        for pool in [PoolKind::Large, PoolKind::Small] {
            self.release_pool(pool)?;
        }
        Ok(())
    }

    fn release_pool(&mut self, pool: PoolKind) -> Result<(), AllocError> {
        let free: Vec<BlockId> = self.pools[pool_index(pool)]
            .free_blocks()
            .map(|(_, id)| id)
            .collect();
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
                        synchronized = true;
                    }
                    self.unmap_block(id, segment)?;
                }
            }
        }
        self.release_empty_expandable_segments()
    }

    fn release_block(&mut self, id: BlockId) -> Result<(), AllocError> {
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
    fn release_available_cached_blocks(
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

    fn gc_threshold(&self) -> Option<(f64, u64)> {
        let threshold = self.config.garbage_collection_threshold?;
        Some((threshold, self.allowed_memory()?))
    }

    /// Frees old cached large blocks once reserved memory passes the GC threshold.
    fn garbage_collect(&mut self) -> Result<(), AllocError> {
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
                !b.is_split() && b.segment == SegmentKind::Classic
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

    // ----- expandable segments -----

    fn expandable_segment(&self, index: u32) -> &ExpandableSegment {
        self.expandable_segments[index as usize]
            .as_ref()
            .expect("live expandable segment")
    }

    fn try_allocate_expandable(
        &mut self,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        if !self
            .expandable_segments
            .iter()
            .flatten()
            .any(|s| s.stream == stream && s.pool == pool)
        {
            self.create_expandable_segment(pool, stream)?;
        }
        let candidates: Vec<BlockId> = self.pools[pool_index(pool)]
            .streams
            .get(&stream)
            .map(|stream_pool| stream_pool.unmapped.values().copied().collect())
            .unwrap_or_default();
        for unmapped in candidates {
            let prev = self.block(unmapped).prev;
            let start = if prev != NIL && self.block(prev).is_available() {
                prev
            } else {
                unmapped
            };
            let mut run = SmallVec::<[BlockId; 4]>::new();
            let mut bytes = 0;
            let mut cursor = start;
            while bytes < size && cursor != NIL && self.block(cursor).is_available() {
                bytes += self.block(cursor).size;
                run.push(cursor);
                cursor = self.block(cursor).next;
            }
            if bytes >= size {
                return self.map_block(&run, size);
            }
        }
        Ok(None)
    }

    fn create_expandable_segment(
        &mut self,
        pool: PoolKind,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        let page = match pool {
            PoolKind::Small => SMALL_BUFFER,
            PoolKind::Large => self.config.large_segment_size,
        };
        let page = round_up(page, self.storage.page_granularity());
        let total = self.storage.memory_info().total;
        let reserved = round_up(total / 8 * 9, page);
        let base = self.storage.reserve_address_space(reserved, page)?;
        let index = self.expandable_segments.len() as u32;
        self.expandable_segments.push(Some(ExpandableSegment {
            base,
            reserved,
            page,
            stream,
            pool,
            mapped: 0,
        }));
        let id = self.new_block(Block {
            address: base,
            size: reserved,
            requested: 0,
            stream,
            pool,
            segment: SegmentKind::Expandable(index),
            prev: NIL,
            next: NIL,
            allocated: false,
            mapped: false,
            event_count: 0,
            stream_uses: SmallVec::new(),
            gc_base: 0,
            frames: None,
        });
        self.insert_unmapped(id);
        Ok(())
    }

    /// Maps the unmapped pages that the first `size` bytes of `run` (adjacent available blocks
    /// of one expandable segment) need, and merges the run into one free mapped block, returned
    /// out of the free set. `None` if the storage ran out of memory (what was mapped stays
    /// cached as a free block).
    fn map_block(&mut self, run: &[BlockId], size: u64) -> Result<Option<BlockId>, AllocError> {
        let start = run[0];
        let SegmentKind::Expandable(segment) = self.block(start).segment else {
            unreachable!("map_block on a classic segment")
        };
        let (base, page) = {
            let s = self.expandable_segment(segment);
            (s.base, s.page)
        };
        let region_end = base + round_up(self.block(start).address + size - base, page);
        if let Some(allowed) = self.allowed_memory() {
            let to_map: u64 = run
                .iter()
                .map(|&id| self.block(id))
                .filter(|b| !b.mapped)
                .map(|b| b.end().min(region_end) - b.address)
                .sum();
            if self.stats.reserved_bytes.all.current as u64 + to_map > allowed {
                return Ok(None);
            }
        }
        let mut n_mapped = 0;
        for &id in run {
            if !self.block(id).mapped {
                self.remove_unmapped(id);
                if !self.map_pages(id, region_end, segment)? {
                    self.insert_unmapped(id);
                    break;
                }
                self.insert_free(id);
            }
            n_mapped += 1;
        }
        if n_mapped == 0 {
            return Ok(None);
        }
        self.remove_free(start);
        for &id in &run[1..n_mapped] {
            let merged = self.try_merge(start, id);
            debug_assert!(merged > 0, "a run of available mapped blocks always merges");
        }
        if n_mapped < run.len() {
            self.insert_free(start);
            return Ok(None);
        }
        Ok(Some(start))
    }

    /// Maps the front of unmapped block `id` up to `region_end` (page aligned), splitting off
    /// the rest as a new unmapped block. Returns false if the storage is out of memory.
    fn map_pages(
        &mut self,
        id: BlockId,
        region_end: u64,
        segment: u32,
    ) -> Result<bool, AllocError> {
        let b = self.block(id).clone();
        let length = b.end().min(region_end) - b.address;
        match self.storage.map(b.address, length) {
            Ok(()) => {}
            Err(StorageError::OutOfMemory { .. }) => return Ok(false),
            Err(error) => return Err(error.into()),
        }
        if length < b.size {
            let rest = self.new_block(Block {
                address: b.address + length,
                size: b.size - length,
                prev: id,
                frames: None,
                ..b.clone()
            });
            if b.next != NIL {
                self.block_mut(b.next).prev = rest;
            }
            self.block_mut(id).next = rest;
            self.block_mut(id).size = length;
            self.insert_unmapped(rest);
        }
        let prev_mapped = b.prev != NIL && self.block(b.prev).mapped;
        let next = self.block(id).next;
        let next_mapped = next != NIL && self.block(next).mapped;
        self.block_mut(id).mapped = true;
        self.block_mut(id).requested = 0;
        let delta_segments = 1 - i64::from(prev_mapped) - i64::from(next_mapped);
        self.stats.segment.update(b.pool, delta_segments);
        self.stats.reserved_bytes.update(b.pool, length as i64);
        self.stats.num_device_alloc += 1;
        if let Some(s) = self.expandable_segments[segment as usize].as_mut() {
            s.mapped += length;
        }
        self.record(TraceAction::SegmentMap, b.address, length, b.stream);
        Ok(true)
    }

    /// Unmaps the whole pages inside free block `id`, leaving any partial pages at its ends as
    /// free mapped blocks.
    fn unmap_block(&mut self, id: BlockId, segment: u32) -> Result<(), AllocError> {
        let (base, page) = {
            let s = self.expandable_segment(segment);
            (s.base, s.page)
        };
        let b = self.block(id).clone();
        let start = base + round_up(b.address - base, page);
        let end = base + (b.end() - base) / page * page;
        if start >= end {
            return Ok(());
        }
        self.storage.unmap(start, end - start)?;
        self.remove_free(id);

        let before_mapped = start > b.address || (b.prev != NIL && self.block(b.prev).mapped);
        let after_mapped = end < b.end() || (b.next != NIL && self.block(b.next).mapped);
        let delta_segments = i64::from(before_mapped) + i64::from(after_mapped) - 1;
        self.stats.segment.update(b.pool, delta_segments);
        self.stats
            .reserved_bytes
            .update(b.pool, -((end - start) as i64));
        self.stats.num_device_free += 1;
        if let Some(s) = self.expandable_segments[segment as usize].as_mut() {
            s.mapped -= end - start;
        }
        self.record(TraceAction::SegmentUnmap, start, end - start, b.stream);

        // Split into [b.address, start) mapped, [start, end) unmapped, [end, b.end()) mapped.
        let mut middle = id;
        if start > b.address {
            middle = self.new_block(Block {
                address: start,
                size: b.end() - start,
                prev: id,
                frames: None,
                ..b.clone()
            });
            if b.next != NIL {
                self.block_mut(b.next).prev = middle;
            }
            self.block_mut(id).next = middle;
            self.block_mut(id).size = start - b.address;
            self.insert_free(id);
        }
        if end < b.end() {
            let next = self.block(middle).next;
            let after = self.new_block(Block {
                address: end,
                size: b.end() - end,
                prev: middle,
                next,
                frames: None,
                ..b.clone()
            });
            if next != NIL {
                self.block_mut(next).prev = after;
            }
            self.block_mut(middle).next = after;
            self.block_mut(middle).size = end - start;
            self.insert_free(after);
        }
        let m = self.block_mut(middle);
        m.mapped = false;
        m.requested = 0;
        for neighbour in [self.block(middle).prev, self.block(middle).next] {
            self.try_merge(middle, neighbour);
        }
        self.insert_unmapped(middle);
        Ok(())
    }

    /// Gives back the address space of expandable segments with nothing mapped.
    fn release_empty_expandable_segments(&mut self) -> Result<(), AllocError> {
        for index in 0..self.expandable_segments.len() {
            let Some(s) = &self.expandable_segments[index] else {
                continue;
            };
            if s.mapped != 0 {
                continue;
            }
            let (base, reserved, stream, pool) = (s.base, s.reserved, s.stream, s.pool);
            let Some(&id) = self.pools[pool_index(pool)]
                .streams
                .get(&stream)
                .and_then(|stream_pool| stream_pool.unmapped.get(&base))
            else {
                continue;
            };
            self.storage.release_address_space(base, reserved)?;
            self.remove_unmapped(id);
            self.drop_block(id);
            self.expandable_segments[index] = None;
        }
        while matches!(self.expandable_segments.last(), Some(None)) {
            self.expandable_segments.pop();
        }
        Ok(())
    }

    // ----- reports -----

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

    fn fragmentation_stats(&self) -> FragmentationStats {
        let mut figures = FragmentationStats::default();
        for b in self.blocks.iter().filter(|b| b.size > 0) {
            if b.allocated {
                figures.internal_waste_bytes += b.size - b.requested;
                continue;
            }
            if !b.mapped || b.event_count > 0 {
                continue;
            }
            figures.cached_free_bytes += b.size;
            match b.pool {
                PoolKind::Small => {
                    figures.largest_free_small = figures.largest_free_small.max(b.size)
                }
                PoolKind::Large => {
                    figures.largest_free_large = figures.largest_free_large.max(b.size)
                }
            }
            match b.segment {
                SegmentKind::Classic => {
                    if b.is_split() {
                        figures.stranded_free_bytes += b.size;
                    }
                }
                SegmentKind::Expandable(segment) => {
                    let s = self.expandable_segment(segment);
                    let start = s.base + round_up(b.address - s.base, s.page);
                    let end = s.base + (b.end() - s.base) / s.page * s.page;
                    figures.stranded_free_bytes += b.size - end.saturating_sub(start);
                }
            }
        }
        figures
    }

    fn segment_heads(&self) -> Vec<BlockId> {
        let mut heads: Vec<BlockId> = (0..self.blocks.len() as BlockId)
            .filter(|&id| {
                let b = self.block(id);
                b.size > 0 && b.prev == NIL
            })
            .collect();
        heads.sort_by_key(|&id| self.block(id).address);
        heads
    }

    fn snapshot(&self) -> Snapshot {
        let mut segments = Vec::new();
        let empty = self.context.no_frames();
        for head in self.segment_heads() {
            let mut current: Option<SegmentSnapshot> = None;
            let mut cursor = head;
            while cursor != NIL {
                let b = self.block(cursor);
                cursor = b.next;
                if !b.mapped {
                    segments.extend(current.take());
                    continue;
                }
                let segment = current.get_or_insert_with(|| SegmentSnapshot {
                    device: 0,
                    address: b.address,
                    total_size: 0,
                    allocated_size: 0,
                    active_size: 0,
                    requested_size: 0,
                    stream: b.stream.0,
                    segment_type: b.pool,
                    segment_pool_id: (0, 0),
                    is_expandable: b.segment != SegmentKind::Classic,
                    frames: empty.clone(),
                    blocks: Vec::new(),
                });
                let state = b.state();
                segment.total_size += b.size;
                if b.allocated {
                    segment.allocated_size += b.size;
                }
                if state != BlockState::Inactive {
                    segment.active_size += b.size;
                    segment.requested_size += b.requested;
                }
                segment.blocks.push(BlockSnapshot {
                    address: b.address,
                    size: b.size,
                    requested_size: b.requested,
                    state,
                    frames: b.frames.clone().unwrap_or_else(|| empty.clone()),
                });
            }
            segments.extend(current);
        }
        let mut allocator_settings = self.config.allocator_settings();
        allocator_settings.push((
            "trace_alloc_max_entries".into(),
            Value::Int(self.history.options.map_or(0, |o| o.max_entries as i64)),
        ));
        allocator_settings.push((
            "trace_alloc_overflowed".into(),
            Value::Bool(self.history.overflowed),
        ));
        Snapshot {
            segments,
            device_traces: vec![self.history.entries.iter().cloned().collect()],
            allocator_settings,
            external_annotations: Vec::new(),
        }
    }

    fn check_invariants(&self) -> Result<(), String> {
        let mut expected = MemoryStats::default();
        let mut n_free = [0usize; 2];
        let mut n_unmapped = [0usize; 2];
        let mut n_live = 0;
        let mut seen = vec![false; self.blocks.len()];
        for head in self.segment_heads() {
            let mut cursor = head;
            let mut prev = NIL;
            let mut segment_bytes = 0u64;
            let mut in_mapped_run = false;
            let head_block = self.block(head);
            let classic = head_block.segment == SegmentKind::Classic;
            let pool = head_block.pool;
            while cursor != NIL {
                let b = self.block(cursor);
                if seen[cursor as usize] {
                    return Err(format!("block {cursor} reached twice"));
                }
                seen[cursor as usize] = true;
                if b.prev != prev {
                    return Err(format!("block {cursor} has prev {} not {prev}", b.prev));
                }
                if prev != NIL && self.block(prev).end() != b.address {
                    return Err(format!(
                        "block {cursor} at {:#x} does not follow its prev",
                        b.address
                    ));
                }
                if b.pool != pool
                    || b.segment != head_block.segment
                    || b.stream != head_block.stream
                {
                    return Err(format!("block {cursor} differs from its segment head"));
                }
                let p = pool_index(pool);
                let stream_pool = self.pools[p].streams.get(&b.stream);
                let in_free =
                    stream_pool.is_some_and(|sp| sp.free.contains(b.size, b.address, cursor));
                let in_unmapped = stream_pool
                    .and_then(|sp| sp.unmapped.get(&b.address))
                    .is_some_and(|&found| found == cursor);
                let should_be_free = b.mapped && b.is_available();
                if in_free != should_be_free {
                    return Err(format!("block {cursor} free-set membership is {in_free}"));
                }
                if in_unmapped == b.mapped {
                    return Err(format!(
                        "block {cursor} unmapped-set membership is {in_unmapped}"
                    ));
                }
                if !b.mapped && (b.allocated || b.event_count > 0) {
                    return Err(format!("unmapped block {cursor} is in use"));
                }
                if b.mapped {
                    segment_bytes += b.size;
                    if !in_mapped_run && !classic {
                        expected.segment.update(pool, 1);
                    }
                    in_mapped_run = true;
                } else {
                    in_mapped_run = false;
                }
                n_free[p] += usize::from(in_free);
                n_unmapped[p] += usize::from(in_unmapped);
                if b.allocated {
                    n_live += 1;
                    if self.live.get(&b.address) != Some(&cursor) {
                        return Err(format!("allocated block {cursor} is not in the live table"));
                    }
                    expected.allocation.update(pool, 1);
                    expected.allocated_bytes.update(pool, b.size as i64);
                    if self.is_oversize(b.size) {
                        expected.oversize_allocations.update(1);
                    }
                }
                if b.allocated || b.event_count > 0 {
                    expected.active.update(pool, 1);
                    expected.active_bytes.update(pool, b.size as i64);
                    expected.requested_bytes.update(pool, b.requested as i64);
                } else if classic && b.is_split() {
                    expected.inactive_split.update(pool, 1);
                    expected.inactive_split_bytes.update(pool, b.size as i64);
                }
                prev = cursor;
                cursor = b.next;
            }
            if classic {
                expected.segment.update(pool, 1);
                if self.is_oversize(segment_bytes) {
                    expected.oversize_segments.update(1);
                }
            }
            expected.reserved_bytes.update(pool, segment_bytes as i64);
        }
        for p in 0..2 {
            let held_free: usize = self.pools[p].streams.values().map(|sp| sp.free.len()).sum();
            let held_unmapped: usize = self.pools[p]
                .streams
                .values()
                .map(|sp| sp.unmapped.len())
                .sum();
            if held_free != n_free[p] || held_unmapped != n_unmapped[p] {
                return Err(format!("pool {p} holds blocks outside any segment"));
            }
        }
        if self.live.len() != n_live {
            return Err(format!(
                "{} live entries for {n_live} allocated blocks",
                self.live.len()
            ));
        }
        let current = |a: &StatArray| [a.all.current, a.small_pool.current, a.large_pool.current];
        for ((name, want), (_, have)) in expected
            .named_arrays()
            .iter()
            .zip(self.stats.named_arrays())
        {
            if current(want) != current(have) {
                return Err(format!(
                    "{name}: recomputed {:?}, kept {:?}",
                    current(want),
                    current(have)
                ));
            }
        }
        if expected.oversize_allocations.current != self.stats.oversize_allocations.current
            || expected.oversize_segments.current != self.stats.oversize_segments.current
        {
            return Err("oversize counts disagree".into());
        }
        Ok(())
    }
}
