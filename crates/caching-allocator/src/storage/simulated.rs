//! Simulated device memory: addresses and accounting, nothing behind them.
//!
//! A simulated storage lets a 100 GB allocator trace replay on a machine with a few GB, and lets
//! tests control time: events recorded on a stream stay pending until the test completes them
//! through an [`EventControl`] handle (or the allocator synchronizes). It supports expandable
//! segments with real range bookkeeping, so mapping the same page twice or unmapping a page that
//! is not mapped is an error here as it is on a GPU.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::handles::{plan_handles, HandleTable};
use super::{EventId, MappingUnits, MemoryInfo, Storage, StorageError, StreamId};

/// First address handed out; non-zero so that a zero address is always a bug.
const FIRST_ADDRESS: u64 = 0x7f00_0000_0000;
/// Segments and reservations start on this boundary, as `cudaMalloc` results do.
const SEGMENT_ALIGN: u64 = 2 << 20;

/// The shared state of a simulated storage's events: which are still pending.
#[derive(Debug, Default)]
struct EventTable {
    next: u64,
    pending: HashMap<u64, StreamId>,
}

/// A handle that completes a simulated storage's events, as the passing of time would on a
/// device. Clone it before handing the storage to an allocator.
#[derive(Debug, Clone, Default)]
pub struct EventControl {
    table: Arc<Mutex<EventTable>>,
}

impl EventControl {
    /// Completes every event recorded so far.
    pub fn complete_all(&self) {
        self.table.lock().pending.clear();
    }

    /// Completes the events recorded on `stream` so far.
    pub fn complete_stream(&self, stream: StreamId) {
        self.table.lock().pending.retain(|_, s| *s != stream);
    }

    /// Number of events still pending.
    pub fn n_pending(&self) -> usize {
        self.table.lock().pending.len()
    }
}

/// A handle that tells a simulated storage where to put its next segment, as the device did in
/// a recording: a trace replay names the address at which the recorded allocator's block came
/// out, which is its segment's start when that allocation obtained a new segment. Clone it
/// before handing the storage to an allocator.
#[derive(Debug, Clone, Default)]
pub struct SegmentPlacement {
    /// The address for the next segment; 0 for none.
    next: Arc<AtomicU64>,
}

impl SegmentPlacement {
    /// The next segment starts at `address` if the whole segment fits there (nothing else
    /// occupies the range); otherwise the storage places it as usual. Holds until the next
    /// segment allocation, or [`SegmentPlacement::clear`].
    pub fn place_next_at(&self, address: u64) {
        self.next.store(address, Ordering::Relaxed);
    }

    /// Forgets the address given by [`SegmentPlacement::place_next_at`].
    pub fn clear(&self) {
        self.next.store(0, Ordering::Relaxed);
    }

    fn take(&self) -> Option<u64> {
        match self.next.swap(0, Ordering::Relaxed) {
            0 => None,
            address => Some(address),
        }
    }
}

/// Device memory that exists only as addresses and byte counts.
#[derive(Debug)]
pub struct SimulatedStorage {
    capacity: u64,
    page_granularity: u64,
    in_use: u64,
    next_address: u64,
    segments: BTreeMap<u64, u64>,
    reservations: BTreeMap<u64, u64>,
    /// How each reservation (by start) is mapped.
    reservation_units: HashMap<u64, MappingUnits>,
    mapped: HandleTable,
    /// Handles created by maps so far.
    handles_mapped: u64,
    events: EventControl,
    placement: SegmentPlacement,
}

impl SimulatedStorage {
    /// A simulated device with `capacity` bytes of memory (an H200 has 150,754,820,096).
    pub fn new(capacity: u64) -> Self {
        SimulatedStorage {
            capacity,
            page_granularity: SEGMENT_ALIGN,
            in_use: 0,
            next_address: FIRST_ADDRESS,
            segments: BTreeMap::new(),
            reservations: BTreeMap::new(),
            reservation_units: HashMap::new(),
            mapped: HandleTable::default(),
            handles_mapped: 0,
            events: EventControl::default(),
            placement: SegmentPlacement::default(),
        }
    }

    /// The handle that places this storage's next segment.
    pub fn segment_placement(&self) -> SegmentPlacement {
        self.placement.clone()
    }

    /// The handle that completes this storage's events.
    pub fn event_control(&self) -> EventControl {
        self.events.clone()
    }

    /// Physical handles that maps have created so far: on a GPU each is a `cuMemCreate` and
    /// its share of `cuMemSetAccess`, the cost of mapping (see [`MappingUnits`]).
    pub fn handles_mapped(&self) -> u64 {
        self.handles_mapped
    }

    /// Bytes of segments and mapped pages currently held.
    pub fn bytes_in_use(&self) -> u64 {
        self.in_use
    }

    fn take_address_range(&mut self, size: u64) -> u64 {
        // Leave a gap after each range so that adjacent segments are never contiguous by
        // accident; skip ranges a placed segment took.
        let span = size.div_ceil(SEGMENT_ALIGN) * SEGMENT_ALIGN + SEGMENT_ALIGN;
        while let Some(end) = self.occupied_until(self.next_address, span) {
            self.next_address = end.div_ceil(SEGMENT_ALIGN) * SEGMENT_ALIGN + SEGMENT_ALIGN;
        }
        let address = self.next_address;
        self.next_address += span;
        address
    }

