//! The recorded history: a bounded ring of trace entries and the user's context stack.
//!
//! [`HistoryOptions`] says whether the allocator records, how many entries the ring keeps and
//! whether entries carry their context. The context is a stack of labels the user pushes
//! (`forward`, `encoder.3`, `mlp`), turned into [`Frame`]s innermost first so PyTorch's viewer
//! shows it as a call stack. This module stores entries; the policy decides what to record.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::snapshot::{Frame, Frames, TraceEntry};

/// The `filename` of frames that hold a context label.
pub(crate) const CONTEXT_FILENAME: &str = "headroom:context";

/// What [`crate::CachingAllocator::record_history`] records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryOptions {
    /// Keep at most this many trace entries; the oldest are dropped first (at least 1).
    pub max_entries: usize,
    /// Attach the context stack to trace entries (it is always attached to live blocks while
    /// recording).
    pub record_context: bool,
}

impl Default for HistoryOptions {
    fn default() -> Self {
        HistoryOptions {
            max_entries: 1 << 20,
            record_context: true,
        }
    }
}

/// The ring of trace entries.
#[derive(Debug, Default)]
pub(crate) struct History {
    pub(crate) options: Option<HistoryOptions>,
    pub(crate) entries: VecDeque<TraceEntry>,
    pub(crate) overflowed: bool,
}

impl History {
    pub(crate) fn is_recording(&self) -> bool {
        self.options.is_some()
    }

    pub(crate) fn push(&mut self, entry: TraceEntry) {
        let Some(options) = self.options else { return };
        while self.entries.len() >= options.max_entries.max(1) {
            self.entries.pop_front();
            self.overflowed = true;
        }
        self.entries.push_back(entry);
    }
}

/// The user's stack of context labels and its frames, rebuilt on each push and pop.
#[derive(Debug)]
pub(crate) struct ContextStack {
    labels: Vec<String>,
    frames: Frames,
    /// One shared empty list, so entries without context cost no allocation.
    empty: Frames,
}

impl Default for ContextStack {
    fn default() -> Self {
        let empty: Frames = Arc::from(Vec::new());
        ContextStack {
            labels: Vec::new(),
            frames: empty.clone(),
            empty,
        }
    }
}

impl ContextStack {
    pub(crate) fn no_frames(&self) -> Frames {
        self.empty.clone()
    }

    pub(crate) fn push(&mut self, label: String) {
        self.labels.push(label);
        self.rebuild();
    }

    pub(crate) fn pop(&mut self) {
        self.labels.pop();
        self.rebuild();
    }

    pub(crate) fn frames(&self) -> Frames {
        self.frames.clone()
    }

    fn rebuild(&mut self) {
        if self.labels.is_empty() {
            self.frames = self.empty.clone();
            return;
        }
        let frames: Vec<Frame> = self
            .labels
            .iter()
            .rev()
            .map(|label| Frame::context(label.as_str()))
            .collect();
        self.frames = Arc::from(frames);
    }
}
