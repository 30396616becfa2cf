//! ViT-L/16 (torchvision's configuration) training steps on the CUDA backend: forward, `sum()`
//! loss, backward, a plain SGD update (`p -= 1e-3 · g`: headroom-optim's fused SGD, one launch for
//! all parameters, in f32 or, for the bf16 model, on bf16 parameters with f32 arithmetic as
//! PyTorch's fused SGD does) and `zero_grad(set_to_none)` — the protocol of PyTorch's `sgd` anchor. Median step
//! time of 6 after 3 warm-ups (and the host's time to enqueue the step: when it nears the step
//! time, the host is the bottleneck), peak allocated bytes over the timed steps and the linear
//! layers that could not run through cuBLASLt since the start (`linear_fallbacks`), fp32 at
//! batch 1 and 32 and the whole model in bf16 at batch 32. Prints one JSON line per setting, or a
//! skip notice without a CUDA device. `vit_step BATCH STEPS [bf16]` runs one setting with STEPS timed steps
//! and one warm-up (for profilers).

use std::sync::Arc;
use std::time::Instant;

use headroom_autograd_core::{BackendRef, DType, Generator, Tensor};
use headroom_nn::{Module, VisionTransformer, VitConfig};
use headroom_ops_cuda::CudaBackend;
use headroom_optim::{Implementation, Optimizer, ParamGroup, Sgd, SgdConfig};
use headroom_testkit::gpu::cuda_or_skip;

fn main() {
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let gpu: BackendRef = cuda.clone();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let numbers: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let bf16 = args.iter().any(|a| a == "bf16");
    let (settings, warmup, timed) = match numbers[..] {
        [batch, steps, ..] => (
            vec![(if bf16 { DType::BF16 } else { DType::F32 }, batch)],
            1,
            steps.max(1),
        ),
        _ => (
            vec![(DType::F32, 1), (DType::F32, 32), (DType::BF16, 32)],
            3,
            6,
        ),
    };
    for (dtype, batch) in settings {
        let generator = Arc::new(Generator::new(0));
        let model =
            VisionTransformer::new(&gpu, VitConfig::vit_l_16(), dtype, &generator).expect("model");
        let params: Vec<Tensor> = model
            .named_parameters()
            .into_iter()
            .map(|(_, p)| p)
            .collect();
        let mut optimizer = Sgd::new(
            vec![ParamGroup::new(params, SgdConfig::new(1e-3))],
            Implementation::Fused,
        )
        .expect("optimizer");
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let pixels: Vec<f32> = (0..batch * 3 * 224 * 224)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32
            })
            .collect();
        let images = Tensor::from_slice(&gpu, &pixels, &[batch, 3, 224, 224])
            .and_then(|x| x.to_dtype(dtype))
            .expect("input");
        // (wall ms, host ms): the host's share is the time to enqueue the whole step; when it
        // is close to the wall time the step is bound by the host, not the GPU.
        let mut step = || -> (f64, f64) {
            let start = Instant::now();
            let loss = model
                .forward(&images)
                .expect("forward")
                .sum_all()
                .expect("loss");
            loss.backward().expect("backward");
            optimizer.step().expect("step");
            optimizer.zero_grad(true).expect("zero_grad");
            let host = start.elapsed().as_secs_f64() * 1e3;
            cuda.synchronize().expect("device");
            (start.elapsed().as_secs_f64() * 1e3, host)
        };
        for _ in 0..warmup {
            step();
        }
        cuda.allocator().reset_peak_stats();
        let (mut times, mut host): (Vec<f64>, Vec<f64>) = (0..timed).map(|_| step()).unzip();
        times.sort_by(f64::total_cmp);
        host.sort_by(f64::total_cmp);
        let ms = (times[(timed - 1) / 2] + times[timed / 2]) / 2.0;
        let host_ms = (host[(timed - 1) / 2] + host[timed / 2]) / 2.0;
        let stats = cuda.allocator().memory_stats();
        println!(
            "{{\"case\": \"vit_l16_sgd\", \"dtype\": \"{dtype:?}\", \"impl\": \"headroom_cuda\", \"batch\": {batch}, \"step_ms\": {ms:.1}, \"host_ms\": {host_ms:.1}, \"peak_allocated_bytes\": {}, \"peak_reserved_bytes\": {}, \"linear_fallbacks\": {}, \"times_ms\": {times:?}}}",
            stats.allocated_bytes.all.peak,
            stats.reserved_bytes.all.peak,
            cuda.linear_fallbacks()
        );
    }
}
