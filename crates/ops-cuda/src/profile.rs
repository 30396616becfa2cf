//! The op profile: device time of every `Backend` primitive, for finding where a step's time goes.
//!
//! While a profile runs ([`CudaBackend::start_op_profile`]), each primitive of `backend.rs` is
//! bracketed by two timing events on the compute stream, and the span is kept with a label (the
//! primitive, its dtype, its shape, its op kind). [`CudaBackend::finish_op_profile`] waits for
//! the device, reads every span's milliseconds and returns them in launch order. A span holds
//! every kernel and library call of one primitive, and nothing else: the device's idle time
//! between primitives (host overhead, synchronisations) is what the step's wall time has beyond
//! the spans' sum. Off (the default), a primitive pays one relaxed atomic load.
//!
//! This module is ground floor: it sits on cudarc and `device.rs`, and knows no kernel family.

use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::{result, sys};
use headroom_autograd_core::{Result, View};
use parking_lot::Mutex;

use crate::device::CudaBackend;
use crate::error::device_error;

/// The device time of one primitive.
#[derive(Debug, Clone, PartialEq)]
pub struct OpTiming {
    /// The primitive, its dtype and shape (`linear bf16 [8192, 768]·[2304, 768]ᵀ`, say).
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

impl OpProfiler {
    fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }
}

/// A recorded timing event on the backend's stream.
fn record(backend: &CudaBackend) -> Result<sys::CUevent> {
    let event = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
        .map_err(|e| device_error("op_profile", e))?;
    // SAFETY: the event was just created in the bound context and the stream is the backend's.
    unsafe { result::event::record(event, backend.stream.cu_stream()) }
        .map_err(|e| device_error("op_profile", e))?;
    Ok(event)
}

/// `f32[8192, 768]`: a view's dtype and shape, for labels.
pub(crate) fn describe(view: &View<'_>) -> String {
    format!("{:?}{:?}", view.dtype, view.layout.shape()).to_lowercase()
}

impl CudaBackend {
    /// Starts recording the device time of every primitive (dropping a profile not finished).
    pub fn start_op_profile(&self) -> Result<()> {
        self.discard_spans()?;
        self.profiler.active.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Stops recording, waits for the device and returns each primitive's time since
    /// [`CudaBackend::start_op_profile`], in launch order.
    pub fn finish_op_profile(&self) -> Result<Vec<OpTiming>> {
        self.profiler.active.store(false, Ordering::Relaxed);
        self.synchronize()?;
        let spans = std::mem::take(&mut *self.profiler.spans.lock());
        self.bind("op_profile")?;
        let mut timings = Vec::with_capacity(spans.len());
        let mut failed = None;
        for span in spans {
            // SAFETY: both events were recorded on the stream that was just synchronised.
            let elapsed = unsafe { result::event::elapsed(span.start, span.end) };
            destroy(&span);
            match elapsed {
                Ok(ms) => timings.push(OpTiming {
                    label: span.label,
                    ms: f64::from(ms),
                }),
                Err(e) => failed = failed.or(Some(device_error("op_profile", e))),
            }
        }
        match failed {
            Some(error) => Err(error),
            None => Ok(timings),
        }
    }

    /// Runs `primitive`, bracketed by timing events labelled `label()` while a profile runs.
    pub(crate) fn timed<T>(
        &self,
        label: impl FnOnce() -> String,
        primitive: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        if !self.profiler.is_active() {
            return primitive();
        }
        self.bind("op_profile")?;
        let start = record(self)?;
        let result = primitive();
        let end = record(self)?;
        self.profiler.spans.lock().push(Span {
            label: label(),
            start,
            end,
        });
        result
    }

    fn discard_spans(&self) -> Result<()> {
        let spans = std::mem::take(&mut *self.profiler.spans.lock());
        if !spans.is_empty() {
            self.bind("op_profile")?;
            spans.iter().for_each(destroy);
        }
        Ok(())
    }
}

fn destroy(span: &Span) {
    // SAFETY: each event was created by `record` and is destroyed once, here; a pending event is
    // released by the driver once it completes. Errors leave nothing on the device.
    unsafe {
        let _ = result::event::destroy(span.start);
        let _ = result::event::destroy(span.end);
    }
}