    /// The end of a segment or reservation that overlaps `[address, address + size)`, if any.
    fn occupied_until(&self, address: u64, size: u64) -> Option<u64> {
        let end = address.checked_add(size)?;
        [&self.segments, &self.reservations]
            .into_iter()
            .filter_map(|ranges| {
                ranges
                    .range(..end)
                    .next_back()
                    .map(|(&start, &len)| start + len)
                    .filter(|&range_end| range_end > address)
            })
            .max()
    }

    fn reservation_containing(&self, address: u64, size: u64) -> Option<(u64, u64)> {
        let (&start, &len) = self.reservations.range(..=address).next_back()?;
        (address + size <= start + len).then_some((start, len))
    }
}

// SAFETY: addresses are numbers only and it does not claim host memory; segments and mapped
// ranges come from one bump counter and an interval table, so they never overlap.
unsafe impl Storage for SimulatedStorage {
    fn name(&self) -> &'static str {
        "simulated"
    }

    fn allocate_segment(&mut self, size: u64) -> Result<u64, StorageError> {
        if size == 0 || self.in_use.saturating_add(size) > self.capacity {
            return Err(StorageError::OutOfMemory { requested: size });
        }
        let address = match self.placement.take() {
            Some(address)
                if address.is_multiple_of(512)
                    && address.checked_add(size).is_some()
                    && self.occupied_until(address, size).is_none() =>
            {
                address
            }
            _ => self.take_address_range(size),
        };
        self.segments.insert(address, size);
        self.in_use += size;
        Ok(address)
    }

    fn free_segment(&mut self, address: u64, size: u64) -> Result<(), StorageError> {
        match self.segments.get(&address) {
            Some(&held) if held == size => {
                self.segments.remove(&address);
                self.in_use -= size;
                Ok(())
            }
            Some(&held) => Err(StorageError::InvalidRange(format!(
                "segment at {address:#x} has {held} bytes, not {size}"
            ))),
            None => Err(StorageError::InvalidRange(format!(
                "no segment at {address:#x}"
            ))),
        }
    }

    fn memory_info(&self) -> MemoryInfo {
        MemoryInfo {
            free: self.capacity.saturating_sub(self.in_use),
            total: self.capacity,
        }
    }

    fn supports_expandable_segments(&self) -> bool {
        true
    }

    fn page_granularity(&self) -> u64 {
        self.page_granularity
    }

    fn reserve_address_space(
        &mut self,
        size: u64,
        units: MappingUnits,
    ) -> Result<u64, StorageError> {
        let address = self.take_address_range(size);
        self.reservations.insert(address, size);
        self.reservation_units.insert(address, units);
        Ok(address)
    }

    fn release_address_space(&mut self, address: u64, size: u64) -> Result<(), StorageError> {
        if self.reservations.get(&address) != Some(&size) {
            return Err(StorageError::InvalidRange(format!(
                "no reservation of {size} bytes at {address:#x}"
            )));
        }
        if self.mapped.overlaps(address, address + size) {
            return Err(StorageError::InvalidRange(format!(
                "reservation at {address:#x} still has mapped pages"
            )));
        }
        self.reservations.remove(&address);
        self.reservation_units.remove(&address);
        Ok(())
    }

    fn map(&mut self, address: u64, size: u64) -> Result<(), StorageError> {
        if size == 0
            || !address.is_multiple_of(self.page_granularity)
            || !size.is_multiple_of(self.page_granularity)
        {
            return Err(StorageError::InvalidRange(format!(
                "map of {size} bytes at {address:#x} is not page aligned"
            )));
        }
        let Some((base, _)) = self.reservation_containing(address, size) else {
            return Err(StorageError::InvalidRange(format!(
                "map of {size} bytes at {address:#x} is outside any reservation"
            )));
        };
        if self.mapped.overlaps(address, address + size) {
            return Err(StorageError::InvalidRange(format!(
                "map of {size} bytes at {address:#x} overlaps mapped pages"
            )));
        }
        if self.in_use.saturating_add(size) > self.capacity {
            return Err(StorageError::OutOfMemory { requested: size });
        }
        let units = self.reservation_units[&base];
        for run in plan_handles(base, units, self.page_granularity, address, size) {
            self.handles_mapped += run.bytes / run.handle;
            self.mapped.insert(run);
        }
        self.in_use += size;
        Ok(())
    }

    fn unmap(&mut self, address: u64, size: u64) -> Result<(), StorageError> {
        let end = address + size;
        self.mapped.whole_handles(address, end).map_err(|reason| {
            StorageError::InvalidRange(format!(
                "unmap of {size} bytes at {address:#x} is not whole mapped handles: {reason}"
            ))
        })?;
        self.mapped.remove(address, end);
        self.in_use -= size;
        Ok(())
    }

    fn releasable_range(&self, address: u64, end: u64) -> (u64, u64) {
        self.mapped.releasable(address, end)
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventId, StorageError> {
        let mut table = self.events.table.lock();
        table.next += 1;
        let id = table.next;
        table.pending.insert(id, stream);
        Ok(EventId(id))
    }

    fn query_event(&mut self, event: EventId) -> Result<bool, StorageError> {
        Ok(!self.events.table.lock().pending.contains_key(&event.0))
    }

    fn synchronize_event(&mut self, event: EventId) -> Result<(), StorageError> {
        self.events.table.lock().pending.remove(&event.0);
        Ok(())
    }

    fn release_event(&mut self, event: EventId) {
        self.events.table.lock().pending.remove(&event.0);
    }

    fn synchronize_device(&mut self) -> Result<(), StorageError> {
        self.events.complete_all();
        Ok(())
    }
}
