//! CUDA graphs on a real device: training steps replayed from a captured graph equal the eager
//! steps bit for bit (a ViT and a GPT-2, fused AdamW stepping outside the graph or inside it, a
//! new batch copied in before every step), a learning rate changed after the capture captures the
//! step again, the graph's private pool survives `empty_cache` and is returned when the graph
//! goes, a change of input shapes drops the graph and captures anew, and every host dependency
//! inside a step (a read, a write from host memory, a foreach optimizer's per-step table,
//! dropout's host seed) refuses the capture with its reason while the step still runs eagerly
//! with the eager results. Each test is marked `#[ignore = "needs a CUDA device"]`: it
//! runs with `--include-ignored`, and fails without a device where `HEADROOM_REQUIRE_GPU=1` is
//! set (testkit's GPU gate).
#![cfg(feature = "cuda")]

use std::sync::{Arc, MutexGuard};

use headroom_autograd_core::{BackendRef, DType, Generator, Result, Tensor, TensorError};
use headroom_nn::{Gpt2Config, Gpt2LMHeadModel, Module, VisionTransformer, VitConfig};
use headroom_ops_cuda::{CaptureError, CudaBackend, CudaGraph, GraphedStep, StepRun};
use headroom_optim::{Adam, AdamConfig, Implementation, Optimizer, ParamGroup};
use headroom_testkit::gpu::{cuda_or_skip, exclusive_device};
use headroom_testkit::inputs::uniform_f32;

const STEPS: usize = 20;
const WARMUP: usize = 3;

fn backend_or_skip() -> Option<(MutexGuard<'static, ()>, Arc<CudaBackend>)> {
    let device = exclusive_device();
    Some((device, cuda_or_skip(CudaBackend::new(0))?))
}

/// An nn result as the core's (the steps here return the core's error type).
fn nn<T>(result: headroom_nn::Result<T>) -> Result<T> {
    result.map_err(|e| TensorError::Device {
        op: "nn",
        reason: e.to_string(),
    })
}

fn clear_grads(params: &[Tensor]) -> Result<()> {
    params.iter().try_for_each(|p| p.set_grad(None))
}

/// What a training run left: every parameter's values, every step's loss, how each step ran,
/// the graphed loop's last fallback reason and Adam's step count.
struct Run {
    params: Vec<Vec<f32>>,
    losses: Vec<f32>,
    runs: Vec<StepRun>,
    reason: Option<String>,
    adam_steps: u64,
}

/// How [`train`] runs its steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Eager,
    /// Forward and backward through a [`GraphedStep`], fused AdamW stepping after it.
    Graphed,
    /// The whole step, fused AdamW inside, through a [`GraphedStep`].
    Whole,
}

