//! The plan's predictions against what was measured: the H200's peaks and step times (from
//! the committed results), and on the CPU every recipe on the tiny Llama, recomputing each
//! number of blocks, through bench-memory; `plan --run` end to end.

use super::*;
use crate::bench_memory::Options;
use crate::Command;

/// `plan` followed by `words`, parsed as the binary parses it.
fn parse(words: &[&str]) -> Args {
    let words: Vec<&str> = std::iter::once("plan")
        .chain(words.iter().copied())
        .collect();
    match crate::parse_command_line(&words).unwrap() {
        Command::Plan(args) => args,
        other => panic!("parsed as {other:?}"),
    }
}

/// `plan` with the options of `line` and `--json` to a temporary file, run; the JSON it wrote.
fn run_to_json(line: &str) -> Value {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("headroom-plan-{}-{n}.json", std::process::id()));
    let path_text = path.to_str().unwrap().to_owned();
    let mut words: Vec<&str> = line.split_whitespace().collect();
    words.extend(["--json", &path_text]);
    run(parse(&words)).unwrap();
    let document = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    document
}

fn plan_of(model: &str, case: &str, checkpointed: usize) -> (LlamaConfig, Plan) {
    let config = LlamaConfig::named(model).unwrap();
    let recipe = *RECIPES.iter().find(|r| r.case == case).unwrap();
    (
        config,
        Plan {
            recipe,
            checkpointed,
        },
    )
}

/// Peaks bench-memory measured on the H200 (`peak_allocated_bytes`) at 2048 tokens a row: the
/// model, batch, recipe, blocks recomputed and bytes, with the file each comes from.
const MEASURED_PEAKS: [(&str, usize, &str, usize, u64); 8] = [
    // results/2026-12-02-3040c90/llama8b_adamw4bit_inbwd_bf16.json
    ("llama-3.1-8b", 1, "adamw4bit_inbwd_bf16", 0, 34_924_668_928),
    // results/2026-12-02-532f72f/llama8b_adamw4bit_inbwd_bf16_b4.json
    ("llama-3.1-8b", 4, "adamw4bit_inbwd_bf16", 0, 62_485_268_480),
    // results/2026-12-02-532f72f/llama8b_adamw4bit_inbwd_bf16_b8.json
    ("llama-3.1-8b", 8, "adamw4bit_inbwd_bf16", 0, 99_231_483_904),
    // results/2026-12-02-ea5bc51/llama8b_adamw_inbwd_bf16.json
    ("llama-3.1-8b", 1, "adamw_inbwd_bf16", 0, 90_634_556_416),
    // results/2026-12-02-3040c90/llama8b_adamw4bit_inbwd_bf16_ckpt.json
    (
        "llama-3.1-8b",
        1,
        "adamw4bit_inbwd_bf16_ckpt",
        32,
        26_325_821_440,
    ),
    // results/2026-12-02-3040c90/llama8b_adamw4bit_bf16_ckpt.json
    ("llama-3.1-8b", 1, "adamw4bit_bf16_ckpt", 32, 40_703_727_616),
    // results/2026-12-02-96d77e3/llama1b_offload.json
    ("llama-3.2-1b", 1, "adamw_inbwd_bf16", 0, 15_495_021_568),
    (
        "llama-3.2-1b",
        1,
        "adamw_offload_inbwd_bf16",
        0,
        5_608_502_272,
    ),
];

/// Every peak measured on the H200 is predicted within 2% (the bound for plans).
#[test]
fn predicted_peaks_are_within_two_percent_of_the_h200s() {
    for (model, batch, case, checkpointed, measured) in MEASURED_PEAKS {
        let (config, plan) = plan_of(model, case, checkpointed);
        let predicted = predict(&config, 2048, batch, plan).gpu_peak;
        let error = error(predicted as f64, measured as f64);
        assert!(
            error.abs() <= PEAK_BOUND,
            "{model} {case} batch {batch}: predicted {predicted}, measured {measured} ({:+.2}%)",
            100.0 * error
        );
    }
}

