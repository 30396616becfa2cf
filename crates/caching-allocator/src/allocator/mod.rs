//! The caching policy: PyTorch's caching allocator over any [`Storage`].
//!
//! Requests are rounded to 512 bytes (or to power-of-two divisions), routed to the small pool
//! (≤ 1 MiB) or the large pool, and served best-fit by (stream, size, address) from freed blocks.
//! A miss obtains a new segment from the storage — 2 MiB for small requests, 20 MiB for requests
//! under 10 MiB, the request rounded to 2 MiB otherwise — or, with expandable segments, maps just
//! enough pages at the end of the stream's one growing segment (or in a hole left by unmapped
//! pages). By default, mapping that would raise reserved memory above its ceiling first unmaps
//! the whole free pages between live blocks, so pages move rather than add up, and each such
//! move raises the ceiling a little (a pool that gets back pages it lent to the other pool
//! raises it by as much), so repeated steps settle;
//! PyTorch never does this (`AllocatorConfig::reclaim_free_pages`,
//! `AllocatorConfig::reclaim_settles`). Blocks are split by PyTorch's
//! rules, merged with free neighbours on free, and a block used by other streams
//! (`record_stream`) is only reused after events recorded on those streams complete.
//!
//! The out-of-memory ladder is PyTorch's, with one fix: after pending frees are completed the pool
//! is searched again, so an allocation never fails while a fitting block sits in the cache
//! (pytorch/pytorch issue 189504).
//!
//! Private pools are PyTorch's graph pools, for CUDA graph capture: while a stream is routed to
//! one ([`CachingAllocator::begin_allocate_to_pool`]), its requests are served from blocks
//! cached under the pool's virtual stream ([`PrivatePoolId::stream`], in a range from
//! [`PRIVATE_POOL_STREAM_BASE`] up), which only later requests routed to the pool reuse, and
//! nothing is done that a stream capture forbids (no event recorded, queried or waited for, no
//! wait for the device, nothing freed or unmapped; new segments and pages are fine). While the
//! pool is live, no release step (`empty_cache`, the ladder, garbage collection, reclaims) frees
//! or unmaps its memory; once released, its free memory goes back at once, and what is freed
//! later is ordinary cached memory. The statistics count its bytes as any others.
//!
//! Everything lives in one [`parking_lot::Mutex`]: blocks in an arena indexed by [`BlockId`],
//! free blocks in ordered sets per pool. This module holds the public types, the state behind
//! the lock, the arena and its pools, and what every step shares (history records, the memory
//! fraction, the oversize test, which stream a private pool's blocks are cached under and used
//! on). The steps are its submodules, one concept each: `malloc` (rounding, the search, new
//! segments, when to reclaim pages, splitting, the out-of-memory ladder), `free` (freeing and
//! merging, recording the events of frees that wait for other streams), `stream_events`
//! (`record_stream` and completing the frees that wait for events), `release` (`empty_cache`,
//! the ladder's release steps, garbage collection, which free pages to reclaim, a released
//! private pool's memory), `expandable` (the run of blocks a request takes, mapping and
//! unmapping the pages of expandable segments), `free_epochs` (which free pages the device is
//! done with: `free` counts into it, reclaims read it, waits for the device reset it),
//! `private_pools` (creating pools, routing requests to them, releasing them) and
//! `introspection` (statistics, a pool's usage, summaries, snapshots, history settings and the
//! invariant check). A submodule uses the types here and calls only the steps its own header
//! names; apart from `free_epochs`, which the others call, no two submodules call each other.
//! This module knows nothing about tensors and nothing about how a storage obtains memory.

mod expandable;
mod free;
mod free_epochs;
mod introspection;
mod malloc;
mod private_pools;
mod release;
mod stream_events;

