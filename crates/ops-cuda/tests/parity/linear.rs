//! Linear layers through cuBLASLt against the CPU: bias and GELU epilogues forward, weight and
//! bias gradients backward, the fallbacks for layouts cuBLASLt does not take, and its workspace
//! as an allocation of the caching allocator.

use std::sync::Arc;

use headroom_autograd_core::{
    BackendRef, DType, Layout, LinearEpilogue, LinearForward, LinearWeightGrad, View,
};
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::inputs::Xorshift;

use crate::{check, download, input, own_backends, poisoned, upload};

/// A linear layer's operands: input `[rows, in]`, weight `[out, in]`, bias `[out]` and output
/// gradient `[rows, out]`.
struct LinearData {
    dims: (usize, usize, usize),
    x: Vec<f64>,
    w: Vec<f64>,
    b: Vec<f64>,
    g: Vec<f64>,
}

impl LinearData {
    fn new(random: &mut Xorshift, (rows, in_f, out_f): (usize, usize, usize)) -> LinearData {
        LinearData {
            dims: (rows, in_f, out_f),
            x: input(random, false, rows * in_f),
            w: input(random, false, out_f * in_f),
            b: input(random, false, out_f),
            g: input(random, false, rows * out_f),
        }
    }
}

/// How a linear case is laid out.
#[derive(Debug, Clone, Copy)]
struct LinearCase {
    bias: bool,
    gelu: bool,
    /// The weight read transposed from `[in, out]` memory.
    weight_transposed: bool,
    /// Elements before the bias and the bias gradient in their buffers (1: not 16-byte aligned).
    bias_offset: usize,
}

/// Output (and pre-activation), dW, dB and dX of one case, each as (name, values).
fn linear_case(
    backend: &BackendRef,
    dtype: DType,
    data: &LinearData,
    case: LinearCase,
) -> Vec<(&'static str, Vec<f64>)> {
    let (rows, in_f, out_f) = data.dims;
    let view = |buffer, layout| View {
        buffer,
        layout,
        dtype,
    };
    let x = upload(backend, dtype, &data.x);
    let x_layout = Layout::contiguous(&[rows, in_f]);
    let (w, w_layout) = if case.weight_transposed {
        let mut stored = vec![0.0; in_f * out_f];
        for o in 0..out_f {
            for i in 0..in_f {
                stored[i * out_f + o] = data.w[o * in_f + i];
            }
        }
        let layout = Layout::from_parts(&[out_f, in_f], &[1, out_f], 0).unwrap();
        (upload(backend, dtype, &stored), layout)
    } else {
        (
            upload(backend, dtype, &data.w),
            Layout::contiguous(&[out_f, in_f]),
        )
    };
    let padded: Vec<f64> = std::iter::repeat_n(0.0, case.bias_offset)
        .chain(data.b.iter().copied())
        .collect();
    let b = upload(backend, dtype, &padded);
    let bias_layout = Layout::from_parts(&[out_f], &[1], case.bias_offset).unwrap();
    let out_layout = Layout::contiguous(&[rows, out_f]);
    let (out, pre) = (
        poisoned(backend, dtype, rows * out_f),
        poisoned(backend, dtype, rows * out_f),
    );
    let epilogue = if case.gelu {
        LinearEpilogue::Gelu {
            pre_activation: view(&pre, &out_layout),
        }
    } else {
        LinearEpilogue::None
    };
    backend
        .linear(LinearForward {
            input: view(&x, &x_layout),
            weight: view(&w, &w_layout),
            bias: case.bias.then(|| view(&b, &bias_layout)),
            epilogue,
            out: view(&out, &out_layout),
        })
        .unwrap();
    let g = upload(backend, dtype, &data.g);
    let w_grad_layout = Layout::contiguous(&[out_f, in_f]);
    let (dw, db) = (
        poisoned(backend, dtype, out_f * in_f),
        poisoned(backend, dtype, out_f + case.bias_offset),
    );
    backend
        .linear_weight_grad(LinearWeightGrad {
            grad_out: view(&g, &out_layout),
            input: view(&x, &x_layout),
            grad_weight: view(&dw, &w_grad_layout),
            grad_bias: case.bias.then(|| view(&db, &bias_layout)),
        })
        .unwrap();
    let dx = poisoned(backend, dtype, rows * in_f);
    backend
        .matmul(
            view(&g, &out_layout),
            view(&w, &w_layout),
            view(&dx, &x_layout),
            false,
        )
        .unwrap();
    let mut res = vec![
        ("out", download(backend, dtype, &out)),
        ("dw", download(backend, dtype, &dw)),
        ("dx", download(backend, dtype, &dx)),
    ];
    if case.gelu {
        res.push(("pre_activation", download(backend, dtype, &pre)));
    }
    if case.bias {
        res.push((
            "db",
            download(backend, dtype, &db)[case.bias_offset..].to_vec(),
        ));
    }
    res
}