/// Step times bench-memory measured on the H200 at 2048 tokens a row (median, ms), the model's
/// calibration: model, batch, recipe, blocks recomputed, ms, with the file each comes from.
const MEASURED_STEPS: [(&str, usize, &str, usize, f64); 10] = [
    // results/2026-12-02-ea5bc51/llama8b_adamw_inbwd_bf16.json
    ("llama-3.1-8b", 1, "adamw_inbwd_bf16", 0, 257.2),
    // results/2026-12-02-3040c90/llama8b_adamw4bit_inbwd_bf16.json
    ("llama-3.1-8b", 1, "adamw4bit_inbwd_bf16", 0, 270.0),
    // results/2026-12-02-532f72f/llama8b_adamw4bit_inbwd_bf16_b4.json and _b8.json
    ("llama-3.1-8b", 4, "adamw4bit_inbwd_bf16", 0, 794.7),
    ("llama-3.1-8b", 8, "adamw4bit_inbwd_bf16", 0, 1497.9),
    // results/2026-12-02-3040c90/llama8b_adamw4bit_inbwd_bf16_ckpt.json
    ("llama-3.1-8b", 1, "adamw4bit_inbwd_bf16_ckpt", 32, 309.7),
    // results/2026-12-02-3040c90/llama8b_adamw4bit_bf16_ckpt.json
    ("llama-3.1-8b", 1, "adamw4bit_bf16_ckpt", 32, 329.0),
    // results/2026-12-02-799f58a/llama8b_b6.json
    ("llama-3.1-8b", 6, "adamw_inbwd_bf16", 0, 1109.9),
    // results/2026-12-02-799f58a/llama1b_b1.json and llama1b_b8.json, 81bb6bf/llama1b_b4.json
    ("llama-3.2-1b", 1, "adamw_inbwd_bf16", 0, 53.1),
    ("llama-3.2-1b", 4, "adamw_inbwd_bf16", 0, 154.3),
    ("llama-3.2-1b", 8, "adamw_inbwd_bf16", 0, 293.1),
];

/// The step-time model predicts each H200 step it was fitted to within 6%, and the host-stepped
/// offload it was given within 1%.
#[test]
fn predicted_steps_are_within_six_percent_of_the_h200s() {
    for (model, batch, case, checkpointed, measured) in MEASURED_STEPS {
        let (config, plan) = plan_of(model, case, checkpointed);
        let predicted = predict(&config, 2048, batch, plan).step_ms;
        let error = error(predicted, measured);
        assert!(
            error.abs() <= 0.06,
            "{model} {case} batch {batch}: predicted {predicted:.1} ms, measured {measured} \
             ({:+.1}%)",
            100.0 * error
        );
    }
    let (config, plan) = plan_of("llama-3.2-1b", "adamw_offload_inbwd_bf16", 0);
    let offload = predict(&config, 2048, 1, plan).step_ms;
    assert!(error(offload, 857.1).abs() <= 0.01, "{offload}");
}

/// The state terms are optim's: Llama-3.1-8B's 4-bit state is the 8,532,152,576 bytes
/// bench-memory counted, its f32 moments 64,242,089,984.
#[test]
fn state_bytes_are_the_optimizers() {
    let config = LlamaConfig::llama_3_1_8b();
    let sizes = predict::parameter_sizes(&config);
    let state = |state| -> u64 { sizes.iter().map(|&n| predict::state_bytes(state, n)).sum() };
    assert_eq!(state(State::Bits4), 8_532_152_576);
    assert_eq!(state(State::F32), 64_242_089_984);
    assert_eq!(sizes.iter().sum::<usize>(), config.num_parameters());
}

/// bench-memory's command line of `plan` on the tiny Llama on the CPU, one measured step.
fn tiny_words(seq: usize, batch: usize, plan: Plan) -> Vec<String> {
    let mut words = vec![
        "bench-memory".to_owned(),
        "--device".into(),
        "cpu".into(),
        "--model".into(),
        "llama-tiny".into(),
        "--seq".into(),
        seq.to_string(),
        "--batch".into(),
        batch.to_string(),
        "--cases".into(),
        plan.recipe.case.into(),
        "--warmup".into(),
        "1".into(),
        "--steps".into(),
        "1".into(),
    ];
    if plan.recipe.checkpointed {
        words.extend(["--checkpoint-blocks".into(), plan.checkpointed.to_string()]);
    }
    words
}

