//! `plan`: the bf16 AdamW recipe, and the blocks it recomputes, that trains a Llama-shaped model
//! fastest at a sequence length and batch within a GPU (and host) memory cap — predicted from
//! the model's shapes, and with `--run` measured by bench-memory on the device.
//!
//! A recipe is one of bench-memory's bf16-model cases ([`RECIPES`]): where AdamW's state lives
//! and how wide it is (f32 moments, 8-bit, 4-bit, f32 moments in host memory stepped by the
//! host, or 4-bit state in host memory streamed through the GPU, which leaves the GPU only the
//! states in flight) and whether the step runs inside backward. A checkpointed recipe recomputes the model's
//! first `k` blocks and keeps every activation of the others: per block, keep or recompute. For
//! each recipe the plan takes the fewest recomputed blocks whose predicted peaks fit, then the
//! recipe predicted fastest ([`predict`]: the GPU peak phase by phase, host bytes, the H200's
//! step time). Memory the state saves buys kept activations, and kept activations buy time.
//!
//! `--run` runs the chosen plan through bench-memory (`--cases <recipe>`, and
//! `--checkpoint-blocks k` for a checkpointed one) on the device `--device` picks, and prints the
//! measured peak and step time beside the predicted ones; `--json` writes both.
//!
//! `--layers N` plans (and measures) a Llama-family model N decoder layers deep.
//! `--find-max-model` walks the standard shapes (Llama-3.2-1B, 3B, Llama-3.1-8B, Qwen2.5-14B,
//! 32B, Llama-3.1-70B) and, between each and the next, the smaller one made deeper four layers
//! at a time, and reports the largest with a plan, from the same predictions; with `--run` it
//! measures the largest (bench-memory `--layers`), and the next smaller one when a larger one
//! fails to run. Widths between the shapes are not walked. PyTorch's side of the same walk is
//! `scripts/pytorch/find_max_model.py`.
//!
//! It sits on nn's Llama configs, optim's quantisation constants and, for `--run`,
//! bench-memory; the predictions know no device.

mod predict;

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use headroom_nn::LlamaConfig;
use serde_json::{json, Value};

#[cfg(test)]
use predict::State;
pub(crate) use predict::{predict, Plan, Prediction, Recipe, RECIPES};

/// The bound the issue sets on a plan's predicted GPU peak against the measured one.
const PEAK_BOUND: f64 = 0.02;

/// `plan`'s options.
#[derive(Debug, clap::Args)]
#[command(
    about = "Pick the bf16 AdamW recipe and the blocks to recompute predicted fastest within a \
             memory cap; --run measures it",
    long_about = "Predicts, for a Llama-shaped model at a sequence length and batch, the GPU peak, \
                  host bytes and H200 step time of each bf16-model AdamW recipe (bench-memory's \
                  case names: state width and place, in backward or not) with the fewest \
                  recomputed blocks that fit the caps, and picks the fastest. --run measures the \
                  plan with bench-memory on the device and prints the measured peak and step \
                  time beside the predicted ones."
)]
pub(crate) struct Args {
    /// A Llama-shaped model: llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen2.5-14b, qwen2.5-32b,
    /// llama-3.1-70b, llama-tiny.
    #[arg(long, default_value = "llama-3.1-8b")]
    model: String,
    /// Tokens a row.
    #[arg(long, default_value_t = 2048, value_parser = crate::at_least_one)]
    seq: usize,
    /// Rows a step.
    #[arg(long, default_value_t = 1, value_parser = crate::at_least_one)]
    batch: usize,
    /// GPU memory the plan may use, MiB (default: an H200's 139 GiB); a plan's predicted peak
    /// and 2% more (the prediction's bound) must fit.
    #[arg(long, value_name = "MIB", default_value_t = 139 * 1024)]
    memory_cap_mb: u64,
    /// Host memory the plan may use for offloaded state, MiB (default: the H200 machine's
    /// 128 GiB; 0 rules offload out).
    #[arg(long, value_name = "MIB", default_value_t = 128 * 1024)]
    host_cap_mb: u64,
    /// The model with N decoder layers instead of its own (a shape between the standard ones).
    #[arg(long, value_name = "N")]
    layers: Option<usize>,
    /// Instead of one model: the plan of each standard shape (Llama-3.2-1B and 3B, Llama-3.1-8B,
    /// Qwen2.5-14B and 32B, Llama-3.1-70B) and of deeper variants between them, and the largest
    /// that fits; with --run, the largest measured (a smaller one when it fails to run).
    #[arg(long, conflicts_with_all = ["model", "layers"])]
    find_max_model: bool,
    /// Measure the plan: bench-memory with its case (and --checkpoint-blocks) on the device.
    #[arg(long)]
    run: bool,
    /// With --run: where bench-memory runs (auto: CUDA when a GPU answers, else the CPU).
    #[arg(long, value_name = "DEVICE", default_value = "auto", requires = "run",
          value_parser = ["auto", "cpu", "cuda"])]
    device: String,
    /// With --run: timed steps (default: bench-memory's for the device).
    #[arg(long, value_name = "N", requires = "run", value_parser = crate::at_least_one)]
    steps: Option<usize>,
    /// Writes the plan, its prediction and (with --run) the measurement as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// The model's standard shapes, smallest first.
