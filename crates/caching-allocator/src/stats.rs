//! The statistics of `torch.cuda.memory_stats()`, kept exactly, plus what PyTorch lacks.
//!
//! [`MemoryStats`] mirrors PyTorch's `DeviceStats`: each [`Stat`] has a current value, a peak and
//! the cumulative increases and decreases, kept for all pools together and for the small and large
//! pools apart ([`StatArray`]). [`MemoryStats::to_flat_map`] flattens them to PyTorch's keys
//! (`allocated_bytes.all.current`, ...). [`FragmentationStats`] holds the figures PyTorch does not
//! report: the largest free block per pool, free bytes stranded in segments that cannot be
//! released, and internal waste.
//!
//! This module only stores numbers; the policy (`crate::allocator`) decides when they move.

use std::collections::BTreeMap;

/// One statistic: PyTorch's `Stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stat {
    /// Its value now.
    pub current: i64,
    /// The largest `current` since creation or the last [`Stat::reset_peak`].
    pub peak: i64,
    /// Sum of all increases since creation or the last [`Stat::reset_accumulated`].
    pub allocated: i64,
    /// Sum of all decreases since creation or the last [`Stat::reset_accumulated`].
    pub freed: i64,
}

impl Stat {
    /// Adds `amount` (negative to decrease), keeping peak and the cumulative sums.
    #[inline]
    pub fn update(&mut self, amount: i64) {
        self.current += amount;
        self.peak = self.peak.max(self.current);
        self.allocated += amount.max(0);
        self.freed += (-amount).max(0);
    }

    /// Sets the peak to the current value.
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    /// Zeroes the cumulative increases and decreases.
    pub fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }
}

/// Which pool a block belongs to: requests up to 1 MiB go to the small pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PoolKind {
    /// Requests of at most 1 MiB, served from 2 MiB segments.
    Small,
    /// Larger requests.
    Large,
}

impl PoolKind {
    /// PyTorch's name for the pool in statistics keys and snapshots.
    pub fn name(self) -> &'static str {
        match self {
            PoolKind::Small => "small",
            PoolKind::Large => "large",
        }
    }
}

/// A statistic for all pools together and for each pool apart (PyTorch's `StatArray`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StatArray {
    /// Both pools.
    pub all: Stat,
    /// The small pool.
    pub small_pool: Stat,
    /// The large pool.
    pub large_pool: Stat,
}

impl StatArray {
    /// Updates `all` and the pool's entry.
    #[inline]
    pub fn update(&mut self, pool: PoolKind, amount: i64) {
        self.all.update(amount);
        self.pool_mut(pool).update(amount);
    }

    /// The entry of one pool.
    pub fn pool(&self, pool: PoolKind) -> &Stat {
        match pool {
            PoolKind::Small => &self.small_pool,
            PoolKind::Large => &self.large_pool,
        }
    }

    fn pool_mut(&mut self, pool: PoolKind) -> &mut Stat {
        match pool {
            PoolKind::Small => &mut self.small_pool,
            PoolKind::Large => &mut self.large_pool,
        }
    }

    fn entries_mut(&mut self) -> [&mut Stat; 3] {
        [&mut self.all, &mut self.small_pool, &mut self.large_pool]
    }