/// On the CPU's allocator (the same caching policy as the GPU's), every recipe on the tiny Llama,
/// recomputing each number of its blocks, at two sizes: the predicted peak within 1% of the
/// measured one (the bound is 2%), so the terms hold where no term dominates.
#[test]
fn predicted_peaks_are_within_one_percent_of_the_tiny_llamas_on_the_cpu() {
    let config = LlamaConfig::tiny();
    let mut worst = (0.0f64, String::new());
    for (seq, batch) in [(32, 2), (64, 4)] {
        for recipe in RECIPES {
            let blocks = if recipe.checkpointed {
                1..=config.num_hidden_layers
            } else {
                0..=0
            };
            for checkpointed in blocks {
                let plan = Plan {
                    recipe,
                    checkpointed,
                };
                let words = tiny_words(seq, batch, plan);
                let refs: Vec<&str> = words.iter().map(String::as_str).collect();
                let Command::BenchMemory(bench) = crate::parse_command_line(&refs).unwrap() else {
                    unreachable!()
                };
                let mut options = Options::new(bench, "test".into()).unwrap();
                options.progress = false;
                let results = crate::bench_memory::execute(&options).unwrap();
                let measured = results[0].peak_allocated_bytes;
                // On the CPU a streamed optimizer is its inner one: its state stays put.
                let on_the_cpu = Plan {
                    recipe: Recipe {
                        state: recipe.state.on_the_cpu(),
                        ..recipe
                    },
                    checkpointed,
                };
                let predicted = predict(&config, seq, batch, on_the_cpu).gpu_peak;
                let error = error(predicted as f64, measured as f64);
                let label = format!("{} k={checkpointed} {seq}x{batch}", recipe.case);
                eprintln!(
                    "{label}: predicted {predicted}, measured {measured} ({:+.2}%) {}",
                    100.0 * error,
                    predict(&config, seq, batch, plan).phase
                );
                if error.is_nan() || error.abs() > worst.0.abs() {
                    worst = (error, label);
                }
            }
        }
    }
    eprintln!("worst: {} {:+.3}%", worst.1, 100.0 * worst.0);
    assert!(worst.0.abs() <= 0.01);
}

/// `plan --run` on the CPU under a cap between keeping every activation and recomputing every
/// block: the plan recomputes one of the tiny Llama's two blocks, and its JSON holds the
/// measured peak within 2% of the predicted one.
#[test]
fn plan_run_measures_a_partly_checkpointed_plan_within_two_percent() {
    // 2 MiB at batch 8: 8- and 4-bit state fit with one block recomputed (about 1.85 and 1.77
    // MB), not with none (2.4 MB and more).
    let caps = Caps {
        gpu: 2 << 20,
        host: 128 << 30,
    };
    let (plan, _) = choose(&LlamaConfig::tiny(), 64, 8, caps).unwrap();
    assert_eq!(plan.checkpointed, 1);
    let document = run_to_json(
        "--model llama-tiny --seq 64 --batch 8 --memory-cap-mb 2 --run --device cpu --steps 1",
    );
    assert_eq!(document["plan"]["case"], plan.recipe.case);
    assert_eq!(document["plan"]["checkpointed_blocks"], plan.checkpointed);
    let peak_error = document["measured"]["peak_error"].as_f64().unwrap();
    assert!(peak_error.abs() <= PEAK_BOUND, "{document}");
    assert!(document["measured"]["step_ms"].as_f64().unwrap() > 0.0);
}

/// Under a cap between the tiny Llama's plans, the plan keeps as many blocks as fit: one of two
/// recomputed where recomputing none does not fit and recomputing both is not needed.
#[test]
fn the_plan_recomputes_only_the_blocks_the_cap_needs() {
    let config = LlamaConfig::tiny();
    let at = |cap: u64| {
        let caps = Caps { gpu: cap, host: 0 };
        choose(&config, 64, 4, caps).map(|(plan, prediction)| {
            assert!(prediction.gpu_peak as f64 * 1.02 <= cap as f64);
            (plan.recipe.case, plan.checkpointed)
        })
    };
    // Everything fits: nothing recomputed, the state whose step the H200 model predicts fastest
    // (8-bit: 5.5 ms per 1e9 parameters against f32 moments' 8.06).
    assert_eq!(at(64 << 20), Some(("adamw8bit_inbwd_bf16", 0)));
    let kept = predict(
        &config,
        64,
        4,
        plan_of("llama-tiny", "adamw4bit_inbwd_bf16", 0).1,
    );
    let one = plan_of("llama-tiny", "adamw4bit_inbwd_bf16_ckpt", 1).1;
    let one = predict(&config, 64, 4, one);
    assert!(one.gpu_peak < kept.gpu_peak);
    let between = at((one.gpu_peak as f64 * 1.02) as u64 + 1).unwrap();
    assert_eq!(between.1, 1, "{between:?}");
    assert!(at(100_000).is_none());
}

