//! ViT-L/16 (torchvision's configuration, fp32) forward + backward on the CUDA backend at batch 1
//! and 32: median step time of 6 after 3 warm-ups, and peak allocated bytes over the timed steps
//! — the setting of PyTorch's `sgd` anchor (whose step also includes a plain SGD update, about
//! 0.5 ms of memory traffic at this size). Prints one JSON line per batch, or a skip notice
//! without a CUDA device. `vit_step BATCH STEPS` runs one batch size with STEPS timed steps and
//! one warm-up (for profilers).

use std::sync::Arc;
use std::time::Instant;

use headroom_autograd_core::{BackendRef, DType, Generator, Tensor};
use headroom_nn::{Module, VisionTransformer, VitConfig};
use headroom_ops_cuda::CudaBackend;

fn main() {
    let cuda = match CudaBackend::new(0) {
        Ok(backend) => backend,
        Err(err) => {
            println!("skipped: {err}");
            return;
        }
    };
    let gpu: BackendRef = cuda.clone();
    let generator = Arc::new(Generator::new(0));
    let model =
        VisionTransformer::new(&gpu, VitConfig::vit_l_16(), DType::F32, &generator).expect("model");
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (batches, warmup, timed) = match args[..] {
        [batch, steps, ..] => (vec![batch], 1, steps.max(1)),
        _ => (vec![1, 32], 3, 6),
    };
    for batch in batches {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let pixels: Vec<f32> = (0..batch * 3 * 224 * 224)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32
            })
            .collect();
        let images = Tensor::from_slice(&gpu, &pixels, &[batch, 3, 224, 224]).expect("input");
        let step = || -> f64 {
            let start = Instant::now();
            let loss = model
                .forward(&images)
                .expect("forward")
                .sum_all()
                .expect("loss");
            loss.backward().expect("backward");
            cuda.synchronize().expect("device");
            let ms = start.elapsed().as_secs_f64() * 1e3;
            for (_, param) in model.named_parameters() {
                param.zero_grad(true).expect("zero_grad");
            }
            ms
        };
        for _ in 0..warmup {
            step();
        }
        cuda.allocator().reset_peak_stats();
        let mut times: Vec<f64> = (0..timed).map(|_| step()).collect();
        times.sort_by(f64::total_cmp);
        let ms = (times[(timed - 1) / 2] + times[timed / 2]) / 2.0;
        let stats = cuda.allocator().memory_stats();
        println!(
            "{{\"case\": \"vit_l16_fwd_bwd\", \"impl\": \"headroom_cuda\", \"batch\": {batch}, \"step_ms\": {ms:.1}, \"peak_allocated_bytes\": {}, \"peak_reserved_bytes\": {}, \"times_ms\": {times:?}}}",
            stats.allocated_bytes.all.peak, stats.reserved_bytes.all.peak
        );
    }
}
