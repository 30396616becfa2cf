//! `bench-memory` end to end on the CPU: the tiny ViT, two cases, one step each, checked against
//! byte counts worked out by hand from the model's shapes; cases that fail (out of memory) are
//! reported without stopping the others; and the command line and the PyTorch anchors.

use std::sync::Arc;

use headroom_autograd_core::DType;
use headroom_ops_cpu::CpuBackend;
use serde_json::Value;

use super::cases::Case;
use super::command_line::{Options, CPU_DEFAULTS, CUDA_DEFAULTS};
use super::models::{Model, Net};
use super::{execute, report, DeviceChoice};
pub(super) use crate::cli_tests::args;
use crate::cli_tests::assert_rejected;
use crate::Command;

/// `VitConfig::tiny()`'s parameters: class token 64, patch embedding 64·3·8·8 + 64, position
/// embedding 17·64, two blocks of 33,472 (norms 2·128, in-projection 3·64·64 + 192,
/// out-projection 64·64 + 64, MLP 64·128 + 128 and 128·64 + 64), final norm 128, head 64·10 + 10.
const TINY_PARAMS: u64 = 64 + 12_288 + 64 + 1_088 + 2 * 33_472 + 128 + 650;

/// bitsandbytes' 8-bit Adam state of a parameter of `n` elements: two u8 codes per element and
/// two f32 scales per block of 256 from 4096 elements on, two f32 moments below.
fn adam8bit_state_bytes(n: u64) -> u64 {
    if n >= 4096 {
        2 * n + 2 * 4 * n.div_ceil(256)
    } else {
        2 * 4 * n
    }
}

/// `bench-memory` on the CPU's tiny ViT at `batch`, one warm-up and one timed step of `cases`,
/// with `extra` flags, parsed and without a progress bar.
fn tiny_vit_on_the_cpu(batch: &str, cases: &str, extra: &[&str]) -> Options {
    let mut list = vec![
        "--device", "cpu", "--model", "vit_tiny", "--batch", batch, "--cases", cases, "--warmup",
        "1", "--steps", "1",
    ];
    list.extend_from_slice(extra);
    let mut options = parse(&args(&list)).unwrap();
    options.progress = false;
    options
}

/// `bench-memory` with `list` after it, parsed as the binary parses it.
pub(super) fn parse(list: &[String]) -> anyhow::Result<Options> {
    let words: Vec<&str> = std::iter::once("bench-memory")
        .chain(list.iter().map(String::as_str))
        .collect();
    match crate::parse_command_line(&words)? {
        Command::BenchMemory(args) => Options::new(args, "test".to_owned()),
        other => anyhow::bail!("parsed as {other:?}"),
    }
}

