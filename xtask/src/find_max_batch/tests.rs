//! find-max-batch's tests: the search against synthetic memory curves (exact answers, bounded
//! probes), the out-of-memory check on real errors, and whole searches on the CPU backend under
//! a cap, each answer checked by fresh runs at the batch found and the next one.

use std::sync::Arc;

use headroom_caching_allocator::{AllocatorConfig, CachingAllocator, HostStorage};
use headroom_nn::Gpt2Config;
use headroom_ops_cpu::CpuBackend;

use super::{
    execute, find_max_batch, is_out_of_memory, markdown, parse, parse_pytorch, search,
    DeviceChoice, Peaks,
};
use crate::bench_memory::cases::{Case, Probe, Protocol, Training};
use crate::bench_memory::models::{Arch, Input, Model};

/// A memory curve: `fixed + per_sample × batch` bytes reserved, out of memory above `cap`.
fn linear(
    fixed: u64,
    per_sample: u64,
    cap: u64,
) -> impl FnMut(usize) -> anyhow::Result<Option<Peaks>> {
    move |batch| {
        let reserved = fixed + per_sample * batch as u64;
        Ok((reserved <= cap).then_some(Peaks {
            allocated: reserved,
            reserved,
            step_ms: 1.0,
        }))
    }
}

#[test]
fn the_search_finds_the_exact_largest_batch_of_linear_curves() {
    let cap = 24 << 30;
    for per_sample in [1u64 << 20, 7_777_777, 277_000_000, 3 << 30, 20 << 30] {
        for fixed in [0u64, 4_900_000_000, 20 << 30] {
            let expected = ((cap - fixed.min(cap)) / per_sample) as usize;
            let (found, probes) =
                search(cap, 1 << 20, &mut linear(fixed, per_sample, cap)).unwrap();
            assert_eq!(found, expected, "fixed {fixed}, per sample {per_sample}");
            // Doubling through 16, jumps of at most 8 times the largest fit, the aimed probe 10%
            // below the line, then the line's batch and the next one: the costly probes (their
            // time grows with the batch) are the three near the answer, with the jumps'
            // geometric sum below half of it.
            let jumps = (found.max(16) / 16).ilog(8) as usize;
            assert!(
                probes.len() <= 8 + jumps,
                "{} probes for {found}: {probes:?}",
                probes.len()
            );
            let probed: usize = probes.iter().map(|p| p.batch).sum();
            assert!(
                probed <= 3 * found + found / 2 + 32,
                "batches {probed} in all for {found}: {probes:?}"
            );
        }
    }
}

#[test]
fn a_line_that_misses_by_a_few_percent_costs_few_probes_near_the_answer() {
    // Linear through the small batches; past 300 every sample costs 5% or 20% more: the line
    // overshoots by a little or by a lot. Exact either way, and few probes above half the answer.
    let cap = 24u64 << 30;
    for extra in [1_000_000u64, 4_000_000] {
        let reserved = |b: u64| 4_000_000_000 + b * 20_000_000 + b.saturating_sub(300) * extra;
        let mut curve = |batch: usize| -> anyhow::Result<Option<Peaks>> {
            let r = reserved(batch as u64);
            Ok((r <= cap).then_some(Peaks {
                allocated: r,
                reserved: r,
                step_ms: 1.0,
            }))
        };
        let (found, probes) = search(cap, 1 << 20, &mut curve).unwrap();
        let expected = (1..).take_while(|&b| reserved(b) <= cap).last().unwrap() as usize;
        assert_eq!(found, expected);
        // Off by 3%: the jump, the aimed probe, the line's batch and the one above it. Off by
        // 14%: an aimed probe that does not fit, one below it, then the same.
        let large = probes.iter().filter(|p| p.batch > found / 2).count();
        let most = if extra == 1_000_000 { 4 } else { 7 };
        assert!(
            large <= most,
            "{large} probes above {}: {probes:?}",
            found / 2
        );
    }
}

