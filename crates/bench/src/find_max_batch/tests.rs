//! find-max-batch's tests: the search against synthetic memory curves (exact answers, bounded
//! probes), the out-of-memory check on real errors, and whole searches on the CPU backend under
//! a cap, each answer checked by fresh runs at the batch found and the next one.

use std::sync::Arc;

use headroom_caching_allocator::{AllocatorConfig, CachingAllocator, HostStorage};
use headroom_nn::{Gpt2Config, LossPath};
use headroom_ops_cpu::CpuBackend;

use super::{
    execute, find_max_batch, is_out_of_memory, markdown, parse_pytorch, search, DeviceChoice,
    Options, Peaks,
};
use crate::bench_memory::cases::Case;
use crate::bench_memory::measure::Protocol;
use crate::bench_memory::models::{Arch, Input, LanguageConfig, Model};
use crate::bench_memory::training::{Probe, Training};
use crate::cli_tests::{args, assert_rejected};

/// `find-max-batch` with `list` after it, parsed as the binary parses it.
fn parse(list: &[String]) -> anyhow::Result<Options> {
    let words: Vec<&str> = std::iter::once("find-max-batch")
        .chain(list.iter().map(String::as_str))
        .collect();
    match crate::parse_command_line(&words)? {
        crate::Command::FindMaxBatch(args) => Options::new(args, "test".to_owned()),
        other => anyhow::bail!("parsed as {other:?}"),
    }
}

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
            host_reserved: None,
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
                host_reserved: None,
                step_ms: 1.0,
            }))
        };
        let (found, probes) = search(cap, 1 << 20, &mut curve).unwrap();
        let expected = (1..).take_while(|&b| reserved(b) <= cap).last().unwrap() as usize;
        assert_eq!(found, expected);
        // The aimed probe (800) fits; the line through it and 128 crosses the knee and
        // overshoots by 4 (3%) or 7 (14%) batches: its probe and at most two more do not fit
        // (a probe that does not fit stops at its peak, a third of a step on the H200), and
        // galloping down then bisection take at most four that fit.
        let above = |fit: bool| {
            probes
                .iter()
                .filter(|p| p.batch > found / 2 && p.peaks.is_some() == fit)
                .count()
        };
        assert!(
            above(true) <= 5 && above(false) <= 3,
            "{} fits and {} misses above {}: {probes:?}",
            above(true),
            above(false),
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
                host_reserved: None,
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
                host_reserved: None,
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
    let protocol = Protocol::ONE_STEP;
    let one = Input::new(&probe.backend, model, 1).unwrap();
    training.run(&one, case, protocol).unwrap().step().unwrap();
    drop(one);
    probe.allocator().empty_cache().unwrap();
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
        arch: Arch::Language {
            config: LanguageConfig::Gpt2(Gpt2Config::tiny()),
            seq: 32,
            loss: LossPath::default(),
        },
        checkpointed_blocks: None,
        layers: None,
        stream_budget: None,
    };
    let vit_tiny = Model::named("vit_tiny").unwrap();
    let llama_tiny = Model::named("llama-tiny").unwrap().with_seq(32).unwrap();
    let cap = 6 << 20;
    for (model, case) in [
        (vit_tiny, Case::AdamFused),
        (vit_tiny, Case::AdamInbwd),
        (vit_tiny, Case::AdamCkpt),
        (vit_tiny, Case::AdamInbwdClip),
        (vit_tiny, Case::AdamBf16),
        (gpt2_tiny, Case::FwdBwd),
        (gpt2_tiny, Case::AdamForeach),
        (llama_tiny, Case::FwdBwdBf16Ckpt),
        (llama_tiny, Case::AdamInbwd),
    ] {
        let cpu = capped_cpu(cap);
        let probe = Probe::cpu(&cpu);
        // `find_max_batch` itself fails if any probe leaves bytes behind.
        let found = find_max_batch(&probe, model, case, cap, 1 << 14).unwrap();
        let name = format!("{} {}", model.name, case.name());
        assert!(found.max_batch >= 2, "{name}: {found:?}");
        assert!(found.ooms >= 1, "{name}");
        assert!(found.at_max.allocated <= cap, "{name}");
        assert_eq!(probe.allocator().memory_allocated(), 0, "{name}");
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
    assert_eq!(
        parse(&args(&["--cases", "sgd", "--cases", "adam_fused,fwd_bwd"]))
            .unwrap()
            .cases,
        [Case::Sgd, Case::AdamFused, Case::FwdBwd]
    );
    assert_rejected(
        parse,
        &[
            (
                &["--cases", "adam_auto"][..],
                "invalid value 'adam_auto' for '--cases <CASE>'",
            ),
            (&["--memory-cap-mb", "0"], "at least 1"),
            // 2^44 + 1 MiB used to wrap to a 1 MiB cap.
            (
                &["--memory-cap-mb", "17592186044417"],
                "--memory-cap-mb 17592186044417: too large to count in bytes",
            ),
            (&["--seq"], "a value is required for '--seq <N>'"),
            (&["--batch", "3"], "unexpected argument '--batch'"),
        ],
    );
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
        at_max: Peaks {
            allocated: 25_000_000_000,
            reserved: 25_500_000_000,
            host_reserved: None,
            step_ms: 650.0,
        },
        ooms: 2,
        probes: Vec::new(),
        probe_seconds: Vec::new(),
        build_seconds: 2.0,
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

/// A case that needs CUDA is refused on the CPU before any search, naming it.
#[test]
fn cuda_only_cases_are_refused_on_the_cpu_before_searching() {
    let options = parse(&args(&["--device", "cpu", "--cases", "sgd,adam_offload"])).unwrap();
    let err = execute(&options).unwrap_err().to_string();
    assert!(
        err.starts_with("--cases adam_offload: needs a CUDA device"),
        "{err}"
    );
}
#[test]
fn the_h200_curves_cost_two_probes_past_batch_16_when_the_line_is_near() {
    // Every probe that fit on ViT-L/16 under the 24 GiB cap (below), as a curve: allocated
    // peaks joined by straight lines, out of memory past the batch the H200 found.
    for (name, max, points) in H200_VIT_L16 {
        let mut curve = |batch: usize| -> anyhow::Result<Option<Peaks>> {
            let i = points
                .iter()
                .position(|&(b, _)| b >= batch)
                .unwrap_or(points.len() - 1)
                .max(1);
            let ((b0, a0), (b1, a1)) = (points[i - 1], points[i]);
            let allocated =
                a0 as f64 + (a1 as f64 - a0 as f64) * (batch as f64 - b0 as f64) / (b1 - b0) as f64;
            Ok((batch <= *max).then_some(Peaks {
                allocated: allocated as u64,
                reserved: allocated as u64,
                host_reserved: None,
                step_ms: 1.0,
            }))
        };
        let (found, probes) = search(H200_CAP, 1 << 16, &mut curve).unwrap();
        assert_eq!(found, *max, "{name}");
        let past16: Vec<(usize, bool)> = probes
            .iter()
            .filter(|p| p.batch > 16)
            .map(|p| (p.batch, p.peaks.is_some()))
            .collect();
        // The line through batches 8 and 16 reaches the cap within five times 16 for every case
        // but the checkpointed, offloaded and compressed ones and the half-precision ones: its
        // batch fits and the next does not. The others take a jump to 128, an aimed probe (one
        // that does not fit, for the checkpointed bf16 case) and the same two.
        let most = if *max <= 5 * 16 { 2 } else { 5 };
        assert!(past16.len() <= most, "{name}: {past16:?}");
    }
}

/// Every fitting probe of one case: its batch and peak allocated bytes.
type FittingPeaks = &'static [(usize, u64)];

/// The fused step's peaks by batch (`adam_fused` and `adam_fused_clip` alike).
const ADAM_FUSED_PEAKS: FittingPeaks = &[
    (1, 4903448576),
    (2, 4909769216),
    (4, 4956926464),
    (8, 6199595520),
    (16, 8692711936),
    (64, 23682260992),
    (70, 25556942848),
];

/// ViT-L/16 on the H200 under a 24 GiB cap (find-max-batch at 120128b, 2026-12-01): per case,
/// the largest batch that fit and every fitting probe's batch and peak allocated bytes.
const H200_VIT_L16: &[(&str, usize, FittingPeaks)] = &[
    (
        "adam_foreach",
        70,
        &[
            (1, 4920225792),
            (2, 4920827904),
            (4, 4956926464),
            (8, 6199595520),
            (16, 8692711936),
            (64, 23682260992),
            (70, 25556942848),
        ],
    ),
    (
        "adam_foreach_unbounded",
        70,
        &[
            (1, 6120755200),
            (2, 6121357312),
            (4, 6122561536),
            (8, 6199595520),
            (16, 8692711936),
            (49, 18995544064),
            (65, 23994736640),
            (69, 25244528640),
            (70, 25556942848),
        ],
    ),
    (
        "adam_single",
        70,
        &[
            (1, 4920164352),
            (2, 4920766464),
            (4, 4956865024),
            (8, 6199534080),
            (16, 8692650496),
            (64, 23682199552),
            (70, 25556881408),
        ],
    ),
    (
        "sgd",
        78,
        &[
            (1, 2470179328),
            (2, 2475123200),
            (4, 2522280448),
            (8, 3764949504),
            (16, 6258065920),
            (71, 23434772480),
            (78, 25621917696),
        ],
    ),
    ("adam_fused", 70, ADAM_FUSED_PEAKS),
    (
        "adam_inbwd",
        70,
        &[
            (1, 3697367552),
            (2, 4329705984),
            (4, 4952982016),
            (8, 6199534080),
            (16, 8692650496),
            (64, 23682199552),
            (70, 25556881408),
        ],
    ),
    (
        "adam8bit",
        76,
        &[
            (1, 3088379392),
            (2, 3094700032),
            (4, 3141857280),
            (8, 4384526336),
            (16, 6877642752),
            (70, 23741873664),
            (76, 25616555520),
        ],
    ),
    (
        "adam8bit_inbwd",
        76,
        &[
            (1, 1888228352),
            (2, 2514669568),
            (4, 3137945600),
            (8, 4384497664),
            (16, 6877614080),
            (70, 23741844992),
            (76, 25616526848),
        ],
    ),
    (
        "adam_ckpt",
        671,
        &[
            (1, 4903448576),
            (2, 4909769216),
            (4, 4926509056),
            (8, 4979966976),
            (16, 5094649344),
            (128, 7896016896),
            (638, 24672136704),
            (671, 25757650944),
        ],
    ),
    (
        "adam_inbwd_ckpt",
        687,
        &[
            (1, 3697367552),
            (2, 3770545664),
            (4, 3834720256),
            (8, 3963069440),
            (16, 4219768320),
            (128, 7813560832),
            (618, 23536408576),
            (687, 25750441472),
        ],
    ),
    // Clipping the fused step's gradients costs no byte at any probed batch.
    ("adam_fused_clip", 70, ADAM_FUSED_PEAKS),
    (
        "adam_inbwd_clip",
        69,
        &[
            (1, 3702645760),
            (2, 4333840896),
            (4, 4965202432),
            (8, 6227925504),
            (16, 8753383936),
            (63, 23590533632),
            (69, 25484679680),
        ],
    ),
    (
        "adam_inbwd_clip_prev",
        70,
        &[
            (1, 3697516032),
            (2, 4329721344),
            (4, 4952997376),
            (8, 6199549440),
            (16, 8692665856),
            (64, 23682199552),
            (70, 25556881408),
        ],
    ),
    (
        "adam_offload",
        167,
        &[
            (1, 4903448576),
            (2, 4910973440),
            (4, 4932884992),
            (8, 5143865856),
            (16, 5800739328),
            (128, 20520558592),
            (162, 24992397312),
            (167, 25650029568),
        ],
    ),
    (
        "adam_ckpt8bit",
        251,
        &[
            (1, 4903448576),
            (2, 4909281792),
            (4, 4923378688),
            (8, 4960472064),
            (16, 5091426304),
            (128, 14932088832),
            (235, 24333549056),
            (245, 25212285952),
            (246, 25300085248),
            (249, 25563653120),
            (250, 25651587072),
            (251, 25739435520),
        ],
    ),
    (
        "adam_bf16",
        120,
        &[
            (1, 4903448576),
            (2, 4911014400),
            (4, 5015982592),
            (8, 5721494016),
            (16, 7133022208),
            (109, 23649052672),
            (120, 25602553856),
        ],
    ),
    (
        "adam_fp16",
        134,
        &[
            (1, 2473414656),
            (2, 2476337152),
            (4, 2581305344),
            (8, 3286816768),
            (16, 4698343424),
            (123, 23700670464),
            (134, 25654183936),
        ],
    ),
    (
        "adam_inbwd_ckpt_bf16",
        795,
        &[
            (1, 3702632960),
            (2, 4337059840),
            (4, 4382644224),
            (8, 4478332928),
            (16, 4673581056),
            (128, 7407054848),
            (767, 24921881088),
            (784, 25391920640),
            (785, 25419571200),
            (790, 25557816832),
            (793, 25640765952),
            (794, 25668416512),
            (795, 25696064512),
        ],
    ),
    (
        "fwd_bwd",
        78,
        &[
            (1, 2470179328),
            (2, 2475090432),
            (4, 2522247680),
            (8, 3764916736),
            (16, 6258033152),
            (71, 23434739712),
            (78, 25621884928),
        ],
    ),
    (
        "fwd_bwd_bf16",
        160,
        &[
            (1, 1252203008),
            (2, 1255528960),
            (4, 1281090048),
            (8, 1905582592),
            (16, 3158462976),
            (128, 20740182016),
            (156, 25136664576),
            (159, 25607682048),
            (160, 25764712448),
        ],
    ),
];
const H200_CAP: u64 = 25769803776;
