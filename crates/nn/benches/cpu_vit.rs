//! CPU speed of a real model: torchvision's ViT-B/16, batch 2 of 224×224 images, f32, one
//! forward and backward (loss = mean cross-entropy), on the CPU backend. The figure is reported
//! in the issue notes; it is never asserted.

use std::sync::Arc;

use criterion::Criterion;
use headroom_autograd_core::{cross_entropy, BackendRef, DType, Generator, Reduction, Tensor};
use headroom_nn::{Module, VisionTransformer, VitConfig};
use headroom_ops_cpu::CpuBackend;

fn vit_b_16_forward_backward(c: &mut Criterion) {
    let cpu: BackendRef = CpuBackend::new_ref();
    let generator = Arc::new(Generator::new(0));
    let model =
        VisionTransformer::new(&cpu, VitConfig::vit_b_16(), DType::F32, &generator).unwrap();
    // torchvision's figure for vit_b_16 (ViT_B_16_Weights.IMAGENET1K_V1.meta["num_params"]).
    assert_eq!(model.num_parameters(), 86_567_656);
    let batch = 2;
    let pixels: Vec<f32> = (0..batch * 3 * 224 * 224)
        .map(|i| ((i % 255) as f32) / 255.0 - 0.5)
        .collect();
    let images = Tensor::from_slice(&cpu, &pixels, &[batch, 3, 224, 224]).unwrap();
    let labels = Tensor::from_slice(&cpu, &[3i64, 7], &[batch]).unwrap();
    let mut group = c.benchmark_group("cpu_vit_b_16");
    group.sample_size(10);
    group.bench_function("cpu_vit_b_16_b2_forward_backward_f32", |b| {
        b.iter(|| {
            let logits = model.forward(&images).unwrap();
            let loss = cross_entropy(&logits, &labels, -100, Reduction::Mean).unwrap();
            loss.backward().unwrap();
            model.zero_grad(true).unwrap();
        })
    });
    group.finish();
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    vit_b_16_forward_backward(&mut criterion);
    criterion.final_summary();
}
