//! The op profile: device time of every `Backend` primitive, for finding where a step's time goes.
//!
//! While a profile runs (`CudaBackend::start_op_profile`), each primitive of `backend.rs` is
//! bracketed by two timing events on the compute stream ([`OpProfiler::timed`]), and the span is
//! kept with a label (the primitive, its op kind, its operands' dtypes and shapes).
//! `CudaBackend::finish_op_profile` waits for the last span to end, reads every span's
//! milliseconds and returns them in launch order. A span holds every kernel and library call of
//! one primitive (and of the primitives it runs through the `Backend` trait, which have spans of
//! their own): the device's idle time between primitives (host overhead, synchronisations) is
//! what the step's wall time has beyond the spans' sum. Off (the default), a primitive pays one
//! relaxed atomic load.
//!
//! This module is ground floor: it sits on cudarc and `error.rs`; the caller binds the context
//! and names the stream.

use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::{result, sys};
use headroom_autograd_core::{Result, View};
use parking_lot::Mutex;

use crate::error::device_error;

/// The device time of one primitive.
#[derive(Debug, Clone, PartialEq)]
pub struct OpTiming {
    /// The primitive and its operands (`linear f32[8192, 768]·f32[2304, 768]ᵀ +bias`, say).
    pub label: String,
    /// Milliseconds between the events around it.
    pub ms: f64,
}

/// The spans recorded so far, while a profile runs.
#[derive(Debug, Default)]
pub(crate) struct OpProfiler {
    active: AtomicBool,
    spans: Mutex<Vec<Span>>,
}

#[derive(Debug)]
struct Span {
    label: String,
    start: sys::CUevent,
    end: sys::CUevent,
}

// SAFETY: the events are plain driver handles, used under the spans' mutex only.
unsafe impl Send for Span {}

/// `f32[8192, 768]`: a view's dtype and shape, for labels.
pub(crate) fn describe(view: &View<'_>) -> String {
    format!("{:?}{:?}", view.dtype, view.layout.shape()).to_lowercase()
}

/// A timing event recorded on `stream` (the context bound).
fn record(stream: sys::CUstream) -> Result<sys::CUevent> {
    let event = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
        .map_err(|e| device_error("op_profile", e))?;
    // SAFETY: the event was just created in the bound context; the caller names a live stream of
    // it.
    unsafe { result::event::record(event, stream) }.map_err(|e| device_error("op_profile", e))?;
    Ok(event)
}

fn destroy(span: &Span) {
    // SAFETY: each event was created by `record` and is destroyed once, here; a pending event is
    // released by the driver once it completes. Errors leave nothing on the device.
    unsafe {
        let _ = result::event::destroy(span.start);
        let _ = result::event::destroy(span.end);
    }
}

impl OpProfiler {
    /// Whether a profile runs.
    pub(crate) fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    /// Starts recording, dropping the spans of a profile not finished (the context bound).
    pub(crate) fn start(&self) {
        let spans = std::mem::take(&mut *self.spans.lock());
        spans.iter().for_each(destroy);
        self.active.store(true, Ordering::Relaxed);
    }

    /// Runs `primitive` between two timing events on `stream`, kept as a span labelled
    /// `label()` (the context bound, a profile running).
    pub(crate) fn timed<T>(
        &self,
        stream: sys::CUstream,
        label: impl FnOnce() -> String,
        primitive: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let start = record(stream)?;
        let result = primitive();
        let end = record(stream)?;
        self.spans.lock().push(Span {
            label: label(),
            start,
            end,
        });
        result
    }

    /// Stops recording, waits for the last span to end (spans end in stream order) and returns
    /// each span's milliseconds in launch order (the context bound).
    pub(crate) fn finish(&self) -> Result<Vec<OpTiming>> {
        self.active.store(false, Ordering::Relaxed);
        let spans = std::mem::take(&mut *self.spans.lock());
        let waited = match spans.last() {
            // SAFETY: the event was recorded on the stream and is destroyed only below.
            Some(last) => unsafe { result::event::synchronize(last.end) }
                .map_err(|e| device_error("op_profile", e)),
            None => Ok(()),
        };
        let mut timings = Vec::with_capacity(spans.len());
        let mut failed = waited.err();
        for span in spans {
            if failed.is_none() {
                // SAFETY: both events were recorded on the stream before the last span's end,
                // which has completed.
                match unsafe { result::event::elapsed(span.start, span.end) } {
                    Ok(ms) => timings.push(OpTiming {
                        label: span.label.clone(),
                        ms: f64::from(ms),
                    }),
                    Err(e) => failed = Some(device_error("op_profile", e)),
                }
            }
            destroy(&span);
        }
        match failed {
            Some(error) => Err(error),
            None => Ok(timings),
        }
    }
}
