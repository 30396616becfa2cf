//! Compression of saved activations on the CUDA backend: the 8-bit kernels give the host
//! codec's bits (every element dtype, block sizes, lengths that end inside a group of four,
//! zero and non-finite blocks), the encoded bytes are the allocator's, and a ViT's gradients with
//! compressed blocks stay within the CPU test's tolerance of plain ones. Each test is marked
//! `#[ignore = "needs a CUDA device"]`: it runs with `--include-ignored`.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use half::{bf16, f16};
use headroom_autograd_core::{no_grad, BackendRef, DType, Tensor};
use headroom_checkpoint::{
    compress, dequantize_int8_blockwise, quantize_int8_blockwise, CodecElement,
    CompressActivations, CompressBlocks, CompressOptions, Compression,
};
use headroom_nn::{BlockStack, Module, VisionTransformer, VitConfig};
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::gpu::backend_or_skip;
use headroom_testkit::inputs::uniform_f32;
use headroom_testkit::worst::{abs_difference_f32, nan_max_f32};

/// The device as the `BackendRef` tensors take, or `None` after the GPU gate's skip notice.
#[track_caller]
fn cuda_backend() -> Option<BackendRef> {
    backend_or_skip(CudaBackend::new(0))
}

fn options(compression: Compression) -> CompressOptions {
    CompressOptions {
        policy: Arc::new(CompressActivations {
            compression,
            min_elements: 1,
        }),
    }
}

/// What backward sees of `exp(x)` saved through `compress` on `backend`: the gradient of
/// `sum(exp(x))`, as f64s.
fn exp_as_backward_sees_it(x: &Tensor, compression: Compression) -> Vec<f64> {
    let leaf = x.detach();
    leaf.requires_grad_(true).unwrap();
    let y = compress(
        |xs| Ok(vec![xs[0].exp()?]),
        std::slice::from_ref(&leaf),
        &options(compression),
    )
    .unwrap();
    y[0].sum_all().unwrap().backward().unwrap();
    leaf.grad().unwrap().to_vec_f64().unwrap()
}

