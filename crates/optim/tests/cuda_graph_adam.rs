//! Fused Adam captured into a CUDA graph alone: each replay steps at its own step number (the
//! kernel adds the replay's index to the captured step), so replays equal eager steps bit for
//! bit, and the optimizer's step count follows the replays; a step outside the graph, or a newer
//! capture, makes the graph stale instead of letting it replay step numbers taken since. Each
//! test is marked
//! `#[ignore = "needs a CUDA device"]`.
#![cfg(feature = "cuda")]

use headroom_autograd_core::{BackendRef, Tensor};
use headroom_ops_cuda::CudaBackend;
use headroom_optim::{Adam, AdamConfig, Implementation, Optimizer, ParamGroup};
use headroom_testkit::gpu::{cuda_or_skip, exclusive_device};

#[test]
#[ignore = "needs a CUDA device"]
fn replays_of_a_captured_fused_adam_step_equal_eager_steps_bitwise() {
    let _device = exclusive_device();
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let gpu: BackendRef = cuda.clone();
    let make = || {
        let values: Vec<f32> = (0..4099).map(|i| (i as f32 * 0.37).sin()).collect();
        let grads: Vec<f32> = (0..4099).map(|i| (i as f32 * 0.11).cos()).collect();
        let p = Tensor::from_slice(&gpu, &values, &[4099]).unwrap();
        p.requires_grad_(true).unwrap();
        p.set_grad(Some(Tensor::from_slice(&gpu, &grads, &[4099]).unwrap()))
            .unwrap();
        let adam = Adam::new(
            vec![ParamGroup::new(vec![p.clone()], AdamConfig::adamw())],
            Implementation::Fused,
        )
        .unwrap();
        (p, adam)
    };
    let (eager_p, mut eager) = make();
    let (graph_p, mut graphed) = make();
    let mut eager_values = Vec::new();
    for _ in 0..6 {
        eager.step().unwrap();
        eager_values.push(eager_p.to_vec::<f32>().unwrap());
    }
    graphed.step().unwrap();
    graphed.step().unwrap();
    let (graph, ()) = cuda
        .capture(|| {
            graphed
                .step()
                .map_err(|e| headroom_autograd_core::TensorError::Device {
                    op: "adam",
                    reason: e.to_string(),
                })
        })
        .unwrap();
    assert_eq!(
        graph_p.to_vec::<f32>().unwrap(),
        eager_values[1],
        "the capture ran nothing"
    );
    assert_eq!(
        graphed.param_step(0, 0).unwrap(),
        2,
        "the captured step has not run"
    );
    for (k, expected) in eager_values[2..].iter().enumerate() {
        graph.replay().unwrap();
        assert_eq!(&graph_p.to_vec::<f32>().unwrap(), expected, "replay {k}");
        assert_eq!(graphed.param_step(0, 0).unwrap(), 3 + k as u64);
    }
    // A new learning rate makes the graph stale: it refuses to replay.
    graphed.set_lr(0, 1e-2);
    let stale = graph.replay().unwrap_err().to_string();
    assert!(stale.contains("hyperparameters changed"), "{stale}");
    drop(graph);
    // Eager steps go on from the replayed count.
    graphed.set_lr(0, AdamConfig::adamw().lr);
    graphed.step().unwrap();
    eager.step().unwrap();
    assert_eq!(
        graph_p.to_vec::<f32>().unwrap(),
        eager_p.to_vec::<f32>().unwrap()
    );
    assert_eq!(graphed.param_step(0, 0).unwrap(), 7);
}

/// A graph whose captured step the optimizer has moved past (an eager step, or a newer graph
/// capturing the step) refuses to replay, naming why, rather than replaying old step numbers.
#[test]
#[ignore = "needs a CUDA device"]
fn an_eager_step_or_a_newer_capture_makes_a_captured_step_stale() {
    let _device = exclusive_device();
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let gpu: BackendRef = cuda.clone();
    let p = Tensor::from_slice(&gpu, &[0.5f32; 1024], &[1024]).unwrap();
    p.requires_grad_(true).unwrap();
    p.set_grad(Some(
        Tensor::from_slice(&gpu, &[0.25f32; 1024], &[1024]).unwrap(),
    ))
    .unwrap();
    let mut adam = Adam::new(
        vec![ParamGroup::new(vec![p.clone()], AdamConfig::adamw())],
        Implementation::Fused,
    )
    .unwrap();
    adam.step().unwrap();
    let step = |adam: &mut Adam| {
        adam.step()
            .map_err(|e| headroom_autograd_core::TensorError::Device {
                op: "adam",
                reason: e.to_string(),
            })
    };
    let (first, ()) = cuda.capture(|| step(&mut adam)).unwrap();
    first.replay().unwrap();
    adam.step().unwrap();
    let stale = first.replay().unwrap_err().to_string();
    assert!(stale.contains("stepped outside the graph"), "{stale}");
    let (second, ()) = cuda.capture(|| step(&mut adam)).unwrap();
    second.replay().unwrap();
    let (third, ()) = cuda.capture(|| step(&mut adam)).unwrap();
    third.replay().unwrap();
    let newer = second.replay().unwrap_err().to_string();
    assert!(newer.contains("a newer graph"), "{newer}");
    third.replay().unwrap();
    // 1 eager, 1 replay of the first graph, 1 eager, 1 of the second, 2 of the third.
    assert_eq!(adam.param_step(0, 0).unwrap(), 6);
}
