//! Free epochs: which free pages the device is already done with, so that a reclaim can unmap
//! them without waiting for the device.
//!
//! Unmapping a free page is safe only once the work queued before its block was freed has run:
//! a kernel still in flight may read it. Waiting for the whole device (what a reclaim did
//! before) stalls the host until every queued kernel has run. Instead, the frees are grouped in
//! epochs: every [`FREES_PER_MARK`] frees, the epoch is closed by a mark, an event recorded on
//! every stream that has a pool. A block remembers the epoch in which it was last freed
//! (`Block::freed_in`); once all of a mark's events have passed, every block freed in that epoch
//! or before is done with, and a reclaim may take its pages at once. In a training loop that
//! reads its loss every step, the marks of the previous step have passed by the time the next
//! step needs pages, so its reclaims find most free pages ready.
//!
//! Marks are only kept when free pages can be reclaimed (`reclaim_free_pages` with expandable
//! segments): PyTorch's policies record nothing more than PyTorch does. At most [`MAX_MARKS`]
//! are outstanding; while that many have not passed, the open epoch grows instead. No mark is
//! recorded while requests are routed to a private pool (a capture may be under way), and a
//! private pool's virtual stream is marked through the stream routed to it.
//!
//! It sits on the parent module's state and on the storage's events. It must not know how
//! reclaims choose their pages.

use smallvec::SmallVec;

use super::{is_reserved, State};
use crate::storage::{EventId, Storage, StreamId};

/// Frees per epoch: one event per stream every this many frees (a ViT-L/16 or GPT-2 step frees
/// a few thousand blocks).
pub(super) const FREES_PER_MARK: u32 = 64;

/// Marks whose events may be outstanding at once.
pub(super) const MAX_MARKS: usize = 64;

/// The epochs of frees and the marks that close them.
#[derive(Debug)]
pub(super) struct FreeEpochs {
    /// The open epoch: blocks freed now get this number.
    current: u64,
    /// Blocks freed in an epoch below this one are done with on every stream.
    passed: u64,
    /// Frees in the open epoch.
    frees: u32,
    /// Closed epochs whose marks have not all passed yet, oldest first: the epoch and its
    /// mark's events.
    marks: std::collections::VecDeque<(u64, SmallVec<[EventId; 2]>)>,
}

impl FreeEpochs {
    pub(super) fn new() -> FreeEpochs {
        FreeEpochs {
            current: 1,
            passed: 1,
            frees: 0,
            marks: std::collections::VecDeque::new(),
        }
    }

    /// The open epoch: what a block freed (or made) now records.
    pub(super) fn current(&self) -> u64 {
        self.current
    }

    /// Whether a block last freed in `epoch` is done with on the device.
    pub(super) fn has_passed(&self, epoch: u64) -> bool {
        epoch < self.passed
    }
}

impl<S: Storage> State<S> {
    /// Whether frees are grouped in epochs (only a policy that reclaims free pages uses them).
    pub(super) fn keeps_free_epochs(&self) -> bool {
        self.expandable && self.config.reclaim_free_pages
    }

    /// Counts a free in the open epoch, and closes the epoch with a mark every
    /// [`FREES_PER_MARK`] frees. A mark that cannot be recorded (a storage error) is skipped:
    /// the epoch stays open, and its blocks wait for the next mark or the next device wait.
    pub(super) fn count_free_in_epoch(&mut self) {
        if !self.keeps_free_epochs() {
            return;
        }
        self.epochs.frees += 1;
        if self.epochs.frees < FREES_PER_MARK || self.routing.is_some() {
            return;
        }
        self.note_passed_marks();
        if self.epochs.marks.len() >= MAX_MARKS {
            return;
        }
        let mut streams: SmallVec<[StreamId; 2]> = SmallVec::new();
        for pool in &self.pools {
            for &stream in pool.streams.keys() {
                // A private pool's blocks are used by the work of the stream routed to it: its
                // captured kernels, which no reclaim races (a live pool's pages are never
                // unmapped, and a pool is released once the device is done with it), and the
                // stream's own work on blocks handed out there. So a free in the pool is a free
                // on that stream, and the mark goes there. Merely skipping the virtual stream
                // would be wrong: a stream whose every request was routed has no pool of its
                // own, so nothing else would mark it. The storage does not know a virtual
                // stream; one never routed holds no block.
                let stream = self.device_stream(stream);
                if !is_reserved(stream) && !streams.contains(&stream) {
                    streams.push(stream);
                }
            }
        }
        let mut events = SmallVec::new();
        for stream in streams {
            match self.storage.record_event(stream) {
                Ok(event) => events.push(event),
                Err(_) => {
                    for event in events {
                        self.storage.release_event(event);
                    }
                    return;
                }
            }
        }
        let epoch = self.epochs.current;
        self.epochs.marks.push_back((epoch, events));
        self.epochs.current += 1;
        self.epochs.frees = 0;
    }

    /// Takes the marks whose events have all passed off the queue (no waiting): every block
    /// freed in their epochs is done with. A query that fails counts as not passed.
    pub(super) fn note_passed_marks(&mut self) {
        while let Some((epoch, events)) = self.epochs.marks.front() {
            let epoch = *epoch;
            let events = events.clone();
            if !events
                .iter()
                .all(|&event| matches!(self.storage.query_event(event), Ok(true)))
            {
                break;
            }
            for event in events {
                self.storage.release_event(event);
            }
            self.epochs.marks.pop_front();
            self.epochs.passed = epoch + 1;
        }
    }

    /// After a wait for the whole device: every block freed so far is done with. The open epoch
    /// closes without a mark.
    pub(super) fn note_device_idle(&mut self) {
        for (_, events) in std::mem::take(&mut self.epochs.marks) {
            for event in events {
                self.storage.release_event(event);
            }
        }
        self.epochs.current += 1;
        self.epochs.passed = self.epochs.current;
        self.epochs.frees = 0;
    }
}