use std::collections::{BTreeMap, VecDeque};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::config::AllocatorConfig;
use crate::error::{AllocError, PrivatePoolMisuse};
use crate::free_index::{BlockId, FreeIndex};
use crate::history::{ContextStack, History};
use crate::snapshot::{BlockState, Frames, TraceAction, TraceEntry};
use crate::stats::{MemoryStats, PoolKind};
use crate::storage::{EventId, Storage, StreamId};
use free_epochs::FreeEpochs;

/// Segment size of the small pool, and page size of its expandable segments.
const SMALL_BUFFER: u64 = 2 << 20;

/// "No block" in the prev/next links.
const NIL: BlockId = u32::MAX;

/// Stream ids from here (2^62) to 2^63 (excluded) are the virtual streams of private pools
/// ([`PrivatePoolId::stream`]): pool `n` caches its blocks under `StreamId(2^62 + n)`. Storages
/// never hand these ids out (CUDA storages number their streams from 0, pinned host memory
/// uses `u64::MAX`), and [`CachingAllocator::allocate`] and
/// [`CachingAllocator::record_stream`] refuse them.
pub const PRIVATE_POOL_STREAM_BASE: u64 = 1 << 62;

/// A private pool ([`CachingAllocator::create_private_pool`]): the memory of a captured CUDA
/// graph, PyTorch's graph pool. Ids are unique in the process and start at 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PrivatePoolId(u64);

impl PrivatePoolId {
    fn next() -> PrivatePoolId {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        PrivatePoolId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }

    /// The pool's number: snapshots give its segments `segment_pool_id` `(id, 0)`.
    pub fn id(self) -> u64 {
        self.0
    }

    /// The virtual stream its blocks are cached under, `StreamId(PRIVATE_POOL_STREAM_BASE +
    /// id)`: a block of the pool is reused only by requests routed to the pool. No storage knows
    /// this stream; snapshots, histories and [`CachingAllocator::allocation_stream`] name the
    /// stream routed to the pool instead.
    pub fn stream(self) -> StreamId {
        StreamId(PRIVATE_POOL_STREAM_BASE + self.0)
    }

    /// The pool whose virtual stream `stream` is, if it is one.
    fn from_stream(stream: StreamId) -> Option<PrivatePoolId> {
        is_reserved(stream)
            .then(|| PrivatePoolId(stream.0 - PRIVATE_POOL_STREAM_BASE))
            .filter(|pool| pool.0 > 0)
    }
}

impl std::fmt::Display for PrivatePoolId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The memory of one private pool ([`CachingAllocator::private_pool_usage`]). The allocator's
/// [`MemoryStats`] count the same bytes too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrivatePoolUsage {
    /// Whether the pool is live (created and not released): nothing of it is freed or unmapped.
    pub live: bool,
    /// Bytes of its segments and mapped pages.
    pub reserved_bytes: u64,
    /// Bytes of its allocated blocks (rounded sizes).
    pub allocated_bytes: u64,
    /// Its segments; a contiguous mapped range of an expandable segment counts as one, as in
    /// [`MemoryStats::segment`].
    pub segments: u64,
}

/// What the allocator keeps of a private pool.
#[derive(Debug)]
struct PrivatePool {
    /// Created and not released: no release step frees or unmaps its memory.
    live: bool,
    /// The stream whose requests were routed to it (set by the first routing): the stream its
    /// blocks are used on.
    stream: Option<StreamId>,
}

/// Whether `stream` is in the range reserved for private pools' virtual streams.
fn is_reserved(stream: StreamId) -> bool {
    (PRIVATE_POOL_STREAM_BASE..2 * PRIVATE_POOL_STREAM_BASE).contains(&stream.0)
}

/// Refuses a private pool's virtual stream where a device stream is expected.
fn device_stream_only(stream: StreamId) -> Result<(), AllocError> {
    if !is_reserved(stream) {
        return Ok(());
    }
    Err(AllocError::PrivatePool {
        pool: PrivatePoolId(stream.0 - PRIVATE_POOL_STREAM_BASE),
        misuse: PrivatePoolMisuse::VirtualStream,
    })
}