/// `STEPS` steps of `loss_of(model input)` with fused AdamW, run as `mode` says; step `i` first
/// copies batch `batch(i)` into the input tensor; with `lr_change`, the learning rate becomes
/// 3e-3 before that step.
fn train(
    cuda: &Arc<CudaBackend>,
    params: Vec<Tensor>,
    input: &Tensor,
    batch: &dyn Fn(usize) -> Result<Tensor>,
    (mode, lr_change): (Mode, Option<usize>),
    loss_of: &dyn Fn(&Tensor) -> Result<Tensor>,
) -> Run {
    let mut adam = Adam::new(
        vec![ParamGroup::new(params.clone(), AdamConfig::adamw())],
        Implementation::Fused,
    )
    .expect("optimizer");
    let mut graph = GraphedStep::new(cuda, WARMUP);
    let (mut losses, mut runs) = (Vec::new(), Vec::new());
    let mut loss: Option<Tensor> = None;
    for step in 0..STEPS {
        input.copy_(&batch(step).expect("batch")).expect("copy in");
        if lr_change == Some(step) {
            adam.set_lr(0, 3e-3);
        }
        let mut body = || -> Result<()> {
            clear_grads(&params)?;
            let value = loss_of(input)?;
            value.backward()?;
            loss = Some(value);
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
        runs.push(run);
        if mode != Mode::Whole {
            adam.step().expect("adam");
        }
        let value = loss
            .as_ref()
            .expect("a loss")
            .to_vec::<f32>()
            .expect("loss");
        losses.push(value[0]);
    }
    let params = params
        .iter()
        .map(|p| p.to_vec::<f32>().expect("parameter"))
        .collect();
    Run {
        params,
        losses,
        runs,
        reason: graph.eager_reason().map(str::to_owned),
        adam_steps: adam.param_step(0, 0).expect("step count"),
    }
}

fn expected_runs() -> Vec<StepRun> {
    let mut runs = vec![StepRun::Eager; WARMUP];
    runs.push(StepRun::Captured);
    runs.resize(STEPS, StepRun::Replayed);
    runs
}

/// A tiny ViT's `train`, its loss `sum(forward(x))`; with `reads_loss`, the step also reads the
/// loss back on the host (a logging `item()`), which no graph can replay.
fn vit_run(cuda: &Arc<CudaBackend>, mode: (Mode, Option<usize>), reads_loss: bool) -> Run {
    let gpu: BackendRef = cuda.clone();
    let generator = Arc::new(Generator::new(0));
    let model =
        VisionTransformer::new(&gpu, VitConfig::tiny(), DType::F32, &generator).expect("model");
    let shape = [2, 3, 32, 32];
    let input = Tensor::zeros(&gpu, &shape, DType::F32).expect("input");
    let batch =
        |step: usize| Tensor::from_slice(&gpu, &uniform_f32(2 * 3 * 32 * 32, step as u64), &shape);
    let loss = |x: &Tensor| {
        let value = nn(model.forward(x))?.sum_all()?;
        if reads_loss {
            value.to_vec::<f32>()?;
        }
        Ok(value)
    };
    train(cuda, model.parameters(), &input, &batch, mode, &loss)
}

#[test]
#[ignore = "needs a CUDA device"]
fn vit_steps_replayed_from_a_graph_equal_the_eager_steps_bitwise() {
    let Some((_device, cuda)) = backend_or_skip() else {
        return;
    };
    let eager = vit_run(&cuda, (Mode::Eager, None), false);
    let graphed = vit_run(&cuda, (Mode::Graphed, None), false);
    assert_eq!(graphed.runs, expected_runs(), "{:?}", graphed.reason);
    assert_eq!(graphed.losses, eager.losses);
    assert!(
        graphed.params == eager.params,
        "parameters differ after {STEPS} steps"
    );
    // The losses moved: the replays trained on the new batches.
    assert_ne!(graphed.losses[STEPS - 1], graphed.losses[WARMUP + 1]);
}

/// The whole step captured, fused AdamW inside the graph: each replay steps Adam at its own
/// step number (the kernel adds the replay's index to the captured step), so the replays equal
/// the eager steps bit for bit and Adam counts every replayed step.
#[test]
#[ignore = "needs a CUDA device"]
fn whole_steps_with_fused_adamw_replayed_from_a_graph_equal_the_eager_steps_bitwise() {
    let Some((_device, cuda)) = backend_or_skip() else {
        return;
    };
    let eager = vit_run(&cuda, (Mode::Eager, None), false);
    let whole = vit_run(&cuda, (Mode::Whole, None), false);
    assert_eq!(whole.runs, expected_runs(), "{:?}", whole.reason);
    assert_eq!(whole.losses, eager.losses);
    assert!(
        whole.params == eager.params,
        "parameters differ after {STEPS} steps"
    );
    assert_eq!(eager.adam_steps, STEPS as u64);
    assert_eq!(whole.adam_steps, STEPS as u64);
}

/// A new learning rate after the capture marks the graph stale: the step warms up and is
/// captured again with the new rate, never replayed with the old one, and the results equal the
/// eager run's with the same change.
#[test]
#[ignore = "needs a CUDA device"]
fn a_learning_rate_changed_after_the_capture_captures_the_step_again() {
    let Some((_device, cuda)) = backend_or_skip() else {
        return;
    };
    const CHANGE: usize = 9;
    let eager = vit_run(&cuda, (Mode::Eager, Some(CHANGE)), false);
    let whole = vit_run(&cuda, (Mode::Whole, Some(CHANGE)), false);
    let mut expected = expected_runs()[..CHANGE].to_vec();
    expected.extend([StepRun::Eager; WARMUP]);
    expected.push(StepRun::Captured);
    expected.resize(STEPS, StepRun::Replayed);
    assert_eq!(whole.runs, expected, "{:?}", whole.reason);
    assert_eq!(whole.losses, eager.losses);
    assert!(
        whole.params == eager.params,
        "parameters differ after {STEPS} steps"
    );
    assert_eq!(whole.adam_steps, STEPS as u64);
}

#[test]
#[ignore = "needs a CUDA device"]
fn gpt2_steps_replayed_from_a_graph_equal_the_eager_steps_bitwise() {
    let Some((_device, cuda)) = backend_or_skip() else {
        return;
    };
    let run = |mode: Mode| {
        let gpu: BackendRef = cuda.clone();
        let generator = Arc::new(Generator::new(1));
        let config = Gpt2Config {
            n_layer: 2,
            ..Gpt2Config::tiny().without_dropout()
        };
        let model = Gpt2LMHeadModel::new(&gpu, config, DType::F32, &generator).expect("model");
        // One row of distinct ids: no two threads of an embedding's backward add into the
        // same row, whose float sums would then depend on the order of their atomics (in the
        // eager loop as much as in the replays).
        let shape = [1, 32];
        let input = Tensor::zeros(&gpu, &shape, DType::I64).expect("input");
        let batch = |step: usize| {
            let ids: Vec<i64> = (0..32)
                .map(|i| ((step * 5 + i * 37) % 128) as i64)
                .collect();
            Tensor::from_slice(&gpu, &ids, &shape)
        };
        let loss =
            |ids: &Tensor| -> Result<Tensor> { nn(model.loss(&nn(model.forward(ids))?, ids)) };
        train(
            &cuda,
            model.parameters(),
            &input,
            &batch,
            (mode, None),
            &loss,
        )
    };
    let eager = run(Mode::Eager);
    let graphed = run(Mode::Graphed);
    assert_eq!(graphed.runs, expected_runs(), "{:?}", graphed.reason);
    assert_eq!(graphed.losses, eager.losses);
    assert!(
        graphed.params == eager.params,
        "parameters differ after {STEPS} steps"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_step_that_reads_the_host_runs_eagerly_with_the_reason_and_the_eager_results() {
    let Some((_device, cuda)) = backend_or_skip() else {
        return;
    };
    let eager = vit_run(&cuda, (Mode::Eager, None), false);
    let graphed = vit_run(&cuda, (Mode::Graphed, None), true);
    assert_eq!(graphed.runs, vec![StepRun::Eager; STEPS]);
    let reason = graphed.reason.expect("a reason");
    assert!(reason.contains("read_host"), "{reason}");
    assert_eq!(graphed.losses, eager.losses);
    assert!(
        graphed.params == eager.params,
        "the eager fallback changed the results"
    );
}

/// The reason of a refused capture.
#[track_caller]
fn refusal<T>(result: std::result::Result<(CudaGraph, T), CaptureError>) -> String {
    match result {
        Err(CaptureError::NotCapturable { reason }) => reason,
        Err(other) => panic!("expected a refusal, got {other}"),
        Ok(_) => panic!("expected a refusal, got a graph"),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn host_dependencies_refuse_the_capture_and_leave_the_backend_usable() {
    let Some((_device, cuda)) = backend_or_skip() else {
        return;
    };
    let gpu: BackendRef = cuda.clone();
    let x = Tensor::full(&gpu, &[64], 1.5, DType::F32).expect("x");
    let read = refusal(cuda.capture(|| x.mul(&x)?.to_vec::<f32>()));
    assert!(read.contains("read_host"), "{read}");
    let write = refusal(cuda.capture(|| Tensor::from_slice(&gpu, &[1.0f32, 2.0], &[2])));
    assert!(write.contains("write_host"), "{write}");
    let sync = refusal(cuda.capture(|| cuda.synchronize()));
    assert!(sync.contains("synchronize"), "{sync}");
    // Dropout's seed comes from the host.
    let generator = Arc::new(Generator::new(3));
    let dropout = headroom_nn::Dropout::new(0.5, generator);
    let drop = refusal(cuda.capture(|| nn(dropout.forward(&x))));
    assert!(drop.contains("dropout"), "{drop}");
    // A foreach optimizer's per-step tables are host data: step it outside the graph (fused
    // Adam reads its step from the replay instead).
    let p = Tensor::full(&gpu, &[64], 1.0, DType::F32).expect("p");
    p.requires_grad_(true).expect("a leaf");
    p.set_grad(Some(x.clone())).expect("grad");
    let mut adam = Adam::new(
        vec![ParamGroup::new(vec![p.clone()], AdamConfig::adamw())],
        Implementation::FOREACH,
    )
    .expect("optimizer");
    adam.step().expect("an eager step first");
    let table = refusal(cuda.capture(|| {
        adam.step().map_err(|e| TensorError::Device {
            op: "adam",
            reason: e.to_string(),
        })
    }));
    assert!(table.contains("step number"), "{table}");
    // Nothing of the refused captures ran, and the backend still computes.
    let y = x.add(&x).expect("add").to_vec::<f32>().expect("read");
    assert_eq!(y, vec![3.0f32; 64]);
    // A step that queues nothing is no graph either.
    let empty = refusal(cuda.capture(|| Ok(())));
    assert!(empty.contains("no work"), "{empty}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_private_pool_outlives_empty_cache_until_the_graph_goes() {
    let Some((_device, cuda)) = backend_or_skip() else {
        return;
    };
    let gpu: BackendRef = cuda.clone();
    let x = Tensor::full(&gpu, &[1 << 20], 2.0, DType::F32).expect("x");
    let (graph, y) = cuda
        .capture(|| {
            let t = x.mul(&x)?;
            t.add(&x)
        })
        .expect("a capture");
    let usage = cuda
        .allocator()
        .private_pool_usage(graph.pool())
        .expect("a live pool");
    // `y` (4 MiB) is held; the temporary `t` was freed inside the pool.
    assert_eq!(usage.allocated_bytes, 4 << 20);
    assert!(usage.reserved_bytes >= 8 << 20, "{usage:?}");
    cuda.allocator().empty_cache().expect("empty_cache");
    let after = cuda
        .allocator()
        .private_pool_usage(graph.pool())
        .expect("live");
    assert_eq!(after.reserved_bytes, usage.reserved_bytes);
    // Captured work did not run; a replay runs it.
    graph.replay().expect("replay");
    assert_eq!(y.to_vec::<f32>().expect("y"), vec![6.0f32; 1 << 20]);
    x.fill_(3.0).expect("fill");
    graph.replay().expect("replay");
    assert_eq!(y.to_vec::<f32>().expect("y"), vec![12.0f32; 1 << 20]);
    let pool = graph.pool();
    drop(graph);
    drop(y);
    assert!(cuda
        .allocator()
        .private_pool_usage(pool)
        .is_none_or(|u| u.allocated_bytes == 0));
    assert_eq!(cuda.free_errors().0, 0);
}

#[test]
#[ignore = "needs a CUDA device"]
fn new_input_shapes_drop_the_graph_and_capture_again() {
    let Some((_device, cuda)) = backend_or_skip() else {
        return;
    };
    let gpu: BackendRef = cuda.clone();
    let w = Tensor::full(&gpu, &[8, 8], 0.5, DType::F32).expect("w");
    w.requires_grad_(true).expect("a leaf");
    let mut step = GraphedStep::new(&cuda, 1);
    let small = Tensor::full(&gpu, &[4, 8], 1.0, DType::F32).expect("small");
    let large = Tensor::full(&gpu, &[16, 8], 1.0, DType::F32).expect("large");
    let mut runs = Vec::new();
    for input in [&small, &small, &small, &large, &large, &large] {
        let mut body = || -> Result<()> {
            w.set_grad(None)?;
            input.matmul(&w)?.sum_all()?.backward()
        };
        runs.push(step.run(&[input], &mut body).expect("step"));
        let grad = w.grad().expect("a gradient").to_vec::<f32>().expect("grad");
        // d/dw of sum(x w) is the column sums of x: the input's rows of ones.
        assert_eq!(grad, vec![input.shape()[0] as f32; 64]);
        if runs.len() == 4 {
            let reason = step.eager_reason().expect("a reason");
            assert!(reason.contains("inputs changed"), "{reason}");
        }
    }
    use StepRun::*;
    assert_eq!(
        runs,
        vec![Eager, Captured, Replayed, Eager, Captured, Replayed]
    );
}