/// The host codec's round trip of `saved` (elements of `T` given as f64s).
fn host_round_trip<T: CodecElement>(saved: &[f64], block: usize, of: fn(f64) -> T) -> Vec<T> {
    let x: Vec<T> = saved.iter().map(|&v| of(v)).collect();
    let mut codes = vec![0i8; x.len()];
    let mut absmax = vec![0f32; x.len().div_ceil(block)];
    quantize_int8_blockwise(&x, block, &mut codes, &mut absmax).unwrap();
    let mut out = vec![x[0]; x.len()];
    dequantize_int8_blockwise(&codes, &absmax, block, &mut out).unwrap();
    out
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_cuda_kernels_give_the_host_codecs_bits() {
    let Some(cuda) = cuda_backend() else { return };
    for (n, block) in [
        (1, 32),
        (4099, 32),
        (70_001, 256),
        (100_003, 4096),
        (262_144, 1024),
    ] {
        // Spread over many binades; one block of zeros and one with an infinity.
        let mut values: Vec<f64> = uniform_f32(n, n as u64)
            .iter()
            .map(|&v| f64::from(v).powi(3) * 3.0)
            .collect();
        if n > 3 * block {
            values[block..2 * block].fill(f64::NEG_INFINITY); // exp(-inf) = 0: a zero block
            values[2 * block + 5] = 200.0; // exp(200) overflows f32, bf16 and f16: infinite
        }
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let x = Tensor::from_f64s(&cuda, &values, &[n], dtype).unwrap();
            let saved = x.exp().unwrap().to_vec_f64().unwrap();
            let got = exp_as_backward_sees_it(&x, Compression::Int8Blockwise { block });
            let expected: Vec<f64> = match dtype {
                DType::F32 => host_round_trip(&saved, block, |v| v as f32)
                    .into_iter()
                    .map(f64::from)
                    .collect(),
                DType::F64 => host_round_trip(&saved, block, |v| v),
                DType::BF16 => host_round_trip(&saved, block, |v| bf16::from_f32(v as f32))
                    .into_iter()
                    .map(f64::from)
                    .collect(),
                _ => host_round_trip(&saved, block, |v| f16::from_f32(v as f32))
                    .into_iter()
                    .map(f64::from)
                    .collect(),
            };
            let same = |a: f64, b: f64| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
            let first_diff = got.iter().zip(&expected).position(|(&a, &b)| !same(a, b));
            assert_eq!(first_diff, None, "{dtype:?}, {n} elements, block {block}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn encoded_bytes_on_the_gpu_are_the_allocators_and_bf16_is_a_cast() {
    let Some(cuda) = cuda_backend() else { return };
    let values: Vec<f64> = uniform_f32(1 << 20, 3)
        .iter()
        .map(|&v| f64::from(v))
        .collect();
    let x = Tensor::from_f64s(&cuda, &values, &[1024, 1024], DType::F32).unwrap();
    x.requires_grad_(true).unwrap();
    for (compression, encoded) in [
        (Compression::default(), (1 << 20) + 4 * 4096),
        (Compression::Bf16, 2 << 20),
    ] {
        let before = cuda.memory_stats().allocated_bytes.all.current;
        let y = compress(
            |xs| Ok(vec![xs[0].exp()?.tanh()?]),
            std::slice::from_ref(&x),
            &options(compression),
        )
        .unwrap();
        // exp's and tanh's outputs are saved, encoded; tanh's output also stays as the result.
        let kept = cuda.memory_stats().allocated_bytes.all.current - before;
        assert_eq!(kept, 2 * encoded + (4 << 20), "{compression:?}");
        y[0].sum_all().unwrap().backward().unwrap();
        x.take_grad();
    }
    let saved = x.exp().unwrap().to_vec_f64().unwrap();
    let got = exp_as_backward_sees_it(&x, Compression::Bf16);
    // (half's `from_f64` drops the low mantissa word before rounding; `from_f32` rounds to
    // nearest even, as the cast kernel does.)
    for (s, g) in saved.iter().zip(&got) {
        assert_eq!(*g, f64::from(bf16::from_f32(*s as f32)));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn vit_gradients_with_compressed_blocks_on_the_gpu_stay_close_to_plain_ones() {
    let Some(cuda) = cuda_backend() else { return };
    let config = VitConfig::tiny();
    let images =
        Tensor::from_slice(&cuda, &uniform_f32(8 * 3 * 32 * 32, 4), &[8, 3, 32, 32]).unwrap();
    let gradients = |runner: Option<CompressBlocks>| -> Vec<Vec<f32>> {
        let generator = Arc::new(headroom_autograd_core::Generator::new(11));
        let mut vit = VisionTransformer::new(&cuda, config, DType::F32, &generator).unwrap();
        vit.set_block_runner(runner.map(|r| Arc::new(r) as _));
        // torchvision's head starts at zero, which would leave every other gradient zero.
        let head = &vit.head.weight;
        let values = uniform_f32(head.numel(), 7);
        {
            let _no_grad = no_grad();
            let filled = Tensor::from_slice(&cuda, &values, head.shape()).unwrap();
            head.copy_(&filled).unwrap();
        }
        let logits = vit.forward(&images).unwrap();
        logits
            .mul(&logits)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        vit.parameters()
            .iter()
            .filter_map(|p| p.grad())
            .map(|g| g.to_vec::<f32>().unwrap())
            .collect()
    };
    let plain = gradients(None);
    let int8 = CompressBlocks {
        options: CompressOptions {
            policy: Arc::new(CompressActivations {
                compression: Compression::Int8Blockwise { block: 64 },
                min_elements: 1024,
            }),
        },
        ..CompressBlocks::all()
    };
    let compressed = gradients(Some(int8));
    for (p, c) in plain.iter().zip(&compressed) {
        let scale = p.iter().map(|v| v.abs()).fold(0.0f32, nan_max_f32);
        let diff = abs_difference_f32(p, c);
        assert!(diff <= 0.02 * scale, "{diff} of {scale}");
    }
}