#[test]
fn bench_memory_on_the_tiny_vit_reports_exact_parameter_gradient_and_state_bytes() {
    let dir = std::env::temp_dir().join(format!("headroom-bench-memory-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json_path, html_path) = (dir.join("bench.json"), dir.join("bench.html"));
    let options = tiny_vit_on_the_cpu(
        "2",
        "adam_foreach,adam8bit",
        &[
            "--json",
            json_path.to_str().unwrap(),
            "--html",
            html_path.to_str().unwrap(),
        ],
    );
    let results = execute(&options).unwrap();
    assert_eq!(results.len(), 2);

    // The state bytes worked out from the model's shapes, and by hand.
    let model = Net::new(
        &CpuBackend::new_ref(),
        Model::named("vit_tiny").unwrap(),
        DType::F32,
    )
    .unwrap();
    let sizes: Vec<u64> = model
        .parameters()
        .iter()
        .map(|p| p.numel() as u64)
        .collect();
    assert_eq!(sizes.iter().sum::<u64>(), TINY_PARAMS);
    let eight_bit_state: u64 = sizes.iter().map(|&n| adam8bit_state_bytes(n)).sum();
    // Quantized: the patch embedding, two in-projections (12,288 each: 24,960 bytes), two
    // out-projections (4,096: 8,320) and four MLP weights (8,192: 16,640); 3,402 elements of
    // small parameters keep f32 moments (27,216 bytes).
    assert_eq!(
        eight_bit_state,
        24_960 * 3 + 8_320 * 2 + 16_640 * 4 + 27_216
    );

    let document: Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let cases = document["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 2);
    let input_bytes = 2 * 3 * 32 * 32 * 4;
    for (case, expected_state) in cases.iter().zip([2 * 4 * TINY_PARAMS, eight_bit_state]) {
        let name = case["case"].as_str().unwrap();
        assert_eq!(case["model"], "vit_tiny", "{name}");
        assert_eq!(case["batch"], 2, "{name}");
        assert_eq!(case["device"], "cpu", "{name}");
        assert_eq!(case["param_bytes"], 4 * TINY_PARAMS, "{name}");
        assert_eq!(case["grad_bytes"], 4 * TINY_PARAMS, "{name}");
        assert_eq!(case["state_bytes"], expected_state, "{name}");
        assert!(case["step_ms"].as_f64().unwrap() > 0.0, "{name}");
        let peak = case["peak_allocated_bytes"].as_u64().unwrap();
        let reserved = case["peak_reserved_bytes"].as_u64().unwrap();
        assert!(
            reserved >= peak,
            "{name}: reserved {reserved} < allocated {peak}"
        );
        // Parameters, state and input stay allocated through the step; every other byte was
        // allocated by it.
        let persistent = 4 * TINY_PARAMS + expected_state + input_bytes;
        assert!(peak > persistent, "{name}: peak {peak}");

        let traced = &case["traced_step"];
        let at_peak = traced["at_peak"].as_object().unwrap();
        let total: u64 = at_peak.values().map(|v| v.as_u64().unwrap()).sum();
        assert_eq!(traced["peak_allocated_bytes"], total, "{name}");
        let phase_peak = traced["phases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["peak_allocated_bytes"].as_u64().unwrap())
            .max()
            .unwrap();
        assert_eq!(
            total, phase_peak,
            "{name}: components vs the allocator's peak"
        );
        assert_eq!(at_peak["parameters"], 4 * TINY_PARAMS, "{name}");
        assert_eq!(at_peak["optimizer_state"], expected_state, "{name}");
        assert_eq!(at_peak["input_and_other"], input_bytes, "{name}");
        // The traced step's phases start where the previous ended, and zero_grad frees exactly
        // the gradients (each its own 512-byte-rounded block).
        let phases = traced["phases"].as_array().unwrap();
        for pair in phases.windows(2) {
            assert_eq!(
                pair[0]["allocated_after_bytes"], pair[1]["allocated_before_bytes"],
                "{name}"
            );
        }
        let zero_grad = &phases[3];
        let rounded_grads: u64 = sizes.iter().map(|n| (4 * n).div_ceil(512) * 512).sum();
        assert_eq!(
            zero_grad["allocated_before_bytes"].as_u64().unwrap()
                - zero_grad["allocated_after_bytes"].as_u64().unwrap(),
            rounded_grads,
            "{name}"
        );
    }
    // 8-bit Adam peaks lower than foreach Adam.
    assert!(cases[1]["peak_allocated_bytes"].as_u64() < cases[0]["peak_allocated_bytes"].as_u64());

    let html = std::fs::read_to_string(&html_path).unwrap();
    assert_eq!(
        html.matches("<svg").count(),
        3,
        "one bar chart, two timelines"
    );
    for external in ["<script", "src=", "href=", "<link"] {
        assert!(
            !html.contains(external),
            "the page loads nothing: {external}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_command_line_is_checked() {
    let options = parse(&args(&["--batch", "1", "--batch", "32", "--cases", "sgd"])).unwrap();
    assert_eq!(options.device, DeviceChoice::Auto);
    assert_eq!(options.batches, [1, 32]);
    assert_eq!(options.cases, [Case::Sgd]);
    assert_eq!((options.protocol.warmup, options.protocol.steps), (3, 6));
    assert_eq!(options.model, None);
    let model = parse(&args(&["--model", "vit_l_16"]))
        .unwrap()
        .model
        .unwrap();
    assert_eq!(model, Model::named("vit_l_16").unwrap());
    let budgets = parse(&args(&["--budget", "6000000000", "--budget", "9000000000"]))
        .unwrap()
        .budgets;
    assert_eq!(budgets, [6_000_000_000, 9_000_000_000]);
    assert_rejected(
        parse,
        &[
            (
                &["--cases", "adam,sgd"][..],
                "invalid value 'adam' for '--cases <CASE>'",
            ),
            (&["--steps", "0"], "must be at least 1"),
            // 2^44 MiB used to wrap to a bucket of 0 bytes.
            (
                &["--bucket-mib", "17592186044416"],
                "--bucket-mib 17592186044416: too large to count in bytes",
            ),
            (&["--batch", "x"], "not a whole number"),
            (&["--batch", "1,0"], "invalid value '0' for '--batch <N>'"),
            (&["--device", "tpu"], "[possible values: auto, cpu, cuda]"),
            (
                &["--model", "resnet"],
                "invalid value 'resnet' for '--model <MODEL>'",
            ),
            (&["--json"], "a value is required for '--json <FILE>'"),
            (
                &["--budget", "6GB"],
                "invalid value '6GB' for '--budget <BYTES>'",
            ),
            (&["--frobnicate"], "unexpected argument '--frobnicate'"),
            (&["--all-cases", "--cases", "sgd"], "cannot be used with"),
            (
                &["--model", "vit_mini", "--seq", "64"],
                "--seq is for language models",
            ),
        ],
    );
}

/// Every list takes commas, repeated flags, or both, in the order given.
#[test]
fn lists_take_commas_or_repeated_flags() {
    let commas = parse(&args(&[
        "--batch",
        "1,32",
        "--cases",
        "sgd,adam_fused",
        "--budget",
        "6000000000,9000000000",
    ]))
    .unwrap();
    let repeated = parse(&args(&[
        "--batch",
        "1",
        "--batch",
        "32",
        "--cases",
        "sgd",
        "--cases",
        "adam_fused",
        "--budget",
        "6000000000",
        "--budget",
        "9000000000",
    ]))
    .unwrap();
    for options in [&commas, &repeated] {
        assert_eq!(options.batches, [1, 32]);
        assert_eq!(options.cases, [Case::Sgd, Case::AdamFused]);
        assert_eq!(options.budgets, [6_000_000_000, 9_000_000_000]);
    }
    let mixed = parse(&args(&["--batch", "8,16", "--batch", "4"])).unwrap();
    assert_eq!(mixed.batches, [8, 16, 4]);
}

/// Without batches or cases, the CPU runs its selection (the finding's optimizers at batch 1,
/// the activation techniques at 32) and CUDA every case at both; batches given take the union
/// of the selection; `--all-cases` takes every case the device runs.
#[test]
fn the_devices_defaults_and_what_the_options_change() {
    let names = |runs: &[(usize, Vec<Case>)]| -> Vec<(usize, Vec<&str>)> {
        runs.iter()
            .map(|(batch, cases)| (*batch, cases.iter().map(|case| case.name()).collect()))
            .collect()
    };
    let plain = parse(&[]).unwrap();
    assert_eq!(
        names(&plain.runs(&CPU_DEFAULTS).unwrap()),
        [
            (
                1,
                vec![
                    "adam_foreach",
                    "adam_foreach_unbounded",
                    "adam_single",
                    "adam_fused",
                    "adam8bit"
                ]
            ),
            (
                32,
                vec!["adam_fused", "adam_inbwd", "adam_ckpt", "adam_auto"]
            ),
        ]
    );
    // Timed steps: 3 on the CPU, 6 on CUDA, unless --steps says.
    assert_eq!(plain.on_device(&CPU_DEFAULTS).protocol.steps, 3);
    assert_eq!(plain.on_device(&CUDA_DEFAULTS).protocol.steps, 6);
    let five = parse(&args(&["--steps", "5"])).unwrap();
    assert_eq!(five.on_device(&CPU_DEFAULTS).protocol.steps, 5);
    assert_eq!(five.on_device(&CUDA_DEFAULTS).protocol.steps, 5);
    let cuda = plain.runs(&CUDA_DEFAULTS).unwrap();
    let every: Vec<Case> = Case::ALL.to_vec();
    assert_eq!(cuda, [(1, every.clone()), (32, every.clone())]);

    let batches = parse(&args(&["--batch", "8"])).unwrap();
    assert_eq!(
        names(&batches.runs(&CPU_DEFAULTS).unwrap()),
        [(
            8,
            vec![
                "adam_foreach",
                "adam_foreach_unbounded",
                "adam_single",
                "adam_fused",
                "adam_inbwd",
                "adam8bit",
                "adam_ckpt",
                "adam_auto"
            ]
        )]
    );
    let all = parse(&args(&["--all-cases"])).unwrap();
    let on_the_cpu: Vec<Case> = every
        .iter()
        .copied()
        .filter(|case| !case.needs_cuda())
        .collect();
    assert_eq!(
        all.runs(&CPU_DEFAULTS).unwrap(),
        [(1, on_the_cpu.clone()), (32, on_the_cpu)]
    );
    let named = parse(&args(&["--cases", "sgd", "--batch", "2,4"])).unwrap();
    assert_eq!(
        named.runs(&CPU_DEFAULTS).unwrap(),
        [(2, vec![Case::Sgd]), (4, vec![Case::Sgd])]
    );
}

/// A case that needs CUDA, named on the CPU, is refused before any case runs, naming it; on
/// CUDA it runs.
#[test]
fn cuda_only_cases_are_refused_on_the_cpu_up_front() {
    let options = parse(&args(&["--cases", "sgd,adam_offload"])).unwrap();
    let err = options.runs(&CPU_DEFAULTS).unwrap_err().to_string();
    assert_eq!(
        err,
        "--cases adam_offload: needs a CUDA device (adam_offload: it offloads activations to \
         pinned host memory over CUDA copies, which the CPU backend has no use for), and this \
         run is on the CPU backend (--device cpu, or no CUDA device answered); leave it out of \
         --cases, or run on a GPU"
    );
    assert_eq!(
        options.runs(&CUDA_DEFAULTS).unwrap(),
        [
            (1, vec![Case::Sgd, Case::AdamOffload]),
            (32, vec![Case::Sgd, Case::AdamOffload])
        ]
    );
    let profile = parse(&args(&["--op-profile"])).unwrap();
    assert_eq!(
        profile.runs(&CPU_DEFAULTS).unwrap_err().to_string(),
        "--op-profile: it times every backend primitive with CUDA events, and this run is on the \
         CPU backend (--device cpu, or no CUDA device answered); leave it out, or run on a GPU"
    );
    assert!(profile.runs(&CUDA_DEFAULTS).is_ok());
    let mut options = parse(&args(&["--device", "cpu", "--cases", "adam_offload"])).unwrap();
    options.progress = false;
    let err = execute(&options).unwrap_err().to_string();
    assert!(err.starts_with("--cases adam_offload"), "{err}");
}

#[test]
fn adam_auto_meets_its_budget_and_predicts_its_peak_to_the_byte_on_the_cpu() {
    // Batch 8: at 4 the tiny ViT's blocks keep too little for checkpointing to lower its peak.
    let run = |extra: &[&str]| execute(&tiny_vit_on_the_cpu("8", "adam_auto", extra)).unwrap();
    let results = run(&[]);
    let r = &results[0];
    let plan = r.plan.as_ref().unwrap();
    assert!(!plan.budget_given);
    assert!(plan.min_budget < plan.budget && plan.budget < plan.keep_all_peak);
    assert_eq!(
        plan.budget,
        plan.min_budget + (plan.keep_all_peak - plan.min_budget) / 2
    );
    // The CPU allocator is deterministic: the measured peak is the predicted one.
    assert_eq!(r.peak_allocated_bytes, plan.predicted_peak);
    assert!(plan.predicted_peak <= plan.budget);
    let uniform = plan.uniform.as_ref().unwrap();
    assert_eq!(uniform.peak, uniform.predicted_peak);
    assert!(uniform.peak <= plan.budget);
    let text = super::budget_plan::describe(r).unwrap();
    assert!(text.contains("predicted peak"), "{text}");

    // At the lowest reachable peak, given as a budget.
    let lowest = plan.min_budget.to_string();
    let results = run(&["--budget", &lowest]);
    let plan = results[0].plan.as_ref().unwrap();
    assert!(plan.budget_given);
    assert_eq!(results[0].peak_allocated_bytes, plan.predicted_peak);
    assert!(plan.predicted_peak <= plan.min_budget);
}

/// A measurement more than 10% off its prediction gets a line with the likely cause; within
/// 10%, nothing.
#[test]
fn predictions_more_than_10_percent_off_are_flagged_with_a_cause() {
    use super::budget_plan::prediction_flags;

    assert_eq!(
        prediction_flags("plan", (109, 100), (90.5, 100.0), false),
        ""
    );
    assert_eq!(
        prediction_flags("plan", (100, 100), (150.0, 100.0), false),
        "  ! plan: step time 1.50x its prediction, more than 10% off; likely cause: timing noise \
         (the profile times each strategy over few steps, and other work on the machine shifts \
         them; more --steps, or a quieter machine, narrow it)\n"
    );
    assert_eq!(
        prediction_flags("uniform", (120, 100), (100.0, 100.0), false),
        "  ! uniform: peak 1.20x its prediction, more than 10% off; likely cause: the measured \
         steps allocate differently from the profiled one (a block's memory depends on its \
         neighbours' strategies, which the prediction assumes it does not)\n"
    );
    let offload = prediction_flags("plan", (80, 100), (100.0, 100.0), true);
    assert!(
        offload.starts_with(
            "  ! plan: peak 0.80x its prediction, more than 10% off; likely cause: offload's"
        ),
        "{offload}"
    );
}

#[test]
fn pytorch_anchors_are_read_from_torch_reference_output() {
    let text = r#"UserWarning: a line torch printed
{"case": "env", "torch": "2.11.0", "gpu": "NVIDIA H200"}
{"case": "adam_foreach", "batch": 1, "param_bytes": 1217000000, "first3_peak_alloc": 6200000000, "steady_peak_alloc": 6160000000, "steady_peak_reserved": 6430000000, "step_ms_median": 35.8, "step_ms_min": 35.1, "wall_s": 20.0}
{"case": "adam8bit", "batch": 1, "error": "ModuleNotFoundError"}
"#;
    let anchors = report::parse_anchors(text).unwrap();
    assert_eq!(anchors.len(), 1);
    let anchor = anchors[&("vit_l_16".to_owned(), "adam_foreach".to_owned(), 1)];
    assert_eq!(anchor.steady_peak_alloc, 6_160_000_000);
    assert_eq!(anchor.steady_peak_reserved, 6_430_000_000);
    assert_eq!(anchor.first3_peak_alloc, 6_200_000_000);
    assert_eq!(anchor.step_ms_median, 35.8);
    // Both foreach cases compare with PyTorch's foreach.
    assert_eq!(Case::AdamForeachUnbounded.pytorch_name(), "adam_foreach");
    assert!(report::parse_anchors("{not json").is_err());
}

#[test]
fn failing_cases_are_reported_and_every_case_is_tried() {
    use headroom_caching_allocator::{AllocatorConfig, CachingAllocator, HostStorage};

    use super::run_cases;
    use super::training::Probe;

    // 1 MiB of host memory: less than one small-pool segment, so every case runs out of memory
    // when it creates the model; each is reported, and the next one is still tried.
    let cpu = Arc::new(CpuBackend::new(CachingAllocator::new(
        HostStorage::with_capacity(1 << 20),
        AllocatorConfig::default(),
    )));
    let probe = Probe::cpu(&cpu);
    let mut options = parse(&args(&[
        "--model",
        "vit_tiny",
        "--batch",
        "2",
        "--cases",
        "adam_foreach_unbounded,sgd",
    ]))
    .unwrap();
    options.progress = false;
    let runs = options.runs(&CPU_DEFAULTS).unwrap();
    let outcomes = run_cases(&probe, &options, &CPU_DEFAULTS, &runs).unwrap();
    assert!(outcomes.results.is_empty());
    let failed: Vec<_> = outcomes
        .failures
        .iter()
        .map(|f| (f.case, f.batch))
        .collect();
    assert_eq!(failed, [(Case::AdamForeachUnbounded, 2), (Case::Sgd, 2)]);
    for failure in &outcomes.failures {
        assert!(failure.error.contains("out of memory"), "{}", failure.error);
    }
    assert_eq!(
        cpu.allocator().memory_allocated(),
        0,
        "nothing is left behind"
    );
}

/// The chromium of this machine, if one is installed.
fn chromium() -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|dir| ["chromium", "chromium-browser"].map(|name| dir.join(name)))
        .find(|candidate| candidate.is_file())
}

/// Pixels of a PNG that are not near-white.
fn inked_pixels(png_path: &std::path::Path) -> usize {
    let decoder = png::Decoder::new(std::io::BufReader::new(
        std::fs::File::open(png_path).unwrap(),
    ));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = info.color_type.samples();
    buf[..info.buffer_size()]
        .chunks(channels)
        .filter(|px| px.iter().take(3).any(|&c| c < 235))
        .count()
}

/// Screenshots `html` in headless chromium at `window` (width, height) and returns the PNG's
/// path.
fn screenshot(
    chromium: &std::path::Path,
    dir: &std::path::Path,
    name: &str,
    html: &str,
    window: (u32, u32),
) -> std::path::PathBuf {
    let page = dir.join(format!("{name}.html"));
    let shot = dir.join(format!("{name}.png"));
    std::fs::write(&page, html).unwrap();
    let status = std::process::Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--hide-scrollbars",
        ])
        .arg(format!("--window-size={},{}", window.0, window.1))
        .arg(format!("--user-data-dir={}", dir.join("profile").display()))
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("file://{}", page.display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "chromium failed on {name}");
    shot
}

/// Screenshots `html` in headless chromium and counts its inked pixels.
fn rendered_ink(
    chromium: &std::path::Path,
    dir: &std::path::Path,
    name: &str,
    html: &str,
) -> usize {
    inked_pixels(&screenshot(chromium, dir, name, html, (940, 420)))
}

#[test]
fn every_chart_of_the_html_report_renders_in_chromium() {
    let Some(chromium) = chromium() else {
        headroom_testkit::gpu::skip("chromium is not installed (apt-get install chromium)");
        return;
    };
    let dir = std::env::temp_dir().join(format!("headroom-bench-html-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let html_path = dir.join("bench.html");
    let options = tiny_vit_on_the_cpu(
        "2",
        "adam_fused,adam_inbwd",
        &["--html", html_path.to_str().unwrap()],
    );
    execute(&options).unwrap();
    let page = std::fs::read_to_string(&html_path).unwrap();
    let charts: Vec<&str> = page
        .split("<svg")
        .skip(1)
        .map(|rest| &rest[..rest.find("</svg>").expect("closed") + "</svg>".len()])
        .collect();
    // The peak bars, and one timeline per case.
    assert_eq!(charts.len(), 3);
    let blank = rendered_ink(
        &chromium,
        &dir,
        "blank",
        "<html><body><svg width=\"900\" height=\"180\"></svg></body></html>",
    );
    assert!(blank < 50, "a blank chart shows {blank} inked pixels");
    for (idx, chart) in charts.iter().enumerate() {
        let html = format!("<html><body style=\"margin:0\"><svg{chart}</body></html>");
        let ink = rendered_ink(&chromium, &dir, &format!("chart{idx}"), &html);
        assert!(ink > 3000, "chart {idx} shows only {ink} inked pixels");
    }
    // Each timeline's other layer, by event order, draws as much.
    for (idx, chart) in charts.iter().enumerate().skip(1) {
        let by_events = chart
            .replace("class=\"by-event\" display=\"none\"", "class=\"by-event\"")
            .replace("class=\"by-time\"", "class=\"by-time\" display=\"none\"");
        assert_ne!(&by_events, chart, "chart {idx} has both layers");
        let html = format!("<html><body style=\"margin:0\"><svg{by_events}</body></html>");
        let ink = rendered_ink(&chromium, &dir, &format!("events{idx}"), &html);
        assert!(
            ink > 3000,
            "chart {idx} by events shows only {ink} inked pixels"
        );
    }
    // The page's toggle switches the layers: with the toggle itself hidden, the page by event
    // order differs from the page by time over the timelines' height, not in a few pixels.
    let hide_toggle = |html: &str| {
        html.replace(
            "</head>",
            "<style>input,label{visibility:hidden}</style></head>",
        )
    };
    let by_events_page = page
        .replace("id=\"axis-time\" checked", "id=\"axis-time\"")
        .replace("id=\"axis-events\"", "id=\"axis-events\" checked");
    assert_ne!(by_events_page, page);
    let rows = |name: &str, html: &str| {
        let png = screenshot(&chromium, &dir, name, &hide_toggle(html), (1400, 1000));
        let mut reader =
            png::Decoder::new(std::io::BufReader::new(std::fs::File::open(png).unwrap()))
                .read_info()
                .unwrap();
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).unwrap();
        buf.truncate(info.buffer_size());
        buf.chunks(info.line_size)
            .map(<[u8]>::to_vec)
            .collect::<Vec<_>>()
    };
    let (by_time, by_event) = (rows("page", &page), rows("page_events", &by_events_page));
    let differing = by_time
        .iter()
        .zip(&by_event)
        .filter(|(a, b)| a != b)
        .count();
    assert!(
        differing >= 100,
        "the toggle changes only {differing} rows of the page"
    );
    std::fs::remove_dir_all(&dir).ok();
}
