//! Introspection: statistics, a private pool's usage, fragmentation figures, the memory summary,
//! snapshots, history settings and the invariant check.
//!
//! Everything here reads the state; only the peak and counter resets, history settings and
//! context labels change it, and none of them touches a block. The snapshot walks each segment
//! and reports its mapped runs as PyTorch does, a private pool's with its `segment_pool_id`; the
//! invariant check recomputes every statistic from the blocks and compares it with the one kept.
//!
//! It sits on the parent module's state and on the report and snapshot models of the crate. It
//! must not change the blocks, pools or storage, so looking never changes what the policy does.

use super::{
    pool_index, round_up, CachingAllocator, ContextGuard, PrivatePoolId, PrivatePoolUsage,
    SegmentKind, State, NIL,
};
use crate::free_index::BlockId;
use crate::history::HistoryOptions;
use crate::snapshot::{BlockSnapshot, BlockState, SegmentSnapshot, Snapshot, Value};
use crate::stats::{FragmentationStats, MemoryStats, PoolKind, StatArray};
use crate::storage::Storage;

impl<S: Storage> CachingAllocator<S> {
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

    /// Sets every peak to its current value. Only the statistics: what the allocator does next
    /// does not depend on it (reclaiming free pages measures against the highest reserved and
    /// allocated figures ever).
    pub fn reset_peak_stats(&self) {
        let mut state = self.state.lock();
        state.reserved_high_water = state.reserved_ceiling();
        state.allocated_high_water = state.allocated_ceiling();
        state.stats.reset_peak();
    }

    /// Zeroes cumulative sums and counters.
    pub fn reset_accumulated_stats(&self) {
        self.state.lock().stats.reset_accumulated();
    }

    /// The memory of private pool `pool`; `None` for a pool this allocator does not know: never
    /// created here, or released and forgotten (`release_private_pool` and `empty_cache` forget
    /// a released pool that holds no memory). Costs a pass over all blocks.
    pub fn private_pool_usage(&self, pool: PrivatePoolId) -> Option<PrivatePoolUsage> {
        self.state.lock().private_pool_usage(pool)
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
    pub fn push_context(&self, label: &str) -> ContextGuard<'_> {
        self.state.lock().context.push(label.to_owned());
        ContextGuard { allocator: self }
    }

    /// The allocator's state in PyTorch's snapshot structure, with the recorded history.
    pub fn snapshot(&self) -> Snapshot {
        self.state.lock().snapshot()
    }

    /// Recomputes every statistic from the blocks and checks the block structure (links,
    /// contiguity, pool membership, private pools, deferred frees). For tests and debugging;
    /// costs a pass over all blocks.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.state.lock().check_invariants()
    }
}

impl<S: Storage> State<S> {
    fn private_pool_usage(&self, pool: PrivatePoolId) -> Option<PrivatePoolUsage> {
        let mut usage = PrivatePoolUsage {
            live: self.private_pools.get(&pool)?.live,
            ..PrivatePoolUsage::default()
        };
        let stream = pool.stream();
        for b in self
            .blocks
            .iter()
            .filter(|b| b.size > 0 && b.stream == stream)
        {
            if !b.mapped {
                continue;
            }
            usage.reserved_bytes += b.size;
            if b.allocated {
                usage.allocated_bytes += b.size;
            }
            // A segment, or a mapped run of an expandable one, starts here.
            if b.prev == NIL || !self.block(b.prev).mapped {
                usage.segments += 1;
            }
        }
        Some(usage)
    }

    fn fragmentation_stats(&self) -> FragmentationStats {
        let mut figures = FragmentationStats::default();
        for b in self.blocks.iter().filter(|b| b.size > 0) {
            if b.allocated {
                figures.internal_waste_bytes += b.size - b.requested;
                continue;
            }
            if !b.mapped || !b.is_available() {
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
                    stream: self.device_stream(b.stream).0,
                    segment_type: b.pool,
                    segment_pool_id: PrivatePoolId::from_stream(b.stream)
                        .map_or((0, 0), |pool| (pool.0 as i64, 0)),
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
        let mut n_deferred = 0;
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
                if !b.mapped && !b.is_available() {
                    return Err(format!("unmapped block {cursor} is in use"));
                }
                if PrivatePoolId::from_stream(b.stream)
                    .is_some_and(|pool| !self.private_pools.contains_key(&pool))
                {
                    return Err(format!("block {cursor} is of an unknown private pool"));
                }
                let deferred = !b.allocated && !b.stream_uses.is_empty();
                if deferred != self.deferred.contains(&cursor) {
                    return Err(format!("block {cursor} deferred-list membership is wrong"));
                }
                n_deferred += usize::from(deferred);
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
                if !b.is_available() {
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
        if self.deferred.len() != n_deferred {
            return Err(format!(
                "{} deferred entries for {n_deferred} blocks",
                self.deferred.len()
            ));
        }
        if let Some((_, pool)) = self.routing {
            if !self.private_pools.get(&pool).is_some_and(|p| p.live) {
                return Err(format!("routed to private pool {pool}, which is not live"));
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