const STANDARD_SHAPES: [&str; 6] = LlamaConfig::STANDARD_NAMES;

/// A plan's display name: its case, and for a checkpointed recipe the blocks it recomputes.
fn describe(plan: Plan, layers: usize) -> String {
    if plan.recipe.checkpointed {
        format!(
            "{} ({}/{layers} recomputed)",
            plan.recipe.case, plan.checkpointed
        )
    } else {
        plan.recipe.case.to_owned()
    }
}

/// The caps in bytes.
#[derive(Debug, Clone, Copy)]
struct Caps {
    gpu: u64,
    host: u64,
}

impl Caps {
    fn of(args: &Args) -> Result<Caps> {
        Ok(Caps {
            gpu: crate::mib_to_bytes("--memory-cap-mb", args.memory_cap_mb)?,
            host: crate::mib_to_bytes("--host-cap-mb", args.host_cap_mb)?,
        })
    }

    /// Whether the predicted peak, and 2% more for the prediction's error, fits the GPU cap, and
    /// the host bytes the host cap.
    fn fit(self, prediction: &Prediction) -> bool {
        prediction.gpu_peak as f64 * (1.0 + PEAK_BOUND) <= self.gpu as f64
            && prediction.host_bytes <= self.host
    }
}

/// `recipe` with the fewest recomputed blocks whose prediction fits `caps` (0 for a recipe that
/// keeps every activation), or the most recomputed if none fits.
fn best_of(
    config: &LlamaConfig,
    seq: usize,
    batch: usize,
    caps: Caps,
    recipe: Recipe,
) -> (Plan, Prediction) {
    let blocks = if recipe.checkpointed {
        1..=config.num_hidden_layers
    } else {
        0..=0
    };
    let mut last = None;
    for checkpointed in blocks {
        let plan = Plan {
            recipe,
            checkpointed,
        };
        let prediction = predict(config, seq, batch, plan);
        if caps.fit(&prediction) {
            return (plan, prediction);
        }
        last = Some((plan, prediction));
    }
    last.expect("every recipe has at least one candidate")
}

/// Every recipe's best candidate (see [`best_of`]) and whether it fits, in [`RECIPES`]' order.
fn candidates(
    config: &LlamaConfig,
    seq: usize,
    batch: usize,
    caps: Caps,
) -> Vec<(Plan, Prediction, bool)> {
    RECIPES
        .into_iter()
        .map(|recipe| {
            let (plan, prediction) = best_of(config, seq, batch, caps, recipe);
            let fits = caps.fit(&prediction);
            (plan, prediction, fits)
        })
        .collect()
}

/// The fitting candidate predicted fastest (the earlier recipe on a tie).
fn choose(
    config: &LlamaConfig,
    seq: usize,
    batch: usize,
    caps: Caps,
) -> Option<(Plan, Prediction)> {
    candidates(config, seq, batch, caps)
        .into_iter()
        .filter(|(_, _, fits)| *fits)
        .map(|(plan, prediction, _)| (plan, prediction))
        .reduce(|best, next| {
            if next.1.step_ms < best.1.step_ms {
                next
            } else {
                best
            }
        })
}

/// Tokens a second at `step_ms` a step.
fn tokens_per_second(seq: usize, batch: usize, step_ms: f64) -> f64 {
    (seq * batch) as f64 / step_ms * 1e3
}

/// A shape `--find-max-model` walks: a standard shape, or one made deeper.
#[derive(Debug, Clone)]
struct Shape {
    name: &'static str,
    config: LlamaConfig,
    /// The layers when deeper than the standard shape's.
    layers: Option<usize>,
}

impl Shape {
    fn label(&self) -> String {
        match self.layers {
            Some(layers) => format!("{} ×{layers} layers", self.name),
            None => self.name.to_owned(),
        }
    }
}

