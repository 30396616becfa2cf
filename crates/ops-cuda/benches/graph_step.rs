//! Training steps at batch 1, eager against replayed from a CUDA graph ([`GraphedStep`]), in one
//! process: ViT-L/16 (224², f32) and GPT-2 small (1 × 1024 tokens, f32, dropout off), each step
//! a new batch copied into the input, forward, loss, backward and fused AdamW. Three loops: eager;
//! the whole step captured, AdamW inside the graph (PyTorch's whole-network capture, the `graph`
//! fields); forward and backward captured, AdamW stepping after the replay (the `outside`
//! fields). All start from the same weights and see the same batches; after `STEPS` steps their
//! parameters are compared bit for bit with the eager loop's. Prints one JSON line per model: the
//! median step time of the steps after capture (wall, synchronised every step) and the host's
//! time to enqueue a step, for each loop, the graph's ratio to eager and whether the parameters
//! are equal. Prints a skip notice without a CUDA device. `graph_step vit|gpt2` runs one model.

use std::sync::Arc;
use std::time::Instant;

use headroom_autograd_core::{BackendRef, DType, Generator, Tensor, TensorError};
use headroom_nn::{Gpt2Config, Gpt2LMHeadModel, Module, VisionTransformer, VitConfig};
use headroom_ops_cuda::{CudaBackend, GraphedStep, StepRun};
use headroom_optim::{Adam, AdamConfig, Implementation, Optimizer, ParamGroup};
use headroom_testkit::gpu::cuda_or_skip;
use headroom_testkit::inputs::uniform_f32;

/// Steps per loop: 3 warm-ups, the capture, then replays.
const STEPS: usize = 20;
const WARMUP: usize = 3;

type Loss<'a> = Box<dyn Fn(&Tensor) -> headroom_autograd_core::Result<Tensor> + 'a>;

/// One loop's outcome: median wall and host ms of the steps after the capture, the final
/// parameters, peak allocated bytes and how the steps ran.
struct Loop {
    wall_ms: f64,
    host_ms: f64,
    params: Vec<Vec<u8>>,
    peak_allocated: u64,
    runs: Vec<StepRun>,
    reason: Option<String>,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    (values[(n - 1) / 2] + values[n / 2]) / 2.0
}

fn nn_error(e: headroom_nn::NnError) -> TensorError {
    TensorError::Device {
        op: "model",
        reason: e.to_string(),
    }
}

fn run_loop(
    cuda: &Arc<CudaBackend>,
    params: Vec<Tensor>,
    input: &Tensor,
    batches: &[Tensor],
    loss_of: &Loss<'_>,
    mode: Mode,
) -> Loop {
    let mut adam = Adam::new(
        vec![ParamGroup::new(params.clone(), AdamConfig::adamw())],
        Implementation::Fused,
    )
    .expect("optimizer");
    let mut graph = GraphedStep::new(cuda, WARMUP);
    let (mut walls, mut hosts, mut runs) = (Vec::new(), Vec::new(), Vec::new());
    cuda.synchronize().expect("device");
    cuda.allocator().reset_peak_stats();
    for step in 0..STEPS {
        let start = Instant::now();
        input
            .copy_(&batches[step % batches.len()])
            .expect("copy in");
        let mut body = || {
            for p in &params {
                p.set_grad(None)?;
            }
            loss_of(input)?.backward()?;
            if mode == Mode::Whole {
                adam.step().map_err(|e| TensorError::Device {
                    op: "adam",
                    reason: e.to_string(),
                })?;
            }
            Ok(())
        };
        let run = match mode {
            Mode::Eager => body().map(|()| StepRun::Eager).expect("eager step"),
            _ => graph.run(&[input], &mut body).expect("graphed step"),
        };
        if mode != Mode::Whole {
            adam.step().expect("adam");
        }
        let host = start.elapsed().as_secs_f64() * 1e3;
        cuda.synchronize().expect("device");
        if step > WARMUP {
            walls.push(start.elapsed().as_secs_f64() * 1e3);
            hosts.push(host);
        }
        runs.push(run);
    }
    let peak_allocated = cuda.allocator().memory_stats().allocated_bytes.all.peak as u64;
    let params = params
        .iter()
        .map(|p| p.to_vec::<f32>().expect("parameter"))
        .map(|v| bytemuck_bytes(&v))
        .collect();
    Loop {
        wall_ms: median(walls),
        host_ms: median(hosts),
        params,
        peak_allocated,
        runs,
        reason: graph.eager_reason().map(str::to_owned),
    }
}