    fn entries(&self) -> [(&'static str, &Stat); 3] {
        [
            ("all", &self.all),
            ("small_pool", &self.small_pool),
            ("large_pool", &self.large_pool),
        ]
    }
}

/// All of `torch.cuda.memory_stats()`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MemoryStats {
    /// Live client allocations (count).
    pub allocation: StatArray,
    /// Segments obtained from the storage (count); a contiguous mapped range of an expandable
    /// segment counts as one.
    pub segment: StatArray,
    /// Allocated blocks plus blocks whose free waits on other streams (count).
    pub active: StatArray,
    /// Free blocks inside segments that also hold other blocks (count; not for expandable).
    pub inactive_split: StatArray,
    /// Bytes of allocated blocks (rounded sizes).
    pub allocated_bytes: StatArray,
    /// Bytes of segments and mapped pages.
    pub reserved_bytes: StatArray,
    /// Bytes of active blocks.
    pub active_bytes: StatArray,
    /// Bytes of inactive split blocks.
    pub inactive_split_bytes: StatArray,
    /// Bytes the callers asked for (before rounding).
    pub requested_bytes: StatArray,
    /// Times an allocation freed the cache and retried.
    pub num_alloc_retries: i64,
    /// Out-of-memory errors returned.
    pub num_ooms: i64,
    /// Times every pending event was waited for (by `empty_cache` or an OOM retry).
    pub num_sync_all_streams: i64,
    /// Segment allocations and page mappings asked of the storage.
    pub num_device_alloc: i64,
    /// Segment frees and page unmappings asked of the storage.
    pub num_device_free: i64,
    /// Live allocations of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Live segments of at least `max_split_size`.
    pub oversize_segments: Stat,
    /// `max_split_size` in bytes, or −1 when unlimited (PyTorch casts its `SIZE_MAX` the same way).
    pub max_split_size: i64,
}

impl MemoryStats {
    /// Sets every peak to its current value (`torch.cuda.reset_peak_memory_stats`).
    pub fn reset_peak(&mut self) {
        for array in self.arrays_mut() {
            for stat in array.entries_mut() {
                stat.reset_peak();
            }
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// Zeroes cumulative sums and counters (`torch.cuda.reset_accumulated_memory_stats`).
    pub fn reset_accumulated(&mut self) {
        for array in self.arrays_mut() {
            for stat in array.entries_mut() {
                stat.reset_accumulated();
            }
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
    }

    /// The statistics under PyTorch's flat keys, sorted (`allocated_bytes.all.current`, ...).
    pub fn to_flat_map(&self) -> BTreeMap<String, i64> {
        let mut map = BTreeMap::new();
        for (name, array) in self.named_arrays() {
            for (pool, stat) in array.entries() {
                insert_stat(&mut map, &format!("{name}.{pool}"), stat);
            }
        }
        insert_stat(&mut map, "oversize_allocations", &self.oversize_allocations);
        insert_stat(&mut map, "oversize_segments", &self.oversize_segments);
        map.insert("num_alloc_retries".into(), self.num_alloc_retries);
        map.insert("num_ooms".into(), self.num_ooms);
        map.insert("num_sync_all_streams".into(), self.num_sync_all_streams);
        map.insert("num_device_alloc".into(), self.num_device_alloc);
        map.insert("num_device_free".into(), self.num_device_free);
        map.insert("max_split_size".into(), self.max_split_size);
        map
    }

    /// The nine stat arrays with PyTorch's names, in PyTorch's order.
    pub fn named_arrays(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }
}

fn insert_stat(map: &mut BTreeMap<String, i64>, prefix: &str, stat: &Stat) {
    map.insert(format!("{prefix}.current"), stat.current);
    map.insert(format!("{prefix}.peak"), stat.peak);
    map.insert(format!("{prefix}.allocated"), stat.allocated);
    map.insert(format!("{prefix}.freed"), stat.freed);
}

/// Figures PyTorch does not report, computed from the blocks when asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FragmentationStats {
    /// The largest free (mapped) block of the small pool.
    pub largest_free_small: u64,
    /// The largest free (mapped) block of the large pool.
    pub largest_free_large: u64,
    /// Free bytes in segments that also hold live blocks: cached, but not releasable by
    /// `empty_cache` (for expandable segments, the free bytes that do not fill a whole page).
    pub stranded_free_bytes: u64,
    /// Free bytes in the cache in all (releasable or not).
    pub cached_free_bytes: u64,
    /// Bytes handed out beyond what callers asked for: Σ (block size − requested size).
    pub internal_waste_bytes: u64,
}