/// The standard shapes, each followed by the deepest variant (four layers at a time, below the
/// next shape's size) that has a plan, with their plans.
fn walk_shapes(args: &Args, caps: Caps) -> Vec<(Shape, Option<(Plan, Prediction)>)> {
    let configs: Vec<LlamaConfig> = STANDARD_SHAPES
        .iter()
        .map(|name| LlamaConfig::named(name).expect("a standard shape has a config"))
        .collect();
    let mut rows = Vec::new();
    for (i, (name, config)) in STANDARD_SHAPES.iter().zip(&configs).enumerate() {
        let planned = choose(config, args.seq, args.batch, caps);
        let fits = planned.is_some();
        rows.push((
            Shape {
                name,
                config: *config,
                layers: None,
            },
            planned,
        ));
        let Some(next) = configs.get(i + 1).filter(|_| fits) else {
            continue;
        };
        let mut deepest = None;
        let mut deeper = *config;
        loop {
            deeper.num_hidden_layers += 4;
            if deeper.num_parameters() >= next.num_parameters() {
                break;
            }
            match choose(&deeper, args.seq, args.batch, caps) {
                Some(planned) => deepest = Some((deeper, planned)),
                None => break,
            }
        }
        if let Some((deeper, planned)) = deepest {
            let shape = Shape {
                name,
                config: deeper,
                layers: Some(deeper.num_hidden_layers),
            };
            rows.push((shape, Some(planned)));
        }
    }
    rows
}

/// `--find-max-model`: each standard shape's plan, deeper variants between the shapes, and the
/// largest with a plan; with `--run`, the largest measured (the next smaller one tried when a
/// larger one fails to run).
fn find_max_model(args: &Args) -> Result<()> {
    if let Some(path) = &args.json {
        crate::output_paths::check_file("--json", path)?;
    }
    let caps = Caps::of(args)?;
    println!(
        "predicted plans at {} rows of {} tokens, GPU cap {} MiB, host cap {} MiB (bf16 \
         weights, AdamW)\n",
        args.batch, args.seq, args.memory_cap_mb, args.host_cap_mb
    );
    println!(
        "{:<24} {:>16}  {:<54} {:>16} {:>16} {:>10} {:>9}",
        "model", "parameters", "plan", "GPU peak (B)", "host (B)", "step (ms)", "tokens/s"
    );
    let rows = walk_shapes(args, caps);
    for (shape, planned) in &rows {
        let parameters = shape.config.num_parameters();
        match planned {
            Some((plan, prediction)) => println!(
                "{:<24} {parameters:>16}  {:<54} {:>16} {:>16} {:>10.1} {:>9.0}",
                shape.label(),
                describe(*plan, shape.config.num_hidden_layers),
                prediction.gpu_peak,
                prediction.host_bytes,
                prediction.step_ms,
                tokens_per_second(args.seq, args.batch, prediction.step_ms)
            ),
            None => println!("{:<24} {parameters:>16}  none fits", shape.label()),
        }
    }
    let fitting: Vec<_> = rows
        .iter()
        .filter_map(|(shape, planned)| Some((shape, planned.as_ref()?)))
        .collect();
    let Some((largest, _)) = fitting.last() else {
        bail!(
            "no standard shape fits {} MiB at batch {}: lower --batch or --seq",
            args.memory_cap_mb,
            args.batch
        );
    };
    println!(
        "\nlargest that fits (predicted): {}, {} parameters.",
        largest.label(),
        largest.config.num_parameters()
    );
    let mut measured = None;
    if args.run {
        for (shape, (plan, prediction)) in fitting.iter().rev() {
            let words = bench_memory_words(args, shape.name, shape.layers, *plan);
            println!(
                "\nmeasuring {}: cargo xtask {}\n",
                shape.label(),
                words.join(" ")
            );
            match measure(words, *plan) {
                Ok(m) => {
                    println!(
                        "\nlargest measured: {}, {} parameters, {}: GPU peak {} B (predicted \
                         {:+.2}%), step {:.1} ms, {:.0} tokens/s",
                        shape.label(),
                        shape.config.num_parameters(),
                        describe(*plan, shape.config.num_hidden_layers),
                        m.peak_allocated_bytes,
                        100.0 * error(prediction.gpu_peak as f64, m.peak_allocated_bytes as f64),
                        m.step_ms,
                        tokens_per_second(args.seq, args.batch, m.step_ms)
                    );
                    measured = Some((*shape, *plan, prediction, m));
                    break;
                }
                Err(err) => println!("{} did not run: {err:#}", shape.label()),
            }
        }
        if measured.is_none() {
            bail!("no planned shape ran on the device");
        }
    }
    if let Some(path) = &args.json {
        let shapes: Vec<Value> = rows
            .iter()
            .map(|(shape, planned)| {
                let mut value = json!({
                    "model": shape.name,
                    "layers": shape.config.num_hidden_layers,
                    "parameters": shape.config.num_parameters(),
                });
                if let Some((plan, prediction)) = planned {
                    value["plan"] = plan_json(*plan, shape.config.num_hidden_layers);
                    value["predicted"] = prediction_json(prediction);
                }
                value
            })
            .collect();
        let mut document = json!({
            "seq": args.seq,
            "batch": args.batch,
            "memory_cap_mb": args.memory_cap_mb,
            "host_cap_mb": args.host_cap_mb,
            "shapes": shapes,
            "largest_predicted": {
                "model": largest.name,
                "layers": largest.config.num_hidden_layers,
                "parameters": largest.config.num_parameters(),
            },
        });
        if let Some((shape, plan, prediction, m)) = &measured {
            document["largest_measured"] = json!({
                "model": shape.name,
                "layers": shape.config.num_hidden_layers,
                "parameters": shape.config.num_parameters(),
                "plan": plan_json(*plan, shape.config.num_hidden_layers),
                "measured": measured_json(prediction, m),
            });
        }
        write_json(path, &document)?;
    }
    Ok(())
}

