//! Expandable segments: one reserved range of addresses per stream and pool, grown and shrunk
//! by mapping and unmapping pages.
//!
//! A request that misses the pool takes a run of available blocks: the first unmapped range (by
//! address: the segment's end, or a hole whose pages were unmapped) with the available block
//! before it and those after it, once mapped, hold the request. Just enough pages are mapped and
//! the run becomes one free mapped block. The page size is 2 MiB in the small pool and
//! `expandable_page_size` in the large one. Releasing unmaps the
//! whole pages inside free blocks (those the storage can release: whole handles), keeping any
//! partial pages at their ends mapped, and gives
//! back the address space of a segment with nothing mapped. Unmapped ranges are blocks too, kept
//! in the pool's unmapped set by address, so the segment stays one linked list of blocks.
//!
//! It sits on the parent module's state, on the storage's page mapping, and on `free` to merge
//! neighbouring blocks. It must not know when to map or unmap: `malloc` and `release` decide.

use smallvec::SmallVec;

use super::{
    pool_index, round_up, Block, ExpandableSegment, Run, SegmentKind, State, NIL, SMALL_BUFFER,
};
use crate::error::AllocError;
use crate::free_index::BlockId;
use crate::snapshot::TraceAction;
use crate::stats::PoolKind;
use crate::storage::{MappingUnits, Storage, StorageError, StreamId};

impl<S: Storage> State<S> {
    /// The run of blocks a request of `size` bytes would take in the stream's expandable segment
    /// of `pool` (created if the stream has none): the first unmapped block, in address order,
    /// that with the available block before it and those after it holds `size` bytes once
    /// mapped. `None` when no run is large enough.
    pub(super) fn expandable_run(
        &mut self,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
    ) -> Result<Option<Run>, AllocError> {
        if !self
            .expandable_segments
            .iter()
            .flatten()
            .any(|s| s.stream == stream && s.pool == pool)
        {
            self.create_expandable_segment(pool, stream)?;
        }
        let Some(stream_pool) = self.pools[pool_index(pool)].streams.get(&stream) else {
            return Ok(None);
        };
        for &unmapped in stream_pool.unmapped.values() {
            let prev = self.block(unmapped).prev;
            let start = if prev != NIL && self.block(prev).is_available() {
                prev
            } else {
                unmapped
            };
            let mut run = Run::new();
            let mut bytes = 0;
            let mut cursor = start;
            while bytes < size && cursor != NIL && self.block(cursor).is_available() {
                bytes += self.block(cursor).size;
                run.push(cursor);
                cursor = self.block(cursor).next;
            }
            if bytes >= size {
                return Ok(Some(run));
            }
        }
        Ok(None)
    }

    /// Bytes [`State::map_block`] would map for the first `size` bytes of `run`.
    pub(super) fn bytes_to_map(&self, run: &[BlockId], size: u64) -> u64 {
        let start = self.block(run[0]);
        let SegmentKind::Expandable(segment) = start.segment else {
            return 0;
        };
        let s = self.expandable_segment(segment);
        let region_end = s.base + round_up(start.address + size - s.base, s.page);
        run.iter()
            .map(|&id| self.block(id))
            .filter(|b| !b.mapped)
            .map(|b| b.end().min(region_end) - b.address)
            .sum()
    }

    /// The whole pages inside block `id` of an expandable segment, in bytes, and the segment's
    /// index: what [`State::unmap_block`] would unmap. `None` for a block of a classic segment.
    pub(super) fn whole_pages(&self, id: BlockId) -> Option<(u64, u32)> {
        let SegmentKind::Expandable(segment) = self.block(id).segment else {
            return None;
        };
        let (start, end) = self.releasable_pages(id, segment);
        Some((end - start, segment))
    }

    /// The whole pages inside block `id` of expandable segment `segment` that the storage can
    /// release (whole handles), as `[start, end)`; empty when there are none.
    fn releasable_pages(&self, id: BlockId, segment: u32) -> (u64, u64) {
        let s = self.expandable_segment(segment);
        let block = self.block(id);
        let start = s.base + round_up(block.address - s.base, s.page);
        let end = s.base + (block.end() - s.base) / s.page * s.page;
        if start >= end || !block.mapped {
            return (start, start);
        }
        let (start, end) = self.storage.releasable_range(start, end);
        (start, end.max(start))
    }

    fn create_expandable_segment(
        &mut self,
        pool: PoolKind,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        let (page, max_handle) = match pool {
            PoolKind::Small => (SMALL_BUFFER, SMALL_BUFFER),
            PoolKind::Large => (
                self.config.expandable_page_size,
                self.config.expandable_handle_size,
            ),
        };
        let page = round_up(page, self.storage.page_granularity());
        let max_handle = max_handle.max(page) / page * page;
        let total = self.storage.memory_info().total;
        let reserved = round_up(total / 8 * 9, page);
        let units = MappingUnits { page, max_handle };
        let base = self.storage.reserve_address_space(reserved, units)?;
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
            freed_in: self.epochs.current(),
        });
        self.insert_unmapped(id);
        Ok(())
    }

    /// Maps the unmapped pages that the first `size` bytes of `run` (adjacent available blocks
    /// of one expandable segment) need, and merges the run into one free mapped block, returned
    /// out of the free set. `None` if the storage ran out of memory (what was mapped stays
    /// cached as a free block).
    pub(super) fn map_block(
        &mut self,
        run: &[BlockId],
        size: u64,
    ) -> Result<Option<BlockId>, AllocError> {
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

    /// Unmaps the whole pages inside free block `id` that the storage can release, leaving the
    /// rest at its ends (partial pages, parts of handles that reach outside it) as free mapped
    /// blocks.
    pub(super) fn unmap_block(&mut self, id: BlockId, segment: u32) -> Result<(), AllocError> {
        let b = self.block(id).clone();
        let (start, end) = self.releasable_pages(id, segment);
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
    pub(super) fn release_empty_expandable_segments(&mut self) -> Result<(), AllocError> {
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
}