/// Adjacent available blocks of one expandable segment that a request will take once their
/// unmapped pages are mapped.
type Run = SmallVec<[BlockId; 4]>;

/// A live allocation: the block handed out by [`CachingAllocator::allocate`]. Give it back with
/// [`CachingAllocator::free`]; it is not `Clone`, so it cannot be freed twice.
#[derive(Debug, PartialEq, Eq, Hash)]
#[must_use = "an allocation that is dropped without `free` stays allocated"]
pub struct Allocation {
    address: u64,
    size: u64,
    requested: u64,
    stream: StreamId,
    allocator: AllocatorId,
    host_memory: bool,
}

/// Which [`CachingAllocator`] handed out an [`Allocation`]: unique among the allocators of a
/// process. A backend compares it with its own allocator's to know that a buffer's memory is
/// memory it can reach (host memory for the CPU backend, its device's for CUDA).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AllocatorId(u64);

impl AllocatorId {
    fn next() -> AllocatorId {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        AllocatorId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

impl Allocation {
    /// The allocator that handed it out.
    pub fn allocator(&self) -> AllocatorId {
        self.allocator
    }

    /// Whether its bytes are host memory the process may read and write for as long as the
    /// allocation lives (its storage is [`Storage::HOST_MEMORY`]: [`crate::HostStorage`], pinned
    /// memory).
    pub fn is_host_memory(&self) -> bool {
        self.host_memory
    }

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
    id: AllocatorId,
}

/// Pops the context label pushed by [`CachingAllocator::push_context`] (or
/// [`AllocatorView::push_context`](crate::AllocatorView::push_context)) when dropped.
#[must_use = "the label is popped as soon as the guard is dropped"]
pub struct ContextGuard<'a> {
    allocator: &'a dyn PopContext,
}

impl std::fmt::Debug for ContextGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContextGuard").finish_non_exhaustive()
    }
}

impl Drop for ContextGuard<'_> {
    fn drop(&mut self) {
        self.allocator.pop_context();
    }
}

/// What a [`ContextGuard`] does when dropped, whatever the allocator's storage.
trait PopContext {
    fn pop_context(&self);
}

impl<S: Storage> PopContext for CachingAllocator<S> {
    fn pop_context(&self) {
        self.state.lock().context.pop();
    }
}