/// What `--run` measured of a plan.
#[derive(Debug, Clone)]
struct Measured {
    peak_allocated_bytes: u64,
    host_state_bytes: u64,
    step_ms: f64,
    device: String,
}

/// bench-memory's command line that measures `plan` on `model` (with `layers` decoder layers
/// when given).
fn bench_memory_words(args: &Args, model: &str, layers: Option<usize>, plan: Plan) -> Vec<String> {
    let mut words: Vec<String> = [
        "bench-memory",
        "--device",
        &args.device,
        "--model",
        model,
        "--seq",
        &args.seq.to_string(),
        "--batch",
        &args.batch.to_string(),
        "--cases",
        plan.recipe.case,
    ]
    .map(str::to_owned)
    .into();
    if let Some(layers) = layers {
        words.extend(["--layers".into(), layers.to_string()]);
    }
    if plan.recipe.checkpointed {
        words.extend(["--checkpoint-blocks".into(), plan.checkpointed.to_string()]);
    }
    if let Some(steps) = args.steps {
        words.extend(["--steps".into(), steps.to_string()]);
    }
    words
}

/// Runs bench-memory's command line `words` (its report goes to stdout as usual) and returns the
/// one case's figures.
fn measure(words: Vec<String>, plan: Plan) -> Result<Measured> {
    let command = format!("cargo xtask {}", words.join(" "));
    let word_refs: Vec<&str> = words.iter().map(String::as_str).collect();
    let crate::Command::BenchMemory(bench_args) = crate::parse_command_line(&word_refs)? else {
        unreachable!("the words start with bench-memory");
    };
    let options = crate::bench_memory::Options::new(bench_args, command)?;
    let results = crate::bench_memory::execute(&options)
        .with_context(|| format!("measuring the plan ({})", plan.recipe.case))?;
    let [result] = results.as_slice() else {
        bail!("bench-memory measured {} cases, not one", results.len());
    };
    Ok(Measured {
        peak_allocated_bytes: result.peak_allocated_bytes,
        host_state_bytes: result.host_state_bytes,
        step_ms: result.step_ms,
        device: result.device.clone(),
    })
}

/// The relative error of `predicted` against `measured`.
fn error(predicted: f64, measured: f64) -> f64 {
    predicted / measured - 1.0
}

/// A plan as JSON: its case and the blocks it recomputes.
fn plan_json(plan: Plan, layers: usize) -> Value {
    json!({
        "case": plan.recipe.case,
        "checkpointed_blocks": plan.checkpointed,
        "blocks": layers,
    })
}

/// A prediction as JSON.
fn prediction_json(prediction: &Prediction) -> Value {
    let terms: serde_json::Map<String, Value> = prediction
        .terms
        .iter()
        .map(|(name, bytes)| ((*name).to_owned(), (*bytes).into()))
        .collect();
    json!({
        "gpu_peak_bytes": prediction.gpu_peak,
        "host_bytes": prediction.host_bytes,
        "step_ms_h200": prediction.step_ms,
        "peak_phase": prediction.phase,
        "terms": terms,
    })
}

/// What was measured as JSON, with the peak's error against `prediction`.
fn measured_json(prediction: &Prediction, m: &Measured) -> Value {
    json!({
        "device": m.device,
        "peak_allocated_bytes": m.peak_allocated_bytes,
        "host_state_bytes": m.host_state_bytes,
        "step_ms": m.step_ms,
        "peak_error": error(prediction.gpu_peak as f64, m.peak_allocated_bytes as f64),
    })
}