/// Under an H200's 139 GiB at 2048 tokens, Qwen2.5-32B has a plan and Llama-3.1-70B none (its
/// bf16 weights alone are 141 GB); the deeper variants of 32B between them fit too.
#[test]
fn the_largest_model_under_an_h200_is_deeper_than_qwen2_5_32b() {
    let caps = Caps {
        gpu: 139 << 30,
        host: 128 << 30,
    };
    let plan = |config: &LlamaConfig| choose(config, 2048, 1, caps);
    let qwen = LlamaConfig::named("qwen2.5-32b").unwrap();
    let (_, prediction) = plan(&qwen).expect("32B has a plan");
    assert!(prediction.gpu_peak <= caps.gpu);
    assert!(plan(&LlamaConfig::named("llama-3.1-70b").unwrap()).is_none());
    let mut deeper = qwen;
    deeper.num_hidden_layers += 4;
    assert!(plan(&deeper).is_some());
}

#[test]
fn plan_options_are_checked() {
    let run_on = |words: &[&str]| -> anyhow::Result<()> {
        let words: Vec<&str> = std::iter::once("plan")
            .chain(words.iter().copied())
            .collect();
        match crate::parse_command_line(&words)? {
            Command::Plan(args) => super::run(args),
            other => anyhow::bail!("parsed as {other:?}"),
        }
    };
    crate::cli_tests::assert_rejected(
        |list: &[String]| {
            let words: Vec<&str> = list.iter().map(String::as_str).collect();
            run_on(&words)
        },
        &[
            (&["--model", "gpt2"], "not a Llama-shaped model"),
            (
                &["--model", "llama-tiny", "--seq", "65"],
                "at most 64 tokens",
            ),
            (&["--device", "cpu"], "--run"),
            (
                &["--find-max-model", "--layers", "3"],
                "cannot be used with",
            ),
            (&["--model", "llama-tiny", "--layers", "0"], "--layers 0"),
            (
                &[
                    "--model",
                    "llama-tiny",
                    "--seq",
                    "64",
                    "--memory-cap-mb",
                    "0",
                ],
                "no recipe fits",
            ),
        ],
    );
}

/// `--layers` makes the tiny Llama three layers deep: the plan is measured on that model, and
/// its JSON names the layers.
#[test]
fn plan_run_measures_a_deeper_model_within_two_percent() {
    let document = run_to_json(
        "--model llama-tiny --layers 3 --seq 64 --batch 4 --memory-cap-mb 2 --run --device cpu --steps 1",
    );
    assert_eq!(document["layers"], 3);
    assert_eq!(document["plan"]["blocks"], 3);
    let peak_error = document["measured"]["peak_error"].as_f64().unwrap();
    assert!(peak_error.abs() <= PEAK_BOUND, "{document}");
}

/// `--find-max-model --json` lists every standard shape and the deeper variants walked between
/// them, each with its plan, and names the largest with one: under an H200's caps a variant of
/// Qwen2.5-32B deeper than its 64 layers.
#[test]
fn find_max_model_writes_every_shape_and_the_largest() {
    let document = run_to_json("--find-max-model");
    let shapes = document["shapes"].as_array().unwrap();
    for name in STANDARD_SHAPES {
        assert!(shapes.iter().any(|s| s["model"] == name), "{name}");
    }
    let largest = &document["largest_predicted"];
    assert_eq!(largest["model"], "qwen2.5-32b");
    assert!(largest["layers"].as_u64().unwrap() > 64, "{largest}");
    let planned: Vec<&Value> = shapes.iter().filter(|s| s.get("plan").is_some()).collect();
    assert_eq!(planned.last().unwrap()["parameters"], largest["parameters"]);
    assert!(shapes
        .iter()
        .any(|s| s["model"] == "llama-3.1-70b" && s.get("plan").is_none()));
}