impl<S: Storage> CachingAllocator<S> {
    /// An allocator over `storage`. Expandable segments are used when `config` asks for them and
    /// the storage can map pages.
    pub fn new(storage: S, config: AllocatorConfig) -> Self {
        let expandable =
            config.expandable_segments && config.caching && storage.supports_expandable_segments();
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
            reserved_high_water: 0,
            allocated_high_water: 0,
            reclaim_allowance: 0,
            reclaim_lent: [0, 0],
            epochs: FreeEpochs::new(),
            private_pools: FxHashMap::default(),
            routing: None,
            deferred: Vec::new(),
            history: History::default(),
            context: ContextStack::default(),
        };
        CachingAllocator {
            state: Mutex::new(state),
            config,
            id: AllocatorId::next(),
        }
    }

    /// This allocator's identity, which every [`Allocation`] it hands out carries.
    pub fn id(&self) -> AllocatorId {
        self.id
    }

    /// The settings in force.
    pub fn config(&self) -> &AllocatorConfig {
        &self.config
    }

    /// Whether this allocator grows expandable segments (asked for, and the storage can map).
    pub fn uses_expandable_segments(&self) -> bool {
        self.state.lock().expandable
    }

    /// Runs `f` on the storage (read only), under the allocator's lock.
    pub fn with_storage<R>(&self, f: impl FnOnce(&S) -> R) -> R {
        f(&self.state.lock().storage)
    }

    /// Runs `f` on the storage with write access, under the allocator's lock.
    ///
    /// # Safety
    /// `f` must not free, unmap or release anything the allocator obtained from the storage
    /// (segments, pages, address ranges, events), nor write memory of a live allocation that its
    /// owner does not expect to change: tensors and pinned buffers read and write that memory
    /// with no check of their own.
    pub unsafe fn with_storage_mut<R>(&self, f: impl FnOnce(&mut S) -> R) -> R {
        f(&mut self.state.lock().storage)
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
    /// The free epoch ([`free_epochs`]) in which the block was last freed, or made.
    freed_in: u64,
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
            freed_in: self.freed_in,
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
        } else if !self.is_available() {
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
    /// The most bytes ever reserved at once, which `reset_peak_stats` leaves alone: reclaiming
    /// free pages keeps reserved memory under this, so a reset of the statistics (a measurement)
    /// never changes what the allocator does.
    reserved_high_water: u64,
    /// The most bytes ever allocated at once, which `reset_peak_stats` leaves alone (for the
    /// same reason): the live peak that settling reclaims measure their slack against.
    allocated_high_water: u64,
    /// With `reclaim_settles`: reserved bytes a request may map up to without a reclaim, raised
    /// by each reclaim.
    reclaim_allowance: u64,
    /// With `reclaim_settles`, by pool ([`pool_index`]): the bytes of free pages that reclaims
    /// for the other pool's requests unmapped from this one, not yet given back. A pool that
    /// needs pages above the reclaim ceiling gets back up to this much ceiling before anything
    /// is reclaimed for it, so pages that a loop's steps move from one pool to the other and
    /// back move once.
    reclaim_lent: [u64; 2],
    /// With `reclaim_free_pages`: the epochs of frees, and which the device is done with.
    epochs: FreeEpochs,
    /// Private pools by id: the live ones, and released ones that still hold blocks.
    private_pools: FxHashMap<PrivatePoolId, PrivatePool>,
    /// The routing in force ([`CachingAllocator::begin_allocate_to_pool`]): requests on this
    /// stream are served from this pool, and nothing touches the device in ways a stream
    /// capture forbids.
    routing: Option<(StreamId, PrivatePoolId)>,
    /// Freed blocks that other streams used, whose events are not recorded yet (they are not
    /// recorded while routing): unavailable until their events are recorded and pass.
    deferred: Vec<BlockId>,
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

    // ----- private pools -----

    /// The stream whose cached blocks serve a request on `stream`: the routed pool's virtual
    /// stream while `stream` is routed to it, `stream` otherwise.
    fn cache_stream(&self, stream: StreamId) -> StreamId {
        match self.routing {
            Some((routed, pool)) if routed == stream => pool.stream(),
            _ => stream,
        }
    }

    /// The device stream behind cache stream `stream`: for a private pool's virtual stream, the
    /// stream routed to the pool (the virtual stream itself if it was never routed).
    fn device_stream(&self, stream: StreamId) -> StreamId {
        PrivatePoolId::from_stream(stream)
            .and_then(|pool| self.private_pools.get(&pool))
            .and_then(|pool| pool.stream)
            .unwrap_or(stream)
    }

    /// Whether `stream` is the virtual stream of a live private pool, whose memory no release
    /// step frees or unmaps.
    fn in_live_pool(&self, stream: StreamId) -> bool {
        PrivatePoolId::from_stream(stream)
            .and_then(|pool| self.private_pools.get(&pool))
            .is_some_and(|pool| pool.live)
    }

    // ----- history -----

    fn record(&mut self, action: TraceAction, addr: u64, size: u64, stream: StreamId) {
        if !self.history.is_recording() {
            return;
        }
        let stream = self.device_stream(stream);
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

    fn is_oversize(&self, size: u64) -> bool {
        self.config.max_split_size.is_some_and(|max| size >= max)
    }

    fn allowed_memory(&self) -> Option<u64> {
        let fraction = self.config.per_process_memory_fraction?;
        Some((self.storage.memory_info().total as f64 * fraction) as u64)
    }

    // ----- expandable segments -----

    fn expandable_segment(&self, index: u32) -> &ExpandableSegment {
        self.expandable_segments[index as usize]
            .as_ref()
            .expect("live expandable segment")
    }
}