/// Writes `document` to `path`, pretty, and says so.
fn write_json(path: &std::path::Path, document: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(document)? + "\n";
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("plan: wrote {}", path.display());
    Ok(())
}

/// Runs `plan`: every recipe's best candidate, the fastest that fits, and with `--run` its
/// measurement.
pub(crate) fn run(args: Args) -> Result<()> {
    if args.find_max_model {
        return find_max_model(&args);
    }
    let Some(mut config) = LlamaConfig::named(&args.model) else {
        bail!(
            "--model {}: not a Llama-shaped model ({}, llama-tiny)",
            args.model,
            STANDARD_SHAPES.join(", ")
        );
    };
    if let Some(layers) = args.layers {
        if layers == 0 {
            bail!("--layers 0: a model needs at least one layer");
        }
        config.num_hidden_layers = layers;
    }
    if args.seq > config.max_position_embeddings {
        bail!(
            "--seq {}: {} takes at most {} tokens a row",
            args.seq,
            args.model,
            config.max_position_embeddings
        );
    }
    if let Some(path) = &args.json {
        crate::output_paths::check_file("--json", path)?;
    }
    let caps = Caps::of(&args)?;
    let layers = config.num_hidden_layers;
    println!(
        "{}, {} rows of {} tokens, bf16 weights without a master copy, AdamW; GPU cap {} MiB, \
         host cap {} MiB",
        args.model, args.batch, args.seq, args.memory_cap_mb, args.host_cap_mb
    );
    println!(
        "\n{:<44} {:>16} {:>16} {:>10} {:>9}  fits",
        "recipe (fewest recomputed that fit)", "GPU peak (B)", "host (B)", "step (ms)", "tokens/s"
    );
    for (plan, prediction, fits) in candidates(&config, args.seq, args.batch, caps) {
        println!(
            "{:<44} {:>16} {:>16} {:>10.1} {:>9.0}  {}",
            describe(plan, layers),
            prediction.gpu_peak,
            prediction.host_bytes,
            prediction.step_ms,
            tokens_per_second(args.seq, args.batch, prediction.step_ms),
            if fits { "yes" } else { "no" }
        );
    }
    let Some((plan, prediction)) = choose(&config, args.seq, args.batch, caps) else {
        bail!(
            "no recipe fits {} MiB at batch {}: lower --batch or --seq, or raise --memory-cap-mb",
            args.memory_cap_mb,
            args.batch
        );
    };
    let terms: Vec<String> = prediction
        .terms
        .iter()
        .map(|(name, bytes)| format!("{name} {bytes}"))
        .collect();
    println!(
        "\nplan: {} — predicted GPU peak {} B at {} ({}), step {:.1} ms on the H200.",
        describe(plan, layers),
        prediction.gpu_peak,
        prediction.phase,
        terms.join(", "),
        prediction.step_ms
    );
    let measured = if args.run {
        let words = bench_memory_words(&args, &args.model, args.layers, plan);
        println!("measuring: cargo xtask {}\n", words.join(" "));
        let measured = measure(words, plan)?;
        let peak_error = error(
            prediction.gpu_peak as f64,
            measured.peak_allocated_bytes as f64,
        );
        println!(
            "\nmeasured on {}: GPU peak {} B (predicted {:+.2}%: {}), step {:.1} ms ({:.0} \
             tokens/s; predicted for the H200 {:.1} ms, {:+.1}%)",
            measured.device,
            measured.peak_allocated_bytes,
            100.0 * peak_error,
            if peak_error.abs() <= PEAK_BOUND {
                "within 2%"
            } else {
                "off by more than 2%"
            },
            measured.step_ms,
            tokens_per_second(args.seq, args.batch, measured.step_ms),
            prediction.step_ms,
            100.0 * error(prediction.step_ms, measured.step_ms)
        );
        Some(measured)
    } else {
        println!(
            "measure it: cargo xtask plan --model {} --seq {} --batch {} --memory-cap-mb {} \
             --host-cap-mb {} --run",
            args.model, args.seq, args.batch, args.memory_cap_mb, args.host_cap_mb
        );
        None
    };
    if let Some(path) = &args.json {
        let mut document = json!({
            "model": args.model,
            "layers": layers,
            "seq": args.seq,
            "batch": args.batch,
            "memory_cap_mb": args.memory_cap_mb,
            "host_cap_mb": args.host_cap_mb,
            "plan": plan_json(plan, layers),
            "predicted": prediction_json(&prediction),
        });
        if let Some(m) = &measured {
            document["measured"] = measured_json(&prediction, m);
        }
        write_json(path, &document)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
