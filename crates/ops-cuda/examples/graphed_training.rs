//! A training loop through CUDA graphs: a small ViT trained with fused AdamW, its whole step
//! (clear the gradients, forward, loss, backward, AdamW's step) run by a [`GraphedStep`]: three
//! eager warm-ups, one capture, then replays, each step's batch copied into the tensor the graph
//! reads; every replay steps AdamW at its own step number, read from the replay. Then the same
//! step with a logging `item()` inside, which a graph cannot replay: it runs eagerly, and the
//! reason says why.
//!
//! `cargo run --release -p headroom-ops-cuda --features cuda --example graphed_training`
//!
//! Without a CUDA device it prints a skip notice.

use std::sync::Arc;

use headroom_autograd_core::{BackendRef, DType, Generator, Result, Tensor, TensorError};
use headroom_nn::{Module, VisionTransformer, VitConfig};
use headroom_ops_cuda::{CudaBackend, GraphedStep};
use headroom_optim::{Adam, AdamConfig, Implementation, Optimizer, ParamGroup};
use headroom_testkit::gpu::cuda_or_skip;

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    if std::env::args().any(|a| a == "--help" || a == "-h") {
        println!("graphed_training: trains a small ViT through CUDA graphs (no arguments)");
        return Ok(());
    }
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return Ok(());
    };
    let gpu: BackendRef = cuda.clone();
    let model = VisionTransformer::new(
        &gpu,
        VitConfig::tiny(),
        DType::F32,
        &Arc::new(Generator::new(0)),
    )?;
    let params = model.parameters();
    let mut adam = Adam::new(
        vec![ParamGroup::new(params.clone(), AdamConfig::adamw())],
        Implementation::Fused,
    )?;
    let shape = [8, 3, 32, 32];
    let input = Tensor::zeros(&gpu, &shape, DType::F32)?;
    let forward = |x: &Tensor| -> Result<Tensor> {
        let logits = model.forward(x).map_err(|e| TensorError::Device {
            op: "vit",
            reason: e.to_string(),
        })?;
        logits.mul(&logits)?.mean_all()
    };
    for (label, logs_inside) in [("plain step", false), ("step with item()", true)] {
        let mut graph = GraphedStep::new(&cuda, 3);
        let mut loss = None;
        for step in 0..8 {
            let batch: Vec<f32> = (0..8 * 3 * 32 * 32)
                .map(|i| ((i * 31 + step * 17) % 97) as f32 / 97.0)
                .collect();
            input.copy_(&Tensor::from_slice(&gpu, &batch, &shape)?)?;
            let mut body = || -> Result<()> {
                params.iter().try_for_each(|p| p.set_grad(None))?;
                let value = forward(&input)?;
                if logs_inside {
                    value.to_vec::<f32>()?;
                }
                value.backward()?;
                loss = Some(value);
                adam.step().map_err(|e| TensorError::Device {
                    op: "adam",
                    reason: e.to_string(),
                })
            };
            let run = graph.run(&[&input], &mut body)?;
            let value = loss.as_ref().expect("set by the step").to_vec::<f32>()?[0];
            println!("{label}: step {step} {run:?}, loss {value:.6e}");
        }
        println!("{label}: AdamW counts {} steps", adam.param_step(0, 0)?);
        if let Some(reason) = graph.eager_reason() {
            println!("{label}: ran eagerly because {reason}");
        }
        if let Some(graph) = graph.graph() {
            let usage = cuda.allocator().private_pool_usage(graph.pool());
            println!("{label}: the graph's private pool: {usage:?}");
        }
    }
    Ok(())
}