fn bytemuck_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .collect()
}

/// How a loop runs its steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Eager,
    /// Forward and backward replayed, AdamW stepping after the replay.
    Outside,
    /// The whole step replayed, AdamW inside the graph.
    Whole,
}

/// Builds the model (same seed every call), its input and batches, and runs one loop.
fn measure(cuda: &Arc<CudaBackend>, model: &str, mode: Mode) -> Loop {
    let gpu: BackendRef = cuda.clone();
    let generator = Arc::new(Generator::new(0));
    match model {
        "vit" => {
            let vit = VisionTransformer::new(&gpu, VitConfig::vit_l_16(), DType::F32, &generator)
                .expect("model");
            let shape = [1, 3, 224, 224];
            let batches: Vec<Tensor> = (0..2)
                .map(|seed| {
                    Tensor::from_slice(&gpu, &uniform_f32(3 * 224 * 224, seed), &shape)
                        .expect("batch")
                })
                .collect();
            let input = Tensor::zeros(&gpu, &shape, DType::F32).expect("input");
            let loss: Loss<'_> = Box::new(|x| vit.forward(x).map_err(nn_error)?.sum_all());
            run_loop(cuda, vit.parameters(), &input, &batches, &loss, mode)
        }
        _ => {
            let config = Gpt2Config::gpt2().without_dropout();
            let vocab = config.vocab_size;
            let gpt2 = Gpt2LMHeadModel::new(&gpu, config, DType::F32, &generator).expect("model");
            let shape = [1, 1024];
            let batches: Vec<Tensor> = (0..2u64)
                .map(|seed| {
                    let ids: Vec<i64> = (0..1024u64)
                        .map(|i| ((i * 7919 + seed * 104_729) % vocab as u64) as i64)
                        .collect();
                    Tensor::from_slice(&gpu, &ids, &shape).expect("batch")
                })
                .collect();
            let input = Tensor::zeros(&gpu, &shape, DType::I64).expect("input");
            let loss: Loss<'_> = Box::new(|ids| {
                let logits = gpt2.forward(ids).map_err(nn_error)?;
                gpt2.loss(&logits, ids).map_err(nn_error)
            });
            run_loop(cuda, gpt2.parameters(), &input, &batches, &loss, mode)
        }
    }
}

fn main() {
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let only: Option<String> = std::env::args().nth(1).filter(|a| !a.starts_with('-'));
    for (model, case) in [
        ("vit", "vit_l16_b1_adamw"),
        ("gpt2", "gpt2_small_b1x1024_adamw"),
    ] {
        if only.as_deref().is_some_and(|o| o != model) {
            continue;
        }
        let run = |mode| {
            let measured = measure(&cuda, model, mode);
            cuda.allocator().empty_cache().expect("empty_cache");
            measured
        };
        let (eager, graphed, outside) = (run(Mode::Eager), run(Mode::Whole), run(Mode::Outside));
        let replayed = |l: &Loop| l.runs.iter().filter(|r| **r == StepRun::Replayed).count();
        println!(
            "{{\"case\": \"{case}\", \"dtype\": \"F32\", \"steps\": {STEPS}, \"eager_step_ms\": {:.3}, \"eager_host_ms\": {:.3}, \"graph_step_ms\": {:.3}, \"graph_host_ms\": {:.3}, \"ratio\": {:.4}, \"replayed_steps\": {}, \"fallback\": {:?}, \"params_bitwise_equal\": {}, \"eager_peak_allocated_bytes\": {}, \"graph_peak_allocated_bytes\": {}, \"outside_step_ms\": {:.3}, \"outside_host_ms\": {:.3}, \"outside_replayed_steps\": {}, \"outside_fallback\": {:?}, \"outside_params_bitwise_equal\": {}}}",
            eager.wall_ms,
            eager.host_ms,
            graphed.wall_ms,
            graphed.host_ms,
            graphed.wall_ms / eager.wall_ms,
            replayed(&graphed),
            graphed.reason.clone().unwrap_or_default(),
            graphed.params == eager.params,
            eager.peak_allocated,
            graphed.peak_allocated,
            outside.wall_ms,
            outside.host_ms,
            replayed(&outside),
            outside.reason.clone().unwrap_or_default(),
            outside.params == eager.params,
        );
    }
}
