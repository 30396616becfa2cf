//! The peak of allocated bytes of the fused linear + cross-entropy (`linear_cross_entropy`) on
//! the CPU backend, whose allocator counts the same requested bytes as CUDA's for the same ops:
//! beyond the inputs and the gradients it returns, forward + backward stay within
//! `chunk_bytes + 8 B per token` (the issue's `64 MiB + 8 B per token` at the default), in bf16
//! (forward, the token pass and the class pass of the backward) and in f32 (one pass), with the
//! full Llama-3 vocabulary of 128,256 classes and a budget small enough that every pass takes
//! several chunks. The allocator's history names what is live at the peak.

use std::collections::HashMap;

use headroom_autograd_core::{
    cross_entropy_f32, linear_cross_entropy, BackendRef, DType, LinearCrossEntropyOptions,
    Reduction, Tensor,
};
use headroom_caching_allocator::{HistoryOptions, TraceAction};
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::inputs::uniform_f64;
use headroom_testkit::loss_fixtures::{labels_every_ninth_ignored, IGNORE_INDEX};
use headroom_testkit::memory::{allocated, peak};

fn leaf(cpu: &BackendRef, shape: &[usize], scale: f64, seed: u64, dtype: DType) -> Tensor {
    let n = shape.iter().product();
    let t = Tensor::from_f64s(cpu, &uniform_f64(n, -scale, scale, seed), shape, dtype).unwrap();
    t.requires_grad_(true).unwrap();
    t
}

/// The peak of allocated bytes above the start while `step` runs, and the sizes of the
/// allocations live at the peak of the requests (from the allocator's history, rounded up to
/// 512 bytes), largest first.
fn peak_and_live(cpu: &BackendRef, step: impl FnOnce()) -> (i64, Vec<u64>) {
    let view = cpu.allocator_view();
    view.record_history(Some(HistoryOptions {
        max_entries: 1 << 20,
        record_context: false,
    }));
    view.reset_peak_stats();
    let before = allocated(cpu);
    step();
    let measured = peak(cpu) - before;
    let trace = view.snapshot().device_traces.concat();
    view.record_history(None);
    let (mut live, mut at_peak) = (HashMap::new(), Vec::new());
    let (mut current, mut highest) = (0i64, 0i64);
    for entry in &trace {
        match entry.action {
            TraceAction::Alloc => {
                // The statistics count blocks: requests rounded up to 512 bytes.
                let size = entry.size.max(1).div_ceil(512) * 512;
                live.insert(entry.addr, size);
                current += size as i64;
                if current > highest {
                    highest = current;
                    at_peak = live.values().copied().collect();
                }
            }
            TraceAction::FreeRequested | TraceAction::Free => {
                current -= live.remove(&entry.addr).map_or(0, |size| size as i64);
            }
            _ => {}
        }
    }
    // The statistics count whole blocks, which may exceed a large request by up to 1 MiB.
    assert!(
        highest <= measured,
        "the history replays to {highest} > {measured}"
    );
    at_peak.sort_unstable_by(|a, b| b.cmp(a));
    (measured, at_peak)
}

/// Forward + backward of the fused loss at `tokens × features × classes` in `dtype` with
/// `chunk_bytes`: the peak beyond the gradients (and the sizes live at it).
fn fused_peak(dtype: DType, tokens: usize, classes: usize, chunk_bytes: usize) -> (i64, Vec<u64>) {
    let cpu = CpuBackend::new_ref();
    let features = 16;
    let hidden = leaf(&cpu, &[tokens, features], 1.0, 3, dtype);
    let weight = leaf(&cpu, &[classes, features], 0.5, 4, dtype);
    let labels = labels_every_ninth_ignored(&cpu, tokens, classes).unwrap();
    let options = LinearCrossEntropyOptions {
        chunk_bytes,
        ..LinearCrossEntropyOptions::default()
    };
    let (measured, live) = peak_and_live(&cpu, || {
        let loss = linear_cross_entropy(&hidden, &weight, None, &labels, &options).unwrap();
        loss.backward().unwrap();
    });
    let grads = ((tokens + classes) * features * dtype.size_in_bytes()) as i64;
    assert!(hidden.grad().is_some() && weight.grad().is_some());
    (measured - grads, live)
}

#[test]
fn the_full_vocabulary_stays_within_chunk_bytes_and_8_bytes_a_token_in_bf16_and_f32() {
    // 48 tokens × 128,256 classes: a 4 MiB budget holds 5 bf16 rows of the token passes and
    // 14,563 classes (of 48 tokens) in the class pass: both passes take several chunks.
    let (tokens, classes, chunk_bytes) = (48, 128_256, 4 << 20);
    let target = (chunk_bytes + 8 * tokens) as i64;
    for dtype in [DType::BF16, DType::F32] {
        let (beyond, live) = fused_peak(dtype, tokens, classes, chunk_bytes);
        println!("{dtype:?}: beyond inputs and gradients {beyond} B (target {target} B), live at the peak {live:?}");
        assert!(beyond <= target, "{dtype:?}: {beyond} > {target}");
    }
}

#[test]
fn the_unfused_loss_holds_every_logit() {
    let cpu = CpuBackend::new_ref();
    let (tokens, features, classes) = (64, 16, 4000);
    let hidden = leaf(&cpu, &[tokens, features], 1.0, 5, DType::F32);
    let weight = leaf(&cpu, &[classes, features], 0.5, 6, DType::F32);
    let labels = labels_every_ninth_ignored(&cpu, tokens, classes).unwrap();
    let (unfused, _) = peak_and_live(&cpu, || {
        let logits = hidden.linear(&weight, None).unwrap();
        let loss = cross_entropy_f32(&logits, &labels, IGNORE_INDEX, Reduction::Mean).unwrap();
        loss.backward().unwrap();
    });
    assert!(unfused >= ((tokens + classes) * features * 4 + tokens * classes * 4) as i64);
}