fn check_linear(
    cuda: &Arc<CudaBackend>,
    cpu: &BackendRef,
    dtype: DType,
    data: &LinearData,
    case: LinearCase,
) {
    let gpu: BackendRef = cuda.clone();
    let (on_gpu, on_cpu) = (
        linear_case(&gpu, dtype, data, case),
        linear_case(cpu, dtype, data, case),
    );
    for ((what, gpu_values), (_, cpu_values)) in on_gpu.iter().zip(&on_cpu) {
        let what = format!("linear {:?} {case:?} {what}", data.dims);
        check(&what, dtype, gpu_values, cpu_values);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn linear_with_bias_and_gelu_epilogues_matches_the_cpu() {
    // A backend of its own, so its fallback count is this test's.
    let Some((cuda, _, cpu, mut random)) = own_backends(0x11ea_11ea_11ea_11ea) else {
        return;
    };
    let case = |bias, gelu, weight_transposed| LinearCase {
        bias,
        gelu,
        weight_transposed,
        bias_offset: 0,
    };
    // ViT-L/16's MLP ([6304, 1024] x [4096, 1024]) scaled down: 2 images of 197 tokens.
    let vit = LinearData::new(&mut random, (197 * 2, 64, 256));
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (bias, gelu) in [(true, false), (false, false), (true, true), (false, true)] {
            check_linear(&cuda, &cpu, dtype, &vit, case(bias, gelu, false));
        }
        check_linear(&cuda, &cpu, dtype, &vit, case(true, true, true));
    }
    assert_eq!(
        cuda.linear_fallbacks(),
        0,
        "aligned f32/f16/bf16 linears all run through cuBLASLt"
    );
    // Odd sizes: cuBLASLt or the fallback, the same values either way.
    let odd = LinearData::new(&mut random, (37, 33, 29));
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        check_linear(&cuda, &cpu, dtype, &odd, case(true, true, false));
        check_linear(&cuda, &cpu, dtype, &odd, case(true, false, true));
    }
    println!(
        "odd sizes: {} of 12 calls composed",
        cuda.linear_fallbacks()
    );
    // A bias (and bias gradient) 4 bytes past 16-byte alignment, and f64: always composed, one
    // fallback forward and one backward.
    for dtype in [DType::F32, DType::F64] {
        let before = cuda.linear_fallbacks();
        let misaligned = LinearCase {
            bias_offset: usize::from(dtype == DType::F32),
            ..case(true, true, false)
        };
        check_linear(&cuda, &cpu, dtype, &vit, misaligned);
        assert_eq!(cuda.linear_fallbacks() - before, 2, "{dtype:?}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_cublaslt_workspace_is_an_allocation_of_the_caching_allocator() {
    // A fresh backend: its first product creates the BLAS state.
    let Some((cuda, gpu, cpu, mut random)) = own_backends(0x3a3a_3a3a_3a3a_3a3a) else {
        return;
    };
    // Every buffer a multiple of the allocator's 512-byte rounding.
    let (rows, in_f, out_f) = (128, 64, 256);
    let data = LinearData::new(&mut random, (rows, in_f, out_f));
    let dtype = DType::F32;
    let view = |buffer, layout| View {
        buffer,
        layout,
        dtype,
    };
    let (x, w, b, g) = (
        upload(&gpu, dtype, &data.x),
        upload(&gpu, dtype, &data.w),
        upload(&gpu, dtype, &data.b),
        upload(&gpu, dtype, &data.g),
    );
    let (out, dw, db) = (
        poisoned(&gpu, dtype, rows * out_f),
        poisoned(&gpu, dtype, out_f * in_f),
        poisoned(&gpu, dtype, out_f),
    );
    let (x_layout, w_layout, b_layout, out_layout) = (
        Layout::contiguous(&[rows, in_f]),
        Layout::contiguous(&[out_f, in_f]),
        Layout::contiguous(&[out_f]),
        Layout::contiguous(&[rows, out_f]),
    );
    let before = gpu.memory_stats().allocated_bytes.all.current;
    gpu.linear(LinearForward {
        input: view(&x, &x_layout),
        weight: view(&w, &w_layout),
        bias: Some(view(&b, &b_layout)),
        epilogue: LinearEpilogue::None,
        out: view(&out, &out_layout),
    })
    .unwrap();
    gpu.linear_weight_grad(LinearWeightGrad {
        grad_out: view(&g, &out_layout),
        input: view(&x, &x_layout),
        grad_weight: view(&dw, &w_layout),
        grad_bias: Some(view(&db, &b_layout)),
    })
    .unwrap();
    let after = gpu.memory_stats().allocated_bytes.all.current;
    // Exactly the 32 MiB workspace cuBLAS and cuBLASLt share, nothing else left behind.
    assert_eq!(after - before, 32 << 20);
    assert_eq!(cuda.linear_fallbacks(), 0);
    let reference = linear_case(
        &cpu,
        dtype,
        &data,
        LinearCase {
            bias: true,
            gelu: false,
            weight_transposed: false,
            bias_offset: 0,
        },
    );
    check(
        "linear out",
        dtype,
        &download(&gpu, dtype, &out),
        &reference[0].1,
    );
    check(
        "linear dw",
        dtype,
        &download(&gpu, dtype, &dw),
        &reference[1].1,
    );
    check(
        "linear db",
        dtype,
        &download(&gpu, dtype, &db),
        &reference[3].1,
    );
}