#[test]
fn the_search_is_exact_on_curves_the_line_mispredicts() {
    // Steps of 64 samples (allocator rounding), and a curve that grows faster past a knee: the
    // prediction is wrong, the midpoints still bound the probes by twice the bits.
    for threshold in 1..=700usize {
        let mut stepped = |batch: usize| -> anyhow::Result<Option<Peaks>> {
            let reserved = 1000 + (batch as u64).div_ceil(64) * 64_000 + batch as u64 * 5;
            Ok((batch <= threshold).then_some(Peaks {
                allocated: reserved,
                reserved,
                step_ms: 1.0,
            }))
        };
        let (found, probes) = search(u64::MAX / 2, 1 << 20, &mut stepped).unwrap();
        assert_eq!(found, threshold);
        let bits = (usize::BITS - threshold.leading_zeros()) as usize;
        assert!(probes.len() <= 3 * bits + 2, "{threshold}: {probes:?}");
        let mut kneed = |batch: usize| -> anyhow::Result<Option<Peaks>> {
            let reserved = if batch < 100 {
                batch * 10
            } else {
                batch * batch
            };
            Ok((batch <= threshold).then_some(Peaks {
                allocated: reserved as u64,
                reserved: reserved as u64,
                step_ms: 1.0,
            }))
        };
        assert_eq!(search(5000, 1 << 20, &mut kneed).unwrap().0, threshold);
    }
}

#[test]
fn the_search_stops_at_the_limit_and_reports_when_nothing_fits() {
    let (found, probes) = search(1 << 40, 100, &mut linear(0, 1, 1 << 40)).unwrap();
    assert_eq!(found, 100);
    let batches: Vec<usize> = probes.iter().map(|p| p.batch).collect();
    assert_eq!(batches, [1, 2, 4, 8, 16, 100]);
    let (found, probes) = search(10, 100, &mut linear(11, 1, 10)).unwrap();
    assert_eq!((found, probes.len()), (0, 1));
    // An error other than a misfit stops the search.
    let mut failing =
        |_: usize| -> anyhow::Result<Option<Peaks>> { anyhow::bail!("a kernel failed") };
    assert!(search(10, 100, &mut failing).is_err());
}

/// A CPU backend whose allocator's storage holds `cap` bytes.
fn capped_cpu(cap: u64) -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new(CachingAllocator::new(
        HostStorage::with_capacity(cap),
        AllocatorConfig::default(),
    )))
}

/// One training step of a fresh model and optimizer at `batch` (after a batch-1 step made the
/// optimizer's state), on a fresh backend capped at `cap`.
fn fresh_step_fits(model: Model, case: Case, cap: u64, batch: usize) -> bool {
    let cpu = capped_cpu(cap);
    let probe = Probe::cpu(&cpu);
    let training = Training::new(&probe, model, case).unwrap();
    let protocol = Protocol {
        warmup: 0,
        steps: 1,
        bucket_bytes: None,
        budget: None,
        op_profile: false,
        record_events: false,
    };
    let one = Input::new(&probe.backend, model, 1).unwrap();
    training.run(&one, case, protocol).unwrap().step().unwrap();
    drop(one);
    probe.allocator.empty_cache().unwrap();
    let result = Input::new(&probe.backend, model, batch)
        .and_then(|input| training.run(&input, case, protocol)?.step());
    match result {
        Ok(()) => true,
        Err(err) if is_out_of_memory(&err) => false,
        Err(err) => panic!("{} at batch {batch}: {err:#}", case.name()),
    }
}

#[test]
fn cpu_searches_under_a_cap_are_exact_and_leave_the_allocator_as_they_found_it() {
    let gpt2_tiny = Model {
        name: "gpt2_tiny",
        arch: Arch::Gpt2 {
            config: Gpt2Config::tiny(),
            seq: 32,
        },
    };
    let vit_tiny = Model::named("vit_tiny").unwrap();
    let cap = 6 << 20;
    for (model, case) in [
        (vit_tiny, Case::AdamFused),
        (vit_tiny, Case::AdamInbwd),
        (vit_tiny, Case::AdamCkpt),
        (vit_tiny, Case::AdamInbwdClip),
        (vit_tiny, Case::AdamBf16),
        (gpt2_tiny, Case::FwdBwd),
        (gpt2_tiny, Case::AdamForeach),
    ] {
        let cpu = capped_cpu(cap);
        let probe = Probe::cpu(&cpu);
        // `find_max_batch` itself fails if any probe leaves bytes behind.
        let found = find_max_batch(&probe, model, case, cap, 1 << 14).unwrap();
        let name = format!("{} {}", model.name, case.name());
        assert!(found.max_batch >= 2, "{name}: {found:?}");
        assert!(found.ooms >= 1, "{name}");
        assert!(found.peak_allocated_bytes <= cap, "{name}");
        assert_eq!(probe.allocator.memory_allocated(), 0, "{name}");
        assert!(fresh_step_fits(model, case, cap, found.max_batch), "{name}");
        assert!(
            !fresh_step_fits(model, case, cap, found.max_batch + 1),
            "{name}"
        );
    }
}

#[test]
fn checkpointing_fits_a_larger_batch_than_the_plain_loop() {
    let model = Model::named("vit_tiny").unwrap();
    let cap = 6 << 20;
    let max = |case| {
        let cpu = capped_cpu(cap);
        find_max_batch(&Probe::cpu(&cpu), model, case, cap, 1 << 14)
            .unwrap()
            .max_batch
    };
    assert!(max(Case::AdamCkpt) > max(Case::AdamFused));
}

#[test]
fn out_of_memory_is_recognised_through_the_error_chain_and_nothing_else_is() {
    let cpu = capped_cpu(1 << 20);
    let probe = Probe::cpu(&cpu);
    let model = Model::named("vit_tiny").unwrap();
    let err = Input::new(&probe.backend, model, 1000).err().unwrap();
    assert!(is_out_of_memory(&err), "{err:#}");
    assert!(is_out_of_memory(&err.context("a probe")));
    assert!(!is_out_of_memory(&anyhow::anyhow!(
        "out of memory (a message, not the type)"
    )));
    let shape = Model::named("gpt2").unwrap().with_seq(4096).err().unwrap();
    assert!(!is_out_of_memory(&shape));
}

#[test]
fn the_command_line_and_pytorchs_lines_are_read() {
    let args = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let options = parse(&args(&[
        "--device",
        "cpu",
        "--model",
        "gpt2",
        "--seq",
        "256",
        "--cases",
        "adam_fused,fwd_bwd",
        "--memory-cap-mb",
        "24576",
    ]))
    .unwrap();
    assert_eq!(options.device, DeviceChoice::Cpu);
    assert_eq!(options.cases, [Case::AdamFused, Case::FwdBwd]);
    assert_eq!((options.seq, options.cap_mib), (Some(256), Some(24576)));
    for (bad, message) in [
        (&["--cases", "adam_auto"][..], "adam_auto plans"),
        (&["--memory-cap-mb", "0"], "at least 1"),
        (&["--seq"], "needs a value"),
        (&["--batch", "3"], "unknown option"),
    ] {
        let err = format!("{:#}", parse(&args(bad)).unwrap_err());
        assert!(err.contains(message), "{bad:?}: {err}");
    }
    let text = r#"a warning
{"case": "adam_fused", "model": "vit_l_16", "max_batch": 67, "peak_allocated_bytes": 24000000000, "ooms": 2, "seconds": 30.5}
{"case": "env", "torch": "2.11.0"}
"#;
    let torch = parse_pytorch(text).unwrap();
    assert_eq!(torch.len(), 1);
    assert_eq!((torch[0].max_batch, torch[0].ooms), (67, 2));
    let ours = super::Found {
        case: Case::AdamFused,
        model: "vit_l_16",
        max_batch: 71,
        peak_allocated_bytes: 25_000_000_000,
        peak_reserved_bytes: 25_500_000_000,
        step_ms: 650.0,
        ooms: 2,
        probes: Vec::new(),
        seconds: 12.0,
    };
    let table = markdown(&[ours], &torch);
    assert!(
        table.contains("| vit_l_16 | adam_fused | 71 | 25.00 | 25.50 | 650.0 | 2 | 0 | 12.0 | 67 | 24.00 | 2 | 30.5 | 1.06 |"),
        "{table}"
    );
}

#[test]
fn the_json_is_written_after_every_case() {
    // Two cases on the CPU under a small cap: the document names both, and says it is complete
    // (written after each case, so a run stopped early would leave the first one, incomplete).
    let path = std::env::temp_dir().join(format!("fmb-json-{}.json", std::process::id()));
    let args: Vec<String> = [
        "--device",
        "cpu",
        "--model",
        "vit_tiny",
        "--cases",
        "sgd,adam_fused",
        "--memory-cap-mb",
        "64",
        "--max-batch",
        "8",
        "--json",
        path.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let found = execute(&parse(&args).unwrap()).unwrap();
    let document: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(document["complete"], true);
    let cases = document["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 2);
    for (case, f) in cases.iter().zip(&found) {
        assert_eq!(case["case"], f.case.name());
        assert_eq!(case["max_batch"], f.max_batch);
    }
}
